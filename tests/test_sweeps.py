"""sweeps and the CLI: every registered sweep in quick mode, resume, errors.

The device sweeps' quick grids are one tiny point each (a few seconds on the
simulator), so this file runs in well under two minutes without a GPU.
"""
import dataclasses
import os
import subprocess
import sys

import pandas as pd
import pytest

import paged_numba
from paged_numba.__main__ import main
from paged_numba.sweeps import ENV_COLUMNS, SWEEPS, Sweep, register, run_sweep

EXPECTED = {"memory-waste", "merge-rule", "exactness", "decode", "paging-overhead", "split-k",
            "sharing", "prefix-cache"}


def counting(measure):
    """``measure`` that counts its calls in ``.calls``."""
    def wrapped(point):
        wrapped.calls += 1
        return measure(point)
    wrapped.calls = 0
    return wrapped


@pytest.fixture(scope="module")
def quick_dir(tmp_path_factory):
    """Every registered sweep run once in quick mode into one directory."""
    out = tmp_path_factory.mktemp("results")
    for sweep in SWEEPS.values():
        run_sweep(sweep, quick=True, out_dir=str(out), progress=False)
    return out


def test_registry():
    assert EXPECTED <= set(SWEEPS)
    for name, s in SWEEPS.items():
        assert s.name == name and s.description
        assert set(s.grid) == set(s.quick_grid), name
        assert len(s.points(quick=True)) <= (2 if s.device else 20), name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_quick_sweep_csv(quick_dir, name):
    sweep = SWEEPS[name]
    df = pd.read_csv(quick_dir / f"{name}_quick.csv")
    points = sweep.points(quick=True)
    assert len(df) == len(points)
    assert set(ENV_COLUMNS) <= set(df.columns)
    assert set(sweep.quick_grid) <= set(df.columns)
    assert df[list(sweep.quick_grid)].astype(str).drop_duplicates().shape[0] == len(points)
    assert (df["gpu"] == "cpu").all() == (not sweep.device)
    assert df["timestamp"].str.endswith("+00:00").all()
    assert df["git_rev"].notna().all() and df["numpy"].notna().all()
    if sweep.figure is not None and _has_matplotlib():
        assert (quick_dir / f"{name}_quick.png").stat().st_size > 0


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_quick_sweep_resumes(quick_dir, name):
    before = (quick_dir / f"{name}_quick.csv").read_text()
    sweep = dataclasses.replace(SWEEPS[name], measure=counting(SWEEPS[name].measure))
    df = run_sweep(sweep, quick=True, out_dir=str(quick_dir), progress=False)
    assert sweep.measure.calls == 0
    assert len(df) == len(sweep.points(quick=True))
    assert (quick_dir / f"{name}_quick.csv").read_text() == before


def test_quick_results_make_sense(quick_dir):
    mem = pd.read_csv(quick_dir / "memory-waste_quick.csv").set_index("allocator")
    assert mem.loc["paged-1", "useful_frac"] == 1.0
    assert mem.loc["contiguous-max", "batch_ratio"] == 1.0
    assert mem.loc["paged-16", "useful_frac"] > mem.loc["contiguous-max", "useful_frac"]
    merge = pd.read_csv(quick_dir / "merge-rule_quick.csv")
    hot = merge[merge["scale"] == 100]
    assert hot["naive_overflows"].all() and (hot["err_merged"] < 1e-2).all()
    assert not merge[merge["scale"] == 1]["naive_overflows"].any()
    exact = pd.read_csv(quick_dir / "exactness_quick.csv")
    assert (exact["err_over_bound"] <= 1).all()
    for name in ("decode", "paging-overhead", "split-k"):
        assert (pd.read_csv(quick_dir / f"{name}_quick.csv")["us"] > 0).all()


def test_quick_serving_sweeps_make_sense(quick_dir):
    share = pd.read_csv(quick_dir / "sharing_quick.csv").set_index("mode")
    assert share.loc["beam", "saving"] > share.loc["parallel", "saving"] > 0
    assert (share["batch_gain"] >= 1).all() and (share["block_size"] == 16).all()
    cache = pd.read_csv(quick_dir / "prefix-cache_quick.csv")
    on, off = cache[cache["caching"] == "on"], cache[cache["caching"] == "off"]
    assert (off["hit_rate"] == 0).all() and (off["prefill_ratio"] == 1).all()
    assert (on["hit_rate"] > 0).all() and (on["prefill_ratio"] < 1).all()


def test_resume_adds_only_missing_points(tmp_path, capsys):
    def measure(p):
        return {"y": p["x"] * 2, "half": p["x"] / 2}
    small = Sweep("toy", grid={"x": [1, 2], "tag": ["a"]}, quick_grid={"x": [1], "tag": ["a"]},
                  measure=counting(measure), device=False)
    first = run_sweep(small, out_dir=str(tmp_path))
    assert small.measure.calls == 2 and len(first) == 2
    err = capsys.readouterr().err
    assert "toy: 2 of 2 points to run" in err
    if _has("tqdm"):
        assert "2/2 [" in err                                    # tqdm's bar: done/total [elapsed<ETA
    bigger = dataclasses.replace(small, grid={"x": [1, 2, 3, 0.5], "tag": ["a"]},
                                 measure=counting(measure))
    df = run_sweep(bigger, out_dir=str(tmp_path), progress=False)
    assert bigger.measure.calls == 2                     # x = 3 and x = 0.5 only
    assert sorted(df["x"]) == [0.5, 1, 2, 3]
    assert list(df["timestamp"][:2]) == list(first["timestamp"])   # old rows kept as they were
    assert list(df.columns[:2]) == ["x", "tag"] and list(df.columns[-len(ENV_COLUMNS):]) == \
        list(ENV_COLUMNS)
    quick = run_sweep(small, quick=True, out_dir=str(tmp_path), progress=False)
    assert len(quick) == 1 and (tmp_path / "toy_quick.csv").exists()
    assert capsys.readouterr().err == ""


def test_progress_without_tqdm(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)          # import tqdm -> ImportError
    s = Sweep("toy", grid={"x": [1, 2]}, quick_grid={"x": [1]}, measure=lambda p: {"y": 1},
              device=False)
    assert len(run_sweep(s, out_dir=str(tmp_path))) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"toy: 2 of 2 points to run -> {tmp_path / 'toy.csv'}"]


def test_no_figure_without_matplotlib(tmp_path, monkeypatch):
    drawn = []
    s = Sweep("toy", grid={"x": [1]}, quick_grid={"x": [1]}, measure=lambda p: {"y": 1},
              figure=lambda df, path: drawn.append(path), device=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)    # import matplotlib -> ImportError
    run_sweep(s, out_dir=str(tmp_path), progress=False)
    assert drawn == []
    monkeypatch.undo()
    if _has_matplotlib():
        run_sweep(s, out_dir=str(tmp_path), progress=False)
        assert drawn == [str(tmp_path / "toy.png")]


def test_register_replaces_by_name():
    s = Sweep("toy-registered", grid={"x": [1]}, quick_grid={"x": [1]}, measure=dict)
    try:
        assert register(s) is s and SWEEPS["toy-registered"] is s
        t = register(dataclasses.replace(s, description="second"))
        assert SWEEPS["toy-registered"] is t
    finally:
        SWEEPS.pop("toy-registered", None)


# -- CLI ---------------------------------------------------------------------------------

def test_cli_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for word in ("device:", "paged_numba 0.1.0", "numba ", "numba-cuda ", "numpy ",
                 "simulator warp support:"):
        assert word in out


def test_cli_list(capsys):
    assert main(["sweep", "--list"]) == 0
    out = capsys.readouterr().out
    for name in EXPECTED:
        assert name in out and SWEEPS[name].description in out


def test_cli_runs_a_sweep(tmp_path, capsys):
    assert main(["sweep", "merge-rule", "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    assert "8 rows" in capsys.readouterr().out
    assert len(pd.read_csv(tmp_path / "merge-rule_quick.csv")) == 8


def test_cli_help_is_plain_text(capsys):
    for argv in (["--help"], ["sweep", "--help"], ["info", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "usage:" in out and "``" not in out and ":func:" not in out and "::" not in out


def test_cli_unwritable_out_is_one_line_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    calls = counting(lambda p: {"y": 1})
    register(Sweep("toy-out", grid={"x": [1]}, quick_grid={"x": [1]}, measure=calls, device=False))
    try:
        with pytest.raises(SystemExit) as e:
            main(["sweep", "toy-out", "--out", str(blocker / "sub"), "--no-progress"])
    finally:
        SWEEPS.pop("toy-out", None)
    assert e.value.code == 2 and calls.calls == 0
    err = capsys.readouterr().err
    assert "cannot write to --out" in err and err.count("\n") == 1


def test_cli_missing_pandas_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pandas", None)         # import pandas -> ImportError
    with pytest.raises(SystemExit) as e:
        main(["sweep", "merge-rule", "--quick", "--out", str(tmp_path)])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert 'pandas is not installed; install it with: pip install -e ".[sweeps]"' in err
    assert err.count("\n") == 1 and not list(tmp_path.iterdir())


def test_cli_list_needs_only_the_core_install():
    """``sweep --list`` (and ``info``) with pandas, hypothesis, tqdm and
    matplotlib unimportable, in a fresh interpreter."""
    code = ("import sys\n"
            "for m in ('pandas', 'hypothesis', 'tqdm', 'matplotlib'):\n"
            "    sys.modules[m] = None\n"
            "from paged_numba.__main__ import main\n"
            "sys.exit(main(['sweep', '--list']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": _repo_root()})
    assert r.returncode == 0, r.stderr
    assert all(name in r.stdout for name in EXPECTED) and r.stderr == ""


@pytest.mark.parametrize("argv, message", [
    (["sweep", "no-such-sweep"], "unknown sweep 'no-such-sweep'; choose from"),
    (["sweep"], "give a sweep name or --list"),
    (["sweep", "merge-rule", "--bogus"], "unrecognized arguments: --bogus"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_cli_mistakes_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.skipif(not paged_numba.simulator_enabled(), reason="only refused on the simulator")
def test_cli_refuses_full_device_grid_on_simulator(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "decode", "--out", str(tmp_path)])
    assert e.value.code == 2 and "needs a GPU" in capsys.readouterr().err
    assert not (tmp_path / "decode.csv").exists()


def test_cli_plot_redraws_from_the_csv(quick_dir, capsys):
    """--plot measures nothing: it redraws a figure from the CSV alone (a GPU
    run's CSV on a machine without a GPU), and a missing CSV is a one-line error."""
    if not _has_matplotlib():
        pytest.skip("the figure needs the plots extra")
    png = quick_dir / "decode_quick.png"
    png.unlink(missing_ok=True)
    assert main(["sweep", "decode", "--plot", "--quick", "--out", str(quick_dir)]) == 0
    assert png.stat().st_size > 0 and str(png) in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["sweep", "decode", "--plot", "--out", str(quick_dir)])     # no decode.csv there
    err = capsys.readouterr().err
    assert e.value.code == 2 and "run the sweep first" in err and err.count("\n") == 1


def test_simulator_timings_are_not_drawn_as_microseconds(quick_dir, monkeypatch):
    """A timing sweep measured on the simulator is drawn as the simulation's
    wall time in seconds, and the title says that it is not a kernel timing."""
    from paged_numba.sweeps import figures

    drawn = {}
    monkeypatch.setattr(figures, "line_figure",
                        lambda df, path, x, y, *args, **kwargs: drawn.update(y=y, **kwargs))
    df = pd.read_csv(quick_dir / "split-k_quick.csv")
    figures.timing_figure(df, "unused.png", "num_partitions", ["batch"], title="t")
    if (df["gpu"] == "simulator").all():
        assert drawn["y"] == "sim_s" and "(s)" in drawn["ylabel"]
        assert "NOT a kernel timing" in drawn["title"] and "µs" not in drawn["ylabel"]
    else:
        assert "µs" in drawn["ylabel"] and "NOT" not in drawn["title"]


def test_cli_subprocess_exit_status(tmp_path):
    r = subprocess.run([sys.executable, "-m", "paged_numba", "sweep", "no-such-sweep"],
                       capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": _repo_root()})
    assert r.returncode == 2
    assert "unknown sweep" in r.stderr and "Traceback" not in r.stderr


def _repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has(module):
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _has_matplotlib():
    return _has("matplotlib")
