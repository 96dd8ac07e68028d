"""``python -m fsm_pd.api.run_router --prefill URL [PORT] --decode URL ...``: the built-in PD router on its own.
(A separate module so ``-m`` does not run ``router.py`` a second time after the package imported it.)"""

from fsm_pd.api.router import router_main

if __name__ == "__main__":
    router_main()
