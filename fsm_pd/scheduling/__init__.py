"""What the engines' schedulers decide, without jax: the engines run it, and so does the simulation.

- ``page_admission``: admission by free pages (the prompts a prefill step takes, the chunks it computes, the decode
  node's admission of waiting rooms);
- ``prealloc``: the decode node's pre-allocation of a waiting room's pages (SGLang's);
- ``step_budget``: how much prefill one step may do while streams decode, from the steps the node has timed.

The KV transfer's control plane (``fsm_pd.control``) is told of the pages these decide; it decides none itself.
"""
