"""Find out whether a CUDA GPU is usable, without importing numba."""
import ctypes


def cuda_gpu_present():
    """True when the CUDA driver loads and reports at least one device."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    try:
        if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return False
    except AttributeError:
        return False
    return count.value > 0
