"""Run one request on an engine and gather its outputs: for tests, benchmarks and non-streaming callers."""

from __future__ import annotations

from fsm_pd.serving.types import Engine, GenerateRequest, RequestStream, TokenOutput


async def generate(engine: Engine, request: GenerateRequest) -> list[TokenOutput]:
    """Submit ``request`` and return every output once the last one arrives; raises the request's EngineError."""
    stream = RequestStream(request.rid)
    engine.submit(request, stream)
    return [out async for out in stream]
