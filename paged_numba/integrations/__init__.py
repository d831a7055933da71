"""Bridges from paged_numba's kernels to other libraries' models.

* :mod:`paged_numba.integrations.transformers`: Hugging Face transformers
  causal LMs generate through the paged kernels, in a continuous-batching
  loop of this package (:func:`~paged_numba.integrations.transformers.generate`)
  or as the attention backend ``"paged|paged_numba"`` of transformers' own
  continuous-batching engine (:func:`~paged_numba.integrations.transformers.register`).

Nothing here is imported by ``import paged_numba``, and torch and
transformers are imported only when a function that needs them runs.
"""
