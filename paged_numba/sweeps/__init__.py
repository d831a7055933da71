"""Experiments declared as data: a grid, a measure, one tidy CSV per sweep.

A :class:`Sweep` names a grid of parameters (the cartesian product of value
lists), a small ``quick_grid`` that runs on Numba's CUDA simulator in
seconds, and a ``measure`` that turns one point into a dict of metrics.
:func:`run_sweep` runs the points not yet in ``<out_dir>/<name>.csv``
(``<name>_quick.csv`` in quick mode), adds environment columns, saves after
every point (so an interrupted sweep resumes where it stopped) and draws the
sweep's figure when matplotlib is installed. From the shell::

    python -m paged_numba sweep --list
    python -m paged_numba sweep merge-rule --quick --out results/

Registered sweeps (:data:`SWEEPS`): ``memory-waste``, ``merge-rule`` and
``fp8`` (the attention error of fp8 KV caches) need no GPU; ``exactness`` checks kernels against the float64 reference;
``decode``, ``paging-overhead``, ``split-k`` and ``swap-vs-recompute`` time
kernels and copies (CUDA events on a GPU; on the simulator one wall-clock
call per point, which measures the simulator, not a kernel).

Three modules, their public names re-exported here: ``runner`` (the
machinery), ``figures`` (the plots) and ``definitions`` (the registered
sweeps). Running a sweep needs pandas (the
``sweeps`` extra), its figure matplotlib (``plots``); listing them needs
neither.

Examples
--------
>>> s = Sweep("squares", grid={"x": [1, 2, 3]}, quick_grid={"x": [2]},
...           measure=lambda p: {"y": p["x"] ** 2}, device=False)
>>> s.points(quick=True)
[{'x': 2}]
>>> import tempfile
>>> with tempfile.TemporaryDirectory() as out:      # writes out/squares.csv
...     df = run_sweep(s, out_dir=out, progress=False)
>>> df[["x", "y", "gpu"]].values.tolist()
[[1, 1, 'cpu'], [2, 4, 'cpu'], [3, 9, 'cpu']]
"""
from .runner import (ENV_COLUMNS, SWEEPS, MissingExtra, Sweep, _git_rev, _progress_bar, _save,
                     device_name, environment, plot_sweep, register, require, run_sweep)
from .figures import line_figure
from .definitions import (ALLOCATORS, L2_BYTES, MAX_ROTATIONS, PAGED_BLOCK_SIZES, _TINY,
                          _event_us, _max_running, _release_device_memory, _requests, _sdpa_us,
                          measure_decode_time, measure_exactness, measure_memory_waste,
                          measure_merge_rule, softmax_average)
from . import serving  # noqa: E402,F401  (registers sharing, prefix-cache)
from . import fp8  # noqa: E402,F401  (registers fp8)
from . import swap  # noqa: E402,F401  (registers swap-vs-recompute)

__all__ = [
    "ALLOCATORS", "ENV_COLUMNS", "L2_BYTES", "MAX_ROTATIONS", "PAGED_BLOCK_SIZES", "SWEEPS",
    "MissingExtra", "Sweep", "device_name", "environment", "line_figure", "measure_decode_time",
    "measure_exactness", "measure_memory_waste", "measure_merge_rule", "plot_sweep", "register",
    "require", "run_sweep", "softmax_average",
]
