"""Merging partial attention states (split-K parts, cascade passes) with the
(m, l) rule: validate, launch :func:`paged_numba.kernels.merge.merge_kernel`."""
import numpy as np

from . import _arrays, _launch
from . import _checks as C
from . import _validate as V
from .interop import Results
from .kernels.merge import merge_kernel


def merge_states(v, s, *, out=None, lse=None, stream=None, validate=True):
    """Merge partial attention states with the (m, l) rule.

    State ``k`` of row ``i`` is attention over one part of the keys: its
    output ``v[i, k]`` (normalised by its own exp-sum) and its log-sum-exp
    ``s[i, k]`` (natural log). The merged state is attention over all parts.

    Parameters
    ----------
    v : array, ``[num_rows, num_states, num_heads, head_size]``
        float16, float32 or bfloat16 partial outputs.
    s : array of float32, ``[num_rows, num_states, num_heads]``
        Their log-sum-exps; ``-inf`` marks an empty state (its weight is 0,
        but its ``v`` must still be finite: ``0 * NaN`` is NaN, as in the
        float64 merge).
    out : array, ``[num_rows, num_heads, head_size]``, optional
        Write the merged output here (``v``'s dtype, C-contiguous; a NumPy
        array for NumPy ``v``, else a device array) and return it.
    lse : array of float32, ``[num_rows, num_heads]``, optional
        Write the merged log-sum-exps here, as ``out``.
    stream : optional
        A numba, PyTorch or CuPy stream, a raw ``cudaStream_t`` int, or None
        (ignored under the simulator).
    validate : bool
        Check the shapes and dtypes of ``v`` and ``s`` first.

    Returns
    -------
    out : array, ``[num_rows, num_heads, head_size]`` in ``v``'s dtype
        ``out`` itself when given; else NumPy for NumPy ``v``, a torch
        tensor for a torch one, CuPy for CuPy, a numba device array otherwise.
    lse : array of float32, ``[num_rows, num_heads]``
        A row with a NaN or ``+inf`` log-sum-exp gets NaN in both, as the
        float64 merge does (``kernels.merge`` has the rule).

    Examples
    --------
    >>> import numpy as np
    >>> from paged_numba import merge_states
    >>> v = np.array([[[[1.0]], [[3.0]]]], np.float32)        # two states, [1, 2, 1, 1]
    >>> s = np.array([[[0.0], [0.0]]], np.float32)            # equal weights
    >>> out, lse = merge_states(v, s)
    >>> float(out[0, 0, 0]), round(float(lse[0, 0]), 4)      # (1 + 3) / 2, log(2)
    (2.0, 0.6931)
    """
    validate = C.flag("validate", validate)
    handle = _launch.stream_handle(stream)
    ns = _launch.numba_stream(handle)    # every copy and fill goes ahead of the kernel on it
    vd, _ = _arrays.as_device(v, "v", ns)
    sd, _ = _arrays.as_device(s, "s", ns)
    if validate:
        V.check_ndim("v", vd, 4, "[num_rows, num_states, num_heads, head_size]")
        V.check_ndim("s", sd, 3, "[num_rows, num_states, num_heads]")
        if V.shape_of(sd) != V.shape_of(vd)[:3]:
            raise ValueError(
                f"s must be [num_rows, num_states, num_heads] = {V.shape_of(vd)[:3]}, but got "
                f"{V.shape_of(sd)}.")
        if np.dtype(sd.dtype) != np.float32:
            raise ValueError(f"s must be float32, but got {np.dtype(sd.dtype).name}.")
    dt = _arrays.logical_dtype(v)
    if dt == np.uint16 and not isinstance(v, np.ndarray):   # bf16 bits on the device
        dt = _arrays.BFLOAT16
    if validate and dt.name not in ("float16", "float32", "bfloat16"):
        raise ValueError(f"v must be float16, float32 or bfloat16, but got {dt.name}.")
    n, _, h, d = V.shape_of(vd)
    inputs = () if isinstance(v, np.ndarray) else (("v", vd), ("s", sd))
    results = Results(v, out, lse, (n, h, d), dt, (n, h), inputs, stream=ns)
    if n and h:
        _launch.launch(merge_kernel(dt.name, dt.name), (h, n), 128,
                       (results.out, results.lse, vd, sd), stream=handle)
    return results.finish(True)
