"""Command line of paged_numba.

  python -m paged_numba info                 device, versions, simulator support
  python -m paged_numba cache [--clear]      the kept compiled kernels (or remove them)
  python -m paged_numba sweep --list         the registered sweeps
  python -m paged_numba sweep NAME [--quick] [--out DIR] [--no-progress]
                                  [--workers N | --scheduler ADDRESS]
  python -m paged_numba sweep NAME --plot [--quick] [--out DIR]

A sweep writes DIR/NAME.csv (DIR/NAME_quick.csv with --quick) and, when
matplotlib is installed, a figure beside it. --plot measures nothing: it
redraws the figure from the CSV already in DIR (e.g. a GPU run's CSV on a
machine without a GPU). --workers N measures the points on N worker
processes of a local Dask cluster (one a GPU on a GPU machine), --scheduler
on a running Dask cluster (several hosts); both need the "distributed"
extra. Running one needs the "sweeps"
extra (pip install -e ".[sweeps]"), its figure the "plots" extra; --list
and info need neither.

Mistakes (an unknown sweep, bad arguments, an --out that cannot be written)
print one line to stderr and exit with status 2; a missing extra prints one
line naming it and exits with status 1.
"""
import argparse
import os
import sys
import tempfile

from ._env import package_version


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error message (no usage dump) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def info():
    """Print the device (or the simulator), versions and simulator warp support."""
    import numpy as np

    import paged_numba
    from paged_numba import _simulator

    if paged_numba.simulator_enabled():
        print("device: running on Numba's CUDA simulator")
    else:
        from numba import cuda

        name = cuda.get_current_device().name
        print(f"device: {name.decode() if isinstance(name, bytes) else name}")
    print(f"paged_numba {paged_numba.__version__}")
    print(f"numba {package_version('numba', 'not installed')}")
    print(f"numba-cuda {package_version('numba-cuda', 'not installed')}")
    print(f"numpy {np.__version__}")
    print("simulator warp support: "
          + ("active" if _simulator.is_installed() else "not active"))


def _writable_dir(path):
    """None if ``path`` is (or can be made) a directory a file can be written
    into, else the reason it is not."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def _cache(clear):
    from paged_numba.kernels import disk_cache

    where = disk_cache.cache_dir()
    if clear:
        print(f"removed {disk_cache.clear()} files from {where}")
        return 0
    files = disk_cache.entries()
    size = sum(f.stat().st_size for f in files)
    state = "on" if disk_cache.enabled() else f"off ({disk_cache.SWITCH_ENV}=0)"
    print(f"{where}: {len(files)} kernels, {size / 2**20:.1f} MiB; the cache is {state}")
    return 0


def main(argv=None):
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="python -m paged_numba", description=__doc__, formatter_class=raw)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("info", help="device, versions, simulator warp support",
                   description="Print the device (or the simulator), the versions of "
                               "paged_numba, numba, numba-cuda and numpy, and whether the "
                               "simulator's warp operations are installed.", formatter_class=raw)
    ca = sub.add_parser("cache", help="where compiled kernels are kept; --clear empties it",
                        description="Print the directory compiled kernels are kept in (set by "
                                    "PAGED_NUMBA_CACHE_DIR;\nPAGED_NUMBA_CACHE=0 turns the cache "
                                    "off), how many it holds and their size.", formatter_class=raw)
    ca.add_argument("--clear", action="store_true", help="remove every kept kernel")
    sw = sub.add_parser("sweep", help="run a registered sweep (see --list)", formatter_class=raw,
                        description="Run the points of a registered sweep that its CSV does not "
                                    "hold yet\n(an interrupted sweep resumes), or list the "
                                    "sweeps.")
    sw.add_argument("name", nargs="?", help="sweep to run")
    sw.add_argument("--list", action="store_true", help="list sweeps and exit")
    sw.add_argument("--quick", action="store_true", help="run the small grid (simulator-sized)")
    sw.add_argument("--out", default="results", help="output directory (default: results/)")
    sw.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sw.add_argument("--plot", action="store_true",
                    help="only redraw the figure from the CSV in --out (measures nothing)")
    where = sw.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, metavar="N",
                       help="measure on N worker processes of a local Dask cluster (one a GPU)")
    where.add_argument("--scheduler", metavar="ADDRESS",
                       help="measure on the running Dask cluster at ADDRESS (tcp://host:8786)")
    args = parser.parse_args(argv)

    if args.command == "info":
        info()
        return 0
    if args.command == "cache":
        return _cache(args.clear)
    from paged_numba.sweeps import SWEEPS, MissingExtra, plot_sweep, require, run_sweep

    if args.list:
        width = max(map(len, SWEEPS))
        for name, s in SWEEPS.items():
            print(f"{name:<{width}}  {s.description}")
        return 0
    if args.name is None:
        parser.exit(2, f"{sw.prog}: error: give a sweep name or --list\n")
    if args.name not in SWEEPS:
        parser.exit(2, f"{sw.prog}: error: unknown sweep {args.name!r}; choose from "
                       f"{', '.join(SWEEPS)}\n")
    sweep = SWEEPS[args.name]
    if args.plot:
        try:
            require("pandas", "sweeps")
            require("matplotlib", "plots")
            print(plot_sweep(sweep, quick=args.quick, out_dir=args.out))
        except MissingExtra as e:
            parser.exit(1, f"{sw.prog}: error: {e}\n")
        except (FileNotFoundError, ValueError) as e:
            parser.exit(2, f"{sw.prog}: error: {e}\n")
        return 0
    if sweep.device and not args.quick:
        import paged_numba

        if paged_numba.simulator_enabled():
            parser.exit(2, f"{sw.prog}: error: {args.name}'s full grid needs a GPU (it would take "
                           "hours on Numba's CUDA simulator); add --quick\n")
    if args.workers is not None and args.workers < 1:
        parser.exit(2, f"{sw.prog}: error: --workers must be at least 1, but got {args.workers}\n")
    try:
        require("pandas", "sweeps")
        if args.name == "exactness":            # its measure checks against paged_numba.testing
            require("hypothesis", "sweeps")
        if args.workers is not None or args.scheduler is not None:
            require("distributed", "distributed")
    except MissingExtra as e:
        parser.exit(1, f"{sw.prog}: error: {e}\n")
    reason = _writable_dir(args.out)
    if reason is not None:
        parser.exit(2, f"{sw.prog}: error: cannot write to --out {args.out!r}: {reason}\n")
    try:
        df = run_sweep(sweep, quick=args.quick, out_dir=args.out,
                       progress=not args.no_progress, workers=args.workers,
                       scheduler=args.scheduler)
    except KeyboardInterrupt:
        print("\ninterrupted; finished points are saved, rerun to resume", file=sys.stderr)
        return 130
    stem = args.name + ("_quick" if args.quick else "")
    print(f"{len(df)} rows in {args.out.rstrip('/')}/{stem}.csv")
    if sweep.figure is not None and len(df):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print('no figure: matplotlib is not installed; install it with: '
                  'pip install -e ".[plots]"', file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
