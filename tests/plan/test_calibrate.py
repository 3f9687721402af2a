"""The compute rate measured beside a run (ddpguide.plan.calibrate): the shape train.py --cost
times, the table's rate for it with every rank busy, and the table scaled by the run's rate
over it; the run's step time is never read."""

from __future__ import annotations

import pytest

from ddpguide.plan import calibrate, catalog, search


@pytest.fixture(scope="module")
def p():
    return search.program()


def _case(p):
    model = catalog.model(p, "gpt", layers=2, dim=128, heads=4, ffn=512)
    hw = p.Hardware(gpus_per_node=4, nics=1, backend="gloo", streams=False, cores=2.0, bandwidth=1e12,
                    matmul=[[64, 128, 512, 4e9], [512, 128, 512, 8e9], [256, 512, 128, 6e9]])
    return model, hw, p.Layout(dp_replicate=2, cp=2)


def test_the_shape_is_the_one_train_py_times(p):
    """cost_meter's rows x dim by dim x ffn: batch 8 over 2 replicas, sequence 64 over cp 2."""
    model, _, lay = _case(p)
    assert calibrate.shape(model, lay, 8, 64) == (4 * 32, 128, 512)
    assert calibrate.shape(model, p.Layout(dp_shard=4, accumulate=2), 8, 64) == (1 * 64, 128, 512)


def test_a_run_at_the_tables_rate_changes_nothing(p):
    """A run that measured the table's rate for its shape keeps the prediction bit for bit (4
    ranks on 2 cores: the simulation shares them as before); one twice as fast doubles every
    rate."""
    model, hw, lay = _case(p)
    rate = p.matmul_rate(hw, *calibrate.shape(model, lay, 8, 64))
    assert calibrate.scale(p, hw, model, lay, 8, 64, {"peak_flops": rate}) == 1.0
    same = calibrate.beside(p, hw, model, lay, 8, 64, {"peak_flops": rate})
    pol = catalog.policy(p, "float32")
    assert p.step(model, lay, pol, same, 8, 64) == p.step(model, lay, pol, hw, 8, 64)
    fast = calibrate.beside(p, hw, model, lay, 8, 64, {"peak_flops": 2 * rate})
    assert [r[3] for r in fast.matmul] == [2 * r[3] for r in hw.matmul] and fast.peak == 2 * hw.peak
    assert hw.matmul[0][3] == 4e9  # the table itself untouched
    slow, quick = (p.step(model, lay, pol, h, 8, 64) for h in (hw, fast))
    assert quick["compute"] < slow["compute"] and quick["total"] < slow["total"]


def test_the_step_time_is_not_read(p):
    """Only peak_flops: a record without it is refused, its step time is never looked at (a
    planted step time of 0 changes nothing)."""
    model, hw, lay = _case(p)
    with pytest.raises(KeyError, match="peak_flops"):
        calibrate.beside(p, hw, model, lay, 8, 64, {"step_seconds": 1.0})
    a = calibrate.beside(p, hw, model, lay, 8, 64, {"peak_flops": 1e9, "step_seconds": 1.0})
    b = calibrate.beside(p, hw, model, lay, 8, 64, {"peak_flops": 1e9, "step_seconds": 0.0})
    assert a.matmul == b.matmul

