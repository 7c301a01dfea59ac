"""The package's shape: which way imports go (read from the source, nothing imported).

Kernels are a leaf (jax and numpy only, like jax's own pallas ops), the top-level packages
import one way (checkpoints/ and search/ plug into nanojax through entry points), the
search does not reach into benchmarks, scripts use public names, behaviour is not read
from environment variables, and no two modules import each other (directly or round a
longer cycle).
"""
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("nanojax", "pallas_kernels", "search", "checkpoints")
# Which top-level package may import which: the kernels are a leaf, the engine uses them,
# the loaders and the search use the engine. nanojax reaches checkpoints/ and search/ only
# through the entry points pyproject.toml declares (nanojax/plugins.py).
ALLOWED = {"pallas_kernels": set(),
           "nanojax": {"pallas_kernels"},
           "checkpoints": {"nanojax", "pallas_kernels"},
           "search": {"nanojax", "pallas_kernels"}}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(*folders):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module name an import statement in the file names (any depth: function-level
    imports count, since they run too), and every string given to __import__ or
    importlib.import_module (an import by another name)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(
                f, ast.Attribute) else None
            if name in ("__import__", "import_module"):
                out.add(node.args[0].value)
    return out


def _project_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in _sources(*PACKAGES)}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


def test_kernels_import_only_jax_numpy_and_each_other():
    allowed = {"jax", "numpy", "pallas_kernels"}
    stdlib = set(sys.stdlib_module_names)
    for path in _sources("pallas_kernels"):
        bad = {m for m in _imports(path)
               if m.split(".")[0] not in allowed | stdlib}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_search_imports_no_benchmark_module():
    for path in _sources("search"):
        bad = {m for m in _imports(path) if m.startswith("nanojax.bench")}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_no_import_cycles():
    _assert_acyclic(_project_graph())


def test_top_level_packages_import_one_way():
    """The package-level graph (tests excluded) is acyclic and its arrows are the allowed
    ones: nanojax imports neither checkpoints nor search, the kernels nothing of ours."""
    graph = {p: set() for p in PACKAGES}
    where = {}
    for path in _sources(*PACKAGES):
        src = path.relative_to(ROOT).parts[0]
        for module in _imports(path):
            dst = module.split(".")[0]
            if dst in PACKAGES and dst != src:
                graph[src].add(dst)
                where.setdefault((src, dst), str(path.relative_to(ROOT)))
    _assert_acyclic(graph)
    bad = sorted(f"{src} -> {dst} ({where[src, dst]})"
                 for src in graph for dst in graph[src] if dst not in ALLOWED[src])
    assert not bad, "imports against the packages' direction: " + "; ".join(bad)
    _assert_acyclic(ALLOWED)


def test_imports_by_name_count(tmp_path):
    """A module named in a string (as a plugin lookup might) is an import too."""
    src = tmp_path / "m.py"
    src.write_text("import importlib\n__import__('search.cli', fromlist=['register'])\n"
                   "importlib.import_module('checkpoints.loader')\n")
    assert {"search.cli", "checkpoints.loader"} <= _imports(src)


def test_scripts_use_public_names_only():
    for path in _sources("bench"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] in PACKAGES:
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports private {private} from {node.module}"


def test_behaviour_is_not_read_from_environment_variables():
    """Only paths may come from the environment (NANOJAX_CACHE and friends)."""
    for path in _sources(*PACKAGES):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value.startswith("NANOJAX_"):
                assert node.value in ("NANOJAX_CACHE", "NANOJAX_COMPILE_CACHE",
                                      "NANOJAX_KV_OFFLOAD_DIR"), \
                    f"{path.name} reads {node.value}"
