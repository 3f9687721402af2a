"""The compute rate measured in a run's own ranks (ddpguide.plan.calibrate): the shape train.py
--cost times, the table scaled by one rank's rate alone over the table's for it, the cores the
ranks got together; the run's step time is never read."""

from __future__ import annotations

import copy

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


def _record(alone, shared, **more):
    return {"alone_flops": alone, "shared_flops": shared, **more}


def test_a_run_at_the_tables_rate_and_cores_changes_nothing(p):
    """A run whose rank alone got the table's rate for its shape, and whose ranks together got
    the table's cores' worth, keeps the prediction bit for bit; one twice as fast alone doubles
    every rate."""
    model, hw, lay = _case(p)
    rate = p.matmul_rate(hw, *calibrate.shape(model, lay, 8, 64))
    record = _record(rate, hw.cores * rate)
    assert calibrate.scale(p, hw, model, lay, 8, 64, record) == 1.0 and calibrate.cores(lay, record) == hw.cores
    same = calibrate.beside(p, hw, model, lay, 8, 64, record)
    pol = catalog.policy(p, "float32")
    assert p.step(model, lay, pol, same, 8, 64) == p.step(model, lay, pol, hw, 8, 64)
    fast = calibrate.beside(p, hw, model, lay, 8, 64, _record(2 * rate, 2 * hw.cores * rate))
    assert [r[3] for r in fast.matmul] == [2 * r[3] for r in hw.matmul] and fast.peak == 2 * hw.peak
    assert fast.cores == hw.cores and hw.matmul[0][3] == 4e9  # the table itself untouched
    slow, quick = (p.step(model, lay, pol, h, 8, 64) for h in (hw, fast))
    assert quick["compute"] < slow["compute"] and quick["total"] < slow["total"]


def test_the_cores_are_the_ranks_rate_together_over_one_alone(p):
    """cores = shared / alone, whatever the table's cores were; all ranks computing then get
    the shared rate together: the step's compute is the same as a device a rank at shared /
    ranks each. A rank alone slower than its share of the shared rate (the load fell between
    the two windows) counts as its share: at most one core a rank."""
    model, hw, lay = _case(p)
    rate = p.matmul_rate(hw, *calibrate.shape(model, lay, 8, 64))
    here = calibrate.beside(p, hw, model, lay, 8, 64, _record(rate, 1.5 * rate))
    assert here.cores == 1.5 and hw.cores == 2.0
    own = copy.deepcopy(here)
    own.cores, own.matmul = 0.0, [[m, k, n, r * 1.5 / lay.world] for m, k, n, r in here.matmul]
    own.peak, own.bandwidth = here.peak * 1.5 / lay.world, here.bandwidth * 1.5 / lay.world
    pol = catalog.policy(p, "float32")
    shared, each = (p.step(model, lay, pol, h, 8, 64)["compute"] for h in (here, own))
    assert shared == pytest.approx(each)
    busy = calibrate.beside(p, hw, model, lay, 8, 64, _record(rate, 8 * rate))
    assert busy.cores == lay.world and calibrate.rate(lay, _record(rate, 8 * rate)) == 2 * rate


def test_the_step_time_is_not_read(p):
    """Only alone_flops and shared_flops: a record without them is refused, its step time and
    its best short timing (peak_flops) are never looked at (planted ones change nothing)."""
    model, hw, lay = _case(p)
    with pytest.raises(KeyError, match="alone_flops"):
        calibrate.beside(p, hw, model, lay, 8, 64, {"step_seconds": 1.0, "peak_flops": 1e9})
    a = calibrate.beside(p, hw, model, lay, 8, 64, _record(1e9, 2e9, step_seconds=1.0, peak_flops=1e9))
    b = calibrate.beside(p, hw, model, lay, 8, 64, _record(1e9, 2e9, step_seconds=0.0, peak_flops=5e9))
    assert a.matmul == b.matmul and a.cores == b.cores


def _saved_loopback(p):
    """The saved run's loopback rows: each layout, its table, its ranks' record, its step."""
    from ddpguide.bench.plan_loopback import LOOPBACK
    from ddpguide.plan import hardware, saved

    bench = saved.load()
    for dim, ranks, seq, batch, name in LOOPBACK:
        found = next(m for m in bench["measurements"] if m["name"] == f"loopback dim {dim}, {name}: step")
        model = catalog.model(p, "gpt", layers=2, dim=dim, heads=4, ffn=4 * dim)
        lay = next(x for x in search.plain(p, model, ranks, batch, seq) if search.name(x) == name)
        hw = hardware.from_fields(p, found["details"]["hardware"], "the saved loopback table", known_only=True)
        yield model, lay, hw, batch, seq, found


def test_the_saved_loopback_run_is_predicted_again_from_its_record(p):
    """Each saved loopback prediction follows from its table and its ranks' two rates alone."""
    pol = catalog.policy(p, "float32")
    for model, lay, hw, batch, seq, found in _saved_loopback(p):
        here = calibrate.beside(p, hw, model, lay, batch, seq, found["details"]["record"])
        predicted = p.step(model, lay, pol, here, batch, seq)["total"]
        assert predicted * 1e3 == pytest.approx(found["details"]["predicted_ms"])


def test_a_core_share_off_2x_moves_a_loopback_prediction_out_of_band(p):
    """Planted: the ranks' rate together halved (the cores they got off 2x). Every saved
    loopback row within 0.8-1.25 where compute is at least 40% of the step leaves the band, and
    there is one; a row measured at its own prediction leaves it too."""
    pol = catalog.policy(p, "float32")
    moved = 0
    for model, lay, hw, batch, seq, found in _saved_loopback(p):
        record, measured = found["details"]["record"], found["value"] / 1e3
        right = p.step(model, lay, pol, calibrate.beside(p, hw, model, lay, batch, seq, record), batch, seq)
        off = calibrate.beside(p, hw, model, lay, batch, seq, {**record, "shared_flops": record["shared_flops"] / 2})
        wrong = p.step(model, lay, pol, off, batch, seq)["total"]
        assert wrong > right["total"]
        if 0.8 <= right["total"] / measured <= 1.25 and right["compute"] / right["total"] >= 0.4:
            assert not 0.8 <= wrong / measured <= 1.25, found["name"]
            moved += 1
        planted = wrong / right["total"]  # measured where the model as it is puts it: 1.0
        if right["compute"] / right["total"] >= 0.4:
            assert planted > 1.25, found["name"]
    assert moved >= 1


def test_the_loopback_layouts_are_two_ranks_and_their_tables_predict_compute_across_the_step(p):
    """Each loopback layout has at most two ranks (one a core of this machine's two: four there
    oversubscribe them) and is one train.py runs with its defaults; predicted from the tables
    measured before their runs, as saved, compute is under a quarter of some steps and over
    three quarters of others."""
    pol = catalog.policy(p, "float32")
    shares = []
    for model, lay, hw, batch, seq, found in _saved_loopback(p):
        assert lay.world <= 2, found["name"]
        step = p.step(model, lay, pol, hw, batch, seq)
        assert step["total"] * 1e3 == pytest.approx(found["details"]["table_predicted_ms"])
        shares.append(step["compute"] / step["total"])
    assert min(shares) < 0.25 and max(shares) > 0.75
