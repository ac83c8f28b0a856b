"""Shared test configuration: tests marked ``gpu`` skip cleanly unless CUDA VMM is usable; the
long multi-process cases (``LONG``) carry the ``long`` marker, which the default run leaves out
(``addopts`` in pyproject.toml) and ``python -m pytest -q -m long`` runs.

Fixtures: ``world_store``, a store the test hosts for ranks that join groups themselves
(``vmmkv.testing.spawn.world_store``). The modules that start vLLM (``test_vllm_*``) run in an
environment of their own: a fresh, empty ``VLLM_CACHE_ROOT`` per module (for its module-scoped
ranks) and per test, and none of the plugin's variables inherited from the caller's shell (each
test sets those it means)."""

import contextlib
import os

import pytest

from vmmkv.alloc import driver
from vmmkv.testing import spawn

# the plugin's variables a vLLM test sets itself when it needs them (README, "Environment")
_PLUGIN_ENV = (
    "VLLM_USE_VMMKV",
    "VLLM_VMMKV_ELASTIC",
    "VMMKV_CHUNK_MIB",
    "VMMKV_DIRECT",
    "VMMKV_SLEEP_INNER_BACKEND",
)


@pytest.fixture
def world_store():
    with spawn.world_store() as store:
        yield store


@contextlib.contextmanager
def _own_vllm_env(request, tmp_path_factory):
    """In a ``test_vllm_*`` module: a fresh ``VLLM_CACHE_ROOT`` and no inherited plugin
    variables for the block; elsewhere nothing."""
    if not request.module.__name__.rpartition(".")[2].startswith("test_vllm_"):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
        for name in list(os.environ):
            if name in _PLUGIN_ENV or name.startswith("VMMKV_ELASTIC_"):
                mp.delenv(name)
        yield


@pytest.fixture(scope="module", autouse=True)
def _vllm_module_env(request, tmp_path_factory):
    with _own_vllm_env(request, tmp_path_factory):
        yield


@pytest.fixture(autouse=True)
def _vllm_test_env(request, tmp_path_factory):
    with _own_vllm_env(request, tmp_path_factory):
        yield


# The slow cases on the 2-core CPU machine CI runs on (``--durations``, 2026-12-04): the
# multi-process fault, protocol, exit, soak and scale cases of 2 s or more, the sm_80 and sm_100
# builds, and single cases of 4 s or more whose behaviour another case of the same module also
# covers. Each parametrized family keeps its fastest case in the default run (the sm_90 builds),
# so every module and failure family is still covered there.
# Node ids below ``tests/``; a renamed case drops out of this list into the default run.
LONG = frozenset(
    {
        "test_bench_prefill.py::test_a_dropped_kv_update_fails_verification_and_aborts_before_any_timing",
        "test_bench_prefill.py::test_host_backend_run_verifies_every_path_and_writes_positive_numbers",
        "test_block_layout_gpu.py::test_v32_block_layout_grow_capture_sleep_wake_publishes_byte_exact_on_host",
        "test_cache.py::test_direct_and_gather_paths_write_the_oracle_bytes_into_every_replica[host-4]",
        "test_cli.py::test_bench_quick_on_the_host_backend_writes_json_and_a_png_with_matplotlib",
        "test_exit.py::test_a_rank_exiting_with_an_open_cache_neither_hangs_nor_leaks_into_the_survivor[global]",
        "test_exit.py::test_a_rank_exiting_with_an_open_cache_neither_hangs_nor_leaks_into_the_survivor[return]",
        "test_fabric_sim.py::test_a_group_across_two_nvlink_domains_falls_back_to_gather_naming_domains_and_ranks",
        "test_fabric_sim.py::test_a_rank_killed_at_each_by_value_step_is_named_and_leaves_no_shm_names[agreement]",
        "test_fabric_sim.py::test_a_rank_killed_at_each_by_value_step_is_named_and_leaves_no_shm_names[export]",
        "test_fabric_sim.py::test_a_rank_killed_at_each_by_value_step_is_named_and_leaves_no_shm_names[import]",
        "test_fabric_sim.py::test_an_error_on_one_rank_at_each_by_value_step_fails_every_rank_naming_it[agreement]",
        "test_fabric_sim.py::test_an_error_on_one_rank_at_each_by_value_step_fails_every_rank_naming_it[exchange]",
        "test_fabric_sim.py::test_an_error_on_one_rank_at_each_by_value_step_fails_every_rank_naming_it[export]",
        "test_fabric_sim.py::test_an_error_on_one_rank_at_each_by_value_step_fails_every_rank_naming_it[import]",
        "test_fabric_sim.py::test_four_processes_as_two_hosts_of_one_domain_map_grow_and_shrink_by_value",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[close-host-2]",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[close-host-3]",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[grow-after-commit-host-2]",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[grow-after-commit-host-3]",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[grow-after-mapping-host-2]",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[grow-after-mapping-host-3]",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[grow-during-exchange-host-3]",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[rendezvous-after-exchange-host-2]",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[rendezvous-after-exchange-host-3]",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[rendezvous-after-request-host-2]",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[rendezvous-after-request-host-3]",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[rendezvous-before-exchange-host-2]",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[rendezvous-before-exchange-host-3]",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[shrink-host-2]",
        "test_faults.py::test_a_peer_killed_at_a_protocol_step_is_named_by_the_survivors_which_release_everything[shrink-host-3]",
        "test_faults.py::test_a_peer_killed_during_a_replayed_step_stops_the_survivors_barrier_with_a_diagnostic[host-3]",
        "test_faults.py::test_a_rank_that_gives_up_its_exchange_is_not_blamed_by_the_peers_whose_connections_break",
        "test_faults.py::test_a_survivor_late_to_the_exchange_names_only_the_dead_peer[grace-alone]",
        "test_fd_budget.py::test_a_deepseek_cache_of_thousands_of_chunks_starts_sleeps_and_wakes_under_the_limit[4-4096-BLNHC]",
        "test_fd_budget.py::test_a_deepseek_cache_of_thousands_of_chunks_starts_sleeps_and_wakes_under_the_limit[4-8192-LBNHC]",
        "test_fdpass.py::test_a_peer_whose_process_is_gone_ends_the_exchange_at_once_with_liveness[no-liveness]",
        "test_fdpass.py::test_forged_connections_are_refused_while_the_real_sender_gets_through[duplicate]",
        "test_fdpass.py::test_harness_kills_a_rank_that_outlives_the_timeout",
        "test_gather.py::test_gather_fallback_writes_the_same_bytes_as_direct_and_the_reference_across_resizes[3]",
        "test_gather.py::test_gather_fallback_writes_the_same_bytes_as_direct_and_the_reference_across_resizes[4]",
        "test_gather.py::test_host_waits_of_the_cache_are_bounded_by_vmmkvs_timeout[gather]",
        "test_gather.py::test_plans_are_capped_per_staging_and_stay_byte_exact",
        "test_gather.py::test_plans_follow_changing_shapes_and_buffer_growth_byte_exact[3]",
        "test_gather.py::test_the_padding_check_reports_a_mismatch_on_every_rank[kinds]",
        "test_gather.py::test_the_padding_check_reports_a_mismatch_on_every_rank[nlo]",
        "test_gather_bench.py::test_the_sweep_runs_on_the_host_backend_and_writes_its_json",
        "test_liveness.py::test_a_process_exiting_with_a_watcher_open_exits_cleanly",
        "test_nvrtc.py::test_every_kernel_compiles_for_each_arch[sm_100]",
        "test_nvrtc.py::test_every_kernel_compiles_for_each_arch[sm_80]",
        "test_nvrtc.py::test_every_kernel_compiles_without_the_cuda_headers[sm_100]",
        "test_nvrtc.py::test_every_kernel_compiles_without_the_cuda_headers[sm_80]",
        "test_nvrtc.py::test_the_mxfp8_indexer_variants_compile_for_hopper_and_blackwell_as_compile_time_twins[sm_100]",
        "test_nvrtc.py::test_the_ue8m0_mla_variants_compile_for_hopper_and_blackwell_as_compile_time_twins[sm_100]",
        "test_ops_cpu.py::test_inductor_runs_a_traced_publish_in_place_and_reads_after_it",
        "test_protocol.py::test_a_late_rank_reads_the_abort_of_the_step_and_the_next_step_lines_up",
        "test_protocol.py::test_a_rank_late_at_the_last_grow_agreement_rolls_back_like_its_peers[3]",
        "test_protocol.py::test_a_rank_late_at_the_rendezvous_agreement_raises_like_its_peer_and_both_retry",
        "test_protocol.py::test_a_rank_late_at_the_shrink_agreement_fails_on_every_rank_and_both_refuse_more",
        "test_protocol.py::test_a_rank_that_failed_before_any_collective_does_not_skew_the_next_attempt",
        "test_protocol.py::test_an_aborted_step_releases_every_waiting_rank_at_once_with_the_reason",
        "test_protocol.py::test_an_export_failure_on_one_rank_fails_every_rank_fast_naming_it[3]",
        "test_rendezvous.py::test_a_rank_that_never_joins_is_named_within_the_timeout_and_nothing_leaks",
        "test_rendezvous.py::test_an_injected_oom_during_grow_rolls_back_every_rank_and_a_later_grow_succeeds",
        "test_rendezvous.py::test_every_rank_writes_every_peer_and_resize_keeps_addresses[host-4]",
        "test_rendezvous.py::test_mismatched_requests_raise_the_same_error_on_every_rank[chunk-chunk_bytes]",
        "test_rendezvous.py::test_resize_targets_must_be_identical_on_all_ranks",
        "test_rendezvous.py::test_tp2_pcp2_subgroups_rendezvous_independently_and_never_cross",
        "test_segments.py::test_bad_mismatched_or_late_layouts_and_wrong_resize_kinds_raise_on_every_rank",
        "test_segments.py::test_block_growth_lands_stores_only_in_committed_blocks_and_a_failed_grow_rolls_back[2-ranks-fail-at-commit]",
        "test_segments.py::test_block_growth_lands_stores_only_in_committed_blocks_and_a_failed_grow_rolls_back[3-ranks-fail-at-commit]",
        "test_segments.py::test_block_growth_lands_stores_only_in_committed_blocks_and_a_failed_grow_rolls_back[3-ranks-fail-in-exchange]",
        "test_soak.py::test_two_hundred_grow_replay_shrink_cycles_stay_byte_exact_and_leak_nothing[host]",
        "test_vllm_elastic_families.py::test_prefix_hits_over_a_few_long_zipf_prefixes_stay_within_2_percent_of_vllms[1-sync]",
        "test_vllm_elastic_families.py::test_prefix_hits_over_a_few_long_zipf_prefixes_stay_within_2_percent_of_vllms[1-bq2]",
        "test_vllm_elastic_families.py::test_prefix_hits_over_a_few_long_zipf_prefixes_stay_within_2_percent_of_vllms[2-sync]",
        "test_vllm_elastic_families.py::test_prefix_hits_over_a_few_long_zipf_prefixes_stay_within_2_percent_of_vllms[2-bq2]",
        "test_vllm_elastic_families.py::test_a_lognormal_ramp_drains_below_half_the_capacity_before_the_idle_release[1-sync]",
        "test_vllm_elastic_families.py::test_a_lognormal_ramp_drains_below_half_the_capacity_before_the_idle_release[1-async]",
        "test_vllm_elastic_families.py::test_a_lognormal_ramp_drains_below_half_the_capacity_before_the_idle_release[1-bq2]",
        "test_vllm_elastic_families.py::test_a_lognormal_ramp_drains_below_half_the_capacity_before_the_idle_release[2-sync]",
        "test_vllm_elastic_families.py::test_a_lognormal_ramp_drains_below_half_the_capacity_before_the_idle_release[2-async]",
        "test_vllm_elastic_families.py::test_a_lognormal_ramp_drains_below_half_the_capacity_before_the_idle_release[2-bq2]",
        "test_vllm_elastic_families.py::test_a_square_wave_releases_once_per_low_half_and_no_grow_follows_a_release_within_5s[1-sync]",
        "test_vllm_elastic_families.py::test_a_square_wave_releases_once_per_low_half_and_no_grow_follows_a_release_within_5s[1-async]",
        "test_vllm_elastic_families.py::test_a_square_wave_releases_once_per_low_half_and_no_grow_follows_a_release_within_5s[1-bq2]",
        "test_vllm_elastic_families.py::test_a_square_wave_releases_once_per_low_half_and_no_grow_follows_a_release_within_5s[2-sync]",
        "test_vllm_elastic_families.py::test_a_square_wave_releases_once_per_low_half_and_no_grow_follows_a_release_within_5s[2-async]",
        "test_vllm_elastic_families.py::test_a_square_wave_releases_once_per_low_half_and_no_grow_follows_a_release_within_5s[2-bq2]",
        "test_vllm_elastic_families.py::test_a_square_wave_behaves_identically_from_its_second_period_on[1-sync]",
        "test_vllm_elastic_families.py::test_a_square_wave_behaves_identically_from_its_second_period_on[1-async]",
        "test_vllm_elastic_families.py::test_a_square_wave_behaves_identically_from_its_second_period_on[1-bq2]",
        "test_vllm_elastic_families.py::test_a_square_wave_behaves_identically_from_its_second_period_on[2-sync]",
        "test_vllm_elastic_families.py::test_a_square_wave_behaves_identically_from_its_second_period_on[2-async]",
        "test_vllm_elastic_families.py::test_a_square_wave_behaves_identically_from_its_second_period_on[2-bq2]",
        "test_vllm_elastic_families.py::test_long_lived_requests_from_a_peak_leave_half_the_capacity_10s_after_the_load_falls[1-bq2]",
        "test_vllm_elastic_families.py::test_long_lived_requests_from_a_peak_leave_half_the_capacity_10s_after_the_load_falls[2-bq2]",
        "test_vllm_elastic_ranks.py::test_three_ranks_under_vllms_async_scheduler_hold_the_reference_bytes",
        "test_vllm_elastic_ranks.py::test_four_ranks_under_vllms_async_scheduler_hold_the_reference_bytes_with_a_late_reader",
        "test_vllm_extensible.py::test_elastic_kv_under_vllms_extensible_cache_over_four_ranks_with_the_async_scheduler",
    }
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.removeprefix("tests/") in LONG:
            item.add_marker(pytest.mark.long)
    if driver.cuda_usable():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device: {driver.why_no_cuda()}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
