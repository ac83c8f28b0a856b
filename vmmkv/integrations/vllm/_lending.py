"""KV lending for a weight update under vLLM 0.34's extensible KV cache over vmmkv's buffer
(PCP > 1): vLLM's worker lends the KV cache's memory to a layer-wise weight update when its own
rank decides so, the one per-rank decision among the buffer's calls; here it is agreed across
the PCP group. Installed by ``_install`` with the other worker sites.

| site (module: name) | replaced by |
|---|---|
| ``vllm.v1.worker.extensible_kv_cache: _release_for_weight_update`` | vLLM's decision taken on every PCP rank, then agreed: if any rank lends, every rank lends (a rank releasing alone would leave its peers writing into chunks it dropped) |

Contract: collective over the PCP group (one agreement, bounded in time, then the release on
every rank when any rank lends); any rank's error is raised on every rank, naming the ranks,
and then no rank has released. vLLM's own buffer (PCP = 1) goes to vLLM's decision unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._buffer import PeerKVBuffer

__all__ = ["agreed_lending"]


def agreed_lending(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``_release_for_weight_update``: vLLM's decision on every PCP rank, its release held
    back; then one agreement over the group (bounded in time): any rank's error is raised on
    every rank (naming the ranks), else if any rank lends every rank releases (collective)."""

    def _release_for_weight_update(kv_cache, model, *, reclaimable, fail_if_short):
        buffer = kv_cache.buffer
        if not isinstance(buffer, PeerKVBuffer):
            return orig(kv_cache, model, reclaimable=reclaimable, fail_if_short=fail_if_short)
        cache = buffer.cache
        wants: list[bool] = []
        error: BaseException | None = None
        try:
            orig(_DecisionOnly(buffer, wants), model, reclaimable=reclaimable,
                 fail_if_short=fail_if_short)  # fmt: skip
        except Exception as exc:
            error = exc
        mine = "error" if error is not None else ("lend" if wants else "keep")
        votes = cache.cache.region.all_gather(
            [mine, "" if error is None else str(error)], "KV lending for a weight update"
        )
        failed = {r: why for r, (v, why) in enumerate(votes) if v == "error"}
        if failed:
            detail = "; ".join(f"rank {r}: {why}" for r, why in failed.items())
            raise RuntimeError(
                f"rank {cache.rank}: the weight update cannot borrow the KV cache's memory on "
                f"PCP ranks {sorted(failed)} ({detail}); no rank released it"
            ) from error
        if any(v == "lend" for v, _ in votes):
            kv_cache.release_physical()
            return True
        return False

    return _release_for_weight_update


class _DecisionOnly:
    """What ``_release_for_weight_update`` reads of an ``ExtensibleKVCache``, with its release
    recorded instead of done."""

    def __init__(self, buffer: PeerKVBuffer, wants: list[bool]) -> None:
        self.buffer = buffer
        self._wants = wants

    def release_physical(self) -> None:
        self._wants.append(True)
