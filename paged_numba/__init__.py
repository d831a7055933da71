"""paged_numba: PagedAttention kernels in numba.cuda, checkable without a GPU.

Importing the package on a machine with no usable CUDA GPU (and with
``NUMBA_ENABLE_CUDASIM`` unset) switches Numba's CUDA simulator on, and under
the simulator it adds the warp operations the simulator lacks
(``paged_numba._simulator``). Set ``NUMBA_ENABLE_CUDASIM=0`` to keep the
simulator off; set it to ``1`` to force it on.

The switch works after ``import numba`` too, but not after ``numba.cuda`` has
been imported: that module picks the simulator or the driver once, when it is
first imported. Without a GPU, ``import paged_numba`` then raises
``ImportError`` saying so (with a GPU it just proceeds).
"""
import os
import sys

from ._env import cuda_gpu_present


def _switch_simulator_on():
    """Switch Numba's CUDA simulator on before ``numba.cuda`` is imported, or
    raise ``ImportError`` when ``numba.cuda`` already chose the driver."""
    if "numba.cuda" not in sys.modules:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        if "numba" in sys.modules:          # numba read its config already: read it again
            sys.modules["numba"].config.reload_config()
    elif not sys.modules["numba"].config.ENABLE_CUDASIM:
        raise ImportError(
            "paged_numba found no CUDA GPU, but numba.cuda was imported before paged_numba "
            "(with NUMBA_ENABLE_CUDASIM unset), so Numba's CUDA simulator could not be "
            "switched on. Set NUMBA_ENABLE_CUDASIM=1 before starting Python, or import "
            "paged_numba before numba.cuda.")


if "NUMBA_ENABLE_CUDASIM" not in os.environ and not cuda_gpu_present():
    _switch_simulator_on()

from . import _simulator  # noqa: E402

_simulator.install()

from . import layouts, page_tables  # noqa: E402,F401  (pn.layouts, pn.page_tables)
from .page_tables import CSRTable  # noqa: E402
from .allocator import BlockAllocator, OutOfBlocksError  # noqa: E402
from .attention import DecodePlan, paged_decode  # noqa: E402
from .merge import merge_states  # noqa: E402
from .cache import PagedKVCache  # noqa: E402
from . import fp8  # noqa: E402,F401  (pn.fp8: fp8 formats, quantize, dequantize)
from .fp8 import fp8_scales  # noqa: E402
from .prefill import PrefillPlan, paged_prefill  # noqa: E402
from .write import write_kv  # noqa: E402
from .block_manager import BlockManager  # noqa: E402
from .blocks import HostPool, copy_blocks, host_pool, swap_blocks  # noqa: E402
from .cascade import CascadeDecodePlan, cascade_decode  # noqa: E402

__version__ = "0.1.0"
__all__ = ["BlockAllocator", "CSRTable", "DecodePlan", "OutOfBlocksError", "PagedKVCache", "PrefillPlan",
           "merge_states", "paged_decode", "paged_prefill", "write_kv", "simulator_enabled"]
__all__ += ["BlockManager", "HostPool", "copy_blocks", "host_pool", "swap_blocks"]
__all__ += ["CascadeDecodePlan", "cascade_decode"]
__all__ += ["fp8_scales"]


def simulator_enabled():
    """True when kernels run on Numba's CUDA simulator instead of a GPU."""
    return _simulator.simulator_enabled()
