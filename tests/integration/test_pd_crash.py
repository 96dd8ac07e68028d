"""``fsm-pd serve --role pd`` SIGKILLed under load keeps in its journals every request it answered: the shared pool's
loop commits a step's rows once, at the step's end (``NodeLoop(commit_per_pass=True)``), rather than before each
effect, on the ground that nothing a client can take as an answer leaves the process before that commit. A real
process on a unix socket, killed with chats still streaming; its two journals are then read as a restarted node and
``fsm-pd replay`` would read them.
"""

from __future__ import annotations

import signal
import sqlite3
import threading
import time

import pytest
from test_pd_front import CHAT, start, stop, until_ready

from fsm_pd.net import unix_http
from fsm_pd.store import read_journal, replay

ANSWERED, IN_FLIGHT = 6, 6


def rooms_by_rid(path) -> dict[str, str | None]:
    """Each request id's final state in a journal (None: open), as its ``rooms`` table holds it."""
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        return {rid: final for rid, final in conn.execute("SELECT rid, final FROM rooms WHERE rid IS NOT NULL")}
    finally:
        conn.close()


def chats(client, url: str, n: int, **fields) -> tuple[list[threading.Thread], list]:
    answers: list = []

    def one() -> None:
        try:
            answers.append(client.post(url + "/v1/chat/completions", json={**CHAT, **fields}, timeout=120))
        except Exception as error:  # noqa: BLE001 - the process was killed under it
            answers.append(error)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    return threads, answers


@pytest.mark.slow
def test_a_pd_process_killed_under_load_has_journaled_every_answer_it_gave(tmp_path):
    url, sock, proc = start(tmp_path, "--pd-policy", "always")
    try:
        with unix_http.client(timeout=120) as client:
            until_ready(client, url, sock, proc)
            threads, answers = chats(client, url, ANSWERED)
            for thread in threads:
                thread.join(120)
            assert [a.status_code for a in answers] == [200] * ANSWERED, answers
            answered = {a.json()["id"].removeprefix("chatcmpl-") for a in answers}
            # more chats, long ones, still streaming when the process is killed: handoffs, steps and commits under way
            threads, _ = chats(client, url, IN_FLIGHT, max_tokens=400, ignore_eos=True)
            time.sleep(1.0)
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            for thread in threads:
                thread.join(60)
    finally:
        stop(proc)
    journals = tmp_path / "journals"
    sides = {role: rooms_by_rid(journals / f"{role}-0.db") for role in ("prefill", "decode")}
    for role, finals in sides.items():  # every answer the client got: its room ended Success, on both sides
        assert {rid: finals.get(rid) for rid in answered} == {rid: "Success" for rid in answered}, role
    result = replay([*read_journal(journals / "prefill-0.db"), *read_journal(journals / "decode-0.db")])
    assert result.consistent
    assert len(sides["decode"]) >= ANSWERED + 1, sides  # the kill came after some of the long chats' rooms opened
