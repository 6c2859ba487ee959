"""Modules import downward only: a static walk over every `import` in src/verispec (function-level ones included,
and the package `__init__` that importing a submodule runs) against the layer order below.

Two rules: no module imports a module of a higher layer, and no import cycle spans two top-level units (a
package's own modules may import each other, e.g. a registry and its members). Both checks run on synthetic
graphs first, so a checker that cannot fail fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import verispec

SRC = Path(verispec.__file__).parent

# Low to high. A module's layer is that of its longest listed prefix; a module not listed is a tool (the top).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "paths", "config", "metrics", "zoo", "threads"),
    ("kernels", "sampling", "verify", "cache"),
    ("model", "quant"),  # QuantLinear is a layer of the model; quant.convert (a tool) is not
    ("stopping", "drafters"),
    ("policies", "profile", "round"),  # one round of verification, its scheduling and the target's step time
    ("decode",),  # the reference loop
    ("engine",),
)
TOOLS = ("quant.convert", "drafters.calibration")  # tools inside lower packages: they run decode or train
# Cycles between units of one layer that are known and tolerated: quant.linear imports model.packing, whose package
# __init__ imports the transformer, which imports quant.linear (model.packing could move below both).
KNOWN_CYCLES = ({"model", "quant"},)


def layer_of(module: str) -> int:
    """The layer of `verispec.a.b` (0 = lowest); tools and unlisted modules are above every layer."""
    name = module.removeprefix("verispec").lstrip(".")
    best, best_len = len(LAYERS), -1
    for prefix in TOOLS:
        if name == prefix or name.startswith(prefix + "."):
            return len(LAYERS)
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the verispec modules it imports (anywhere in its source), each with the subpackages it runs."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    def with_packages(name: str) -> set[str]:
        # Importing verispec.a.b runs verispec/a/__init__.py first (the root package's lazy one is left out).
        parts = name.split(".")
        return {".".join(parts[:n]) for n in range(2, len(parts) + 1)}

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]  # a submodule, or a name in node.module
            else:
                continue
            for name in names:
                if name.startswith("verispec.") and (hit := resolve(name)) is not None:
                    targets |= with_packages(hit)
        targets.discard(mod)
        graph[mod] = targets
    return graph


def upward_imports(graph: dict[str, set[str]], layer=layer_of) -> list[str]:
    return sorted(f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
                  for m, ts in graph.items() for t in ts if layer(t) > layer(m))


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def cross_unit_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan) that hold modules of more than one top-level unit (KNOWN_CYCLES
    aside)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            units = {unit(m) for m in comp}
            if len(units) > 1 and not any(units <= known for known in KNOWN_CYCLES):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checks_can_fail():
    cyclic = {"verispec.decode": {"verispec.engine.policies", "verispec.engine"},
              "verispec.engine": {"verispec.engine.engine"}, "verispec.engine.engine": {"verispec.decode"},
              "verispec.engine.policies": set()}
    assert cross_unit_cycles(cyclic) == [["verispec.decode", "verispec.engine", "verispec.engine.engine"]]
    assert upward_imports(cyclic) == [
        "verispec.decode (layer 5) imports verispec.engine (layer 6)",
        "verispec.decode (layer 5) imports verispec.engine.policies (layer 6)",
    ]
    registry = {"verispec.drafters": {"verispec.drafters.lookup"}, "verispec.drafters.lookup": {"verispec.drafters"}}
    known = {"verispec.model": {"verispec.quant.linear"}, "verispec.quant.linear": {"verispec.model"}}
    assert cross_unit_cycles(known) == []
    assert cross_unit_cycles(registry) == [] and upward_imports(registry) == []
    assert layer_of("verispec.quant.linear") == 2 and layer_of("verispec.quant.convert") == len(LAYERS)
    assert layer_of("verispec.cli") == len(LAYERS) and layer_of("verispec.drafters.calibration") == len(LAYERS)


def test_the_graph_sees_function_level_and_package_imports():
    graph = import_graph()
    assert "verispec.decode" in graph and "verispec.engine.engine" in graph
    assert {"verispec.decode", "verispec.engine"} <= graph["verispec.engine.engine"] | graph["verispec.engine"]
    assert "verispec.profile" in graph["verispec.cli"]  # imported inside a function


def test_modules_import_downward_only():
    assert upward_imports(import_graph()) == []


def test_no_import_cycle_spans_two_units():
    assert cross_unit_cycles(import_graph()) == []


def test_decode_and_engine_share_a_round_below_both():
    graph = import_graph()
    assert not any(t.startswith("verispec.engine") for t in graph["verispec.decode"])
    for mod in ("verispec.decode", "verispec.engine.engine"):
        assert "verispec.round" in graph[mod] and "verispec.policies" in graph[mod]
