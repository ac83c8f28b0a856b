"""README.md against the code: every environment variable the library reads is in the README's
table, and the table names none the code does not read (vLLM's own layout variable aside)."""

from __future__ import annotations

import ast
import pathlib
import re

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


def test_every_environment_variable_the_code_reads_is_in_the_readme_table():
    missing = {n: f for n, f in variables_in_code().items() if n not in variables_in_readme()}
    assert not missing, f"not in README.md's table: {missing}"


def test_the_readme_table_names_no_variable_the_code_does_not_read():
    stale = variables_in_readme() - set(variables_in_code()) - VLLM_OWN
    assert not stale, stale
