"""Started by Python in every process whose ``PYTHONPATH`` names this folder: the simulated
GPU machine of ``ddpguide.core.gpusim`` when ``DDPGUIDE_SIMULATE_GPUS`` is set."""

import os

if os.environ.get("DDPGUIDE_SIMULATE_GPUS", "").strip():
    from ddpguide.core import gpusim

    try:
        gpusim.install_from_environ()
    except SystemExit as stop:  # Python would print it and go on: a bad count stops the process
        os._exit(stop.code if isinstance(stop.code, int) else 2)
