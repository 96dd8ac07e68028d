"""The ``fsm-pd`` command and the processes it starts: ``main`` (the subcommands), ``serve`` (one node), ``serve_pd``
(``--role pd``: both roles in one process), ``launch`` (a local cluster), ``flags`` (every role's flags, jax-free) and
``checks`` (what is checked after parsing and before anything loads). ``python -m fsm_pd.cli`` runs ``main``."""
