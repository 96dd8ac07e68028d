"""Replay streams: each room is written out before the next is read (memory stays at one room per journal), and the
streams of several journals merge in room order."""

from __future__ import annotations

import json

from fsm_pd.cli.main import EXIT_OK, main
from fsm_pd.effects import Node, RecordingInterpreter, VirtualClock
from fsm_pd.machines import RECEIVER, SENDER
from fsm_pd.report import table
from fsm_pd.store import Journal, read_journal, replay
from fsm_pd.store.reader import JournalReader

LAYOUT = {"num_layers": 1, "num_pages": 4, "page_size": 2, "kv_heads": 1, "head_dim": 4}


def journals(tmp_path, rooms: int = 60) -> list[str]:
    """A prefill and a decode journal over the same rooms, every third one failed on both sides."""
    paths = []
    for node_id, machine, deadlines in (("p0", SENDER, {"bootstrap": 5.0, "waiting": 5.0, "pull_hold": 5.0}),
                                        ("d0", RECEIVER, {"bootstrap": 5.0, "admission": 5.0, "waiting": 5.0,
                                                          "transfer": 5.0})):
        path = tmp_path / f"{node_id}.db"
        node = Node(node_id, machine, Journal(path), RecordingInterpreter(), VirtualClock(), deadlines)
        for room in range(rooms):
            node.create(room * 104729 % 1000003, {"layout": LAYOUT})
            if room % 3 == 0:
                node.submit(room * 104729 % 1000003, "abort", {"reason": "client went away"})
        node.step()
        node.journal.close()
        paths.append(str(path))
    return paths


def test_each_room_is_written_before_the_next_is_read(tmp_path, monkeypatch, capsys):
    paths = journals(tmp_path)
    read, seen_when_written = [0], []
    sides = JournalReader.sides

    def counted(self, room=None):
        for side in sides(self, room):
            read[0] += 1
            yield side

    room = table.TableWriter.room

    def written(self, reports):
        seen_when_written.append(read[0])
        room(self, reports)

    monkeypatch.setattr(JournalReader, "sides", counted)
    monkeypatch.setattr(table.TableWriter, "room", written)
    assert main(["replay", *paths]) == EXIT_OK
    # the n-th room (two sides, one per journal) is written when its own sides and a few more (the look-ahead of
    # the merge and of the grouping into rooms, a constant) have been read: never the whole journal first
    assert len(seen_when_written) == 60
    assert all(read_so_far <= 2 * n + 4 for n, read_so_far in enumerate(seen_when_written, 1)), seen_when_written
    assert "60 rooms, 20 with a failed side; every room replays consistently." in capsys.readouterr().out


def test_streamed_json_equals_the_in_memory_replay(tmp_path, capsys):
    paths = journals(tmp_path)
    assert main(["replay", *paths, "--format", "json"]) == EXIT_OK
    streamed = json.loads(capsys.readouterr().out)
    whole = replay([row for p in paths for row in read_journal(p)])
    assert streamed["rooms"] == [r.to_dict() for r in whole.rooms]
    assert streamed["consistent"] is True and streamed["divergences"] == [] and streamed["journals"] == paths
    assert main(["replay", *paths, "--failed", "--format", "json"]) == EXIT_OK
    failed = json.loads(capsys.readouterr().out)["rooms"]
    assert [(r["room"], r["role"]) for r in failed] == [(r.room, r.role) for r in whole.rooms if r.failed]
