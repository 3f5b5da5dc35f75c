"""``python -m wide_moe_triton.tune``: the tuning command."""

import sys

from .command import main

sys.exit(main())
