"""The names of tensor-core prefill variants shared by ``tune_prefill.py`` and
``ptxas_prefill.py``: ``w<warps>n<block_n>`` and options (``tune_prefill.py``'s
docstring lists them).

>>> parse_variant("w8n64-fx-wg-ws-sw-pp-s3")
(8, 64, {'fast_exp2': True, 'wgmma': True, 'producer': True, 'swizzle': True, 'pingpong': True, 'stages': 3}, None, None)
"""
import re

OPTIONS = {"qsmem": ("q_in_regs", False), "qregs": ("q_in_regs", True),
           "fx": ("fast_exp2", True), "fma": ("fma_softmax", True), "tok": ("token_copies", True),
           "mt2": ("m_tiles", 2), "wg": ("wgmma", True),
           "ws": ("producer", True), "sw": ("swizzle", True),
           "pp": ("pingpong", True), "ps": ("persistent", True), "lz": ("lazy_rescale", True),
           "pq": ("prefetch_queries", True), "pr": ("prefetch_ranges", True),
           "ds": ("deferred_stores", True), "fe": ("fma_exp2", True),
           "sh": ("split_halves", True), "mb": ("mbarriers", True),
           "tm": ("tensor_maps", True), "ll": ("lean_loop", True),
           "sr": ("split_rings", True), "lv": ("lane_vote", True),
           "ew": ("early_weights", True), "sp": ("staged_p", True)}


def parse_variant(name):
    """``(num_warps, block_n, kernel_options, heads_per_block, num_parts)`` of a
    variant name (``None``: the plan's default)."""
    m = re.fullmatch(r"w(\d+)n(\d+)((?:-[a-z0-9]+)*)", name)
    if not m:
        raise SystemExit(f"bad variant {name!r}")
    hpb = parts = None
    nw, bn, opts = int(m.group(1)), int(m.group(2)), m.group(3).split("-")[1:]
    options = {}
    for o in opts:
        if o in OPTIONS:
            options[OPTIONS[o][0]] = OPTIONS[o][1]
        elif re.fullmatch(r"r\d+", o):
            options["max_registers"] = int(o[1:])
        elif re.fullmatch(r"pg\d+", o):
            options["producer_registers"] = int(o[2:])
        elif re.fullmatch(r"h\d+", o):
            hpb = int(o[1:])
        elif re.fullmatch(r"fe\d+", o):     # every k-th n-tile's exponentials on the FMA pipe
            options["fma_exp2"] = int(o[2:])
        elif re.fullmatch(r"s\d+", o):
            options["stages"] = int(o[1:])
        elif re.fullmatch(r"p\d+", o):
            parts = int(o[1:])
        else:
            raise SystemExit(f"bad option {o!r} in {name!r}")
    return nw, bn, options, hpb, parts
