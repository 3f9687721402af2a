"""A quorum of a lighthouse started again meets under the prefix the old lighthouse's quorum
of the same number used (torchft/<quorum id>/<group rank>, in a store that outlives the
lighthouse). With torchft's own naming a rank that reads its peer's key before the peer has
written it again connects to the old quorum's dead address; ft_train.py's process group names
the meeting by the quorum's step too, and the late peer is waited for."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ddpguide.failures import engine
from ddpguide.launch import programs

TIMEOUT = timedelta(seconds=3)


def _quorum(pgs, addr: str, step: int, late_s: float = 0.0) -> dict[int, str]:
    """One quorum at ``step``, as the Manager forms it: torchft logs the quorum with its step,
    then every member configures its process group under ``addr`` and all-reduces; rank 0 at
    once, each next rank ``late_s`` after the one before. What each rank got."""
    logging.getLogger("torchft_quorums").info("", extra={"quorum_id": 1, "step": step})
    got: dict[int, str] = {}

    def rank(r: int) -> None:
        time.sleep(late_s * r)
        try:
            pgs[r].configure(addr, f"group{r}", r, 2)
            t = torch.ones(3)
            pgs[r].allreduce([t], dist.AllreduceOptions()).wait()
            got[r] = f"sum {t.tolist()}"
        except Exception as e:   # what gloo says, for the assertion
            got[r] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(pgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for pg in pgs:               # the old quorum's processes gone: their addresses refuse
        pg.abort(errored=False)
    return got


@pytest.mark.parametrize("named", [False, True])
def test_a_later_lighthouses_quorum_does_not_read_the_old_quorums_addresses(named):
    from torchft import ProcessGroupGloo

    program = programs.load(engine.PROGRAM)
    seen = program.QuorumLog()     # what torchft logs of each new quorum, the step with it
    make = (lambda timeout: program.quorum_named_gloo(timeout, seen)) if named else (
        lambda timeout: ProcessGroupGloo(timeout=timeout))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    addr = f"127.0.0.1:{store.port}/torchft/1/0"     # the Manager's name for quorum 1
    both = {0: "sum [2.0, 2.0, 2.0]", 1: "sum [2.0, 2.0, 2.0]"}
    assert _quorum([make(TIMEOUT), make(TIMEOUT)], addr, step=0) == both   # the old lighthouse's
    if named:   # the new lighthouse's quorum 1, rank 1 a second late: rank 0 waits for it
        assert _quorum([make(TIMEOUT), make(TIMEOUT)], addr, step=5, late_s=1.0) == both
    else:       # torchft's own naming: rank 0 reads rank 1's old address and connects to it
        got = _quorum([make(TIMEOUT)], addr, step=5)   # (without it: a store wait timeout)
        assert got[0].startswith("RuntimeError: Gloo connectFullMesh failed"), got
