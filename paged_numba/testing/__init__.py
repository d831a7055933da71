"""Hypothesis strategies and error bounds for fuzzing paged-attention kernels.

A strategy draws a *problem* (shapes, block tables, sequence lengths and a
seed for the data) rather than the data itself, so that examples stay cheap
to draw and shrink, and the arrays come from ``numpy.random`` with that seed.

Error bounds come from the data, never from a hand-tuned tolerance: a
first-order rounding-error analysis of fp32 attention (see
:func:`attention_error_bound`) is evaluated on the very inputs of the test,
and one unit in the last place of the output dtype is added for the final
rounding. An fp16 result may therefore be off by one fp16 ulp plus a tiny
fp32 term; anything larger is a bug.

Three modules, every name re-exported here: ``strategies`` (the problems and
the strategies that draw them), ``bounds`` (the error-bound model) and
``checks`` (the float64 references and the comparison with them).

Examples
--------
>>> from hypothesis import given
>>> from paged_numba.testing import decode_problems
>>> @given(decode_problems(head_sizes=(16,), max_seq_len=40))
... def test_shapes(p):
...     assert p.block_tables.shape == (p.num_seqs, p.max_blocks)
>>> test_shapes()
"""
from .bounds import (P_ROUNDING, PV_WEIGHT_ERROR, TENSOR_CORE_U, U32, attention_error_bound,
                     decode_bounds, gamma, merge_error_bound, prefill_bounds, prefill_error_bound)
from .checks import (BFLOAT16, cascade_reference, check_attention, check_close, decode_reference,
                     prefill_reference, ulp)
from .strategies import (ALL_DTYPES, GQA_GROUPS, DecodeProblem, PrefillProblem, _PagedProblem,
                         block_tables, config_id, decode_problems, lengths, prefill_problems,
                         variants)

__all__ = [
    "ALL_DTYPES", "BFLOAT16", "GQA_GROUPS", "P_ROUNDING", "PV_WEIGHT_ERROR", "TENSOR_CORE_U", "U32",
    "DecodeProblem", "PrefillProblem", "attention_error_bound", "block_tables", "cascade_reference",
    "check_attention", "merge_error_bound",
    "check_close", "config_id", "decode_bounds", "decode_problems", "decode_reference", "gamma",
    "lengths", "prefill_bounds", "prefill_error_bound", "prefill_problems", "prefill_reference",
    "ulp", "variants", "_PagedProblem",
]
