"""The KV pool's bookkeeping, apart from the model that computes into it: which pages belong to which room
(``pages.py``), which pages hold which cached prompt prefix (``prefix_cache.py``), and when other threads may read the
pool's bytes between the model thread's jobs (``lease.py``). Pure Python, no jax: the simulation runs it too."""
