"""Python lists and tuples wherever an integer array goes, CSR page tables only
when passed as such, and the simulator switch whatever was imported first."""
import os
import subprocess
import sys

import numpy as np
import pytest

import paged_numba as pn
from paged_numba import page_tables as pt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
I32 = np.int32

# Three sequences, so the padded table has three rows (the length of a CSR
# triple): 7 = 4 + 3 tokens in blocks 5, 1; 4 in block 2; 9 = 2 * 4 + 1 in 0, 3, 6.
TABLE = [[5, 1, -1], [2, -1, -1], [0, 3, 6]]
LENS = [7, 4, 9]
BLOCK_SIZE = 4


def as_tuples(rows):
    return tuple(tuple(r) for r in rows)


@pytest.fixture(scope="module")
def cache():
    c = pn.PagedKVCache(num_blocks=8, block_size=BLOCK_SIZE, num_kv_heads=1, head_size=16,
                        dtype="float32")
    kv = np.random.default_rng(0).standard_normal((32, 1, 16)).astype(np.float32)
    pn.write_kv(c, kv, -kv, np.arange(32))
    return c


@pytest.fixture(scope="module")
def query():
    return np.random.default_rng(1).standard_normal((3, 2, 16)).astype(np.float32)


@pytest.fixture(scope="module")
def decoded(cache, query):
    return pn.paged_decode(query, cache, np.array(TABLE, I32), np.array(LENS, I32))


# -- the same result from lists, tuples and arrays -------------------------------------

@pytest.mark.parametrize("form", ["list", "tuple"])
def test_decode_takes_lists_and_tuples(cache, query, decoded, form):
    table, lens = (TABLE, LENS) if form == "list" else (as_tuples(TABLE), tuple(LENS))
    out = pn.paged_decode(query, cache, table, lens)
    assert np.array_equal(out, decoded)


def test_three_row_list_is_a_padded_table(cache, query, decoded):
    """Three rows are never taken for (kv_indptr, kv_indices, kv_last_page_len)."""
    assert not pn._validate.is_csr(TABLE) and not pn._validate.is_csr(as_tuples(TABLE))
    with pytest.raises(ValueError, match="seq_lens is required with a padded block table"):
        pn.paged_decode(query, cache, TABLE, None)


@pytest.mark.parametrize("empty", [[], ()])
def test_empty_list_table_is_an_empty_batch(cache, empty):
    """An empty list or tuple of rows is a table of no sequences, as an empty
    ``[0, k]`` array is: decode and prefill return an empty output."""
    q = np.zeros((0, 2, 16), np.float32)
    assert pn.paged_decode(q, cache, empty, empty).shape == (0, 2, 16)
    assert pn.paged_prefill(q, cache, empty, [0], empty).shape == (0, 2, 16)


def test_csr_table_of_lists_and_of_arrays(cache, query, decoded):
    csr = pt.padded_to_csr(TABLE, LENS, BLOCK_SIZE)
    assert isinstance(csr, pn.CSRTable)
    as_lists = pn.CSRTable(*(a.tolist() for a in csr))
    assert as_lists.kv_indptr == [0, 2, 3, 6]                  # 2, 1 and 3 pages
    assert np.array_equal(pn.paged_decode(query, cache, as_lists, None), decoded)
    # a plain tuple of three arrays is still read as CSR
    assert np.array_equal(pn.paged_decode(query, cache, tuple(csr), LENS), decoded)


def test_prefill_and_plan_take_lists(cache):
    q = np.random.default_rng(2).standard_normal((4, 2, 16)).astype(np.float32)
    cu = [0, 2, 3, 4]                                           # q_lens 2, 1, 1
    ref = pn.paged_prefill(q, cache, np.array(TABLE, I32), np.array(cu, I32),
                           np.array(LENS, I32))
    assert np.array_equal(pn.paged_prefill(q, cache, TABLE, tuple(cu), LENS), ref)
    csr = pn.CSRTable(*(a.tolist() for a in pt.padded_to_csr(TABLE, LENS, BLOCK_SIZE)))
    assert np.array_equal(pn.paged_prefill(q, cache, csr, cu), ref)
    plan = pn.PrefillPlan(cache, cu, tuple(LENS), num_heads=2)
    out = plan.run(pn._arrays.as_device(q, "q")[0], as_tuples(TABLE)).copy_to_host()
    assert np.array_equal(out, ref)


def test_write_kv_takes_lists_and_tuples():
    kv = np.arange(3 * 8, dtype=np.float32).reshape(3, 1, 8)
    results = []
    for slots in (np.array([5, -1, 0]), [5, -1, 0], (5, -1, 0)):
        c = pn.PagedKVCache(num_blocks=2, block_size=4, num_kv_heads=1, head_size=8,
                            dtype="float32")
        pn.write_kv(c, kv, kv, slots)
        results.append(c.to_host()[0])
    assert all(np.array_equal(r, results[0]) for r in results)


def test_cascade_takes_lists(cache, query):
    ref = pn.cascade_decode(query, cache, np.array([0, 1], I32), 8,
                            np.array([[2], [3], [4]], I32), np.array([3, 1, 4], I32))
    out = pn.cascade_decode(query, cache, [0, 1], 8, [[2], [3], [4]], (3, 1, 4))
    assert np.array_equal(out, ref)


def test_page_table_converters_take_lists_and_tuples():
    csr = pt.padded_to_csr(np.array(TABLE, I32), np.array(LENS, I32), BLOCK_SIZE)
    for table, lens in ((TABLE, LENS), (as_tuples(TABLE), tuple(LENS))):
        got = pt.padded_to_csr(table, lens, BLOCK_SIZE)
        assert all(np.array_equal(a, b) for a, b in zip(got, csr))
    back, lens = pt.csr_to_padded(*(tuple(a.tolist()) for a in csr), BLOCK_SIZE, max_blocks=3)
    assert back.tolist() == TABLE and lens.tolist() == LENS
    assert pt.seq_lens_from_csr(csr.kv_indptr.tolist(), csr.kv_last_page_len.tolist(),
                                BLOCK_SIZE).tolist() == LENS
    pt.validate_csr(*(a.tolist() for a in csr), num_blocks=8, block_size=BLOCK_SIZE)


# -- bad lists ---------------------------------------------------------------------------

BAD_TABLES = [
    pytest.param([[5, 1], [2], [0, 3, 6]], "block_tables", "ragged", id="ragged"),
    pytest.param([[5, 1.0, -1], [2, -1, -1], [0, 3, 6]], "block_tables[0, 1]", "1.0", id="float"),
    pytest.param([[5, True, -1], [2, -1, -1], [0, 3, 6]], "block_tables[0, 1]", "True", id="bool"),
    pytest.param([[5, "1", -1], [2, -1, -1], [0, 3, 6]], "block_tables[0, 1]", "'1'", id="str"),
]
BAD_LENS = [
    pytest.param([7, [4], 9], "seq_lens", "ragged", id="ragged"),
    pytest.param([7, 4.0, 9], "seq_lens[1]", "4.0", id="float"),
    pytest.param((7, False, 9), "seq_lens[1]", "False", id="bool"),
    pytest.param([7, "4", 9], "seq_lens[1]", "'4'", id="str"),
]


def _raises(call, *fragments):
    with pytest.raises(ValueError) as err:
        call()
    for f in fragments:
        assert f in str(err.value), str(err.value)


@pytest.mark.parametrize("table, name, value", BAD_TABLES)
def test_bad_list_tables_are_named(cache, query, table, name, value):
    fragments = (name, value)
    _raises(lambda: pn.paged_decode(query, cache, table, LENS), *fragments)
    _raises(lambda: pn.paged_prefill(query, cache, table, [0, 1, 2, 3], LENS), *fragments)
    _raises(lambda: pn.cascade_decode(query, cache, [0], 4, table, LENS), *fragments)
    _raises(lambda: pt.padded_to_csr(table, LENS, BLOCK_SIZE), *fragments)


@pytest.mark.parametrize("lens, name, value", BAD_LENS)
def test_bad_list_lengths_are_named(cache, query, lens, name, value):
    fragments = (name, value)
    _raises(lambda: pn.paged_decode(query, cache, TABLE, lens), *fragments)
    _raises(lambda: pn.paged_prefill(query, cache, TABLE, [0, 1, 2, 3], lens), *fragments)
    _raises(lambda: pn.PrefillPlan(cache, [0, 1, 2, 3], lens, num_heads=2), *fragments)
    _raises(lambda: pt.padded_to_csr(TABLE, lens, BLOCK_SIZE), *fragments)


def test_bad_list_slots_and_offsets_are_named(cache, query):
    kv = np.zeros((3, 1, 16), np.float32)
    _raises(lambda: pn.write_kv(cache, kv, kv, [0, True, 2]), "slot_mapping[1]", "True")
    _raises(lambda: pn.write_kv(cache, kv, kv, [0, [1], 2]), "slot_mapping", "ragged")
    _raises(lambda: pn.paged_prefill(query, cache, TABLE, [0, 1, 2.0, 3], LENS),
            "cu_seqlens_q[2]", "2.0")
    _raises(lambda: pn.paged_decode(query, cache, pn.CSRTable([0, 2, 3, 6], [5, 1, 2, 0, 3, "6"],
                                                              [3, 4, 1]), None),
            "kv_indices[5]", "'6'")
    _raises(lambda: pt.csr_to_padded([0, 1.5], [1], [1], BLOCK_SIZE), "kv_indptr[1]", "1.5")


# -- the simulator switch and import order ---------------------------------------------

@pytest.mark.parametrize("first", ["import numba", "import numba.cuda", "from numba import cuda"])
def test_simulator_switch_after_numba_import(first):
    """``import numba`` first still lets the switch work; ``numba.cuda`` first fixes
    the choice, so without a GPU ``import paged_numba`` says how to fix it."""
    from paged_numba._env import cuda_gpu_present

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    code = f"{first}\nimport paged_numba\nprint(paged_numba.simulator_enabled())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    if cuda_gpu_present():
        assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr
    elif first == "import numba":
        assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr
    else:
        assert proc.returncode != 0
        assert "ImportError" in proc.stderr and "numba.cuda was imported before paged_numba" \
            in proc.stderr and "NUMBA_ENABLE_CUDASIM=1" in proc.stderr, proc.stderr
