"""The killed-prefill drill of issue 51, on real processes (tiny model, tcp, 127.0.0.1) behind the built-in router: the
prefill process dies mid-transfer (``FSM_PD_FAULT_CRASH_AT=after_ready``: it exits as SIGKILL would, right after
READY went out), the decode node's pull breaks off and it recomputes the prompt itself, and the client gets a 200.

What the journals must then tell (``fsm-pd replay --request``): the request was answered by the decode node after a
recompute (its ``recompute`` record), and the prefill side, whose journal just stops in Transferring, ended because
its node died (the decode node's ``peer`` record, written when its heartbeats found the prefill dead after the room
had failed there on its own; or, when READY was lost with the process, the decode room's own ``peer_failed`` end,
which the decode node recomputes the same way). And the answer carries the route headers every answer carries."""

from __future__ import annotations

import httpx
from polling import until
from processes import Cluster

from fsm_pd.cli.launch import free_port
from fsm_pd.cli.main import EXIT_OK, main
from fsm_pd.effects.faults import CRASH_EXIT_CODE
from fsm_pd.store import read_journal

RID = "killed-prefill-1"


def test_a_prefill_killed_mid_transfer_replays_as_dead_and_its_request_as_answered_after_recompute(tmp_path, capsys):
    c = Cluster(tmp_path)
    paused = tmp_path / "faults-paused"
    paused.touch()  # the warm-up request passes; the crash waits for the one under test
    prefill_env = {**c.env, "FSM_PD_FAULT_CRASH_AT": "after_ready", "FSM_PD_FAULT_PAUSE_FILE": str(paused)}
    try:
        boot = free_port()
        prefill = c.launch_node("prefill", "--bootstrap-port", str(boot), "--transfer-backend", "tcp",
                                env=prefill_env)
        decode = c.launch_node("decode", "--transfer-backend", "tcp")
        p, d = c.healthy([prefill, decode])
        router = c.router(p, boot, d)  # --pd-policy always: every prompt through the prefill node
        body = {"text": "the prefill node dies on this one", "sampling_params": {"max_new_tokens": 8,
                                                                                 "temperature": 0}}
        warm = httpx.post(router + "/generate", json={**body, "rid": "warm-up"}, timeout=120)
        assert warm.status_code == 200, warm.text
        paused.unlink()

        answer = httpx.post(router + "/generate", json={**body, "rid": RID}, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["output_ids"] == warm.json()["output_ids"]  # greedy: what an undisturbed run gives
        assert answer.json()["meta_info"]["kv_recompute"]
        # issue 51, point 11: a recomputed answer says its path and why, as every answer does
        assert answer.headers["X-FSM-PD-Route"] == "pd" and answer.headers["X-FSM-PD-Route-Reason"], answer.headers
        assert answer.headers["X-FSM-PD-KV-Recompute"] == "1"
        assert prefill[1].wait(timeout=30) == CRASH_EXIT_CODE

        p_journal = tmp_path / f"prefill-{p.rsplit(':', 1)[1]}.db"
        d_journal = tmp_path / f"decode-{d.rsplit(':', 1)[1]}.db"
        # the decode node's heartbeats find the prefill dead 2 to 3 s after it died: then its peer record, or, where
        # READY died with the process before it left (a loaded host: zmq had it queued), the room's own end
        assert until(lambda: any(r.role == "peer" or r.trigger == "peer_failed" for r in read_journal(d_journal)),
                     timeout_s=30)
    finally:
        c.stop()

    capsys.readouterr()
    assert main(["replay", str(p_journal), str(d_journal), "--request", RID]) == EXIT_OK
    out = " ".join(capsys.readouterr().out.split())  # the terminal's line breaks out
    assert "failed its transfer after" in out and f"answered by decode decode-{d.rsplit(':', 1)[1]} after recompute" \
        in out, out
    assert "its node died: its journal stops after its " in out and "the decode node found it dead " in out, out
    assert "Transferring" in out and " - - " not in out
    print(out[-2500:])
