"""Command line: ``python -m paged_numba {info, sweep}``.

::

    python -m paged_numba info                       # device, versions, simulator support
    python -m paged_numba sweep --list               # registered sweeps
    python -m paged_numba sweep NAME [--quick] [--out DIR] [--no-progress]

Mistakes (an unknown sweep, bad arguments) print one line to stderr and
exit with status 2.
"""
import argparse
import importlib.metadata
import os
import sys


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error message (no usage dump) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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
    print(f"numba {_version('numba')}")
    print(f"numba-cuda {_version('numba-cuda')}")
    print(f"numpy {np.__version__}")
    print("simulator warp support: "
          + ("active" if _simulator.is_installed() else "not active"))


def main(argv=None):
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = _Parser(prog="python -m paged_numba", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("info", help="device, versions, simulator warp support")
    sw = sub.add_parser("sweep", help="run a registered sweep (see --list)")
    sw.add_argument("name", nargs="?", help="sweep to run")
    sw.add_argument("--list", action="store_true", help="list sweeps and exit")
    sw.add_argument("--quick", action="store_true", help="run the small grid (simulator-sized)")
    sw.add_argument("--out", default="results", help="output directory (default: results/)")
    sw.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)

    if args.command == "info":
        info()
        return 0
    from paged_numba.sweeps import SWEEPS, run_sweep

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
    if sweep.device and not args.quick:
        import paged_numba

        if paged_numba.simulator_enabled():
            parser.exit(2, f"{sw.prog}: error: {args.name}'s full grid needs a GPU (it would take "
                           "hours on Numba's CUDA simulator); add --quick\n")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        parser.exit(2, f"{sw.prog}: error: cannot create --out {args.out!r}: {e.strerror}\n")
    try:
        df = run_sweep(sweep, quick=args.quick, out_dir=args.out,
                       progress=not args.no_progress)
    except KeyboardInterrupt:
        print("\ninterrupted; finished points are saved, rerun to resume", file=sys.stderr)
        return 130
    stem = args.name + ("_quick" if args.quick else "")
    print(f"{len(df)} rows in {args.out.rstrip('/')}/{stem}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
