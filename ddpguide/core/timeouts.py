"""How long one collective may wait for the other ranks: the package's default and its limit.

Every command line and launcher of the package takes its collective timeout
from here (nothing here imports torch, so a command checks it at once). The
default is far below c10d's own (10 minutes for nccl, 30 for gloo, in
``torch/distributed/constants.py``): on a laptop, a collective that waits a
minute is a bug, and it should say so.
"""

DEFAULT_TIMEOUT_S = 60.0
#: The longest timeout the package accepts: longer is a typo, not a plan.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
