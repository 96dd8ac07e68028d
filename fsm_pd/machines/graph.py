"""Structural checks of a transition table, run when the package is imported and in a test.

A table that passes cannot leave a room stuck: one initial state, no exits from terminal states, every state
reachable, every non-terminal state can reach Failed, and every non-terminal state is guarded by one deadline timer
at any moment: its own, armed on entry and cancelled on every exit, or, in a state that hands over (``handovers``:
state -> (trigger, timer)), the next one, armed by that trigger's self-loop as it cancels the first. There every row
says by the trigger's guard (``<trigger>_seen``, in ``conditions`` or ``unless``) which of the two it runs under, so
that each exit cancels the one armed. Any other self-loop leaves the running timer alone, or restarts it (progress:
cancel and arm it in one row).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fsm_pd.machines.effect_types import ArmTimer, CancelTimer, Effect
from fsm_pd.machines.guards import GUARDS
from fsm_pd.machines.states import INITIAL, STATE_NAMES, TERMINAL

ROW_KEYS = {"trigger", "source", "dest", "conditions", "unless", "effects", "reason"}


class TableError(ValueError):
    """A transition table breaks a structural rule."""


def validate(table: Sequence[Mapping], deadlines: Mapping[str, str],
             handovers: Mapping[str, tuple[str, str]] | None = None) -> None:
    """Raise :class:`TableError` naming the first broken rule."""
    problems = list(_problems(table, deadlines, handovers or {}))
    if problems:
        raise TableError("; ".join(problems))


def _problems(table: Sequence[Mapping], deadlines: Mapping[str, str], handovers: Mapping[str, tuple[str, str]]):
    for state, (trigger, timer) in handovers.items():
        if state in TERMINAL or deadlines.get(state) in (None, timer) or f"{trigger}_seen" not in GUARDS:
            yield (f"handover of {state} to {timer!r} on {trigger!r}: it needs a non-terminal state with a deadline "
                   f"of its own, another timer, and a guard {trigger}_seen")
    edges: dict[str, set[str]] = {s: set() for s in STATE_NAMES}
    timeouts: set[tuple[str, str | None]] = set()  # (state, the deadline running) of each timeout exit to Failed
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
        running, unsaid = _running(row, src, deadlines, handovers)
        if unsaid:
            yield f"{where}: {src} hands its deadline over on {unsaid}; say which one runs, by {unsaid}_seen"
            continue
        yield from _deadline_problems(where, row, src, dst, effects, deadlines, handovers, running)
        if row["trigger"] == "timeout" and dst == "Failed":
            timeouts.add((src, running))
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
        elif (state, deadlines[state]) not in timeouts:
            yield f"non-terminal state {state} has no timeout exit to Failed"
    for state, (_, timer) in handovers.items():
        if (state, timer) not in timeouts:
            yield f"{state} has no timeout exit to Failed under its {timer} deadline"


def _running(row: Mapping, src: str, deadlines: Mapping[str, str],
             handovers: Mapping[str, tuple[str, str]]) -> tuple[str | None, str | None]:
    """(the deadline armed when ``row`` fires, None) or, where ``src`` hands over and the row does not say which of
    its deadlines runs although it changes timers or leaves, (None, the hand-over's trigger). A row that waits on
    changing nothing runs under either: (None, None)."""
    handover = handovers.get(src)
    if handover is None or row["trigger"] == "create":
        return deadlines.get(src), None
    trigger, timer = handover
    if f"{trigger}_seen" in row.get("conditions", ()):
        return timer, None
    if f"{trigger}_seen" in row.get("unless", ()):
        return deadlines.get(src), None
    if row.get("dest") == src and not any(isinstance(e, ArmTimer | CancelTimer) for e in row["effects"]):
        return None, None
    return None, trigger


def _deadline_problems(where, row, src, dst, effects, deadlines, handovers, running):
    armed = {e.timer for e in effects if isinstance(e, ArmTimer)}
    cancelled = {e.timer for e in effects if isinstance(e, CancelTimer)}
    trigger, handed_to = handovers.get(src, (None, None))
    if row["trigger"] == "create":
        expected_arm, expected_cancel = {deadlines.get(src)}, set()
    elif src == dst and row["trigger"] == trigger and running == deadlines.get(src):
        expected_arm, expected_cancel = {handed_to}, {running}  # the hand-over
    elif src == dst:  # a self-loop leaves the running timer alone, or restarts it (progress: cancel, arm again)
        restart = {running or deadlines.get(src)}
        expected_arm, expected_cancel = (restart, restart) if armed or cancelled else (set(), set())
    else:
        expected_arm = set() if dst in TERMINAL else {deadlines.get(dst)}
        expected_cancel = {running}
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
