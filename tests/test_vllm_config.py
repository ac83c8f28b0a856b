"""The plugin's refusals of vLLM 0.34.0 settings it cannot serve, on vLLM's own config objects.

``check_vllm_config`` runs in the replaced ``allocate_kv_cache`` before any collective (the
wiring: ``tests/test_vllm_sleep.py``). Checked here on real ``VllmConfig`` s (CPU device; flags
that vLLM refuses on the CPU platform, such as sleep mode, set after construction, as a GPU
worker would hold them):

- KV-transfer connectors: any configured connector (vLLM creates one when
  ``KVTransferConfig.is_kv_transfer_instance``; vLLM itself refuses a transfer config without a
  connector) is refused, naming it, its role and why;
- sleep-mode backends: another backend than ``vmmkv`` is refused whenever vLLM's sleep
  allocator is on (``enable_cumem_allocator``, or ``enable_sleep_mode`` which implies it), since
  vLLM reaches the backend without sleep mode; with the allocator off it is accepted;
- ``sleep_mode_offload_cudagraph`` under the ``vmmkv`` backend with sleep mode and CUDA graphs on
  is refused; vLLM's own ``VllmConfig.use_cumem_cudagraph_pool`` is the reference that graphs
  are offloaded under ``cumem`` only.
"""

from __future__ import annotations

import pytest

from tests.helpers import vllm_marks

pytestmark = vllm_marks()

LAYOUT = "LBNHC"


def _config(**kw):
    from vmmkv.testing.vllm import configs

    return configs.vllm_config(LAYOUT, pcp=2, **kw)


def _refusal(cfg) -> str:
    """'' when the plugin accepts ``cfg``, else its UnsupportedKVCache message."""
    from vmmkv.integrations.vllm import UnsupportedKVCache
    from vmmkv.integrations.vllm._support import check_vllm_config

    try:
        check_vllm_config(cfg)
    except UnsupportedKVCache as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize(
    "connector, role, extra, named",
    [
        ("NixlConnector", "kv_producer", {}, "NixlConnector"),  # PCP prefill, disaggregated
        ("MooncakeConnector", "kv_both", {}, "MooncakeConnector"),
        (
            "MultiConnector",
            "kv_both",
            {
                "connectors": [
                    {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
                ]
            },
            "MultiConnector (NixlConnector, OffloadingConnector)",
        ),
    ],
)
def test_a_kv_transfer_connector_is_refused_naming_it_its_role_and_why(
    connector, role, extra, named
):
    from vllm.config import KVTransferConfig

    kvt = KVTransferConfig(kv_connector=connector, kv_role=role, kv_connector_extra_config=extra)
    assert kvt.is_kv_transfer_instance  # vLLM would create this connector in the worker
    msg = _refusal(_config(kv_transfer_config=kvt))
    assert f"the KV-transfer connector {named} (kv_role '{role}')" in msg, msg
    assert "not registered RDMA-capable" in msg and "own memory pool" in msg, msg
    assert "Run without --kv-transfer-config" in msg, msg


def test_without_a_kv_transfer_config_the_config_is_accepted():
    cfg = _config()
    assert cfg.kv_transfer_config is None
    assert _refusal(cfg) == ""


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


def test_vllm_offloads_cuda_graphs_under_the_cumem_backend_name_only(monkeypatch):
    """The reference for the next test: vLLM's own decision, on a CUDA-like platform."""
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    cfg = _config()
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    cfg.model_config.enable_sleep_mode = True
    cfg.model_config.sleep_mode_offload_cudagraph = True
    wants = {}
    for backend in ("cumem", "vmmkv"):
        cfg.model_config.sleep_mode_backend = backend
        wants[backend] = cfg.use_cumem_cudagraph_pool
    assert wants == {"cumem": True, "vmmkv": False}


@pytest.mark.parametrize(
    "sleep_mode, offload, graphs, refused",
    [
        (True, True, True, True),
        (True, True, False, False),  # no graphs: nothing to offload under any backend
        (True, False, True, False),
        (False, True, True, False),  # no sleep mode: vLLM ignores the flag under any backend
    ],
)
def test_offloading_cuda_graphs_under_the_vmmkv_backend_is_refused(
    sleep_mode, offload, graphs, refused
):
    from vllm.config import CUDAGraphMode

    cfg = _config()
    cfg.compilation_config.cudagraph_mode = (
        CUDAGraphMode.FULL_AND_PIECEWISE if graphs else CUDAGraphMode.NONE
    )
    model = cfg.model_config
    model.enable_sleep_mode = model.enable_cumem_allocator = sleep_mode
    model.sleep_mode_backend = "vmmkv"
    model.sleep_mode_offload_cudagraph = offload
    msg = _refusal(cfg)
    if not refused:
        assert msg == ""
        return
    assert "--sleep-mode-offload-cudagraph with --sleep-mode-backend vmmkv" in msg, msg
    assert "would stay resident while asleep" in msg, msg
    assert "drop --sleep-mode-offload-cudagraph" in msg, msg
