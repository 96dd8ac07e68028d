"""Structural checks of a transition table, run when the package is imported and in a test.

A table that passes cannot leave a room stuck: one initial state, no exits from terminal states, every state
reachable, every non-terminal state can reach Failed, and every non-terminal state is guarded by its own deadline
timer, armed on entry and cancelled on every exit (a self-loop may restart it: cancel and arm it in one row).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fsm_pd.machines.effect_types import ArmTimer, CancelTimer, Effect
from fsm_pd.machines.guards import GUARDS
from fsm_pd.machines.states import INITIAL, STATE_NAMES, TERMINAL

ROW_KEYS = {"trigger", "source", "dest", "conditions", "unless", "effects", "reason"}


class TableError(ValueError):
    """A transition table breaks a structural rule."""


def validate(table: Sequence[Mapping], deadlines: Mapping[str, str]) -> None:
    """Raise :class:`TableError` naming the first broken rule."""
    problems = list(_problems(table, deadlines))
    if problems:
        raise TableError("; ".join(problems))


def _problems(table: Sequence[Mapping], deadlines: Mapping[str, str]):
    edges: dict[str, set[str]] = {s: set() for s in STATE_NAMES}
    for i, row in enumerate(table):
        where = f"row {i} ({row.get('trigger')} from {row.get('source')})"
        if unknown := set(row) - ROW_KEYS:
            yield f"{where}: unknown keys {sorted(unknown)}"
        src, dst = row.get("source"), row.get("dest")
        if src not in STATE_NAMES or dst not in STATE_NAMES:
            yield f"{where}: states must be KVPoll names, got {src!r} -> {dst!r}"
            continue
        if src in TERMINAL:
            yield f"{where}: terminal state {src} has an exit"
        for name in (*row.get("conditions", ()), *row.get("unless", ())):
            if name not in GUARDS:
                yield f"{where}: unknown guard {name!r}"
        effects = row.get("effects")
        if not isinstance(effects, tuple) or not all(isinstance(e, Effect) for e in effects):
            yield f"{where}: effects must be a tuple of Effect instances"
            continue
        yield from _deadline_problems(where, src, dst, effects, deadlines, row["trigger"])
        edges[src].add(dst)

    sources = {row.get("source") for row in table}
    if INITIAL not in sources:
        yield f"the initial state {INITIAL} has no transitions"
    reachable = _reachable(edges, INITIAL)
    for state in STATE_NAMES:
        if state not in reachable:
            yield f"{state} is unreachable from {INITIAL}"
        elif state not in TERMINAL and "Failed" not in _reachable(edges, state):
            yield f"{state} cannot reach Failed"
    for state in set(STATE_NAMES) - TERMINAL:
        if deadlines.get(state) is None:
            yield f"non-terminal state {state} has no deadline timer"
        elif not any(r.get("source") == state and r["trigger"] == "timeout" and r.get("dest") == "Failed"
                     for r in table):
            yield f"non-terminal state {state} has no timeout exit to Failed"


def _deadline_problems(where, src, dst, effects, deadlines, trigger):
    armed = {e.timer for e in effects if isinstance(e, ArmTimer)}
    cancelled = {e.timer for e in effects if isinstance(e, CancelTimer)}
    if trigger == "create":
        expected_arm, expected_cancel = {deadlines.get(src)}, set()
    elif src == dst:  # a self-loop leaves the state's timer alone, or restarts it (progress: cancel, arm again)
        restart = {deadlines.get(src)}
        expected_arm, expected_cancel = (restart, restart) if armed or cancelled else (set(), set())
    else:
        expected_arm = set() if dst in TERMINAL else {deadlines.get(dst)}
        expected_cancel = {deadlines.get(src)}
    if armed != expected_arm or cancelled != expected_cancel:
        yield (f"{where}: must arm {sorted(expected_arm)} and cancel {sorted(expected_cancel)}, "
               f"arms {sorted(armed)} and cancels {sorted(cancelled)}")


def _reachable(edges: Mapping[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in edges[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen
