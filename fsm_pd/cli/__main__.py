"""``python -m fsm_pd.cli``: the ``fsm-pd`` command."""

import sys

from fsm_pd.cli.main import main

sys.exit(main())
