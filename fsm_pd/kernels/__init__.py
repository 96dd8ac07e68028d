"""KV pool layout and the pure-JAX page kernels (gather, scatter, host staging)."""

from fsm_pd.kernels.layout import PAD_PAGE, KVLayout

__all__ = ["PAD_PAGE", "KVLayout"]
