"""One request's failure stays its own: a batched model call that raises is run again one request at a time.

A batch mixes requests from unrelated clients. When the batched call raises (a value the compiled program cannot
take, a shape it was never built for), the exception says nothing about which request caused it, and failing the
whole batch would hand every neighbour a 500 it did nothing to earn. Running each member alone finds the culprit;
the others get the answer they would have had anyway (sampling depends on the request's seed and step only, and a
prefill or decode step rewrites the same KV for the same positions).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")


def run_isolating(items: Sequence[Item], run: Callable[[Sequence[Item]], Sequence[Result]],
                  what: str) -> list[Result | Exception]:
    """``run(items)``, one result per item; if it raises, ``run([item])`` for each, an exception standing in for
    the result of an item that still fails alone."""
    try:
        results = list(run(items))
    except Exception as exc:  # noqa: BLE001 - whatever it was, it is pinned on the item that still raises alone
        if len(items) == 1:
            log.exception("%s failed", what)
            return [exc]
        log.warning("%s of %d requests failed (%s: %s); running each alone", what, len(items),
                    type(exc).__name__, exc)
    else:
        return results
    alone: list[Result | Exception] = []
    for item in items:
        try:
            alone.append(run([item])[0])
        except Exception as exc:  # noqa: BLE001
            log.exception("%s failed for one request", what)
            alone.append(exc)
    return alone
