"""``python -m ddpguide.train`` and ``torchrun -m ddpguide.train``."""

import sys

from ddpguide.train.cli import main

sys.exit(main())
