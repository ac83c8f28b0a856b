"""The vLLM plugin's layout, read from its source with ``ast`` (no vLLM, no torch): no import
circle between its modules, counting imports inside functions; the installer imports the site
modules and none of them imports it back; the test tooling stays outside the plugin; no file
over 500 lines. Not marked ``vllm``: it runs in the default suite."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = "vmmkv.integrations.vllm"
ROOT = pathlib.Path(__file__).resolve().parent.parent / "vmmkv" / "integrations" / "vllm"
INIT = "__init__"
INSTALLER = "_install"
SITE_MODULES = ("_allocation", "_stores", "_lending", "_elastic_worker", "_elastic_engine")
MAX_LINES = 500
TOOLS = ROOT.parent.parent / "testing" / "vllm"


def _modules() -> dict[str, pathlib.Path]:
    return {p.stem: p for p in sorted(ROOT.glob("*.py"))}


def _imported(source: str) -> set[str]:
    """Every dotted name an import in ``source`` (a plugin module's) names, at module level or
    inside a function, relative imports resolved against the plugin package: ``from ._x import
    y`` names ``<package>._x`` and ``<package>._x.y``; ``from . import y`` names ``<package>.y``."""
    names: set[str] = set()
    parts = PACKAGE.split(".")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(parts[: len(parts) + 1 - node.level]) if node.level else ""
            base = ".".join(filter(None, (base, node.module)))
            if base != PACKAGE:
                names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def _edges(stem: str, source: str, modules: set[str]) -> set[str]:
    """The plugin modules ``stem`` imports (``__init__``: a name of the package itself), with
    the lazy table of the package's ``__getattr__`` (``_LAZY``: attribute -> module)."""
    found = set()
    for name in _imported(source):
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            head = name[len(PACKAGE) + 1 :].split(".")[0]
            found.add(head if head in modules else INIT)
    if stem == INIT:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets
            ):
                found.update(ast.literal_eval(node.value).values())
    found.discard(stem)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {stem: _edges(stem, p.read_text(), set(modules)) for stem, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_reader_sees_imports_inside_functions_and_finds_a_circle():
    source = (
        "from ._b import x\n"
        "def f():\n"
        "    from . import _c, helper\n"
        "    import vmmkv.integrations.vllm._d\n"
        "    from ...testing import spawn\n"
    )
    got = _edges("_a", source, {"_a", "_b", "_c", "_d", INIT})
    assert got == {"_b", "_c", "_d", INIT}, got  # helper: a name of the package itself
    assert "vmmkv.testing.spawn" in _imported(source)
    assert _cycle({"_a": {"_b"}, "_b": {"_c"}, "_c": {"_a"}}) == ["_a", "_b", "_c", "_a"]
    assert _cycle({"_a": {"_b"}, "_b": set(), "_c": {"_a", "_b"}}) is None


def test_the_plugins_modules_import_each_other_without_a_circle():
    graph = _graph()
    assert len(graph) > 10 and INIT in graph, sorted(graph)  # the reader found the package
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def test_the_installer_imports_every_site_module_and_only_the_entry_point_imports_it():
    graph = _graph()
    assert {INSTALLER, *SITE_MODULES} <= set(graph), sorted(graph)
    assert set(SITE_MODULES) <= graph[INSTALLER], graph[INSTALLER]
    importers = sorted(stem for stem, targets in graph.items() if INSTALLER in targets)
    assert importers == [INIT], importers


def test_the_test_tooling_lives_outside_the_plugin_and_the_plugin_imports_none_of_it():
    tools = {p.stem for p in TOOLS.glob("*.py")}
    assert {"configs", "trace", "workloads"} <= tools, tools
    assert not {"testing", "trace", "workloads"} & set(_modules()), sorted(_modules())
    for stem, path in _modules().items():
        tools = sorted(n for n in _imported(path.read_text()) if n.startswith("vmmkv.testing"))
        assert not tools, (stem, tools)


def test_no_file_of_the_plugin_is_over_500_lines():
    sizes = {stem: len(p.read_text().splitlines()) for stem, p in _modules().items()}
    assert len(sizes) > 10, sizes  # the reader found the package
    over = {stem: n for stem, n in sizes.items() if n > MAX_LINES}
    assert not over, over
