"""The diagrams in docs/state-machines.md are the ones the tables generate (run the module to refresh them)."""

from __future__ import annotations

from fsm_pd.machines.diagram import DOC, committed, diagrams, mermaid
from fsm_pd.machines.effect_types import ArmTimer


def test_committed_diagrams_match_the_tables():
    doc = DOC.read_text()
    for name, generated in diagrams().items():
        assert committed(doc, name) == generated, (
            f"docs/state-machines.md has a stale {name} diagram: run `python -m fsm_pd.machines.diagram`")


def test_a_table_change_changes_the_diagram():
    table = [{"trigger": "create", "source": "Bootstrapping", "dest": "Bootstrapping", "conditions": ["is_new"],
              "effects": (ArmTimer("bootstrap"),)}]
    before = mermaid(table)
    assert "create [is_new] / ArmTimer(bootstrap)" in before
    table.append({"trigger": "abort", "source": "Bootstrapping", "dest": "Failed", "effects": ()})
    assert "Bootstrapping --> Failed: abort" in mermaid(table) and mermaid(table) != before
