"""The sweep machinery: :class:`Sweep`, the registry :data:`SWEEPS`,
:func:`run_sweep` (points, resume, environment columns, CSV) and
:func:`plot_sweep` (a figure from the CSV alone; the figures themselves are
in :mod:`paged_numba.sweeps.figures`).

pandas (the ``sweeps`` extra) is imported only where a DataFrame is made or
read, tqdm only for the progress bar and matplotlib only for figures, so
that the registry can be listed with the core install.
"""
import dataclasses
import datetime
import importlib
import itertools
import os
import socket
import subprocess
import sys
from collections.abc import Callable

import numpy as np

from .._env import package_version

ENV_COLUMNS = ("gpu", "gpu_index", "gpu_bus_id", "host", "numba", "numba_cuda", "numpy",
               "git_rev", "timestamp", "command")


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra
    that installs it."""


def require(module, extra):
    """Import and return ``module``, or raise :class:`MissingExtra` naming the
    ``extra`` of ``paged-numba`` that installs it.

    >>> require("numpy", "sweeps").__name__
    'numpy'
    >>> require("no_such_module", "plots")
    Traceback (most recent call last):
        ...
    paged_numba.sweeps.runner.MissingExtra: no_such_module is not installed; install it with: pip install -e ".[plots]"
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise MissingExtra(f'{module} is not installed; install it with: '
                           f'pip install -e ".[{extra}]"') from None


@dataclasses.dataclass
class Sweep:
    """One experiment: a parameter grid and a function measuring one point.

    Parameters
    ----------
    name : str
        Registry key and CSV file name.
    grid, quick_grid : dict of str -> list
        Parameter values; the points are the cartesian product. ``quick_grid``
        should run on the simulator in well under a minute.
    measure : callable(point: dict) -> dict
        Metrics of one point. Values must be scalars (written to CSV).
    description : str
    figure : callable(df, path), optional
        Draws one figure of the sweep's DataFrame into the PNG ``path``.
    device : bool
        Whether ``measure`` runs kernels (the ``gpu`` column then names the
        device or ``"simulator"``; otherwise it says ``"cpu"``).

    Examples
    --------
    >>> s = Sweep("sums", grid={"a": [1, 2], "b": [10, 20]}, quick_grid={"a": [1], "b": [10]},
    ...           measure=lambda p: {"total": p["a"] + p["b"]}, device=False)
    >>> s.points()                        # 2 x 2 points, the last parameter varying fastest
    [{'a': 1, 'b': 10}, {'a': 1, 'b': 20}, {'a': 2, 'b': 10}, {'a': 2, 'b': 20}]
    >>> [s.measure(p) for p in s.points(quick=True)]
    [{'total': 11}]
    """

    name: str
    grid: dict
    quick_grid: dict
    measure: Callable[[dict], dict]
    description: str = ""
    figure: Callable | None = None
    device: bool = True

    def points(self, quick=False):
        """The grid's points, as dicts ``{param: value}`` in row-major order."""
        grid = self.quick_grid if quick else self.grid
        return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


SWEEPS: dict[str, Sweep] = {}


def register(sweep):
    """Add ``sweep`` to :data:`SWEEPS` (replacing one of the same name); return it.

    Parameters
    ----------
    sweep : Sweep

    Returns
    -------
    Sweep
        ``sweep`` itself, so that ``s = register(Sweep(...))`` keeps a handle.

    Examples
    --------
    >>> import shutil, tempfile
    >>> s = register(Sweep("cubes", grid={"x": [2, 3]}, quick_grid={"x": [2]},
    ...                    measure=lambda p: {"y": p["x"] ** 3}, device=False))
    >>> SWEEPS["cubes"] is s, "merge-rule" in SWEEPS
    (True, True)
    >>> out = tempfile.mkdtemp()
    >>> run_sweep("cubes", quick=True, out_dir=out, progress=False)["y"].tolist()   # by name
    [8]
    >>> del SWEEPS["cubes"]; shutil.rmtree(out)      # leave the registry as it was
    """
    SWEEPS[sweep.name] = sweep
    return sweep


# -- running ------------------------------------------------------------------

def _git_rev():
    """Short commit of the repository holding this package, or ``"unknown"``."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name():
    """The CUDA device's name, or ``"simulator"`` under Numba's CUDA simulator.

    Returns
    -------
    str
        E.g. ``"NVIDIA H200"`` on a GPU.

    Examples
    --------
    >>> from paged_numba import simulator_enabled
    >>> (device_name() == "simulator") == simulator_enabled()   # "simulator" on a CPU-only machine
    True
    """
    from .. import simulator_enabled

    if simulator_enabled():
        return "simulator"
    from numba import cuda

    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def device_place():
    """``(index, PCI bus id)`` of the CUDA device this process measures on:
    the index among the host's GPUs (the current device's entry of
    ``CUDA_VISIBLE_DEVICES`` where a launcher such as dask-cuda set it, else
    its own index) and ``"DDDD:BB:DD.0"``; ``("", "")`` under the simulator.

    >>> from paged_numba import simulator_enabled
    >>> device_place() == ("", "") or not simulator_enabled()
    True
    """
    from .. import simulator_enabled

    if simulator_enabled():
        return "", ""
    from numba import cuda

    dev = cuda.get_current_device()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if v.strip()]
    index = visible[dev.id] if dev.id < len(visible) else str(dev.id)
    pci = dev.get_device_identity()
    return index, (f"{pci['pci_domain_id']:04x}:{pci['pci_bus_id']:02x}:"
                   f"{pci['pci_device_id']:02x}.0")


def environment(device=True):
    """Environment columns (all but ``timestamp`` and ``command``) for a
    sweep's rows: what measured them, so that rows from different GPUs or
    hosts are never mixed silently.

    Parameters
    ----------
    device : bool
        Name the device in ``gpu`` (:func:`device_name`) and place it
        (:func:`device_place`); ``False`` gives ``"cpu"`` and no place.

    Returns
    -------
    dict of str -> str
        ``gpu``, ``gpu_index``, ``gpu_bus_id``, ``host`` (this machine's
        name), ``numba``, ``numba_cuda``, ``numpy`` (versions, ``"unknown"``
        if not installed) and ``git_rev`` (short commit or ``"unknown"``).

    Examples
    --------
    >>> env = environment(device=False)
    >>> sorted(env)
    ['git_rev', 'gpu', 'gpu_bus_id', 'gpu_index', 'host', 'numba', 'numba_cuda', 'numpy']
    >>> env["gpu"], env["gpu_index"], env["numpy"] == np.__version__
    ('cpu', '', True)
    """
    index, bus = device_place() if device else ("", "")
    return dict(gpu=device_name() if device else "cpu", gpu_index=index, gpu_bus_id=bus,
                host=socket.gethostname(), numba=package_version("numba"),
                numba_cuda=package_version("numba-cuda"), numpy=np.__version__,
                git_rev=_git_rev())


def _progress_bar(total, label):
    """tqdm's bar on stderr over ``total`` points (its ETA), or None without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit="point", file=sys.stderr, dynamic_ncols=True)


def _save(rows, path, params):
    """Write ``rows`` (list of dicts) to ``path`` atomically: parameters first,
    then metrics, then environment columns."""
    pd = require("pandas", "sweeps")
    df = pd.DataFrame(rows)
    rest = [c for c in df.columns if c not in params and c not in ENV_COLUMNS]
    df = df[[c for c in params if c in df] + rest + [c for c in ENV_COLUMNS if c in df]]
    df.to_csv(path + ".tmp", index=False)
    os.replace(path + ".tmp", path)


def utc_stamp():
    """Now, UTC, ISO 8601 to the second: a row's ``timestamp``."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _failed(row):
    """Whether a CSV row records a point that failed (an ``error``, no metrics)."""
    return str(row.get("error", "")) not in ("", "nan")


def _local_rows(sweep, points, command):
    """The rows of ``points`` measured one after the other in this process
    (a measure that raises stops the sweep)."""
    env = environment(sweep.device)
    for point in points:
        metrics = sweep.measure(dict(point))
        yield {**point, **metrics, **env, "timestamp": utc_stamp(), "command": command}


def run_sweep(sweep, quick=False, out_dir="results", progress=True, workers=None,
              scheduler=None):
    """Run the points of ``sweep`` missing from its CSV; return all its rows.

    Parameters
    ----------
    sweep : Sweep or str
        A sweep or the name of a registered one.
    quick : bool
        Run ``quick_grid`` into ``<out_dir>/<name>_quick.csv`` instead of
        ``grid`` into ``<out_dir>/<name>.csv``.
    out_dir : str
        Created if missing.
    progress : bool
        Print the number of points to run and a progress bar with ETA to
        stderr (tqdm's, advancing per point; no bar when tqdm is missing).
    workers : int, optional
        Measure the points on a local Dask cluster of this many worker
        processes (one a GPU on a GPU machine), as tasks, instead of one
        after the other here (:mod:`paged_numba.sweeps.distributed`; the
        ``distributed`` extra).
    scheduler : str, optional
        Measure them on the running Dask cluster at this address instead.

    Returns
    -------
    pandas.DataFrame
        One row per point: the parameters, the metrics, and ``gpu`` (device
        name, ``"simulator"`` or ``"cpu"``), ``gpu_index`` and ``gpu_bus_id``
        (which of the host's GPUs; empty without one), ``host``, ``numba``,
        ``numba_cuda``, ``numpy`` (versions), ``git_rev``, ``timestamp``
        (UTC, ISO 8601) and ``command`` (the CLI call that reproduces the
        row); rows measured by workers also have ``error``.

    Notes
    -----
    Resume: a point whose parameter values (compared as strings) already have
    a row in the CSV is not measured again; its row is kept as it is, whatever
    environment produced it (delete the CSV to measure afresh). The CSV is
    rewritten after every point, and at the end in the grid's order. Here a
    measure that raises stops the sweep; on workers it gives a row with its
    ``error`` and the sweep goes on, and a later run measures that point
    again (its row replaced). If matplotlib imports, ``sweep.figure``
    draws ``<out_dir>/<name>[_quick].png`` from all rows. Needs pandas (the
    ``sweeps`` extra): without it, :class:`MissingExtra` is raised before
    anything runs.

    Examples
    --------
    >>> import os, shutil, tempfile
    >>> calls = []
    >>> def halve(p):
    ...     calls.append(p["x"])
    ...     return {"half": p["x"] / 2}
    >>> s = Sweep("halves", grid={"x": [1, 2, 4]}, quick_grid={"x": [2]}, measure=halve,
    ...           device=False)
    >>> out = tempfile.mkdtemp()
    >>> run_sweep(s, quick=True, out_dir=out, progress=False)["half"].tolist()
    [1.0]
    >>> df = run_sweep(s, out_dir=out, progress=False)     # the full grid, a separate CSV
    >>> df["x"].tolist(), df["half"].tolist(), df["gpu"].tolist()
    ([1, 2, 4], [0.5, 1.0, 2.0], ['cpu', 'cpu', 'cpu'])
    >>> len(run_sweep(s, out_dir=out, progress=False)), calls   # resumed: nothing re-measured
    (3, [2, 1, 2, 4])
    >>> sorted(os.listdir(out))
    ['halves.csv', 'halves_quick.csv']
    >>> shutil.rmtree(out)
    """
    pd = require("pandas", "sweeps")
    if isinstance(sweep, str):
        sweep = SWEEPS[sweep]
    points = sweep.points(quick)
    params = list((sweep.quick_grid if quick else sweep.grid))
    stem = sweep.name + ("_quick" if quick else "")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, stem + ".csv")
    rows = []
    if os.path.exists(path) and os.path.getsize(path):
        rows = pd.read_csv(path, dtype=str, keep_default_na=False).to_dict("records")

    def key(row):
        return tuple(str(row.get(p, "")) for p in params)

    have = {key(r) for r in rows if not _failed(r)}
    todo = [p for p in points if key(p) not in have]
    if progress:
        print(f"{stem}: {len(todo)} of {len(points)} points to run -> {path}", file=sys.stderr)
    if todo:
        command = f"python -m paged_numba sweep {sweep.name}" + (" --quick" if quick else "")
        if workers is None and scheduler is None:
            results = _local_rows(sweep, todo, command)
        else:
            from .distributed import distributed_rows

            results = distributed_rows(sweep, todo, command, workers, scheduler)
        bar = _progress_bar(len(todo), stem) if progress else None
        try:
            for row in results:
                rows = [r for r in rows if key(r) != key(row)] + [row]   # a failed row replaced
                _save(rows, path, params)
                if bar is not None:
                    bar.update(1)
        finally:
            results.close()
            if bar is not None:
                bar.close()
        order = {key(p): i for i, p in enumerate(points)}
        rows.sort(key=lambda r: order.get(key(r), len(order)))
        _save(rows, path, params)
    df = pd.read_csv(path) if rows else pd.DataFrame(columns=params)
    if sweep.figure is not None and len(df):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return df
        sweep.figure(df, os.path.join(out_dir, stem + ".png"))
    return df


def plot_sweep(sweep, quick=False, out_dir="results"):
    """Draw ``sweep``'s figure from its CSV without measuring anything (e.g. a
    GPU sweep's committed CSV on a machine without a GPU); return the PNG's path.

    Parameters
    ----------
    sweep : Sweep or str
    quick : bool
        Read ``<name>_quick.csv`` and write ``<name>_quick.png``.
    out_dir : str
        The directory of the CSV, and of the figure.

    Returns
    -------
    str

    Examples
    --------
    >>> import os, shutil, tempfile
    >>> s = Sweep("lines", grid={"x": [1, 2]}, quick_grid={"x": [1]},
    ...           measure=lambda p: {"y": 3 * p["x"]}, device=False,
    ...           figure=lambda df, path: open(path, "w").write(str(df["y"].tolist())))
    >>> out = tempfile.mkdtemp()
    >>> _ = run_sweep(s, out_dir=out, progress=False)
    >>> png = os.path.join(out, "lines.png")   # drawn only where matplotlib imports
    >>> if os.path.exists(png): os.remove(png)
    >>> path = plot_sweep(s, out_dir=out)                 # from lines.csv alone
    >>> os.path.basename(path), open(path).read()
    ('lines.png', '[3, 6]')
    >>> shutil.rmtree(out)
    """
    pd = require("pandas", "sweeps")
    if isinstance(sweep, str):
        sweep = SWEEPS[sweep]
    stem = sweep.name + ("_quick" if quick else "")
    csv = os.path.join(out_dir, stem + ".csv")
    if sweep.figure is None:
        raise ValueError(f"sweep {sweep.name!r} has no figure")
    if not os.path.exists(csv):
        raise FileNotFoundError(f"{csv} does not exist: run the sweep first")
    path = os.path.join(out_dir, stem + ".png")
    sweep.figure(pd.read_csv(csv), path)
    return path
