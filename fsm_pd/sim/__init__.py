"""The deterministic simulation: real machines and journals, simulated network, data plane and clock."""

from fsm_pd.sim.run import simulate, summarize
from fsm_pd.sim.world import SimConfig, World

__all__ = ["SimConfig", "World", "simulate", "summarize"]
