"""Tiling of the tensor-core decode kernel (:mod:`paged_numba.kernels.decode_tc`):
which caches and head groups it takes, the blocks that saturate HBM, and the
depth and size of its copy ring."""
from .decode import SHARED_BYTES

HEAD_SIZES = (32, 64, 128, 256)
LAYOUTS = ("nhd", "vllm", "hnd", "interleaved")
DTYPES = ("float16", "bfloat16")
# fp8 caches (P @ V and the keys through ldmatrix only; not the "vllm" layout,
# whose value rows are strided): 16 codes a 16-byte vector, four vectors an ldmatrix
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
FP8_HEAD_SIZES = (64, 128, 256)
FP8_LAYOUTS = ("nhd", "hnd", "interleaved")
MAX_HPB = 8
MAX_PV_MMA_HPB = 16         # with P @ V on tensor cores: the mma's 16 rows, two 8-head halves
STEP = 8                    # tokens per warp step: the mma's N
# paged_decode's choice of decode_tc_kernel(pv_mma=..., key_rows=...) (see the factory):
SATURATING_WARP_DIMS = 1024  # warps x head size per SM that saturate HBM (H200 grid)
MAX_SHARED_BYTES = 232448    # static + dynamic shared memory of one block (sm_90, opt-in)


def supports(head_size, heads_per_block, dtype, layout, query_dtype=None):
    """Whether :func:`decode_tc_kernel` handles this combination (more than
    ``MAX_HPB`` heads a block only with ``pv_mma``; an fp8 cache only with
    ``pv_mma`` and ``key_rows``, and ``query_dtype`` float16 or bfloat16, None
    meaning float16, the plans' default).

    >>> supports(128, 4, "float8_e4m3fn", "nhd"), supports(128, 4, "float8_e5m2", "vllm")
    (True, False)
    >>> supports(128, 4, "float8_e4m3fn", "nhd", "float32")
    False
    """
    if dtype in FP8_DTYPES:
        return (head_size in FP8_HEAD_SIZES and heads_per_block <= MAX_PV_MMA_HPB
                and layout in FP8_LAYOUTS and (query_dtype or "float16") in DTYPES)
    return (head_size in HEAD_SIZES and heads_per_block <= MAX_PV_MMA_HPB and dtype in DTYPES
            and layout in LAYOUTS)


def kv_bytes(dtype):
    """Bytes of one cache element: 1 for fp8, else 2."""
    return 1 if dtype in FP8_DTYPES else 2


def saturating_blocks(head_size, num_warps):
    """Resident thread blocks per multiprocessor beyond which more blocks do
    not make this kernel faster: HBM is saturated once an SM holds about
    ``SATURATING_WARP_DIMS`` warps x head dims of copies in flight. The split-K
    model (``attention.num_partitions_for``) counts no more slots than this.
    On the H200 grid the best partition counts filled 7.8 (head 128, 4 warps),
    15.5 (head 64, 4 warps) and 5.8-7.8 (head 256, 2 warps) warps per SM.

    >>> saturating_blocks(128, 4), saturating_blocks(64, 4), saturating_blocks(256, 2)
    (2, 4, 2)
    """
    return max(1, -(-SATURATING_WARP_DIMS // (num_warps * head_size)))


def _chunks_per_lane(head_size, layout, pv_mma, elem_bytes=2):
    """16-byte ring chunks a lane copies per step: its key vectors, and its
    value vectors where the values go through the ring (``elem_bytes`` a
    cache element)."""
    nvec = head_size * elem_bytes // 16
    staged = pv_mma or layout != "vllm"
    return nvec // 4 + (STEP * min(32, nvec) // 32 if staged else 0)


def ring_stages(head_size, num_warps, stages, layout, pv_mma=False, dynamic=False,
                elem_bytes=2):
    """Ring depth that fits the static shared memory, or with ``dynamic`` the
    most one thread block may have (``MAX_SHARED_BYTES``); 0 if not even 2 fit
    (``elem_bytes``: of a cache element).

    >>> ring_stages(128, 4, 2, "nhd", True), ring_stages(128, 8, 2, "nhd", True)
    (2, 0)
    >>> ring_stages(128, 8, 2, "nhd", True, dynamic=True)
    2
    """
    room = (MAX_SHARED_BYTES if dynamic else SHARED_BYTES) - 4 * (
        num_warps * head_size + 3 * num_warps * MAX_HPB + num_warps * STEP * MAX_HPB) - 512
    fit = room // (_chunks_per_lane(head_size, layout, pv_mma, elem_bytes) * 32 * num_warps * 16)
    return min(stages, fit) if fit >= 2 else 0


def dynamic_ring_bytes(head_size, num_warps, stages, layout, pv_mma=False, elem_bytes=2):
    """Bytes of the copy ring where it lives in dynamic shared memory, else 0:
    where the static 48 KB hold fewer of the ``stages`` asked for than the
    most a block may have (more warps than 4 at head size 128, or a deeper
    ring than 2 stages there).

    >>> dynamic_ring_bytes(128, 4, 2, "nhd", True), dynamic_ring_bytes(128, 8, 2, "nhd", True)
    (0, 65536)
    >>> dynamic_ring_bytes(128, 4, 4, "nhd", True)      # 4 stages of 4 warps
    65536
    """
    depth = ring_stages(head_size, num_warps, stages, layout, pv_mma, True, elem_bytes)
    if depth <= ring_stages(head_size, num_warps, stages, layout, pv_mma, False, elem_bytes):
        return 0
    return depth * _chunks_per_lane(head_size, layout, pv_mma, elem_bytes) * 32 * num_warps * 16
