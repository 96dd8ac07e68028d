"""``python -m fsm_pd.sim --seeds 1-200 --fault-rate 0.2``: see ``sweep.py``."""

import sys

from fsm_pd.sim.sweep import main

sys.exit(main())
