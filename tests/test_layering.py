"""The package's layer graph: which layer may import which, what must never be imported, and no
import cycle.

Every `import` and `from ... import` in radixserve/ (at module level or inside a function, where
lazy imports live) is read with `ast`; nothing is imported. A module may import its own layer and
the layers ALLOWED lists for its own (each below it in LAYERS); NEVER names the edges that would
break the design whatever the order says (the scheduler knows no model, the router and the shared
HTTP layer no engine), and the API server's and the router's modules import without torch. A violation
tolerated while other work removes it goes in KNOWN_UPWARD or KNOWN_CYCLES (both empty now); a
fixed one must leave the list, so it cannot come back unnoticed.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "radixserve"

# Lowest first: a module may import its own layer and the ones below. Keys are the first name
# under radixserve/ (a subpackage or a top-level module).
LAYERS: list[tuple[str, set[str]]] = [
    # shared types and settings
    ("leaf", {"settings", "sampling_params", "validation", "default_model", "kv_events_config", "chat_formats"}),
    ("process", {"process"}),  # what every process does for itself (logging, GC, its children): no torch
    ("grammar", {"grammar"}),  # constrained decoding: xgrammar behind a small interface
    ("cache", {"cache"}),
    ("kernels", {"kernels"}),
    ("distributed", {"distributed"}),  # tensor-parallel process groups and collectives (model layers call them)
    ("attention", {"attention"}),
    ("model", {"model"}),
    ("scheduler", {"scheduler"}),
    ("engine", {"engine"}),
    ("http_common", {"http_common"}),  # HTTP helpers the server and the router share
    ("server", {"server"}),
    ("router", {"router"}),
    ("entry", {"__init__", "__main__", "bench", "bench_offline", "bench_one_batch", "bench_serving", "experiment",
               "cli", "client", "launch_server", "launch_router"}),
]
# The layers each layer may import besides its own: the layer graph as it is meant to be (every
# entry below its importer in LAYERS). An edge the code needs and this table lacks is a design
# change: make it here, in review, not by accident.
ALLOWED: dict[str, set[str]] = {
    "leaf": set(),
    "process": set(),
    "grammar": {"leaf"},
    "cache": {"leaf"},  # cache/factory.py sizes the cache from the settings
    "kernels": set(),
    "distributed": set(),
    "attention": {"cache", "kernels"},
    "model": {"leaf", "kernels", "distributed", "attention"},
    "scheduler": {"leaf", "cache"},
    "engine": {"leaf", "process", "grammar", "cache", "kernels", "distributed", "attention", "model", "scheduler"},
    "http_common": set(),
    # The API process speaks the engine process's messages (server -> engine); the start-up check
    # reads a checkpoint's quantization config (server -> model).
    "server": {"leaf", "process", "grammar", "cache", "model", "engine", "http_common"},
    "router": {"leaf", "process", "cache", "http_common"},
    "entry": {name for name, _ in LAYERS[:-1]},
}
# Edges that must never exist: the scheduler decides with positions and the cache alone, the router
# and the shared HTTP layer run without an engine or a model (and without torch).
NEVER: set[tuple[str, str]] = {
    ("scheduler", "model"), ("scheduler", "attention"), ("scheduler", "kernels"), ("scheduler", "engine"),
    ("scheduler", "distributed"), ("cache", "scheduler"), ("cache", "model"),
    ("router", "server"), ("router", "engine"), ("router", "model"), ("router", "scheduler"),
    ("http_common", "engine"), ("http_common", "server"), ("http_common", "model"),
    ("grammar", "engine"), ("grammar", "model"),
}
# The engine process's modules the API process imports: the messages it speaks, the detokenizer's
# text rules, the KV publisher's address check. Everything else under engine/ runs only in the
# engine process and its ranks.
API_SIDE_ENGINE = {"radixserve.engine.messages", "radixserve.engine.detokenize", "radixserve.engine.kv_publisher"}
# Importing these loads no torch: the API server's and the router's modules, the engine modules the
# API imports, and every process helper (the Hugging Face tokenizer loaded at start-up still
# imports torch, through transformers, when it loads).
TORCH_FREE = ("radixserve.server.api_server", "radixserve.launch_server", "radixserve.router.app",
              "radixserve.launch_router", *sorted(API_SIDE_ENGINE), "radixserve.process.spawn",
              "radixserve.process.logging_setup", "radixserve.process.gc_tuning", "radixserve.process.tokenizer",
              "radixserve.process.supervisor")

# A helper for tests and entry points only: it may import the leaf layer, and only the entry layer
# and default_model (which resolves the built-in tiny model for the entry points) may import it.
TESTING = "testing"
TESTING_IMPORTERS = {"default_model"}

# (importing module, imported module) pairs that run upward today.
KNOWN_UPWARD: set[tuple[str, str]] = set()
# Import cycles (as sorted module lists) that exist today.
KNOWN_CYCLES: list[list[str]] = []


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 2:
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
    """radixserve modules `path` imports: `from a.b import c` is a.b.c when that is a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target.startswith("radixserve") and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    known = set(modules) | {"radixserve"}
    return {name: imported_modules(path, name, known) for name, path in modules.items()}


def layer_of(module: str) -> Optional[int]:
    """The rank of a module's layer; None for the testing helper."""
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    if key == TESTING:
        return None
    for rank, (_, names) in enumerate(LAYERS):
        if key in names:
            return rank
    raise AssertionError(f"{module} is in no layer: add radixserve/{key} to LAYERS in {Path(__file__).name}")


ENTRY = len(LAYERS) - 1


def allowed(importer: str, imported: str) -> bool:
    low, high = layer_of(imported), layer_of(importer)
    if low is None:  # the testing helper: for tests and entry points only
        return high is None or high == ENTRY or importer.split(".")[1] in TESTING_IMPORTERS
    if high is None:
        return low == 0
    return low == high or LAYERS[low][0] in ALLOWED[LAYERS[high][0]]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_every_module_has_a_layer(graph):
    for module in graph:
        layer_of(module)


def test_imports_run_downward(graph):
    upward = {(a, b) for a, targets in graph.items() for b in targets
              if b != "radixserve" and not allowed(a, b)}
    assert upward - KNOWN_UPWARD == set(), "imports that run upward (see LAYERS)"
    # A fixed violation leaves the allow-list too, so it cannot come back unnoticed.
    assert KNOWN_UPWARD - upward == set(), "fixed: remove from KNOWN_UPWARD"


def test_the_allowed_edges_run_downward_and_avoid_the_nevers():
    rank = {name: i for i, (name, _) in enumerate(LAYERS)}
    assert set(ALLOWED) == set(rank)
    for importer, imported in ALLOWED.items():
        assert all(rank[low] < rank[importer] for low in imported), f"{importer}: {imported} not all below it"
    assert {(a, b) for a, bs in ALLOWED.items() for b in bs} & NEVER == set()


def test_the_api_process_imports_only_the_engine_modules_it_speaks_with(graph):
    reached = {(a, b) for a, targets in graph.items() if a.startswith("radixserve.server.")
               for b in targets if b.startswith("radixserve.engine.") and b not in API_SIDE_ENGINE}
    assert reached == set(), "server/ runs in the API process: it may import only API_SIDE_ENGINE of engine/"


def test_the_process_helpers_are_every_process_module():
    """process/ holds exactly the helpers TORCH_FREE checks, so a new one is checked too."""
    helpers = {name for name in all_modules() if name.startswith("radixserve.process.")}
    assert helpers == {name for name in TORCH_FREE if name.startswith("radixserve.process.")}


def test_the_api_process_and_the_router_import_no_torch():
    code = ("import importlib, sys\n"
            f"for name in {TORCH_FREE!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent, env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_import_cycles(graph):
    # The package root only re-exports lazily; edges into it are not dependencies.
    found = cycles({a: targets - {"radixserve"} for a, targets in graph.items()})
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert new == [], "import cycles"
    assert [c for c in KNOWN_CYCLES if c not in found] == [], "fixed: remove from KNOWN_CYCLES"


def test_the_checker_sees_lazy_relative_and_upward_imports(tmp_path):
    """The parser itself: a function-level import, a relative one, and `from pkg import module`."""
    pkg = tmp_path / "radixserve"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "attention").mkdir()
    (pkg / "kernels" / "__init__.py").write_text("")
    (pkg / "attention" / "__init__.py").write_text("")
    (pkg / "attention" / "backend.py").write_text("")
    (pkg / "kernels" / "norm.py").write_text("from . import rope\n\ndef f():\n"
                                             "    from radixserve.attention import backend\n")
    (pkg / "kernels" / "rope.py").write_text("import radixserve.kernels.norm\n")
    known = {"radixserve.kernels", "radixserve.kernels.norm", "radixserve.kernels.rope", "radixserve.attention",
             "radixserve.attention.backend"}
    norm = imported_modules(pkg / "kernels" / "norm.py", "radixserve.kernels.norm", known)
    assert norm == {"radixserve.kernels.rope", "radixserve.attention.backend"}
    assert not allowed("radixserve.kernels.norm", "radixserve.attention.backend")
    assert allowed("radixserve.attention.backend", "radixserve.kernels.norm")
    assert not allowed("radixserve.scheduler.prefill", "radixserve.model.qwen2")  # below, but never
    graph = {"radixserve.kernels.norm": norm,
             "radixserve.kernels.rope": imported_modules(pkg / "kernels" / "rope.py", "radixserve.kernels.rope", known)}
    assert cycles(graph) == [["radixserve.kernels.norm", "radixserve.kernels.rope"]]
