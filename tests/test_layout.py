"""The layout DESIGN.md fixes, read off the source: the op never imports the blocks, no two modules import each
other (directly or round a circle, function-local imports included), and the blocks never branch on backend
names (one place, ``attn_ops.registry``, chooses a backend)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"attn_ops": ROOT / "attn_ops", "attn_zoo.models": ROOT / "models", "attn_zoo": ROOT / "attn_zoo"}
BACKEND_NAMES = {"triton", "torch", "chunked", "sdpa", "flex"}


def _modules() -> dict:
    """Dotted module name -> path, for every module of the project's packages."""
    out = {}
    for prefix, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if prefix == "attn_zoo" and parts and parts[0] == "models":
                continue  # attn_zoo.models is the repository's models/ folder, read above
            out[name] = path
    return out


def _imports(name: str, path: Path, known: set) -> set:
    """Project modules ``name`` imports anywhere in its source (module level or inside functions)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # a module importing its own package's face
                found.add(t)
    return found


def _graph():
    mods = _modules()
    return mods, {n: _imports(n, p, set(mods)) for n, p in mods.items()}


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_op_never_imports_the_blocks():
    _, graph = _graph()
    bad = {m: sorted(t for t in ts if t.startswith("attn_zoo")) for m, ts in graph.items() if m.startswith("attn_ops")}
    assert not {m: ts for m, ts in bad.items() if ts}


def test_no_import_circles():
    _, graph = _graph()
    # a package's __init__ re-exporting its submodules is its face, not a circle: leave package -> own child out
    trimmed = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    assert _cycles(trimmed) == []


def test_cycle_finder_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("block", ["evoformer", "pairformer", "transformer", "triangle", "esm2", "esmc",
                                   "primitives", "inference", "sharding", "networks", "embedders", "heads"])
def test_blocks_never_branch_on_backend_names(block):
    path = ROOT / "models" / f"{block}.py"
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                for c in consts:
                    if isinstance(c, ast.Constant) and c.value in BACKEND_NAMES:
                        hits.append(f"{path.name}:{node.lineno} compares with {c.value!r}")
    assert not hits
