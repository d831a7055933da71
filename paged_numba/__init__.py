"""paged_numba: PagedAttention kernels in numba.cuda, checkable without a GPU.

Importing the package on a machine with no usable CUDA GPU (and with
``NUMBA_ENABLE_CUDASIM`` unset) switches Numba's CUDA simulator on, and under
the simulator it adds the warp operations the simulator lacks
(``paged_numba._simulator``). Set ``NUMBA_ENABLE_CUDASIM=0`` to keep the
simulator off; set it to ``1`` to force it on.
"""
import os
import sys

from ._env import cuda_gpu_present

if "NUMBA_ENABLE_CUDASIM" not in os.environ and "numba" not in sys.modules:
    if not cuda_gpu_present():
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

from . import _simulator  # noqa: E402

_simulator.install()

from . import layouts, page_tables  # noqa: E402,F401  (pn.layouts, pn.page_tables)
from .allocator import BlockAllocator, OutOfBlocksError  # noqa: E402
from .attention import DecodePlan, merge_states, paged_decode  # noqa: E402
from .cache import PagedKVCache  # noqa: E402
from .prefill import PrefillPlan, paged_prefill  # noqa: E402
from .write import write_kv  # noqa: E402
from .block_manager import BlockManager  # noqa: E402
from .blocks import copy_blocks, host_pool, swap_blocks  # noqa: E402
from .cascade import CascadeDecodePlan, cascade_decode  # noqa: E402

__version__ = "0.1.0"
__all__ = ["BlockAllocator", "DecodePlan", "OutOfBlocksError", "PagedKVCache", "PrefillPlan",
           "merge_states", "paged_decode", "paged_prefill", "write_kv", "simulator_enabled"]
__all__ += ["BlockManager", "copy_blocks", "host_pool", "swap_blocks"]
__all__ += ["CascadeDecodePlan", "cascade_decode"]


def simulator_enabled():
    """True when kernels run on Numba's CUDA simulator instead of a GPU."""
    return _simulator.simulator_enabled()
