"""The plugin's refusals of vLLM 0.33.0 settings it cannot serve, on vLLM's own config objects.

``check_vllm_config`` runs in the replaced ``allocate_kv_cache`` before any collective (the
wiring: ``tests/test_vllm_sleep.py``). Checked here on real ``VllmConfig`` s (CPU device; flags
that vLLM refuses on the CPU platform, such as sleep mode, set after construction, as a GPU
worker would hold them):

- sleep-mode backends: another backend than ``vmmkv`` is refused whenever vLLM's sleep
  allocator is on (``enable_cumem_allocator``, or ``enable_sleep_mode`` which implies it), since
  vLLM reaches the backend without sleep mode; with the allocator off it is accepted.
"""

from __future__ import annotations

import pytest

from tests.helpers import vllm_marks

pytestmark = vllm_marks()

LAYOUT = "LBNHC"


def _config(**kw):
    from vmmkv.integrations.vllm import testing

    return testing.vllm_config(LAYOUT, pcp=2, **kw)


def _refusal(cfg) -> str:
    """'' when the plugin accepts ``cfg``, else its UnsupportedKVCache message."""
    from vmmkv.integrations.vllm import UnsupportedKVCache
    from vmmkv.integrations.vllm._patches import check_vllm_config

    try:
        check_vllm_config(cfg)
    except UnsupportedKVCache as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize(
    "sleep_mode, cumem, backend, flag",
    [
        (True, True, "cumem", "--enable-sleep-mode"),
        (False, True, "cumem", "--enable-cumem-allocator"),  # LLM.sleep() reaches the backend
        (False, False, "cumem", None),  # nothing of vLLM's own KV cache is releasable either
        (True, True, "vmmkv", None),
        (False, True, "vmmkv", None),
    ],
)
def test_another_sleep_backend_is_refused_whenever_vllms_sleep_allocator_is_on(
    sleep_mode, cumem, backend, flag
):
    cfg = _config()
    model = cfg.model_config
    model.enable_sleep_mode, model.enable_cumem_allocator = sleep_mode, cumem
    model.sleep_mode_backend = backend
    msg = _refusal(cfg)
    if flag is None:
        assert msg == ""
        return
    assert f"the sleep-mode backend '{backend}' with vLLM's sleep allocator on ({flag})" in msg
    assert "release_kv_cache_memory" in msg and "--sleep-mode-backend vmmkv" in msg, msg
