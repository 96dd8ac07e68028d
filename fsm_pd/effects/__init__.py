"""Running effects: the node loop, effect interpreters, timers and clocks."""

from fsm_pd.effects.clock import RealClock, VirtualClock
from fsm_pd.effects.interpreter import EffectError, EffectInterpreter, RecordingInterpreter
from fsm_pd.effects.node import Node

__all__ = ["EffectError", "EffectInterpreter", "Node", "RealClock", "RecordingInterpreter", "VirtualClock"]
