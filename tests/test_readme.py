"""README.md against the code: every environment variable the library reads is in the README's
table, the table names none the code does not read (vLLM's own layout variable aside) and its
defaults are the code's; the API tour runs as written; the first screen's commands are the Quick
start's; the requirements, the plugin's log lines and the vLLM skip reason are the code's."""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAME = re.compile(r"(?:VMMKV|VLLM)_[A-Z0-9_]*[A-Z0-9]")
# named in the table, read by vLLM itself: the plugin's errors tell the user to set it
VLLM_OWN = {"VLLM_KV_CACHE_LAYOUT"}


def variables_in_code() -> dict[str, str]:
    """Every string constant of vmmkv/ that is exactly a ``VMMKV_``/``VLLM_`` name (how the
    code spells a variable it reads: ``os.environ.get("...")``, ``ENV = "..."``, a knob table),
    with the first file that holds it."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "vmmkv").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if NAME.fullmatch(node.value):
                    found.setdefault(node.value, str(path.relative_to(ROOT)))
    return found


def variables_in_readme() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([A-Z0-9_]+)`", row.split("|")[1])}


def test_the_code_reads_the_variables_this_test_is_meant_to_find():
    # the scan itself: a reader in each layer (library, plugin, elastic knobs, test hooks)
    found = variables_in_code()
    for name in ("VMMKV_DIRECT", "VMMKV_CHUNK_MIB", "VLLM_USE_VMMKV", "VLLM_VMMKV_ELASTIC",
                 "VMMKV_ELASTIC_FLOOR_BLOCKS", "VMMKV_SLEEP_INNER_BACKEND", "VMMKV_TEST_HOST"):  # fmt: skip
        assert name in found, (name, sorted(found))


def vllm_variables_the_harness_sets() -> set[str]:
    """vLLM's own variables that the engine harness sets for the engines it starts (the keys of
    ``ENV`` in vmmkv/testing/vllm/host.py, read without importing it: it imports vLLM); vmmkv
    reads none of them, so the table leaves them out."""
    for node in ast.parse((ROOT / "vmmkv/testing/vllm/host.py").read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["ENV"]:
            return {k.value for k in node.value.keys if k.value.startswith("VLLM_")}
    raise AssertionError("vmmkv/testing/vllm/host.py has no ENV")


def test_every_environment_variable_the_code_reads_is_in_the_readme_table():
    sets = vllm_variables_the_harness_sets()
    assert sets == {"VLLM_WORKER_MULTIPROC_METHOD", "VLLM_NO_USAGE_STATS",
                    "VLLM_ENABLE_V1_MULTIPROCESSING"}  # fmt: skip
    readme = variables_in_readme()
    missing = {n: f for n, f in variables_in_code().items() if n not in readme | sets}
    assert not missing, f"not in README.md's table: {missing}"


def test_the_readme_table_names_no_variable_the_code_does_not_read():
    stale = variables_in_readme() - set(variables_in_code()) - VLLM_OWN
    assert not stale, stale


def section(title: str, text: str | None = None) -> str:
    """The body of README.md's section ``## title`` (up to the next ``## ``)."""
    text = (ROOT / "README.md").read_text() if text is None else text
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def indented_commands(body: str) -> list[str]:
    """The command lines of a section's indented blocks that start with ``pip install``."""
    return [line[4:] for line in body.splitlines() if line.startswith("    pip install ")]


@pytest.mark.timeout(300)
def test_the_api_tour_runs_as_written_with_two_ranks_publishing_to_each_other(tmp_path):
    tour = section("API tour").split("```python\n", 1)[1].split("\n```", 1)[0] + "\n"
    (tmp_path / "tour.py").write_text(tour)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "tour.py"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=280)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    for rank in (0, 1):  # both ranks took part; each one's replica holds the peer's rows too
        line = re.search(rf"^rank {rank}: (\w+) publication .*reference: (\w+); (\{{.*\}})$",
                         p.stdout, re.M)  # fmt: skip
        assert line and line.group(1, 2) == ("direct", "True"), p.stdout
        stats = ast.literal_eval(line[3])
        assert stats["peer_bytes_issued"] > 0 and stats["tokens_stored"] > 0, stats
        assert f"rank {rank}: committed blocks: 8" in p.stdout, p.stdout


def test_the_first_screen_shows_the_quick_starts_lines_in_its_order():
    text = (ROOT / "README.md").read_text()
    first = text.split("- **Set up**", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    quick = indented_commands(section("Quick start"))
    assert quick[0].endswith("download.pytorch.org/whl/cpu"), quick  # optional, first
    assert [line.strip() for line in first.strip().splitlines()] == quick[:3], (first, quick)


def test_the_vllm_skip_reason_names_the_readmes_install_route():
    from tests.helpers import VLLM_INSTALL

    (line,) = [c for c in indented_commands(section("Running vLLM with vmmkv")) if "-m pytest" in c]
    assert line == f"{VLLM_INSTALL} && python -m pytest -q -m vllm", line


def test_the_requirements_the_readme_states_are_the_distributions():
    from importlib.metadata import metadata

    text = (ROOT / "README.md").read_text()
    meta = metadata("vmmkv")  # pyproject.toml's, as installed
    deps = [d.split(";")[0].replace(" ", "") for d in meta.get_all("Requires-Dist")]
    assert f"Python ≥ {meta['Requires-Python'].removeprefix('>=')}" in text, meta["Requires-Python"]
    for name, shown in (("torch", "torch ≥ {}"), ("cuda-python[all]", "cuda-python ≥ {}")):
        (dep,) = [d for d in deps if d.startswith(name + ">=")]
        assert shown.format(dep.split(">=")[1]) in text, dep
    assert "vllm==0.34.0" in deps and "vLLM **0.34.0** plugin" in text, deps


def _table_defaults() -> dict[str, str]:
    """Each table row's default where it is one literal in backquotes."""
    out = {}
    for row in section("Environment variables").splitlines():
        cells = row.split(" | ")
        if row.startswith("| `") and re.fullmatch(r"`[^`]+`", cells[1]):
            for name in re.findall(r"`([A-Z0-9_]+)`", cells[0]):
                out[name] = cells[1].strip("`")
    return out


def test_the_tables_defaults_are_the_codes(monkeypatch):
    from vmmkv import _env
    from vmmkv.integrations import vllm as plugin
    from vmmkv.integrations.vllm import _elastic_settings as _elastic
    from vmmkv.ops import build

    for name in _table_defaults():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "$XDG_CACHE_HOME")
    settings = _elastic.elastic_settings(
        4096, 1 << 20, 64 << 20, block_size=64, max_num_batched_tokens=8192, max_num_seqs=256,
        concurrent_batches=1, env={},
    )  # fmt: skip
    switch = {False: "0", True: "1"}
    code = {
        "VMMKV_DIRECT": _env.direct(),
        "VMMKV_BARRIER_TIMEOUT": f"{_env.barrier_timeout():g}",
        "VMMKV_BARRIER_TRAP": switch[_env.barrier_trap()],
        "VMMKV_CHECK_PADDING": switch[_env.check_padding()],
        "VMMKV_FABRIC": switch[_env.fabric()],
        "VMMKV_LAUNCH_API": _env.launch_api(),
        "VMMKV_CACHE_DIR": str(build.cache_dir()),
        "VLLM_USE_VMMKV": switch[plugin.enabled()],
        "VLLM_VMMKV_ELASTIC": switch[_elastic.elastic_enabled()],
        "VMMKV_ELASTIC_CALM_S": f"{settings.calm_seconds:g}",
        "VMMKV_ELASTIC_WINDOW_S": f"{settings.window_seconds:g}",
        "VMMKV_ELASTIC_RELEASE_STEPS": f"{settings.release_steps}",
        "VMMKV_ELASTIC_IDLE_S": f"{settings.idle_seconds:g}",
        "VMMKV_ELASTIC_ORDER": settings.order,
        "VMMKV_SLEEP_INNER_BACKEND": _constant(
            "vmmkv/integrations/vllm/_sleep.py", "DEFAULT_INNER"
        ),
    }
    assert _table_defaults() == code


def _constant(path: str, name: str) -> str:
    """A module-level string constant, read without importing the module (this one imports
    vLLM)."""
    for node in ast.parse((ROOT / path).read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == [name]:
            return node.value.value
    raise AssertionError(f"{path} has no {name}")


def _log_formats() -> list[re.Pattern]:
    """Every string of vmmkv/ that starts with "vmmkv: " (log messages), as a pattern: its
    %-placeholders and f-string fields match any text."""
    found = []
    for path in sorted((ROOT / "vmmkv").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                parts = [node.value]
            elif isinstance(node, ast.JoinedStr):
                parts = [v.value if isinstance(v, ast.Constant) else None for v in node.values]
            else:
                continue
            if not isinstance(parts[0], str) or not parts[0].startswith("vmmkv: "):
                continue
            pattern = "".join(
                ".+" if p is None else re.sub(r"%[ds]", ".+", re.escape(p)) for p in parts
            )
            found.append(re.compile(pattern))
    return found


def test_the_log_lines_the_readme_names_are_the_plugins():
    body = section("Running vLLM with vmmkv").split("### How to tell the plugin is active", 1)[1]
    body = body.split("\n### ", 1)[0]
    named = re.findall(r"`(vmmkv: [^`]+)`", body)
    assert len(named) >= 8, named
    formats = _log_formats()
    for line in named:
        example = re.sub(r"<[^>]+>", "X", line)
        assert any(f.fullmatch(example) for f in formats), line


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")
@pytest.mark.timeout(300)
def test_the_readmes_logging_configuration_shows_the_plugins_lines_in_vllm(tmp_path):
    body = section("Running vLLM with vmmkv")
    (tmp_path / "vmmkv-logging.json").write_text(body.split("```json\n", 1)[1].split("```", 1)[0])
    script = (
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "configure_logging(LoggingConfig())  # as every vLLM process does\n"
        "from vmmkv.integrations.vllm import patched\n"
        "with patched():\n"
        "    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    runs = {}
    for shown in (False, True):
        if shown:
            env["VLLM_LOGGING_CONFIG_PATH"] = str(tmp_path / "vmmkv-logging.json")
        p = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=280)  # fmt: skip
        assert p.returncode == 0, p.stdout + p.stderr
        runs[shown] = p.stdout + p.stderr
    # vLLM alone hides the plugin's INFO lines; the README's configuration shows them
    assert "vmmkv: replaced" not in runs[False], runs[False]
    assert re.search(r"vmmkv: replaced \d+ vLLM call sites \(worker\)", runs[True]), runs[True]
