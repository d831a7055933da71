"""Test setup: the simulator is chosen on a machine without a GPU (importing
paged_numba does that), and hypothesis gets two profiles:

* ``ci``: few, small examples, for Numba's CUDA simulator (the default there);
* ``gpu``: big shapes, 25 examples for each combination of compile-time
  parameters per property (280 for decode, 72 for prefill: see the test
  modules), i.e. thousands per property (the default on a GPU; run with
  ``-n 16`` from pytest-xdist).

Choose one with ``HYPOTHESIS_PROFILE=ci|gpu``; ``GPU_EXAMPLES=N`` changes the
``gpu`` profile's example count.
"""
import os

import paged_numba  # noqa: F401  (switches the simulator on where there is no GPU)
from hypothesis import HealthCheck, settings

_slow = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=20, deadline=None, suppress_health_check=_slow,
                          print_blob=True)
settings.register_profile("gpu", max_examples=int(os.environ.get("GPU_EXAMPLES", 25)),
                          deadline=None,
                          suppress_health_check=_slow, print_blob=True)
settings.load_profile(os.environ.get(
    "HYPOTHESIS_PROFILE", "ci" if paged_numba.simulator_enabled() else "gpu"))
