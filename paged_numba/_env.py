"""Facts about the environment: whether a CUDA GPU is usable (without
importing numba) and which versions of packages are installed."""
import ctypes
import importlib.metadata


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


def package_version(dist, missing="unknown"):
    """The installed version of the distribution ``dist``, or ``missing``.

    >>> package_version("numpy") != "unknown", package_version("no-such-dist", "not installed")
    (True, 'not installed')
    """
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return missing
