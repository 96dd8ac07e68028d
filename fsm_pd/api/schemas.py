"""Request bodies of the serving API, as pydantic models so the OpenAPI schema says what each route accepts.

Unknown fields are ignored, not refused: sglang-router re-serialises every request with its own defaults
(``log_metrics``, ``return_bytes``, ``skip_special_tokens``, ...), and OpenAI clients send fields we do not use.
Fields fsm-pd cannot honour with a non-default value (penalties, ``min_p``, ``n > 1``, ``echo``) are checked in
``api.requests`` and answered with a 400 that names them. Every number is range-checked here or by
``SamplingParams`` before a request can reach a batch; NaN and Infinity are refused (``allow_inf_nan=False``, and
before that by ``api.strict_json``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fsm_pd.engine.sampling import MAX_SEED, MAX_TOP_K
from fsm_pd.store.schema import MAX_ROOM

StopField = str | list[str] | None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class SGLangSamplingParams(_Body):
    temperature: float | None = Field(None, ge=0, description="0 is greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K, description="0 or -1 keeps every token")
    min_p: float | None = Field(None, ge=0, le=1, description="only 0 (off) is supported")
    max_new_tokens: int | None = Field(None, ge=1)
    stop: StopField = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED,
                             description="fsm-pd extension; SGLang's name sampling_seed is also read")
    sampling_seed: int | None = Field(None, ge=0, le=MAX_SEED)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int | None = None


class GenerateBody(_Body):
    """SGLang's ``/generate``: one prompt as ``text`` or ``input_ids``."""

    text: str | list[str] | None = None  # a list (a batch) is refused with a 400 that says so
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams | None = None
    stream: bool = False
    return_logprob: bool = False
    rid: str | None = Field(None, min_length=1, max_length=256)
    model: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | None = Field(None, ge=0, le=MAX_ROOM)


class _OpenAIBody(_Body):
    """What OpenAI's completions and chat completions bodies share, plus SGLang's PD fields."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0, le=1)
    stop: StopField = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | None = Field(None, ge=0, le=MAX_ROOM)


class CompletionBody(_OpenAIBody):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt only; a batch is refused with a 400
    max_tokens: int | None = Field(None, description="default 16, as OpenAI")
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = None
    echo: bool | None = None


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionBody(_OpenAIBody):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, description="default: what is left of the context")
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name; sglang-router sends this one")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None


class AbortBody(_Body):
    rid: str = ""
    abort_all: bool = False
