"""numba.cuda kernels. Each is built by a cached factory that freezes its
compile-time constants (head size, block size, layout, ...) into the kernel;
the public functions in ``paged_numba`` validate inputs and launch them."""
