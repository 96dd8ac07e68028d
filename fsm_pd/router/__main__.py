"""``python -m fsm_pd.router --prefill URL [PORT] --decode URL ...``: the built-in PD router on its own."""

from fsm_pd.router.app import router_main

if __name__ == "__main__":
    router_main()
