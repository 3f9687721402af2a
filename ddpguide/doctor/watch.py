"""What ends a rank from a thread: the watchdog, a silent rank 0; the tests' fault injection."""

from __future__ import annotations

import os
import signal
import threading

from ddpguide.doctor.consistency import Problem


def start_watchdog(limit_s: float, rank: str, host: str, phase: list[str]) -> None:
    def expire() -> None:
        print(Problem(rank, host, f"the doctor itself did not finish within {limit_s:g} s "
                      f"(stuck while {phase[0]})").line(), flush=True)
        os._exit(1)
    timer = threading.Timer(limit_s, expire)
    timer.daemon = True
    timer.start()


#: Fault injection for the tests: this rank stops itself (SIGSTOP) after the sweep's first size,
#: or right after the process group forms.
STOP_VARIABLE = "DDPGUIDE_DOCTOR_STOP_IN_SWEEP"
STOP_AFTER_GROUP = "DDPGUIDE_DOCTOR_STOP_AFTER_GROUP"


def fault(rank: int, variable: str = STOP_VARIABLE) -> None:
    if os.environ.get(variable, "").strip() == str(rank):
        os.kill(os.getpid(), signal.SIGSTOP)


def root_silent(seconds: float, host: str) -> None:
    print(Problem(0, host, f"stopped answering (no heartbeat for {seconds:g} s): the process is "
                  "stopped or hung, or its host is down").line(), flush=True)
    os._exit(1)
