"""The programs that time compute wait for the device before they read the clock, or time it
with events on the compute stream: on CUDA a kernel returns before it has run, so an
unsynchronised timer measures launches. Checked with a CUDA device simulated
(torch.cuda.synchronize and the events recorded); the capstone's matmul rate is measured on
the run's device, not on the CPU."""

from __future__ import annotations

import torch

from ddpguide.launch.programs import load

CUDA = torch.device("cuda", 0)


def test_pipeline_schedules_times_each_stage_call_between_two_compute_stream_events(monkeypatch):
    """On CUDA a span's ends are events on the compute stream: torch.cuda.synchronize() would
    wait for NCCL's streams too (the receives posted ahead of the compute)."""
    program = load("pipeline_schedules.py")
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", device)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream", device))

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self, stream):
            events.append(("record", stream))
            self.at = len(events)

        def elapsed_time(self, end):
            return float(end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)

    class Stage:
        stage_index = 3

        def forward_one_chunk(self, *args, **kwargs):
            events.append("forward")

        backward_one_chunk = backward_weight_one_chunk = forward_one_chunk

    stage, spans = Stage(), []
    program.time_compute(stage, spans, CUDA)
    stage.forward_one_chunk()
    stage.backward_one_chunk(0, full_backward=False)
    assert events == [("record", ("stream", CUDA)), "forward", ("record", ("stream", CUDA))] * 2
    assert [(kind, index) for kind, index, *_ in spans] == [("F", 3), ("I", 3)]
    assert [program.seconds_between(start, end) for *_, start, end in spans] == [2e-3, 2e-3]
    events.clear()
    program.time_compute(stage := Stage(), spans, torch.device("cpu"))
    stage.forward_one_chunk()
    assert events == ["forward"]  # the CPU runs each operation before it returns
    assert isinstance(spans[-1][2], float) and spans[-1][2] <= spans[-1][3]


def test_the_capstone_measures_its_matmul_rate_on_the_run_s_device(monkeypatch):
    cost = load("gpt/cost_meter.py")
    asked, synced = [], []
    real_randn = torch.randn

    def randn(*shape, dtype=None, device=None):
        asked.append(device)
        return real_randn(*shape, dtype=dtype)  # no GPU here: the numbers come from the CPU

    monkeypatch.setattr(torch, "randn", randn)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    rate = cost.matmul_peak(8, 8, 8, torch.float64, CUDA, repeats=3)
    assert rate > 0
    assert asked == [CUDA, CUDA]
    assert synced == [CUDA] * 6  # before and after each timed repeat
