"""vmmkv's environment variables: one parser per kind (``vmmkv._env``), so that a word means the
same for every variable of that kind, the library's and the vLLM plugin's alike."""

from __future__ import annotations

import pytest

from vmmkv import _env
from vmmkv.integrations import vllm as plugin
from vmmkv.integrations.vllm import _elastic_settings as _elastic

# every switch vmmkv reads, with the reader that parses it (the plugin's through its own)
BOOLEANS = {
    "VMMKV_BARRIER_TRAP": _env.barrier_trap,
    "VMMKV_CHECK_PADDING": _env.check_padding,
    "VMMKV_FABRIC": _env.fabric,
    "VLLM_USE_VMMKV": plugin.enabled,
    "VLLM_VMMKV_ELASTIC": _elastic.elastic_enabled,
}
WORDS = {"1": True, "true": True, "TRUE": True, " True ": True, "0": False, "false": False,
         "False": False, "": False}  # fmt: skip
REFUSED = ("yes", "no", "on", "2", "-1", "1.0", "maybe")


@pytest.mark.parametrize("name", sorted(BOOLEANS))
def test_every_switch_takes_the_same_words(name, monkeypatch):
    read = BOOLEANS[name]
    monkeypatch.delenv(name, raising=False)
    assert read() is False  # unset
    for word, value in WORDS.items():
        monkeypatch.setenv(name, word)
        assert read() is value, (name, word)
    for word in REFUSED:
        monkeypatch.setenv(name, word)
        with pytest.raises(ValueError) as err:
            read()
        assert str(err.value) == (
            f"{name} must be '0' or '1', got {word!r} ('false' and 'true' also work)"
        )


def test_the_tri_state_takes_auto_and_the_switches_words(monkeypatch):
    monkeypatch.delenv("VMMKV_DIRECT", raising=False)
    assert _env.direct() == "auto"
    for word, value in {**WORDS, "auto": None, "AUTO": None}.items():
        monkeypatch.setenv("VMMKV_DIRECT", word)
        want = "auto" if value is None or word == "" else ("1" if value else "0")
        assert _env.direct() == want, word
    for word in REFUSED:
        monkeypatch.setenv("VMMKV_DIRECT", word)
        with pytest.raises(ValueError, match=r"^VMMKV_DIRECT must be 'auto', '0' or '1', got"):
            _env.direct()


# every number vmmkv reads: (variable, a value it takes and what it gives, values it refuses)
NUMBERS = {
    "VMMKV_BARRIER_TIMEOUT": (_env.barrier_timeout, ("2.5", 2.5), ("0", "-1", "nan", "inf", "x")),
    "VMMKV_CHUNK_MIB": (_env.chunk_bytes, ("0.5", 1 << 19), ("0", "-2", "inf", "x", "0.3")),
}
# elastic KV's knobs: (a value, the setting it sets, what it gives, its bound, integer, refused)
KNOBS = {
    "VMMKV_ELASTIC_WATERMARK_BLOCKS": ("7", "watermark", 7, 1, True, ("0", "1.5", "x", "inf")),
    "VMMKV_ELASTIC_CALM_S": ("0.25", "calm_seconds", 0.25, 0, False, ("-1", "nan", "inf", "x")),
    "VMMKV_ELASTIC_RELEASE_STEPS": ("3", "release_steps", 3, 1, True, ("0", "2.0", "x")),
}


@pytest.mark.parametrize("name", sorted(NUMBERS))
def test_the_librarys_numbers_parse_and_refuse_naming_the_variable(name, monkeypatch):
    read, (word, value), refused = NUMBERS[name]
    monkeypatch.setenv(name, word)
    assert read() == value
    for word in refused:
        monkeypatch.setenv(name, word)
        with pytest.raises(ValueError, match=rf"^{name} must be .*, got {word!r}"):
            read()


def _settings(env):
    return _elastic.elastic_settings(
        4096, 1 << 20, 64 << 20, block_size=64, max_num_batched_tokens=8192, max_num_seqs=256,
        concurrent_batches=1, env=env,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(KNOBS))
def test_elastic_knobs_parse_through_the_same_number_parser(name):
    word, field, value, minimum, integer, refused = KNOBS[name]
    assert getattr(_settings({name: word}), field) == value
    for bad in refused:
        with pytest.raises(ValueError) as err:
            _settings({name: bad})
        with pytest.raises(ValueError) as same:  # the very words of vmmkv._env.number
            _env.number(name, None, minimum=minimum, integer=integer, env={name: bad})
        assert str(err.value) == str(same.value)


def test_set_variables_lists_vmmkvs_own_and_nothing_else():
    env = {"VMMKV_DIRECT": "1", "VLLM_USE_VMMKV": "true", "VLLM_VMMKV_ELASTIC": "0",
           "VMMKV_ELASTIC_CALM_S": "3", "VLLM_KV_CACHE_LAYOUT": "BLNHC", "PATH": "/bin",
           "VLLM_PLUGINS": "vmmkv"}  # fmt: skip
    assert _env.set_variables(env) == {
        "VLLM_USE_VMMKV": "true", "VLLM_VMMKV_ELASTIC": "0", "VMMKV_DIRECT": "1",
        "VMMKV_ELASTIC_CALM_S": "3",
    }  # fmt: skip
