"""The forkserver's start-up: import once what every worker needs, and die with the agent.

``node`` mode preloads this module in multiprocessing's forkserver, so each
(re)started worker is a fork of a process that has already imported torch,
``torch._dynamo`` (DistributedDataParallel's constructor imports it) and the
training code.

Forked workers hold the forkserver's "agent is alive" pipe open, so the
forkserver would not notice its agent's death by itself, and workers set to
die with their parent (the forkserver) would then live on. Hence the
forkserver asks the kernel to kill it when the agent goes.
"""

import os

import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401
from torch.nn.parallel import DistributedDataParallel  # noqa: F401

from ddpguide.core.processes import die_with_parent
from ddpguide.elastic import worker  # noqa: F401
from ddpguide.train import loop as train  # noqa: F401

AGENT_PID_ENV = "DDPGUIDE_AGENT_PID"

if os.environ.get(AGENT_PID_ENV) == str(os.getppid()):  # we are that agent's forkserver
    die_with_parent()
