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


TRITON_DIR = ROOT / "attn_ops" / "triton"
MAX_FILE_LINES = 600


def _triton_decorated(fn) -> bool:
    """Whether ``fn`` carries ``@triton.jit`` (bare or called, any alias of the module that ends in ``jit``)."""
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
        if isinstance(target, ast.Name) and target.id == "jit":
            return True
    return False


def code_lines(source: str):
    """(kernel, host) code line counts of a module: a code line holds a token other than a comment and lies in no
    docstring (module, class, function); kernel lines lie inside a ``@triton.jit`` function, decorator included."""
    import io
    import tokenize

    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
            tokenize.ENDMARKER}
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            code.update(range(tok.start[0], tok.end[0] + 1))
    tree = ast.parse(source)
    kernel = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                    isinstance(body[0].value.value, str):
                code.difference_update(range(body[0].lineno, body[0].end_lineno + 1))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _triton_decorated(node):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            kernel.update(range(first, node.end_lineno + 1))
    return len(code & kernel), len(code - kernel)


def test_code_line_rule():
    src = ('"""Doc."""\nimport triton\n\n\n@triton.jit\ndef k(X):\n    """Doc\n    more."""\n    # a note\n'
           '    x = 1\n    return x\n\n\ndef host():\n    return 2  # reason\n')
    assert code_lines(src) == (4, 3)  # decorator, def, two statements | import, def, return


MAX_HOST_RATIO = 1.12  # the ratio reached (1.19 without the rotary kernels), never above 1.2; lower it as host code shrinks


def test_triton_line_budget():
    """No backend file over ``MAX_FILE_LINES`` raw lines; the host/kernel code ratio is printed and held at its
    current value, ``MAX_HOST_RATIO``, which itself stays within the rule host <= 1.2 x kernel."""
    kernel = host = 0
    rows, too_long = [], []
    for path in sorted(TRITON_DIR.glob("*.py")):
        text = path.read_text()
        raw = len(text.splitlines())
        k, h = code_lines(text)
        kernel, host = kernel + k, host + h
        rows.append(f"{path.name:20s} raw {raw:4d}  kernel {k:4d}  host {h:4d}")
        if raw > MAX_FILE_LINES:
            too_long.append(f"{path.name}: {raw}")
    print("\n".join(rows))
    print(f"attn_ops/triton: kernel {kernel}, host {host}, host/kernel {host / kernel:.2f}")
    assert not too_long, f"files over {MAX_FILE_LINES} lines: {too_long}"
    assert MAX_HOST_RATIO <= 1.2
    assert host <= MAX_HOST_RATIO * kernel, f"host/kernel {host / kernel:.2f} > {MAX_HOST_RATIO}"


def test_imports_without_triton():
    """Where triton cannot be imported (CPU-only installs off Linux), the blocks import and fall back to
    PyTorch: the kernel paths of models/kernels.py report themselves unavailable."""
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import attn_zoo.models.primitives as P\n"
        "from attn_zoo.models import kernels\n"
        "assert kernels.triton is None\n"
        "ln = P.LayerNorm(8)\n"
        "x = torch.randn(2, 3, 8)\n"
        "assert kernels.layer_norm(x, ln, x.dtype, force=True) is None\n"
        "assert not kernels.use_gate_kernel(x, force=True)\n"
        "ref = torch.nn.functional.layer_norm(x, (8,), ln.weight, ln.bias, ln.eps)\n"
        "assert torch.allclose(ln(x), ref)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
