"""Mermaid state diagrams generated from the tables (``python -m fsm_pd.machines.diagram`` rewrites the docs).

One arrow per (source, dest); its label lists each group of triggers that take it (guards in brackets) followed by
the effects that group asks for.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "state-machines.md"


def mermaid(table: Sequence[Mapping]) -> str:
    # (src, dst) -> effect list -> the triggers (with guards) that take this edge with those effects
    edges: dict[tuple[str, str], dict[str, list[str]]] = {}
    for row in table:
        label = row["trigger"]
        guards = [*row.get("conditions", ()), *(f"not {g}" for g in row.get("unless", ()))]
        if guards:
            label += f" [{', '.join(guards)}]"
        effects = ", ".join(type(e).__name__ + (f"({_arg(e)})" if _arg(e) else "") for e in row["effects"])
        edges.setdefault((row["source"], row["dest"]), {}).setdefault(effects, []).append(label)
    lines = ["stateDiagram-v2", "    [*] --> Bootstrapping"]
    for (src, dst), groups in edges.items():
        labels = [", ".join(triggers) + (f" / {effects}" if effects else "") for effects, triggers in groups.items()]
        lines.append(f"    {src} --> {dst}: {'<br/>'.join(labels)}")
    lines += ["    Success --> [*]", "    Failed --> [*]"]
    return "\n".join(lines)


def _arg(effect) -> str:
    values = [str(v) for v in effect.to_dict().values()][1:]
    return ", ".join(values)


def diagrams() -> dict[str, str]:
    from fsm_pd.machines.receiver import RECEIVER_TRANSITIONS
    from fsm_pd.machines.sender import SENDER_TRANSITIONS

    return {"sender": mermaid(SENDER_TRANSITIONS), "receiver": mermaid(RECEIVER_TRANSITIONS)}


def block(name: str, text: str) -> str:
    return f"<!-- BEGIN {name} diagram (generated) -->\n```mermaid\n{text}\n```\n<!-- END {name} diagram -->"


def committed(doc: str, name: str) -> str | None:
    found = re.search(rf"<!-- BEGIN {name} diagram \(generated\) -->\n```mermaid\n(.*?)\n```\n<!-- END {name}", doc,
                      re.S)
    return found.group(1) if found else None


def rewrite(path: Path = DOC) -> None:
    doc = path.read_text()
    for name, text in diagrams().items():
        if f"<!-- BEGIN {name} diagram (generated) -->" not in doc:
            raise SystemExit(f"{path} has no BEGIN/END markers for the {name} diagram")
        pattern = rf"<!-- BEGIN {name} diagram \(generated\) -->.*?<!-- END {name} diagram -->"
        doc = re.sub(pattern, lambda _m, n=name, t=text: block(n, t), doc, flags=re.S)
    path.write_text(doc)


if __name__ == "__main__":
    rewrite(Path(sys.argv[1]) if len(sys.argv) > 1 else DOC)
