"""Registers, local memory and SASS size of tensor-core prefill variants, read
offline (no GPU): ``compile_ptx`` for sm_90a, then the CUDA toolkit's
``ptxas -v`` (and ``cuobjdump -sass`` or ``nvdisasm`` where found).

    NUMBA_ENABLE_CUDASIM=0 python experiments/ptxas_prefill.py \
        default w8n64-fx-wg-ws-sw-pp w8n128-fx-wg-ws-sw-s3-pp --dump /tmp/sass

A variant is named as in ``tune_prefill.py`` (``default``: the sm_90 default
tiling and options at head size 128, fp16, ``"nhd"``, block size 16, group 4).
``--dump DIR`` writes each variant's PTX and SASS there (the SASS needs
cuobjdump or nvdisasm: the toolkit's or the ``nvidia-cuda-cuobjdump``
wheel's). ``--loop`` also counts the instructions a consumer warp issues for
one key tile in the steady state: the shortest path through the innermost
loop that holds the products and the exponentials (a tile that needs no mask,
no soft cap or ALiBi, the row maxima unmoved), and the same path through the
O rescale (the multiplies that a warp vote skips), by kind of instruction.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

from numba import cuda  # noqa: E402

from paged_numba.kernels.prefill import prefill_signature  # noqa: E402
from paged_numba.kernels.prefill_tc import prefill_tc_kernel  # noqa: E402
from paged_numba.kernels.prefill_tc_tiling import prefill_tc_config  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from variants import parse_variant  # noqa: E402


def variant_kernel(name, head_size, block_size, group, dtype, layout):
    """The kernel of variant ``name`` (``-ng``: built without the device guard;
    ``-tlc``: with the timeline's loop clocks, ``timeline="loop"``)."""
    guard = not name.endswith("-ng")
    name = name.removesuffix("-ng")
    extra = {"timeline": "loop"} if name.endswith("-tlc") else {}
    name = name.removesuffix("-tlc")
    if name == "default":
        hpb, _, bn, nw, opts = prefill_tc_config(head_size, group, None, layout, sm90=True)
    else:
        nw, bn, opts, heads, _ = parse_variant(name)
        hpb = heads or prefill_tc_config(head_size, group, None, layout, sm90=True)[0]
    return prefill_tc_kernel(head_size, block_size, hpb, bn, dtype, layout, nw, **opts,
                             **extra, guard=guard)


def find_tool(name):
    """``name`` on the PATH, else from the ``nvidia-cuda-cuobjdump`` or
    ``nvidia-cuda-nvdisasm`` wheel (``nvidia/cu*/bin``), else None."""
    if shutil.which(name):
        return shutil.which(name)
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for sub in sorted(os.listdir(root), reverse=True):
            path = os.path.join(root, sub, "bin", name)
            if os.access(path, os.X_OK):
                return path
    return None


def ptxas(ptx, dump=None, name="k"):
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        info = subprocess.run(["ptxas", "-v", "-arch=sm_90a", "-O3", src, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr
        sass = ""
        for tool in ("cuobjdump", "nvdisasm"):
            path = find_tool(tool)
            if path:
                args = [path, "-sass", cubin] if tool == "cuobjdump" else [path, cubin]
                sass = subprocess.run(args, capture_output=True, text=True).stdout
                break
        if dump:
            os.makedirs(dump, exist_ok=True)
            with open(os.path.join(dump, f"{name}.ptx"), "w") as f:
                f.write(ptx)
            if sass:
                with open(os.path.join(dump, f"{name}.sass"), "w") as f:
                    f.write(sass)
    return info, sass


CLASSES = (   # (name, opcodes): the first that holds an instruction's opcode
    ("HGMMA/WARPGROUP", ("HGMMA", "WARPGROUP")), ("MUFU", ("MUFU",)),
    ("FMUL/FFMA/FADD/FMNMX", ("FMUL", "FFMA", "FADD", "FMNMX")),
    ("FSETP/FSEL", ("FSETP", "FSEL", "FCHK")), ("F2FP/I2FP", ("F2FP", "I2FP", "F2F")),
    ("SHFL", ("SHFL",)), ("BAR/VOTE", ("BAR", "VOTE", "WARPSYNC", "SYNCS")),
    ("branch/predicate", ("BRA", "BSSY", "BSYNC", "CALL", "PLOP3", "UPLOP3")),
    ("MOV", ("MOV", "UMOV", "R2UR", "CS2R", "IMAD.MOV", "IMAD.U32")),
    ("uniform integer", ("U",)),
    ("integer ALU", ("IMAD", "IADD3", "VIADD", "LOP3", "ISETP", "SEL", "SHF", "LEA", "LDC")))


def kind(text):
    op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
    for name, prefixes in CLASSES:
        if any(op.startswith(p) and (p != "U" or op[1:2].isupper()) for p in prefixes):
            return name
    return "other"


def code(sass):
    """The instructions of a kernel's SASS, ``[(address, text)]``, and where
    each branch target is, ``{address or label: index}``: ``cuobjdump -sass``
    names targets by address, ``nvdisasm`` by labels on lines of their own,
    and prints the other sections' words in the same ``/*address*/`` form, so
    only its ``.text`` section is read."""
    m = re.search(r"^\s*\.section\s+\.text\.", sass, re.M)
    if m:
        end = re.search(r"^\s*\.section\s", sass[m.end():], re.M)
        sass = sass[m.start():m.end() + end.start() if end else len(sass)]
    ins, at, labels = [], {}, []
    for line in sass.splitlines():
        lab = re.match(r"^(\.L\w+):", line)
        if lab:
            labels.append(lab.group(1))
            continue
        m = re.match(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*(?:/\*.*)?$", line)
        if not m or m.group(2).startswith("."):
            continue
        a = int(m.group(1), 16)
        for name in labels + [a]:
            at[name] = len(ins)
        labels = []
        ins.append((a, m.group(2).rstrip(" ;")))
    return ins, at


def loop_path(sass, rescale=False):
    """The classes of the instructions on the shortest path from the head of the
    innermost loop holding ``HGMMA`` and ``MUFU.EX2`` to its back edge (forward
    branches only); ``rescale``: through the blocks that only multiply, skipped
    on a warp vote (``rescale_half``). The shortest path may skip work whose
    predicates go together (a short-circuit ``or`` that the mask then needs),
    so it is a lower bound where such branches remain."""
    ins, at = code(sass)
    target = {}
    for k, (a, t) in enumerate(ins):
        m = re.search(r"\bBRA\s+(?:!?U?P\w+,\s*)?(?:(0x[0-9a-f]+)|`\((\.L\w+)\))", t)
        if m:
            target[k] = at[int(m.group(1), 16) if m.group(1) else m.group(2)]
    loops = [(target[k], k) for k in target if target[k] < k and any(
        "HGMMA" in t for _, t in ins[target[k]:k]) and any("MUFU.EX2" in t for _, t in
                                                             ins[target[k]:k])]
    if not loops:
        return None
    head, tail = min(loops, key=lambda x: x[1] - x[0])
    cost = {head: (1, None)}         # shortest forward path: (length, predecessor)
    for k in range(head, tail):
        if k not in cost:
            continue
        t = ins[k][1]
        succ = []
        if k in target:
            skipped = [u for _, u in ins[k + 1:target[k]]]
            pred = re.match(r"@!?(P\d)", t)
            writer = next((u for _, u in reversed(ins[head:k]) if pred and re.match(
                rf"(?:@!?U?P\w+\s+)?\S+\s+{pred.group(1)},", u)), "")
            voted = writer.startswith("VOTE.ANY")
            # the O rescale: multiplies skipped on a warp vote
            only_mul = voted and skipped and all(u.split()[0] == "FMUL" for u in skipped)
            if target[k] > k and not (rescale and only_mul):
                succ.append(target[k])
            if t.startswith("@") and not (only_mul and not rescale and target[k] > k):
                succ.append(k + 1)
        else:
            succ.append(k + 1)
        for n in succ:
            if n <= tail and (n not in cost or cost[n][0] > cost[k][0] + 1):
                cost[n] = (cost[k][0] + 1, k)
    path, k = [], tail
    while k is not None:
        path.append(ins[k][1])
        k = cost[k][1]
    return collections.Counter(kind(t) for t in path)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--layout", default="nhd")
    ap.add_argument("--dump")
    ap.add_argument("--loop", action="store_true",
                    help="count a consumer warp's instructions a key tile (needs cuobjdump "
                         "or nvdisasm)")
    a = ap.parse_args()
    loops = {}
    print(f"{'variant':>28} {'regs':>5} {'stack':>6} {'spill st':>9} {'spill ld':>9} "
          f"{'SASS':>6}")
    for name in a.variants:
        kernel = variant_kernel(name, a.head_size, a.block_size, a.group, a.dtype, a.layout)
        sig = prefill_signature(a.dtype, a.layout, tensor_maps="-tm" in name)
        # the producer kernel is launched with launch_bounds (its threads, 1 block)
        threads = getattr(kernel, "block_threads", None)
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0),
                                  launch_bounds=(threads, 1) if threads else None)
        # the libNVVM of numba-cuda may write a newer PTX version than this ptxas reads
        ptx = re.sub(r"\.version \d+\.\d+", ".version 9.0", ptx)
        ptx = re.sub(r"\.target sm_90\b", ".target sm_90a", ptx)
        info, sass = ptxas(ptx, a.dump, name)
        nums = [int(m.group(1)) if (m := re.search(pat, info)) else -1 for pat in (
            r"Used (\d+) registers", r"(\d+) bytes stack frame", r"(\d+) bytes spill stores",
            r"(\d+) bytes spill loads")]
        count = len(code(sass)[0])
        print(f"{name:>28} {nums[0]:>5} {nums[1]:>6} {nums[2]:>9} {nums[3]:>9} {count:>6}")
        if a.loop and sass:
            loops[name] = (loop_path(sass), loop_path(sass, rescale=True))
    if loops:
        print("\ninstructions a consumer warp issues for one key tile (steady state; "
              "'+r': O rescaled)")
        names = {n: chr(ord("A") + i) for i, n in enumerate(loops)}
        print("  ".join(f"{c} = {n}" for n, c in names.items()))
        cols = [(n, i) for n in loops for i in range(2)]
        print(f"{'':>22} " + " ".join(f"{names[n] + ('+r' if i else ''):>6}" for n, i in cols))
        for cls in [c for c, _ in CLASSES] + ["other", "total"]:
            vals = [(loops[n][i] or {}) for n, i in cols]
            vals = [sum(v.values()) if cls == "total" else v.get(cls, 0) for v in vals]
            if any(vals):
                print(f"{cls:>22} " + " ".join(f"{v:>6}" for v in vals))


if __name__ == "__main__":
    main()
