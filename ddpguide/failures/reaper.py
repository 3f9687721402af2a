"""``python -m ddpguide.failures.reaper PID LAUNCH_ID``: when process PID has died, kill every
process that carries ``DDPGUIDE_LAUNCH_ID=LAUNCH_ID`` (torchrun's workers are in sessions of
their own and outlive a killed engine otherwise), then exit."""

from __future__ import annotations

import os
import signal
import sys
import time

from ddpguide.core.processes import alive, processes_with_env, signal_all
from ddpguide.launch.ranks import LAUNCH_ID_VARIABLE


def main(argv: list[str]) -> None:
    watched, launch_id = int(argv[0]), argv[1]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while alive(watched):
        time.sleep(0.2)
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline:
        left = [p for p in processes_with_env(LAUNCH_ID_VARIABLE, launch_id)
                if p != os.getpid() and alive(p)]
        if not left:
            return
        signal_all(left, signal.SIGKILL)
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1:])
