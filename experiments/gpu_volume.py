"""How many hypothesis examples the property tests of each kernel family run
under the ``gpu`` profile, and whether all of them pass: one CSV row per
family, the examples counted from hypothesis's own statistics, so that a run on
a GPU proves (or refutes) "at least 10,000 examples per family, 0 failures".

    python3 experiments/gpu_volume.py run --all --dry-run         # the plan and commands
    python3 experiments/gpu_volume.py run decode prefill --workers 16 --log /tmp/gv
    python3 experiments/gpu_volume.py run write_kv --target 2000 --sanitizer memcheck

A family is the selection of its ``@given`` tests that hold its kernels to the
float64 reference (``FAMILIES``). ``run`` collects it with ``GPU_EXAMPLES`` at
a sentinel value and reads each item's ``max_examples`` (this file is loaded
as a pytest plugin for that): an item at the sentinel follows the profile, the
others have fixed counts (``@settings``), a skipped item counts nothing.
``GPU_EXAMPLES`` is the least count that brings the followers plus the fixed
counts to ``--target`` (at least 1); ``--override-fixed`` gives every item
``max_examples=GPU_EXAMPLES`` (``ceil(target / items)``). The selection runs
with ``HYPOTHESIS_PROFILE=gpu``, pytest-xdist (``--workers``) and
``--hypothesis-show-statistics``, its output in ``<log>/<run_id>-<family>.log``.

Counting: the statistics give each item one block per phase, ``- during
<phase> phase (...)`` and then ``- N passing examples, M failing examples, K
invalid examples``. The lines of the reuse, generate and target phases are
summed (the examples that count towards ``max_examples``), not those of the
shrink and explain phases (re-runs of a failure already found). Hypothesis
stops an item early when its strategies run out of distinct examples, and a
run stopped by ``--timeout`` (exit code 124) has statistics only for the items
that finished: the count is what ran, whatever the plan.

A row (``--out``, appended) is ``met`` when examples_passing >= target and no
test failed or errored; git_rev ends in ``+dirty`` when tracked files differ
from it; ``--sanitizer TOOL`` runs pytest under compute-sanitizer (every
process; an error makes the exit code 9) and records its distinct ``ERROR
SUMMARY`` / ``RACECHECK SUMMARY`` lines with their number of processes.
``guard`` and ``non_finite`` have one ``@given`` test each (the scatter's
slot mapping; non-finite data anywhere in a decode), beside fixed cases;
``wgmma`` has one fixed-count item, which reaches a large target only with
``--override-fixed``.
"""
import argparse
import collections
import datetime
import json
import math
import os
import pathlib
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pandas as pd

ROOT = pathlib.Path(__file__).resolve().parent.parent
# PYTHONPATH that lets pytest load this file as a plugin (-p gpu_volume)
PLUGIN_PATH = os.pathsep.join(filter(None, [str(ROOT / "experiments"),
                                             os.environ.get("PYTHONPATH")]))
# family: the selection of its hypothesis tests against the float64 reference. decode: on a
# GPU fp16/bf16 caches take tensor cores by default, and split-K (num_partitions None, 1-4) is
# drawn; split_k: merge_states; prefill: on sm_90 the warpgroup kernels (the default there);
# wgmma: the warpgroup products those kernels are built on; fp8: every example writes its
# pools with the fp8 scatter; guard, non_finite: one @given test each.
FAMILIES = {name: ["tests/" + t for t in tests.split()] for name, tests in {
    "write_kv": "test_cache.py::test_write_then_gather_returns_what_was_written",
    "decode": "test_decode.py::test_decode_matches_reference",
    "split_k": "test_decode.py::test_merge_states_equals_single_pass "
               "test_decode.py::test_merge_states_of_many_parts",
    "prefill": "test_prefill.py::test_prefill_matches_reference "
               "test_prefill.py::test_one_query_per_sequence_matches_decode",
    "wgmma": "test_wgmma.py::test_product_shapes",
    "decode_tc": "test_decode_tensor_cores.py::test_decode_tensor_core_variants_match_reference "
                 "test_decode_tensor_cores.py::test_decode_dynamic_ring_matches_reference "
                 "test_decode_tensor_cores.py::test_group_decode_kernels_match_reference "
                 "test_decode_group16.py::test_sixteen_heads_a_block_match_reference_and_eight",
    "fp8": "test_fp8.py::test_fp8_decode_matches_reference "
           "test_fp8.py::test_fp8_prefill_matches_reference "
           "test_fp8_decode_tc.py::test_fp8_tensor_core_decode_matches_reference "
           "test_fp8_prefill_tc.py::test_fp8_prefill_tensor_cores_property",
    "blocks": "test_blocks.py::test_copy_blocks_random_pairs",
    "guard": "test_guard.py test_guard_decode.py",
    "non_finite": "test_non_finite.py",
}.items()}
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:benchmark"]
SENTINEL = 99991                      # GPU_EXAMPLES while collecting: marks the followers
COUNTED = ("reuse", "generate", "target")
EXAMPLES = re.compile(r"(\d+) passing(?: examples?)?, (\d+) failing(?: examples?)?, (\d+) invalid")
SANITIZE = ["--target-processes", "all", "--report-api-errors", "no", "--error-exitcode", "9",
            "--print-limit", "50"]


# -- loaded into pytest by -p gpu_volume (with experiments/ on PYTHONPATH) ----------------

def pytest_collection_finish(session):
    """With GPU_VOLUME_ITEMS set: write {nodeid: max_examples} there (None: not a
    hypothesis test; 0: skipped by a mark)."""
    if path := os.environ.get("GPU_VOLUME_ITEMS"):
        from _pytest.skipping import evaluate_skip_marks
        found = {}
        for item in session.items:
            fn = getattr(item, "obj", None)
            found[item.nodeid] = (None if not getattr(fn, "is_hypothesis_test", False) else 0
                                  if evaluate_skip_marks(item)
                                  else fn._hypothesis_internal_use_settings.max_examples)
        pathlib.Path(path).write_text(json.dumps(found))


def pytest_collection_modifyitems(items):
    """With GPU_VOLUME_OVERRIDE set: every hypothesis test runs GPU_EXAMPLES examples."""
    if os.environ.get("GPU_VOLUME_OVERRIDE"):
        from hypothesis import settings
        n = int(os.environ["GPU_EXAMPLES"])
        for fn in {getattr(i.obj, "__func__", i.obj) for i in items if hasattr(i, "obj")}:
            if getattr(fn, "is_hypothesis_test", False):
                fn._hypothesis_internal_use_settings = settings(
                    fn._hypothesis_internal_use_settings, max_examples=n)


# -- the driver ---------------------------------------------------------------------------

def collect(selection):
    """{nodeid: max_examples or None} of the selection's items under the gpu profile."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "items.json")
        env = dict(os.environ, PYTHONPATH=PLUGIN_PATH, HYPOTHESIS_PROFILE="gpu",
                   GPU_EXAMPLES=str(SENTINEL), GPU_VOLUME_ITEMS=path)
        proc = subprocess.run([*PYTEST, "-p", "gpu_volume", "--collect-only", "-q", *selection],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode or not os.path.exists(path):
            sys.exit(f"collecting {' '.join(selection)} failed ({proc.returncode}):\n"
                     + (proc.stdout + proc.stderr)[-3000:])
        return json.loads(pathlib.Path(path).read_text())


def plan(found, target, override):
    """GPU_EXAMPLES for the selection, and the most examples it can run."""
    counts = [n for n in found.values() if n is not None]
    live = [n for n in counts if n]
    follow = len(live) if override else sum(n == SENTINEL for n in live)
    fixed = 0 if override else sum(n for n in live if n != SENTINEL)
    n = max(1, math.ceil((target - fixed) / follow)) if follow else 1
    return dict(tests=len(found), items=len(counts), follow=follow, fixed=fixed,
                fixed_items=len(live) - follow, skipped=len(counts) - len(live),
                gpu_examples=n, most=follow * n + fixed)


def parse(lines):
    """Examples (passing, failing, invalid) of the COUNTED phases and the items
    with statistics; tests (passed, failed with errors, skipped) from pytest's
    last summary line; compute-sanitizer's summary lines and their numbers."""
    examples, nodes, phase, inside, tests = [0, 0, 0], set(), None, False, (0, 0, 0)
    for line in lines:
        if re.match(r"=+ .+ =+$", line):                  # a pytest section header
            inside = "Hypothesis Statistics" in line
        elif inside and (m := re.match(r"(\S+::\S.*):$", line)):
            nodes.add(m[1])
            phase = None
        elif inside and (m := re.search(r"- during (\w+) phase", line)):
            phase = m[1]
        elif inside and phase in COUNTED and (m := EXAMPLES.search(line)):
            examples = [t + int(x) for t, x in zip(examples, m.groups())]
        if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s", line):
            c = collections.Counter({w.rstrip("s") if w.startswith("error") else w: int(n)
                                     for n, w in re.findall(r"(\d+) (\w+)", line)})
            tests = c["passed"], c["failed"] + c["error"], c["skipped"]
    sums = collections.Counter(m[0].strip() for line in lines
                               if (m := re.search(r"(ERROR|RACECHECK) SUMMARY: .*", line)))
    return examples, len(nodes), tests, "; ".join(f"{k} (x{v})" for k, v in sorted(sums.items()))


def stream(cmd, env, log, timeout):
    """Run cmd, its output into log and kept; after timeout seconds SIGINT to its
    process group (pytest still prints its summaries), SIGKILL 60 s later."""
    lines, stopped = [], []
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)

    def stop():
        stopped.append(True)
        for sig in (signal.SIGINT, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:          # the whole group has ended
                return
            time.sleep(60)
    timer = threading.Timer(timeout or 0, stop)
    timer.daemon = True
    if timeout:
        timer.start()
    with open(log, "w") as f:
        for line in proc.stdout:
            f.write(line)
            f.flush()
            lines.append(line.rstrip("\n"))
    rc = proc.wait()
    timer.cancel()
    return (124 if stopped else rc), lines


def output(cmd, default):
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    text = proc.stdout.strip() if proc.returncode == 0 else ""
    return text.splitlines()[-1] if text else default


def run(a):
    now = datetime.datetime.now(datetime.timezone.utc)
    run_id = now.strftime("%Y%m%dT%H%M%SZ-") + secrets.token_hex(2)
    if not a.dry_run:
        log_dir = pathlib.Path(a.log or tempfile.mkdtemp(prefix="gpu_volume-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        gpu = output([sys.executable, "-c", "import paged_numba; from numba import cuda\n"
                      "n = 'simulator' if paged_numba.simulator_enabled() else "
                      "cuda.get_current_device().name\nprint(getattr(n, 'decode', lambda: n)())"],
                     "unknown")
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT).returncode
        git_rev = output(["git", "rev-parse", "--short=12", "HEAD"], "unknown")
        git_rev += "+dirty" * bool(dirty)
        print(f"run {run_id} on {gpu}, logs in {log_dir}")
    unmet = 0
    for name in list(FAMILIES) if a.all else a.families:
        selection = FAMILIES[name]
        p = plan(collect(selection), a.target, a.override_fixed)
        env = {"HYPOTHESIS_PROFILE": "gpu", "GPU_EXAMPLES": str(p["gpu_examples"])}
        cmd = [*PYTEST, "-n", str(a.workers), "-q", "--hypothesis-show-statistics", *selection]
        if a.override_fixed:
            env.update(GPU_VOLUME_OVERRIDE="1", PYTHONPATH=PLUGIN_PATH)
            cmd += ["-p", "gpu_volume"]
        if a.sanitizer:
            cmd = ["compute-sanitizer", "--tool", a.sanitizer, *SANITIZE, *cmd]
        command = " ".join([f"{k}={v}" for k, v in env.items()]
                           + ["python3" if w == sys.executable else w for w in cmd])
        if a.dry_run:
            short = "" if p["most"] >= a.target else f" < target {a.target}"
            print(f"{name}: {p['tests']} tests, {p['items']} hypothesis items "
                  f"({p['follow']} follow GPU_EXAMPLES, {p['fixed_items']} fixed at "
                  f"{p['fixed']} examples in all, "
                  f"{p['skipped']} skipped): GPU_EXAMPLES={p['gpu_examples']}, at most "
                  f"{p['most']} examples{short}\n  {command}")
            continue
        log = log_dir / f"{run_id}-{name}.log"
        start = time.perf_counter()
        rc, lines = stream(cmd, dict(os.environ, **env), log, a.timeout)
        seconds = time.perf_counter() - start
        (passing, failing, invalid), with_stats, (passed, failed, skipped), sanitizer = parse(lines)
        met = passing >= a.target and failed == 0
        unmet += not met
        row = dict(run_id=run_id, gpu=gpu, family=name, selection=" ".join(selection),
                   items=p["items"], gpu_examples=p["gpu_examples"], examples_passing=passing,
                   examples_failing=failing, examples_invalid=invalid, tests_passed=passed,
                   tests_failed=failed, tests_skipped=skipped, seconds=round(seconds, 1),
                   target=a.target, met=met, exit_code=rc, git_rev=git_rev, command=command,
                   sanitizer_summary=sanitizer)
        out = pathlib.Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame([row]).to_csv(out, mode="a", header=not out.exists(), index=False,
                                   lineterminator="\n")
        print(f"{name}: {passing} passing examples ({failing} failing, {invalid} invalid) in "
              f"{with_stats}/{p['items']} items, GPU_EXAMPLES={p['gpu_examples']}; tests {passed} "
              f"passed, {failed} failed, {skipped} skipped; {seconds:.0f} s, exit {rc}; target "
              f"{a.target} {'met' if met else 'NOT met'}{'; ' * bool(sanitizer)}{sanitizer}; {log}")
    if not a.dry_run:
        print("appended to", a.out)
    return 1 if unmet else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    r = ap.add_subparsers(dest="what", required=True).add_parser("run")
    r.add_argument("families", nargs="*", metavar="FAMILY", help=", ".join(FAMILIES))
    r.add_argument("--all", action="store_true", help="every family")
    r.add_argument("--target", type=int, default=10000, help="passing examples a family needs")
    r.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="pytest -n")
    r.add_argument("--timeout", type=float, help="seconds a family may run (then SIGINT)")
    r.add_argument("--out", default=str(ROOT / "results" / "gpu_volume.csv"))
    r.add_argument("--log", help="directory of the pytest logs (default: a new temporary one)")
    r.add_argument("--sanitizer", choices=["memcheck", "racecheck", "initcheck"])
    r.add_argument("--override-fixed", action="store_true",
                   help="@settings(max_examples=...) counts give way to GPU_EXAMPLES too")
    r.add_argument("--dry-run", action="store_true", help="print the plan and commands only")
    a = ap.parse_args()
    if bool(a.families) == a.all or set(a.families) - set(FAMILIES):
        ap.error(f"name families ({', '.join(FAMILIES)}) or give --all")
    sys.exit(run(a))


if __name__ == "__main__":
    main()
