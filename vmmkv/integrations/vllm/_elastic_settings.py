"""Elastic KV's settings: what the engine core and every worker agree on without talking, the
environment knobs behind them, and the two attributes a resize rides on (``RESIZE``: ``(seq,
target)`` on every ``SchedulerOutput``; ``STAMP``: ``(seq, committed, error)`` on a worker's
output).

Both sides compute :class:`ElasticSettings` from the same config and environment
(:func:`elastic_settings`; :func:`settings_for` from vLLM's configs, its block's bytes from
:func:`block_bytes`): only ``num_blocks``, ``quantum`` and ``floor`` must be equal everywhere; the
rest is the engine core's policy (``_elastic``). :func:`check_elastic_config` refuses what elastic
mode has not been built or tested for, on either side before any collective. docs/design.md,
"Elastic KV in vLLM", has the measurements behind the defaults.

Local and pure; no vLLM import at module level (``check_elastic_config`` imports ``_layout`` for
its error).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..._env import boolean, choice, number

__all__ = [
    "ELASTIC_ENV",
    "KNOBS",
    "RESIZE",
    "STAMP",
    "ElasticSettings",
    "block_bytes",
    "check_elastic_config",
    "elastic_enabled",
    "elastic_settings",
    "settings_for",
]

ELASTIC_ENV = "VLLM_VMMKV_ELASTIC"
# knob -> environment variable (every PCP rank and the engine core read the same environment)
KNOBS = {
    "floor": "VMMKV_ELASTIC_FLOOR_BLOCKS",
    "watermark": "VMMKV_ELASTIC_WATERMARK_BLOCKS",
    "release_steps": "VMMKV_ELASTIC_RELEASE_STEPS",
    "calm_seconds": "VMMKV_ELASTIC_CALM_S",
    "window_seconds": "VMMKV_ELASTIC_WINDOW_S",
    "cached_blocks": "VMMKV_ELASTIC_CACHED_BLOCKS",
    "idle_seconds": "VMMKV_ELASTIC_IDLE_S",
    "order": "VMMKV_ELASTIC_ORDER",  # "lowest" (default) or "lifo" (vLLM's, for comparison)
}
ORDERS = ("lowest", "lifo")
CACHED_TOKENS = 16384  # default cap on cached-free blocks, in tokens (kvcached keeps 16000)
RELEASE_STEPS = 10  # a release also needs this many calm steps (and calm_seconds)
CALM_SECONDS = 10.0  # a release comes this long after the last grow (twice after a release)
WINDOW_SECONDS = 30.0  # the allocation rate behind the watermark is the peak of this window
IDLE_SECONDS = 5.0
# a new level is a quarter watermark above what a resize needs, so that the next time's need,
# a little higher by the load's jitter, still finds it (a square wave: without it 1 of 9 runs
# repeat their sizes from the second period on, with it 8; BENCHMARKS.md)
LEVEL_MARGIN = 0.25
STAMP = "vmmkv_kv_blocks"  # (seq, committed blocks, error or None) on a ModelRunnerOutput
RESIZE = "vmmkv_resize"  # (seq, target blocks) on every SchedulerOutput


def elastic_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``VLLM_VMMKV_ELASTIC``: true turns elastic mode on (with ``VLLM_USE_VMMKV=1``)."""
    return boolean(ELASTIC_ENV, env=env)


@dataclass(frozen=True)
class ElasticSettings:
    """What the engine core and every worker agree on without talking: both compute it from
    the same config and environment (:func:`elastic_settings`). Only ``num_blocks``,
    ``quantum`` and ``floor`` must be equal everywhere; the rest is the engine core's policy."""

    num_blocks: int  # vLLM's pool size (the capacity; block 0 is vLLM's null block)
    quantum: int  # blocks per chunk: targets are multiples of it (or num_blocks)
    floor: int  # committed at start and after an idle release
    watermark: int  # grow when fewer uncached committed blocks are free (the upper bound)
    release_steps: int  # calm steps a release also needs; steps to wait after a refused grow
    release_min: int  # release only when the limit falls by at least this
    cached_blocks: int  # at most this many cached-free blocks are kept
    idle_seconds: float  # idle time before the engine's idle release
    order: str = "lowest"  # free blocks: lowest id first, or vLLM's order ("lifo")
    # the watermark follows the allocation rate between watermark_min and watermark (0: fixed)
    watermark_min: int = 0
    calm_seconds: float = CALM_SECONDS  # calm time before a release (and since the last grow)
    window_seconds: float = WINDOW_SECONDS  # the window of the observed allocation rate
    lead_steps: int = 2  # steps a grow takes to become usable, plus the current one
    block_bytes: int = 0  # one block's bytes over every layer (stats; with chunk_bytes, holes)
    chunk_bytes: int = 0  # the workers' chunk (0: quantum blocks, aligned)
    # release whole free chunks below the highest block in use (False under vLLM's extensible
    # KV cache, whose recommit commits a prefix: a hole would come back committed)
    holes: bool = True
    # a grow's or a release's new size level is this share of a watermark above what it needs
    # (ElasticPool._level); elastic_settings: LEVEL_MARGIN
    level_margin: float = 0.0

    def round(self, blocks: int) -> int:
        """``blocks`` rounded up to the quantum, within [floor, num_blocks]."""
        q = self.quantum
        return min(self.num_blocks, max(self.floor, -(-blocks // q) * q))


def _knob(env: Mapping[str, str], name: str, default: float, *, lo: float, kind=int) -> Any:
    return number(KNOBS[name], default, minimum=lo, integer=kind is int, env=env)


def elastic_settings(
    num_blocks: int,
    block_bytes: int,
    chunk_bytes: int,
    *,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    concurrent_batches: int,
    holes: bool = True,
    env: Mapping[str, str] | None = None,
) -> ElasticSettings:
    """Elastic mode's settings for a pool of ``num_blocks`` blocks of ``block_bytes`` (every
    layer's bytes of one block, one replica) in chunks of ``chunk_bytes``.

    Defaults. ``concurrent_batches`` is vLLM's ``max_concurrent_batches`` (1; 2 with async
    scheduling or 2 pipeline stages; pipeline stages + 1 with both): a grow rides on step k's
    ``SchedulerOutput`` and is confirmed by its model output, processed after
    ``concurrent_batches - 1`` more steps were scheduled, so it becomes usable
    ``concurrent_batches`` steps later and the free blocks must cover ``lead_steps`` =
    ``concurrent_batches + 1`` steps. The worst step takes
    ``ceil(max_num_batched_tokens / block_size) + max_num_seqs`` blocks (every running request
    crossing a block boundary at once): ``watermark``, the upper bound, covers ``lead_steps`` of
    those (at most a quarter of the pool). A step that admits a full token budget takes
    ``ceil(max_num_batched_tokens / block_size) + ceil(max_num_seqs / block_size)`` blocks:
    ``watermark_min`` is one of those, and ``floor`` (what an idle engine keeps, and a burst
    after idle is served from until its grow lands) ``lead_steps`` of them. The pool's watermark
    follows ``lead_steps`` x the largest step of the last ``window_seconds`` within those
    bounds. ``VMMKV_ELASTIC_WATERMARK_BLOCKS`` fixes the watermark (and makes the floor's
    default 2 x watermark); ``release_min`` = the quantum (the pool adds the watermark)."""
    env = os.environ if env is None else env
    if num_blocks < 2 or block_bytes <= 0 or chunk_bytes <= 0:
        raise ValueError(
            f"elastic KV needs >= 2 blocks of > 0 bytes and chunks of > 0 bytes, got "
            f"{num_blocks} blocks of {block_bytes} B, chunks of {chunk_bytes} B"
        )
    quantum = max(1, chunk_bytes // block_bytes)
    if concurrent_batches < 1:
        raise ValueError(f"concurrent_batches must be >= 1, got {concurrent_batches}")
    lead = concurrent_batches + 1
    budget = -(-max_num_batched_tokens // block_size)
    worst = min(num_blocks // 4, lead * (budget + max_num_seqs))
    admit = min(worst, budget + -(-max_num_seqs // block_size))
    fixed = bool(env.get(KNOBS["watermark"], "").strip())
    watermark = _knob(env, "watermark", max(1, worst), lo=1)
    floor = _knob(env, "floor", 2 * watermark if fixed else max(1, lead * admit), lo=1)
    floor = min(num_blocks, -(-floor // quantum) * quantum)
    return ElasticSettings(
        num_blocks=num_blocks,
        quantum=quantum,
        floor=floor,
        watermark=watermark,
        release_steps=_knob(env, "release_steps", RELEASE_STEPS, lo=1),
        release_min=quantum,
        cached_blocks=_knob(env, "cached_blocks", -(-CACHED_TOKENS // block_size), lo=0),
        idle_seconds=_knob(env, "idle_seconds", IDLE_SECONDS, lo=0.0, kind=float),
        order=_order(env),
        watermark_min=watermark if fixed else max(1, admit),
        calm_seconds=_knob(env, "calm_seconds", CALM_SECONDS, lo=0.0, kind=float),
        window_seconds=_knob(env, "window_seconds", WINDOW_SECONDS, lo=0.0, kind=float),
        lead_steps=lead,
        block_bytes=block_bytes,
        chunk_bytes=chunk_bytes,
        holes=holes,
        level_margin=LEVEL_MARGIN,
    )


def _order(env: Mapping[str, str]) -> str:
    return choice(KNOBS["order"], ORDERS, ORDERS[0], env=env)


def block_bytes(kv_cache_config: Any) -> int:
    """Bytes of one block over every layer (one replica): vLLM's backing allocation (every
    ``KVCacheTensor`` places its layers in the same one and names its size) over the block
    count. The engine core's copy of the config keeps the tensors (its groups' specs do not: a
    uniform group keeps one layer's spec), so both sides derive the same quantum."""
    return max(t.size for t in kv_cache_config.kv_cache_tensors) // kv_cache_config.num_blocks


def settings_for(vllm_config: Any, kv_cache_config: Any, chunk_bytes: int,
                 num_blocks: int | None = None):  # fmt: skip
    """:func:`elastic_settings` from vLLM's configs, identical in every process.
    ``num_blocks``: the pool's size when it is not the config's (a worker under vLLM's
    extensible KV cache: the budget ``extend_kv_cache`` commits, which the engine core's
    config holds once vLLM has shrunk it; the block's bytes are the same)."""
    sc = vllm_config.scheduler_config
    # no holes under vLLM's extensible KV cache: its recommit (wake, the end of a lending)
    # commits a prefix of its count, so a hole would come back committed behind the pool
    extensible = bool(getattr(vllm_config.cache_config, "enable_extensible_kv_cache", False))
    return elastic_settings(
        kv_cache_config.num_blocks if num_blocks is None else num_blocks,
        block_bytes(kv_cache_config), chunk_bytes,
        block_size=vllm_config.cache_config.block_size,
        max_num_batched_tokens=sc.max_num_batched_tokens, max_num_seqs=sc.max_num_seqs,
        concurrent_batches=vllm_config.max_concurrent_batches, holes=not extensible,
    )  # fmt: skip


def check_elastic_config(cfg: Any) -> None:
    """Refuse what elastic mode has not been built or tested for (local, before any
    collective; the plugin's own refusals run too): pipeline and data parallelism, speculative
    decoding, KV cache events."""
    from ._layout import UnsupportedKVCache

    pc = cfg.parallel_config
    untested = []
    if pc.pipeline_parallel_size > 1:
        untested.append(f"pipeline parallelism ({pc.pipeline_parallel_size} stages)")
    if pc.data_parallel_size > 1:
        untested.append(f"data parallelism ({pc.data_parallel_size} ranks)")
    if getattr(cfg, "speculative_config", None) is not None:
        untested.append("speculative decoding (speculative_config)")
    events = getattr(cfg, "kv_events_config", None)
    if events is not None and getattr(events, "enable_kv_cache_events", False):
        untested.append("KV cache events (a released block's hash is dropped without an event)")
    if untested:
        raise UnsupportedKVCache(
            "elastic KV (VLLM_VMMKV_ELASTIC=1) has not been tested with "
            + "; ".join(untested)
            + ": run without VLLM_VMMKV_ELASTIC=1"
        )
