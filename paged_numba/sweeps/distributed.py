"""Sweeps over several processes, GPUs or hosts, through Dask's distributed
scheduler (the ``distributed`` extra: ``dask[distributed]``, and ``dask-cuda``
for GPUs).

:func:`paged_numba.sweeps.run_sweep` with ``workers=N`` starts a local
cluster of ``N`` worker processes: on a GPU, dask-cuda's
``LocalCUDACluster`` (one worker a GPU, each seeing only its own through
``CUDA_VISIBLE_DEVICES``); under the simulator or for a sweep that runs no
kernel, ``N`` CPU processes. ``scheduler=ADDRESS`` uses a cluster that is
already running (``dask scheduler`` and ``dask worker`` on several hosts,
or ``dask-jobqueue`` on Slurm). Each point is one task
(:func:`measure_point`); a worker process keeps the kernels it compiled for
the points after it. Rows come back as points finish and the runner writes
them to the one CSV as they arrive, so an interrupted sweep resumes with
the points it lacks.

A point whose measure raises, or whose worker died more often than the
scheduler allows (``distributed.scheduler.allowed-failures``), gives a row
with its ``error`` and no metrics; the sweep goes on, and the next run
measures that point again.

The local clusters' workers run without Dask's sampling profiler
(``distributed.worker.profile.enabled``): it walks every thread's stack
every 10 ms, and the simulator runs a Python thread a CUDA thread, so a
simulated kernel ran many times slower under it. Start the workers of a
cluster of your own for the simulator with it off, too.
"""
import functools

from .runner import environment, require, utc_stamp


@functools.cache
def _worker_environment(device):
    """The environment columns of this worker process (its GPU, its host)."""
    return environment(device)


def measure_point(measure, device, point, command):
    """One point's row, computed on a worker: the point, ``measure(point)``'s
    metrics, the worker's environment columns, ``timestamp``, ``command`` and
    ``error`` (``""``; where ``measure`` raises, ``"Type: message"`` and no
    metrics).

    >>> row = measure_point(lambda p: {"y": 2 * p["x"]}, False, {"x": 3}, "cmd")
    >>> row["y"], row["error"], row["gpu"], row["command"]
    (6, '', 'cpu', 'cmd')
    >>> measure_point(lambda p: 1 / 0, False, {"x": 3}, "cmd")["error"]
    'ZeroDivisionError: division by zero'
    """
    try:
        metrics, error = measure(dict(point)), ""
    except Exception as exc:  # noqa: BLE001 - the row records it, the sweep goes on
        metrics, error = {}, f"{type(exc).__name__}: {exc}"
    return {**point, **metrics, **_worker_environment(device), "timestamp": utc_stamp(),
            "command": command, "error": error}


def _cluster(workers, device):
    """A local cluster of ``workers`` processes: one a GPU where the sweep runs
    kernels on GPUs, else CPU processes of one thread each."""
    distributed = require("distributed", "distributed")
    from .. import simulator_enabled

    if device and not simulator_enabled():
        dask_cuda = require("dask_cuda", "distributed")
        return dask_cuda.LocalCUDACluster(n_workers=workers, threads_per_worker=1,
                                          dashboard_address=None)
    return distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                    dashboard_address=None)


def distributed_rows(sweep, points, command, workers=None, scheduler=None):
    """Measure ``points`` of ``sweep`` on a Dask cluster; yield their rows (see
    :func:`measure_point`) as they finish, in any order.

    Parameters
    ----------
    sweep : Sweep
        Its ``measure`` must pickle (a module-level function does; Dask
        pickles others, lambdas included, by value).
    points : list of dict
    command : str
        The ``command`` column.
    workers : int, optional
        Start a local cluster of this many worker processes (closed at the end).
    scheduler : str, optional
        The address of a running cluster's scheduler (``"tcp://host:8786"``),
        instead of ``workers``.
    """
    distributed = require("distributed", "distributed")
    import dask

    with dask.config.set({"distributed.worker.profile.enabled": False}):
        cluster = None if scheduler is not None else _cluster(workers, sweep.device)
    client = distributed.Client(scheduler if cluster is None else cluster)
    try:
        futures = [client.submit(measure_point, sweep.measure, sweep.device, point, command,
                                 pure=False) for point in points]
        point_of = {f.key: p for f, p in zip(futures, points)}
        for future in distributed.as_completed(futures):
            if future.status == "finished":
                yield future.result()
            else:       # the task itself failed: its worker died too often
                exc = future.exception()
                yield {**point_of[future.key], "timestamp": utc_stamp(), "command": command,
                       "error": f"{type(exc).__name__}: {exc}"}
            future.release()
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
