"""Elastic KV on workload families it was not tuned on, through vLLM 0.34.0's own scheduler at
``vllm serve``'s defaults with no elastic knob set (``vmmkv.integrations.vllm.workloads``:
simulated seconds, DeepSeek-V3.2's block bytes, 4096 blocks, async scheduling).

Checked against unmodified vLLM on the same seeded arrivals: prefix-hit tokens (Zipf over a few
long shared prefixes), preemptions, committed memory while a lognormal load ramps up and down
and drains, a square wave (one release per low half, none followed by a grow within 5 s), an
idle engine back at the floor, and the same figures step by step on a second run. Long-lived
requests admitted at a peak pin blocks across the peak's range: the pool releases the free
chunks between them as holes, and the light load after the peak commits at most half the
capacity 10 s after the peak ends (seeds 0-2, sync and async scheduling).
"""

from __future__ import annotations

import pytest

from tests.helpers import vllm_marks

pytestmark = vllm_marks()


@pytest.fixture
def engine(monkeypatch):
    """The plugin's engine-core sites on vLLM's classes; elastic mode with its defaults."""
    from vmmkv.integrations.vllm import _patches

    monkeypatch.setenv("VLLM_USE_VMMKV", "1")
    monkeypatch.setenv("VLLM_VMMKV_ELASTIC", "1")
    _patches.install_engine()
    try:
        yield monkeypatch
    finally:
        _patches.uninstall()


def _pair(family, seed=0):
    """(elastic, unmodified vLLM) runs of one family and their summaries."""
    from vmmkv.integrations.vllm.workloads import FamilyRun, summary

    el, plain = (
        FamilyRun(trace=family, seed=seed),
        FamilyRun(trace=family, seed=seed, elastic=False),
    )
    el.run()
    plain.run()
    return el, summary(el), summary(plain)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_hits_over_a_few_long_zipf_prefixes_stay_within_2_percent_of_vllms(engine, seed):
    run, got, vllm = _pair("zipf", seed)
    assert vllm["hit_tokens"] > 1_000_000
    assert got["hit_tokens"] >= 0.98 * vllm["hit_tokens"], (got, vllm)
    assert got["preemptions"] <= vllm["preemptions"] + 1
    assert got["committed_mean"] <= 0.4, got  # prefixes kept: in use + cached + watermarks


def test_a_lognormal_ramp_drains_below_half_the_capacity_before_the_idle_release(engine):
    run, got, vllm = _pair("ramp")
    assert got["phases"]["drain"] <= 0.5, got
    assert got["committed_mean"] <= 0.6, got
    assert got["preemptions"] <= vllm["preemptions"] + 1, (got, vllm)
    assert got["phases"]["idle"] == run.el.s.floor / run.num_blocks
    assert got["grows"] <= 8 and got["releases"] >= 3, got  # grows track the ramp


def test_a_square_wave_releases_once_per_low_half_and_no_grow_follows_a_release_within_5s(engine):
    run, got, vllm = _pair("wave")
    releases = [t for t, kind, _ in run.events if kind == "release"]
    for p in range(4):
        assert sum(40 * p + 20 <= t < 40 * p + 40 for t in releases) <= 1, run.events
    assert got["release_to_grow_min_s"] >= 5.0, run.events
    assert got["preemptions"] <= vllm["preemptions"] + 1, (got, vllm)
    assert got["committed_mean"] <= 0.6, got


@pytest.mark.parametrize("async_depth", [1, 2], ids=["sync", "async"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_lived_requests_from_a_peak_leave_half_the_capacity_10s_after_the_load_falls(
    engine, seed, async_depth
):
    """The long requests pin blocks across the peak's range: the pool releases the whole free
    chunks between them (holes), so the light phase commits at most half the capacity from
    10 s after the peak ends on, with no preemption beyond vLLM's and no step touching a block
    outside the committed set (the trace checks every step)."""
    from vmmkv.integrations.vllm.workloads import FamilyRun, summary

    run = FamilyRun(trace="long", seed=seed, async_depth=async_depth)
    plain = FamilyRun(trace="long", seed=seed, async_depth=async_depth, elastic=False)
    run.run()
    plain.run()
    got, vllm = summary(run), summary(plain)
    fell = dict(run.phase_ends)["peak"]
    light = [r.committed for r in run.rows if r.phase == "light" and r.t >= fell + 10.0]
    assert light and max(light) <= 0.5 * run.num_blocks, (max(light), run.events)
    assert run.el.counts["hole_blocks"] > 0, run.events
    assert got["preemptions"] <= vllm["preemptions"] + 1, (got, vllm)
    assert got["committed_mean"] <= 0.5, got


def test_an_idle_engine_returns_to_the_floor_and_a_run_is_exact(engine):
    from vmmkv.integrations.vllm.workloads import FamilyRun

    runs = [FamilyRun(trace="idle", seed=3) for _ in range(2)]
    for r in runs:
        r.run()
    first, second = runs
    assert [(r.t, r.committed, r.in_use) for r in first.rows] == [
        (r.t, r.committed, r.in_use) for r in second.rows
    ]
    assert first.rows[-1].committed == first.el.s.floor and first.rows[-1].in_use == 0
    idle = [t for t, kind, _ in first.events if kind == "idle"]
    assert len(idle) == 1 and first.el.stats()["usage"] == 0.0
