"""A replaced group's rejoin, predicted (the failures suite's helpers), and measured once with
a state of 1 GB (the suite's full mode).

The rejoins of ``failures`` heal a toy model of under 2 KB: their prediction,
``m / 2 + P + (s + k) / 2 + B / W`` (``failures``' docstring), is all process start. Here
``ft_train.py --state-mb 1024`` gives each rank 1 GiB more float64 state that every heal moves
with the model, so that ``B / W`` is a real size; the run is the suite's: 2 groups of 1 rank,
one rank killed with SIGKILL from outside, every invariant checked (the healed state equal,
bitwise, to what the seed filled, among them). P is timed as the suite times it, by a probe
that starts with the same 1 GiB option (a restarted rank allocates that state and leaves it
unfilled: the heal fills it). The measured rejoin is reported in two parts read from the
rows: the kill to the new incarnation's ``started`` row (against m / 2 + P) and from there to
its ``healed`` row (against (s + k) / 2 + B / W). W is the suite's: a bare loopback socket.
``rejoin_measured_over_predicted_kill_1gb_heal_path`` is the same rejoin over the same sum
with W timed, before the run, along the heal's own path (``heal_path_bytes_per_s``: torchft's
HTTPTransport from another process, and the copy into the state).

``python -m ddpguide.bench.failures_state --add FILE`` runs this measurement alone and adds
it to a saved failures report (its measurements, its ratio, and a note with its own time
and load): the prediction and the rejoin it predicts are measured in the same run, so the
ratio does not depend on the rest of the suite.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

from ddpguide.bench.report import Report

#: torchrun's --monitor-interval in the engine's command
MONITOR_S = 0.1

STATE_MB = 1024
RATIO = "rejoin_measured_over_predicted_kill_1gb"
#: the same rejoin, B / W with W timed through torchft's own heal path (``heal_path_bytes_per_s``)
RATIO_HEAL_PATH = RATIO + "_heal_path"
ANCHORS = {RATIO: (
    "SIGKILL to the new incarnation healed, 1 GiB more state / process start + quorum + heal "
    "bytes (B / W: 1 GiB over loopback)", "torchrun, torchft", "0.8-1.25"),
    RATIO_HEAL_PATH: (
    "the same / the same prediction with W timed through torchft's HTTPTransport and the "
    "copy into the state, 1 GiB, before the run", "torchft http_transport.py", "0.8-1.25")}
#: a process that serves ``megabytes`` MB of float64 through torchft's HTTPTransport (as a
#: heal's donor stages its state), writes the address to fetch it from, and serves until its
#: standard input closes
_DONOR = """
import os, sys, torch
from datetime import timedelta
from torchft.checkpointing import HTTPTransport
megabytes, out = int(sys.argv[1]), sys.argv[2]
state = {"state": torch.ones(megabytes * 2**20 // 8, dtype=torch.float64)}
transport = HTTPTransport(timedelta(seconds=120), num_chunks=0)
transport.send_checkpoint([1], 1, state, timedelta(seconds=120))
with open(out + ".tmp", "w") as f:
    f.write(transport.metadata())
os.replace(out + ".tmp", out)
sys.stdin.read()
transport.shutdown()
"""


def loopback_bytes_per_s(megabytes: int = 64) -> float:
    """W: bytes per second through one TCP connection on 127.0.0.1."""
    chunk = bytes(1 << 20)
    with socket.create_server(("127.0.0.1", 0)) as server:
        def drain() -> None:
            conn, _ = server.accept()
            with conn:
                while conn.recv(1 << 20):
                    pass
        reader = threading.Thread(target=drain)
        reader.start()
        start = time.perf_counter()
        with socket.create_connection(server.getsockname()[:2]) as conn:
            for _ in range(megabytes):
                conn.sendall(chunk)
        reader.join(60)
        return megabytes * len(chunk) / (time.perf_counter() - start)


def heal_path_bytes_per_s(megabytes: int, timeout: float = 120.0) -> float:
    """W along a heal's own path: ``megabytes`` MB of float64 staged by torchft's HTTPTransport
    in another process (``_DONOR``), fetched here with ``recv_checkpoint`` (torch's streaming
    load over HTTP) and copied into a tensor of this process's (as ``ft_train.py``'s
    ``load_state_dict`` does), timed from the request to the copy done; the bytes checked."""
    import subprocess
    import tempfile
    from datetime import timedelta

    import torch
    from torchft.checkpointing import HTTPTransport

    with tempfile.TemporaryDirectory(prefix="ddpguide-heal-path-") as tmp:
        address = Path(tmp, "address")
        donor = subprocess.Popen([sys.executable, "-c", _DONOR, str(megabytes), str(address)],
                                 stdin=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
        receiver = HTTPTransport(timedelta(seconds=timeout), num_chunks=0)
        try:
            until = time.monotonic() + timeout
            while not address.exists():
                if time.monotonic() > until or donor.poll() is not None:
                    raise RuntimeError(f"the heal-path donor did not start (exit status "
                                       f"{donor.poll()})")
                time.sleep(0.05)
            into = torch.empty(megabytes * 2**20 // 8, dtype=torch.float64)
            with warnings.catch_warnings():   # torch's, on the bytes it reads (as in the program)
                warnings.filterwarnings("ignore", message=".*not writable")
                start = time.perf_counter()
                got = receiver.recv_checkpoint(0, address.read_text(), 1,
                                               timedelta(seconds=timeout))
                into.copy_(got["state"])
                seconds = time.perf_counter() - start
            if not bool((into == 1).all()):
                raise RuntimeError("the heal path moved other bytes than the donor staged")
        finally:
            receiver.shutdown(wait=False)
            if donor.stdin is not None:
                donor.stdin.close()
            try:
                donor.wait(30)
            except subprocess.TimeoutExpired:
                donor.kill()
                donor.wait(30)
        return into.numel() * into.element_size() / seconds


def rejoin_predicted_s(settings, start_s: float, bandwidth: float) -> float:
    """A restarted group's rejoin, m / 2 + P + (s + k) / 2 + B / W (module docstring)."""
    from ddpguide.failures import runs

    return (MONITOR_S / 2 + start_s + (settings.step_seconds + settings.quorum_tick_ms / 1000) / 2
            + runs.heal_bytes(settings) / bandwidth)


def rejoin_measured_s(report: dict, failure: dict) -> float | None:
    """From ``failure`` (the signal that ended the rank) to its group's next ``healed`` row."""
    healed = [r["time"] for r in report["healed"] if r["group"] == failure["groups"][0]
              and r["time"] > failure["time"]]
    return min(healed) - failure["time"] if healed else None


def probed_start_s(failure: dict) -> float:
    """P for ``failure``: the median of the probes timed before it and after its group was
    back (``start_s``, ``start_after_s``; the first alone when the run ended first)."""
    return statistics.median([failure[k] for k in ("start_s", "start_after_s") if k in failure])


def run(report: Report, folder: Path, bandwidth: float, state_mb: int = STATE_MB) -> None:
    """One kill of a group of 2 whose ranks hold ``state_mb`` MB more state; adds the rejoin,
    its prediction with its parts, and ``RATIO``."""
    from ddpguide.failures import engine, runs

    step_s = 0.05
    # a 1 GiB heal holds the donor's next step until it is served: 30 s for every collective
    options: dict = dict(steps=4000, step_seconds=step_s, deadline_s=400.0, timeout_s=30,
                         state_mb=state_mb)
    settings = engine.Settings(**options)
    heal_path = heal_path_bytes_per_s(state_mb)   # before the run, never beside it
    with runs.StartProbe(folder / "probe", state_mb=state_mb) as probe:
        chaos_run = runs.run_ft(folder / "run", failures=1, seed=1, kinds=("kill",),
                                gap_s=(0.5, 1.0), before=probe,
                                after=lambda k: {"start_after_s": probe(k)["start_s"]},
                                **options)
    failed = [c["name"] for c in chaos_run["checks"] if not c["ok"]]
    kills = [f for f in chaos_run["failures"] if f["what"] == "SIGKILL (kill)"]
    measured = rejoin_measured_s(chaos_run, kills[0]) if kills and not failed else None
    if measured is None:
        raise RuntimeError(f"the {state_mb} MB run: failed checks {failed}, failures "
                           f"{chaos_run['failures']}")
    kill = kills[0]
    started = min(r["time"] for r in chaos_run["started"] if r["group"] == kill["groups"][0]
                  and r["time"] > kill["time"])
    parts = {"monitor_half_s": MONITOR_S / 2, "start_s": probed_start_s(kill),
             "quorum_wait_s": (step_s + settings.quorum_tick_ms / 1000) / 2,
             "heal_bytes": runs.heal_bytes(settings), "bandwidth_bytes_per_s": bandwidth}
    parts["heal_s"] = parts["heal_bytes"] / bandwidth
    predicted = rejoin_predicted_s(settings, parts["start_s"], bandwidth)   # the parts' sum
    by_heal_path = rejoin_predicted_s(settings, parts["start_s"], heal_path)
    report.add("process start P kill 1gb", parts["start_s"], "s", before_s=kill["start_s"],
               after_s=kill.get("start_after_s"))
    report.add("rejoin kill 1gb", measured, "s", predicted_s=predicted, **parts,
               kill_to_started_s=started - kill["time"],
               started_to_healed_s=kill["time"] + measured - started,
               heal_path_bytes_per_s=heal_path, predicted_by_heal_path_s=by_heal_path,
               seconds=chaos_run["seconds"], commands=chaos_run["commands"])
    report.ratios[RATIO] = measured / predicted
    report.ratios[RATIO_HEAL_PATH] = measured / by_heal_path


def add_to(path: Path, folder: Path) -> dict:
    """Run the measurement and add it to the failures report saved at ``path`` (written whole)."""
    from ddpguide.core.commands import write_atomically

    saved = json.loads(path.read_text())
    at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load = round(os.getloadavg()[0], 2)
    report = Report("failures")
    run(report, folder, loopback_bytes_per_s())
    saved["measurements"] = [m for m in saved["measurements"] if not m["name"].endswith(" 1gb")]
    saved["measurements"] += [m for m in report.to_dict()["measurements"]]
    saved["ratios"].update({k: v for k, v in report.ratios.items() if k in ANCHORS})
    saved["notes"] = [n for n in saved["notes"] if not n.startswith(f"{RATIO}:")] + [
        f"{RATIO}: measured alone at {at} (load {load} to {round(os.getloadavg()[0], 2)}), "
        f"by python -m ddpguide.bench.failures_state --add"]
    write_atomically(path, json.dumps(saved, indent=2) + "\n")
    return saved


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from ddpguide.bench.report import add_parser, saved_suite

    parser = add_parser("python -m ddpguide.bench.failures_state", __doc__.splitlines()[0], "failures")
    path = saved_suite(parser, parser.parse_args(argv).add, "failures")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="ddpguide-failures-state-") as tmp:
        saved = add_to(path, Path(tmp))
    print(f"{RATIO} {saved['ratios'][RATIO]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
