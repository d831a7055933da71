"""Sweeps on a local Dask cluster (``run_sweep(workers=N)``, ``--workers N``):
the same rows as one process, failed points recorded and measured again on
the next run, a worker killed mid-run survived, and resume.

The clusters here are of 2 CPU worker processes running the simulator;
each test starts its own (a few seconds) and stays well under a minute.
"""
import functools
import os
import pathlib
import sys

import pandas as pd
import pytest

from paged_numba.sweeps import Sweep, measure_exactness, run_sweep

distributed = pytest.importorskip("distributed")
cloudpickle = pytest.importorskip("cloudpickle")
# the workers cannot import this file: its functions travel by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# columns that say when and where a row was measured, not what
WHERE = ["timestamp", "gpu_index", "gpu_bus_id", "host", "error"]
EXACT = Sweep("exact-small", device=True, measure=measure_exactness,
              grid=dict(block_size=[4, 16], table=["random"], dtype=["float16"], layout=["nhd"],
                        context=[20], num_partitions=["auto"], num_seqs=[2], num_heads=[2],
                        num_kv_heads=[1], head_size=[8], seed=[0, 1]), quick_grid={})


def _cube(calls, point):
    """``x ** 3``, leaving a file per call in ``calls``; fails for ``x == 2``
    unless ``calls/fixed`` exists."""
    calls = pathlib.Path(calls)
    (calls / f"x{point['x']}-{os.getpid()}-{len(list(calls.iterdir()))}").touch()
    if point["x"] == 2 and not (calls / "fixed").exists():
        raise ValueError("x = 2 is not measured today")
    return {"cube": point["x"] ** 3}


def _die_once(marker, point):
    """``x + 1``; the worker that first measures ``x == 1`` dies on the spot."""
    marker = pathlib.Path(marker)
    if point["x"] == 1 and not marker.exists():
        marker.touch()
        os._exit(3)
    return {"next": point["x"] + 1}


def _measured(calls):
    return sorted(int(f.name.split("-")[0][1:]) for f in pathlib.Path(calls).iterdir()
                  if f.name != "fixed")


def test_workers_give_the_rows_of_one_process(tmp_path):
    one = run_sweep(EXACT, out_dir=str(tmp_path / "one"), progress=False)
    two = run_sweep(EXACT, out_dir=str(tmp_path / "two"), progress=False, workers=2)
    assert len(one) == len(EXACT.points()) == 4
    assert (two["error"].isna()).all()
    assert (two["gpu"] == "simulator").all() and set(two["host"]) == set(one["host"])
    what = [c for c in one.columns if c not in WHERE]
    pd.testing.assert_frame_equal(one[what], two[what])      # the grid's order, the same errors


def test_a_failing_point_is_recorded_then_measured_again(tmp_path):
    calls = tmp_path / "calls"
    calls.mkdir()
    sweep = Sweep("cubes", grid={"x": [1, 2, 3]}, quick_grid={}, device=False,
                  measure=functools.partial(_cube, str(calls)))
    df = run_sweep(sweep, out_dir=str(tmp_path), progress=False, workers=2)
    assert df["x"].tolist() == [1, 2, 3]
    assert df["error"].fillna("").tolist() == ["", "ValueError: x = 2 is not measured today", ""]
    assert df["cube"].isna().tolist() == [False, True, False]
    assert _measured(calls) == [1, 2, 3]
    (calls / "fixed").touch()
    df = run_sweep(sweep, out_dir=str(tmp_path), progress=False, workers=2)
    assert _measured(calls) == [1, 2, 2, 3]                  # only the failed point again
    assert df["cube"].tolist() == [1, 8, 27] and df["error"].isna().all()


def test_a_killed_worker_is_survived_and_the_sweep_resumes(tmp_path):
    sweep = Sweep("nexts", grid={"x": [0, 1, 2, 3, 4, 5]}, quick_grid={}, device=False,
                  measure=functools.partial(_die_once, str(tmp_path / "died")))
    df = run_sweep(sweep, out_dir=str(tmp_path), progress=False, workers=2)
    assert (tmp_path / "died").exists()                       # a worker did die
    assert df["next"].tolist() == [1, 2, 3, 4, 5, 6] and df["error"].isna().all()
    # an interrupted run's CSV: the rows of x = 1 and 4 missing
    csv = tmp_path / "nexts.csv"
    pd.read_csv(csv).query("x not in (1, 4)").to_csv(csv, index=False)
    calls = tmp_path / "calls"
    calls.mkdir()
    again = Sweep("nexts", grid=sweep.grid, quick_grid={}, device=False,
                  measure=functools.partial(_cube, str(calls)))
    df = run_sweep(again, out_dir=str(tmp_path), progress=False, workers=2)
    assert _measured(calls) == [1, 4]                         # only the missing points
    assert df["x"].tolist() == [0, 1, 2, 3, 4, 5]
    assert df["cube"].fillna(-1).tolist() == [-1, 1, -1, -1, 64, -1]


def test_cli_workers_and_missing_extra(tmp_path, capsys, monkeypatch):
    from paged_numba.__main__ import main

    assert main(["sweep", "merge-rule", "--quick", "--out", str(tmp_path), "--no-progress",
                 "--workers", "2"]) == 0
    df = pd.read_csv(tmp_path / "merge-rule_quick.csv")
    assert len(df) and df["error"].isna().all() and (df["gpu"] == "cpu").all()
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", "merge-rule", "--quick", "--out", str(tmp_path), "--workers", "0"])
    assert exit_.value.code == 2 and "--workers must be at least 1" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "distributed", None)      # as if not installed
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", "merge-rule", "--quick", "--out", str(tmp_path), "--workers", "2"])
    assert exit_.value.code == 1 and '".[distributed]"' in capsys.readouterr().err
