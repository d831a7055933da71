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

import pytest

import paged_numba  # noqa: F401  (switches the simulator on where there is no GPU)
from hypothesis import HealthCheck, settings

_slow = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
# 8 examples a property on the simulator keep the suite under 30 minutes on two cores
# (each CI run draws new ones); the gpu profile draws more (GPU_EXAMPLES)
settings.register_profile("ci", max_examples=8, deadline=None, suppress_health_check=_slow,
                          print_blob=True)
settings.register_profile("gpu", max_examples=int(os.environ.get("GPU_EXAMPLES", 25)),
                          deadline=None,
                          suppress_health_check=_slow, print_blob=True)
settings.load_profile(os.environ.get(
    "HYPOTHESIS_PROFILE", "ci" if paged_numba.simulator_enabled() else "gpu"))


# The slow tier: simulator tests that take tens of seconds or more each (measured with
# --durations). ``python -m pytest -m "not slow" paged_numba tests`` leaves them out and
# still runs every public function on the simulator (the doctests and the small tests);
# the default run, CI's, runs them all. Keys are test files; values are test functions,
# single parametrisations by their full name, or test classes (state machines).
SLOW = {
    "test_ptx.py": {"test_specialisations_compile_to_ptx"},
    "test_decode.py": {
        "test_decode_seed_examples[p2-1]", "test_decode_seed_examples[p3-2]",
        "test_decode_matches_reference", "test_decode_independent_of_block_placement",
        "test_layouts_and_page_table_forms_agree", "test_merge_states_of_many_parts",
        "test_merge_states_equals_single_pass",
        "test_plan_run_matches_paged_decode_and_repacks_new_buffers",
        "test_decode_seed_examples[p1-3]", "test_custom_scale_and_partition_count_agree",
    },
    "test_decode_tensor_cores.py": {
        "test_decode_tensor_core_variants_match_reference",
        "test_decode_dynamic_ring_matches_reference", "test_tensor_core_variants_agree_across_layouts",
        "test_tensor_core_block_prefetch_crosses_windows",
        "test_large_group_decode_on_the_prefill_tile",
    },
    "test_non_finite.py": {"test_tensor_core_decode_non_finite_queries_and_keys"},
    "test_cascade.py": {"test_cascade_matches_reference"},
    "test_prefill.py": {
        "test_prefill_matches_reference", "test_layouts_and_page_table_forms_agree",
        "test_prefill_explicit_cases[tc-long]", "test_prefill_explicit_cases[tc-long-two-warps]",
        "test_tc_prefill_window_and_variants", "test_tc_prefill_kernel_options",
        "test_tc_prefill_split_k[two-parts]", "test_tc_prefill_split_k[more-parts-than-tiles]",
        "test_tc_prefill_split_k[mqa-decode]",
    },
    "test_prefill_wgmma.py": {"test_tc_prefill_wgmma[split-k]",
                              "test_tc_prefill_wgmma[two-warpgroups]"},
    "test_interop.py": {
        "test_large_group_decode_writes_out_and_lse_in_place",
        "test_plans_write_out_and_lse_in_place_and_repack_for_new_buffers",
        "test_every_launching_call_takes_every_kind_of_stream",
    },
    "test_fp8.py": {"test_fp8_decode_matches_reference"},
    "test_block_manager_machine.py": {"TestManagerMachine"},
    "test_serving_sims.py": {
        "test_system_prompts_raise_the_batch_and_chat_history_thrashes_a_small_pool"},
    "test_transformers.py": {
        "test_generate_matches_model_generate",
        "test_generate_with_preemption_matches_model_generate",
        "test_hf_engine_backend_matches_paged_sdpa",
    },
}


# The quick tier (``-m quick``, under two minutes on two cores): every doctest (each
# public function's example runs on the simulator) and the host-side test files
# (bookkeeping, tables, layouts, validation, bad inputs), which launch few kernels.
QUICK_FILES = {
    "test_allocator.py", "test_block_manager.py", "test_page_tables.py", "test_layouts.py",
    "test_validation.py", "test_bookkeeping_inputs.py", "test_bad_inputs.py",
    "test_simulator.py", "test_serving_sim.py", "test_architecture.py",
}


@pytest.hookimpl(tryfirst=True)          # before -m deselects by the marks
def pytest_collection_modifyitems(items):
    """Mark the tests named in :data:`SLOW` ``slow``, and the doctests and the
    tests of :data:`QUICK_FILES` ``quick``; run the PTX compilation (the
    longest test, a process of its own) first, so the others run beside it
    instead of after it."""
    items.sort(key=lambda item: item.path.name != "test_ptx.py")    # (a stable sort)
    for item in items:
        if type(item).__name__ == "DoctestItem" or item.path.name in QUICK_FILES:
            item.add_marker(pytest.mark.quick)
        names = SLOW.get(item.path.name, ())
        cls = getattr(item, "cls", None)
        if (item.name in names or getattr(item, "originalname", None) in names
                or (cls is not None and cls.__name__ in names)):
            item.add_marker(pytest.mark.slow)
