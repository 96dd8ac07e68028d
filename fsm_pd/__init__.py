"""fsm-pd: prefill/decode disaggregation for JAX, every KV handoff a journaled, replayable state machine."""

__version__ = "0.1.0"
