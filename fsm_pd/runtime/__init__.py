"""Process-wide helpers of a serving process: lazy package exports (``lazy``), the garbage collector's policy
(``gc_policy``), JAX's persistent compile cache (``compile_cache``) and how a process ends (``process_exit``)."""
