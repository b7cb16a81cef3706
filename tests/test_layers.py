"""The package's layers: a module never imports one from a higher layer (lazy imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "che_bench"

# Lowest first; a module may import its own layer and any lower one. Models are built from
# plain arguments (a task, an encoding's name, options), so they sit below the run's config.
LAYERS = (
    ("che_bench", "che_bench.errors", "che_bench.registry", "che_bench.settings", "che_bench.runtime_settings",
     "che_bench.setting_types", "che_bench.atomic", "che_bench.device_memory", "che_bench.cpu",
     "che_bench.allocator", "che_bench.native_build",
     "che_bench.plugins", "che_bench.protocol", "che_bench.members", "che_bench.curricula"),
    ("che_bench.tasks", "che_bench.encodings"),
    ("che_bench.model",),
    ("che_bench.config", "che_bench.outcomes"),
    ("che_bench.train",),
    ("che_bench.eval",),
    ("che_bench.store",),
    ("che_bench.run",),
    ("che_bench.reports", "che_bench.checks"),
    ("che_bench.commands", "che_bench.cli"),
)


def layer_of(module: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes
               if prefix != "che_bench" or module == "che_bench"):
            return rank
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name.startswith("che_bench.")}


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda path: module_name(path))
def test_no_module_imports_a_higher_layer(path):
    own = layer_of(module_name(path))
    higher = sorted(name for name in imported_modules(path)
                    if _known(name) and layer_of(name) > own)
    assert not higher, f"{module_name(path)} (layer {own}) imports {higher}"


def _known(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for layer in LAYERS for p in layer)


@pytest.mark.parametrize("path", MODULES, ids=lambda path: module_name(path))
def test_modules_and_functions_fit_on_a_screen(path):
    source = path.read_text()
    too_long = [f"{path.name}: {source.count(chr(10))} lines"] if source.count("\n") > 400 else []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > 60:
                too_long.append(f"{path.name}:{node.lineno} {node.name} has {length} lines")
    assert not too_long, "; ".join(too_long)


def import_cycle(package: str) -> list[str] | None:
    """A cycle of imports among the modules of ``package`` (lazy and ``TYPE_CHECKING`` imports
    included), as the modules around it, or None: a package without one reads from its
    lowest module up."""
    inside = {module_name(path): path for path in MODULES
              if module_name(path).startswith(package + ".")}
    graph = {module: sorted(n for n in imported_modules(path) if n in inside and n != module)
             for module, path in inside.items()}
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> list[str] | None:
        if module in trail:
            return [*trail[trail.index(module):], module]
        if module in done:
            return None
        for imported in graph[module]:
            cycle = visit(imported, [*trail, module])
            if cycle:
                return cycle
        done.add(module)
        return None

    return next(filter(None, (visit(module, []) for module in sorted(graph))), None)


@pytest.mark.parametrize("package", ["che_bench.train"])
def test_a_package_has_no_import_cycle(package):
    cycle = import_cycle(package)
    assert cycle is None, " -> ".join(cycle)
