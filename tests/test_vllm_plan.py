"""vmmkv.integrations.vllm in one process against the real vLLM 0.34.0: the plugin's gate and
patches, the plan read from vLLM's own KVCacheConfig (views, segments, refusals) and the three
PCP cases of ``pcp_store_plan``."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import VLLM_LAYOUTS, vllm_marks
from vmmkv import __version__

pytestmark = vllm_marks()


def _python(code: str, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def configs():
    from vmmkv.testing.vllm.configs import build_kv_cache_config

    return {layout: build_kv_cache_config(layout)[1] for layout in VLLM_LAYOUTS}


@pytest.mark.timeout(300)
def test_vllms_plugin_loader_finds_the_entry_point_and_it_patches_only_in_a_worker_process():
    """vLLM runs register() in every process: enabled, it checks the version and waits; only the
    import of vLLM's GPU worker module (a GPU worker: it imports MRV2's model runner while it
    loads) installs the patches, once that module has run. API-server-like processes import no
    vLLM model-runner or model module on vmmkv's behalf."""
    code = (
        "import sys\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vmmkv.integrations import vllm as v\n"
        "heavy = [m for m in sys.modules if m.startswith(('vllm.v1.worker.gpu', 'vllm.models.',"
        " 'vllm.model_executor.layers.sparse_attn_indexer'))]\n"
        "before = (v.installed(), heavy)\n"
        "import vllm.v1.worker.gpu.model_runner\n"
        "runner_only = v.installed()\n"
        "import vllm.v1.worker.gpu_worker\n"
        "import vllm.v1.worker.gpu.attn_utils as a\n"
        "print(before, runner_only, v.installed(), a.allocate_kv_cache.__module__)\n"
    )
    assert (
        _python(code, VLLM_USE_VMMKV="1")
        == "(False, []) False True vmmkv.integrations.vllm._allocation"
    )
    assert _python(code, VLLM_USE_VMMKV="0") == "(False, []) False False vllm.v1.worker.utils"
    # elastic mode patches vLLM's Worker too, which does not exist yet when the GPU worker module
    # imports MRV2's runner: the sites install once the worker module has run, as vLLM imports it
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vmmkv.integrations import vllm as v\n"
        "import vllm.v1.worker.gpu_worker as w\n"
        "print(v.installed(), w.Worker.extend_kv_cache.__module__,"
        " w.Worker.compile_or_warm_up_model.__module__)\n"
    )
    site = "vmmkv.integrations.vllm._elastic_worker"
    got = _python(code, VLLM_USE_VMMKV="1", VLLM_VMMKV_ELASTIC="1")
    assert got == f"True {site} {site}", got


@pytest.mark.timeout(300)
def test_a_vllm_release_other_than_the_supported_one_is_refused_naming_vmmkv_and_both_releases():
    from vmmkv.integrations.vllm import SUPPORTED_VLLM, UnsupportedVLLM, check_vllm_version

    assert SUPPORTED_VLLM == "==0.34.0"
    assert check_vllm_version() == "0.34.0"  # the installed one
    assert check_vllm_version("0.34.0+cu130") == "0.34.0+cu130"
    for other in ("0.33.0", "0.34.1", "0.35.0", "not-a-version"):
        with pytest.raises(
            UnsupportedVLLM,
            match=rf"vmmkv {re.escape(__version__)}'s vLLM plugin supports "
            rf"vllm==0\.34\.0 only .* the installed vLLM is {other}.*vmmkv 0\.1\.0 at commit 77d5183",
        ):
            check_vllm_version(other)
    # through register(), as vLLM's loader calls it in every process (metadata of another vLLM)
    code = (
        "import importlib.metadata as md\n"
        "real = md.version\n"
        "md.version = lambda n: '0.33.0' if n == 'vllm' else real(n)\n"
        "from vmmkv.integrations import vllm as v\n"
        "try:\n"
        "    v.register()\n"
        "except v.UnsupportedVLLM as exc:\n"
        "    print('refused:', exc)\n"
    )
    out = _python(code, VLLM_USE_VMMKV="1")
    assert out.startswith(f"refused: vmmkv {__version__}'s vLLM plugin supports vllm==0.34.0 only")
    assert "the installed vLLM is 0.33.0" in out, out


def test_a_moved_or_changed_site_is_refused_at_install_naming_it_and_nothing_is_patched():
    """A renamed vLLM op used to kill every process with a bare AttributeError."""
    import vllm._custom_ops as ops
    from vllm.v1.worker.gpu import attn_utils

    from vmmkv.integrations import vllm as integration
    from vmmkv.integrations.vllm import _install

    real_alloc, real_op = attn_utils.allocate_kv_cache, ops.indexer_k_quant_and_cache
    del ops.indexer_k_quant_and_cache  # a moved site (R3's simulation)
    try:
        with pytest.raises(integration.UnsupportedVLLM) as info:
            integration.install()
    finally:
        ops.indexer_k_quant_and_cache = real_op
    msg = str(info.value)
    assert "vllm._custom_ops.indexer_k_quant_and_cache: missing (AttributeError" in msg, msg
    assert "nothing was patched" in msg and "vllm==0.34.0" in msg, msg
    assert not integration.installed() and attn_utils.allocate_kv_cache is real_alloc

    def changed(kv_cache_config, device, layout, kernel_block_sizes=None, *, extra=None):
        return real_alloc(kv_cache_config, device, layout, kernel_block_sizes)

    attn_utils.allocate_kv_cache = changed  # a new parameter: signature drift
    try:
        with pytest.raises(
            integration.UnsupportedVLLM,
            match=r"allocate_kv_cache: parameters "
            r"\('kv_cache_config', 'device', 'layout', 'kernel_block_sizes', "
            r"'extra'\), expected",
        ):
            integration.install()
        assert attn_utils.allocate_kv_cache is changed and not integration.installed()
    finally:
        attn_utils.allocate_kv_cache = real_alloc
    assert len(_install._SITES) == 13


@pytest.mark.timeout(120)
def test_register_without_the_variable_imports_no_vllm_module_and_refuses_bad_values():
    code = (
        "import sys\n"
        "from vmmkv.integrations.vllm import register\n"
        "register()\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n"
    )
    assert _python(code) == "[]"
    from vmmkv.integrations.vllm import register

    os.environ["VLLM_USE_VMMKV"] = "yes"
    try:
        with pytest.raises(ValueError, match="VLLM_USE_VMMKV must be '0' or '1', got 'yes'"):
            register()
    finally:
        del os.environ["VLLM_USE_VMMKV"]


def test_patched_replaces_every_call_site_and_unregister_restores_vllms_objects():
    import vllm._custom_ops as ops
    from vllm.model_executor.layers import sparse_attn_indexer as sai
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.models.deepseek_v32 import attention as v32
    from vllm.v1.worker import extensible_kv_cache as ekc
    from vllm.v1.worker import utils
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.gpu import model_runner as mrv2

    from vmmkv.integrations import vllm as integration

    sites = [
        (attn_utils, "allocate_kv_cache"),
        (v32, "maybe_gather_mla_latent_cache_inputs"),
        (mla_attention, "maybe_gather_mla_latent_cache_inputs"),
        (sai, "maybe_gather_indexer_k"),
        (ops, "concat_and_cache_mla"),
        (ops, "indexer_k_quant_and_cache"),
        (utils.KVBlockZeroer, "zero_block_ids"),
        (mrv2, "copy_kv_cache_blocks_inplace"),
        (mrv2.GPUModelRunner, "shutdown"),
        (mla_attention.MLAAttention, "_gather_pcp_cache_inputs"),
        (ekc, "ExtensibleTensor"),
        (ekc.ExtensibleKVCache, "__init__"),
        (ekc, "_release_for_weight_update"),
    ]
    before = [getattr(owner, name) for owner, name in sites]
    with integration.patched():
        with integration.patched():  # idempotent
            now = [getattr(owner, name) for owner, name in sites]
            assert all(a is not b for a, b in zip(before, now, strict=True))
            assert all(f.__module__.endswith(("_allocation", "_stores", "_lending")) for f in now)
            assert integration.original(ops, "concat_and_cache_mla") is before[4]
    assert [getattr(owner, name) for owner, name in sites] == before
    assert not integration.installed() and integration.active_cache() is None
    assert utils.allocate_kv_cache is before[0]  # vLLM's own function is never touched


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_the_plan_reads_vllms_placement_and_growth_segments_from_its_kv_cache_tensors(
    configs, layout
):
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from vmmkv.integrations.vllm import create_views, plan_kv_cache

    config = configs[layout]
    plan = plan_kv_cache(config, layout, [64], mla_kind="fp8_ds_mla_ue8m0")
    tensors = config.kv_cache_tensors
    assert plan.size == tensors[0].size and plan.num_blocks == 32 and len(plan.layers) == 8
    kinds = {name: p.kind for name, p in plan.layers.items()}
    assert {k for n, k in kinds.items() if n.endswith(".k_cache")} == {"indexer_k"}
    assert {k for n, k in kinds.items() if n.endswith(".attn")} == {"fp8_ds_mla_ue8m0"}
    if layout.startswith("LB"):  # one segment per layer: (offset + l * layer_stride, page)
        want = sorted(
            (t.offset + i * t.layer_stride, t.block_stride)
            for t in tensors
            for i in range(len(t.layers))
        )
        assert plan.layer_major and list(plan.segments) == want
    else:  # one packed block of every layer
        assert not plan.layer_major
        assert plan.segments == ((0, tensors[0].block_stride),)
        assert tensors[0].block_stride * 32 == plan.size
    raw = torch.empty(plan.size, dtype=torch.int8)
    views = create_views(config, layout, raw, [64])
    plain = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[layout], [64])
    base = next(iter(plain.values())).data_ptr() - plan.layers[tensors[0].layers[0]].offset
    for name, v in plain.items():
        got = views[name]
        assert (got.shape, got.stride(), got.dtype) == (v.shape, v.stride(), v.dtype)
        assert got.data_ptr() - raw.data_ptr() == v.data_ptr() - base
        assert got.data_ptr() - raw.data_ptr() == plan.layers[name].offset


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_vllm_itself_refuses_the_layouts_that_split_a_page(layout):
    from vmmkv.testing.vllm.configs import build_kv_cache_config

    with pytest.raises(ValueError, match=f"layout {layout} cannot express"):
        build_kv_cache_config(layout)


def test_unsupported_layouts_specs_and_kernel_blocks_are_refused_naming_them(configs):
    import dataclasses

    import torch

    from vmmkv.integrations.vllm import UnsupportedKVCache, VllmKVCache, plan_kv_cache
    from vmmkv.testing.vllm.configs import build_kv_cache_config, layer_specs, vllm_config

    with pytest.raises(UnsupportedKVCache, match="layout LHBNC is not supported.*LBHNC, LBNHC"):
        plan_kv_cache(configs["LBNHC"], "LHBNC")
    with pytest.raises(UnsupportedKVCache, match="kernel block size 32 != block size 64"):
        plan_kv_cache(configs["LBNHC"], "LBNHC", [32])
    with pytest.raises(UnsupportedKVCache, match="mla_kind 'indexer_k' is not a format of 656"):
        plan_kv_cache(configs["LBNHC"], "LBNHC", mla_kind="indexer_k")
    # MLA layers in bfloat16 ("auto" cache dtype): named, with the spec, before any collective
    specs = layer_specs(vllm_config("LBNHC"))
    for n in [n for n in specs if n.endswith(".attn")]:
        specs[n] = dataclasses.replace(
            specs[n], cache_dtype_str="auto", dtype=torch.bfloat16, state_content_bytes=None
        )
    name = "model.layers.0.self_attn.attn"
    _, config = build_kv_cache_config("LBNHC", specs=specs)
    with pytest.raises(UnsupportedKVCache, match=rf"'{name}' has MLAAttentionSpec\(cache_dtype_str='auto'.*dtype=torch.bfloat16") as err:  # fmt: skip
        VllmKVCache(config, "LBNHC", cpu_group=None, device="cpu")
    assert "fp8_ds_mla" in str(err.value) and "indexer" in str(err.value)


def test_the_vllm_config_check_refuses_float16_models_and_micro_batching():
    import torch

    from vmmkv.integrations.vllm import UnsupportedKVCache
    from vmmkv.integrations.vllm._support import check_vllm_config
    from vmmkv.testing.vllm.configs import vllm_config

    cfg = vllm_config("LBNHC")
    check_vllm_config(cfg)
    cfg.model_config.dtype = torch.float16
    with pytest.raises(UnsupportedKVCache, match="bfloat16 activations only.*torch.float16"):
        check_vllm_config(cfg)
    cfg.model_config.dtype = torch.bfloat16
    cfg.parallel_config.enable_dbo = True
    with pytest.raises(UnsupportedKVCache, match="micro-batching"):
        check_vllm_config(cfg)
    cfg.parallel_config.enable_dbo = False


def test_the_three_pcp_cases_map_to_num_local_only_and_this_ranks_slots():
    import torch

    from vmmkv.integrations.vllm import pcp_store_plan

    rows, world = 5, 3
    expanded = torch.cat([torch.arange(world * rows), torch.tensor([900, 901])])  # + a tail
    # 1. replicated draft decodes: an unexpanded mapping, at most the local rows
    p = pcp_store_plan(rows, torch.arange(4), 3, True, 1, world)
    assert (p.tokens, p.num_local_only, p.gathered) == (3, 3, None)
    assert p.slots.tolist() == [0, 1, 2]
    # 2. pcp_shard_decode_requests (DCP == 1): every row published at the own section
    p = pcp_store_plan(rows, expanded, 2, True, 1, world)
    assert (p.tokens, p.num_local_only) == (rows, 0)
    assert p.gathered.tolist() == list(range(15)) and p.slots.tolist() == [5, 6, 7, 8, 9]
    # 3. DCP > 1: decode rows local only, at rank 0's slots (vLLM's canonical writer), on every
    # rank; the other rows published at the own section
    for rank in range(world):
        p = pcp_store_plan(rows, expanded, 2, False, rank, world)
        assert (p.tokens, p.num_local_only) == (rows, 2)
        assert p.slots.tolist() == [0, 1, *range(5 * rank + 2, 5 * rank + 5)], rank
        assert p.gathered.tolist() == list(range(15))
        p = pcp_store_plan(rows, expanded, rows, False, rank, world)  # all decodes
        assert p.num_local_only == p.tokens == rows and p.slots.tolist() == list(range(5))
    with pytest.raises(ValueError, match="num_decode_tokens"):
        pcp_store_plan(rows, expanded, rows + 1, False, 0, world)
    with pytest.raises(ValueError, match="fewer than 3 ranks x 5 rows"):
        pcp_store_plan(rows, torch.arange(9), 0, True, 0, world)
