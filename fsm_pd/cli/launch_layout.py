"""Where ``fsm-pd launch`` puts its cluster: one process per node (prefill nodes, decode nodes, the router), or one
``fsm-pd serve --role pd`` process that runs a prefill and a decode engine on the host's accelerator (``--layout``).

A TPU host lets one process at a time hold its chips. Laid out as nodes there, launch gives the chip to the first
decode node and runs every other node on the host's CPU cores: the prefill node prefills long prompts on the CPU,
and the first answer waits for its start too (21.6 s after the command warm on a v5e, docs/tpu.md round r17; issue
50 asks 12). ``--role pd`` is how PD runs on one chip: both engines on it, one KV pool, a handoff that moves page
ownership, each engine's machines and journal as two nodes keep them (``serve_pd.py``). So where a host's accelerator
goes to one process, launch's default cluster (one prefill, one decode, ``--tp`` 1, no flag for one role alone) is
that one process, listening where the router would (``--port``, or ``DIR/router.sock`` with ``--uds``), with its
journals in ``--journal-dir`` under the nodes' names (``prefill-0.db``, ``decode-0.db``: ``fsm-pd replay`` reads them
as it reads a cluster's). Anything else is laid out as nodes, as before.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # children.py imports httpx: not for a command line that only builds its parser (main.py)
    from fsm_pd.cli.children import Child

from fsm_pd.net.unix_sockets import node_socket_paths, unix_address

LAYOUTS = ("auto", "nodes", "pd")
PD_NAME = "pd"


def one_process_problem(prefill: int, decode: int, prefill_tp: int, decode_tp: int,
                        role_args: Sequence[str]) -> str | None:
    """Why this cluster cannot be one ``--role pd`` process, or None."""
    if (prefill, decode) != (1, 1):
        return f"it runs one prefill and one decode engine (asked: --prefill {prefill} --decode {decode})"
    if (prefill_tp, decode_tp) != (1, 1):
        return "its engines run at --tp 1 (asked: --prefill-tp/--decode-tp above 1)"
    if role_args:
        return ("a flag for one role or the router alone (--prefill-arg, --decode-arg, --router-arg) has no process "
                f"of its own to go to (asked: {' '.join(role_args)}); pass it with --node-arg")
    return None


def choose(layout: str, accelerator: bool, problem: str | None) -> str:
    """``nodes`` or ``pd``. ``auto``: ``pd`` where the host's accelerator goes to one process and the cluster fits one
    (``problem`` is None). ``pd`` asked for a cluster that does not fit one: ``ValueError`` saying why."""
    if layout == "pd" and problem is not None:
        raise ValueError(f"--layout pd: one process cannot run this cluster: {problem}")
    if layout == "auto":
        return "pd" if accelerator and problem is None else "nodes"
    return layout


def plan_one_process(port: int, model: str, backend: str | None, journal_dir: Path, extra: Sequence[str],
                     router_extra: Sequence[str], uds: Path | None) -> Child:
    """The one ``fsm-pd serve --role pd`` process: the nodes' flags (``extra``) and the router's (``--pd-policy``,
    ``--max-request-bytes``), on the router's port or ``uds/router.sock``. The transfer backend only where one was
    asked for: its own default moves page ownership (``pool``)."""
    from fsm_pd.cli.children import Child

    argv = [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "pd", "--host", "127.0.0.1", "--model", model,
            "--journal-dir", str(journal_dir), *(["--transfer-backend", backend] if backend else []), *extra,
            *router_extra]
    log = journal_dir / f"{PD_NAME}.log"
    if uds is None:
        return Child(PD_NAME, [*argv, "--port", str(port)], f"http://127.0.0.1:{port}", log)
    path = str((uds / "router.sock").absolute())
    return Child(PD_NAME, [*argv, "--uds", path], unix_address(path), log, sockets=node_socket_paths("pd", path))
