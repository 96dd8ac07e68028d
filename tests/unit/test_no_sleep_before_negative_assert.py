"""No test sleeps a fixed time and then asserts that something did not happen.

``time.sleep(0.1); assert not retried`` passes whenever the retry is merely late: on a busy machine the sleep proves
nothing. A negative claim holds only after a positive event that shows its moment has passed (an event, a barrier, a
later message ordered after the one that must not come, a counter), so this scans every test file with ``ast`` and
reports the pattern:

1. a statement that is a fixed sleep: ``time.sleep(C)`` or ``await asyncio.sleep(C)`` (any ``sleep``) with a
   constant ``C > 0`` (``asyncio.sleep(0)`` only yields);
2. followed, in the same block, by an ``assert`` of a negative: ``not ...``, ``... not in ...``, ``... is None``,
   ``... == 0`` / ``== []`` / ``== ()`` / ``== {}`` / ``== ""`` / ``== set()`` (also inside ``and`` / ``or``);
3. with no wait between them: a statement that calls something named ``wait``, ``wait_for``, ``join``, ``result``,
   ``get``, ``until`` or ``wait_*``, or sends a test driver that command (``node("wait", room=1)``), ends the
   search.

A sleep inside a loop body is a poll (it runs until a condition holds), so loop bodies are not searched. The check is
deliberately syntactic and simple; a false alarm is fixed by waiting on the event the assert depends on.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
WAITS = {"wait", "wait_for", "join", "result", "get", "until"}
EMPTY = (ast.List, ast.Tuple, ast.Dict, ast.Set)


def _name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def is_fixed_sleep(stmt: ast.stmt) -> bool:
    if not isinstance(stmt, ast.Expr):
        return False
    call = stmt.value.value if isinstance(stmt.value, ast.Await) else stmt.value
    return (isinstance(call, ast.Call) and _name(call.func) == "sleep" and len(call.args) == 1
            and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, int | float)
            and call.args[0].value > 0)


def _is_wait(call: ast.Call) -> bool:
    name = _name(call.func) or ""
    command = call.args[0].value if call.args and isinstance(call.args[0], ast.Constant) else None
    return name in WAITS or name.startswith("wait_") or command in WAITS  # command: a driver's node("wait", ...)


def waits(stmt: ast.stmt) -> bool:
    return any(isinstance(node, ast.Call) and _is_wait(node) for node in ast.walk(stmt))


def is_negative(test: ast.expr) -> bool:
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return True
    if isinstance(test, ast.BoolOp):
        return any(is_negative(value) for value in test.values)
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, right = test.ops[0], test.comparators[0]
        if isinstance(op, ast.NotIn):
            return True
        if isinstance(op, ast.Is) and isinstance(right, ast.Constant) and right.value is None:
            return True
        if isinstance(op, ast.Eq):
            if isinstance(right, ast.Constant) and right.value in (0, "", b""):
                return True
            if isinstance(right, EMPTY) and not getattr(right, "elts", getattr(right, "keys", None)):
                return True
            if isinstance(right, ast.Call) and _name(right.func) == "set" and not right.args:
                return True
    return False


def _blocks(node: ast.AST):
    """The statement lists of ``node`` and everything in it, loop bodies left out (a sleep there is a poll)."""
    for child in ast.walk(node):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(child, field, None)
            loop_body = isinstance(child, ast.For | ast.AsyncFor | ast.While) and field == "body"
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt) and not loop_body:
                yield block


def findings(source: str, filename: str = "<test>") -> list[str]:
    """``file:line`` of each fixed sleep followed by a negative assert with no wait between them."""
    tree = ast.parse(source, filename)
    found = []
    for block in _blocks(tree):
        for i, stmt in enumerate(block):
            if not is_fixed_sleep(stmt):
                continue
            for later in block[i + 1:]:
                if waits(later):
                    break
                asserts = [n for n in ast.walk(later) if isinstance(n, ast.Assert) and is_negative(n.test)]
                if asserts:
                    found.append(f"{filename}:{stmt.lineno} sleeps, then asserts a negative at line "
                                 f"{asserts[0].lineno}")
                    break
    return found


def test_no_test_sleeps_a_fixed_time_before_asserting_a_negative():
    problems = []
    for path in sorted(TESTS.rglob("*.py")):
        problems += findings(path.read_text(), str(path.relative_to(TESTS.parent)))
    assert not problems, "wait on an event before asserting that something did not happen:\n" + "\n".join(problems)


def test_the_check_reports_the_pattern_it_is_for():
    # test_api_tasks.py before it waited for the task's cleanup to begin
    before = '''
async def scenario():
    task = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    caller = asyncio.ensure_future(cancel_and_wait(task, what="the stubborn task"))
    await asyncio.sleep(0.01)
    assert not caller.done()  # waiting for the stubborn task
    caller.cancel()
'''
    assert findings(before) == ["<test>:6 sleeps, then asserts a negative at line 7"]
    for negative in ("not retried", "calls == []", "late is None", "count == 0", "a and not b", "calls == set()"):
        assert findings(f"def t():\n    time.sleep(0.2)\n    x = 1\n    assert {negative}\n"), negative


def test_a_wait_between_a_poll_and_a_yield_are_not_reported():
    waited = "def t():\n    time.sleep(0.2)\n    assert done.wait(5)\n    assert not retried\n"
    driven = "def t():\n    time.sleep(0.2)\n    d('wait', room=1)\n    assert not retried\n"
    polled = "def t():\n    while not ready():\n        time.sleep(0.01)\n    assert not retried\n"
    yielded = "async def t():\n    await asyncio.sleep(0)\n    assert not retried\n"
    positive = "def t():\n    time.sleep(0.2)\n    assert retried\n"
    assert [findings(s) for s in (waited, driven, polled, yielded, positive)] == [[], [], [], [], []]
