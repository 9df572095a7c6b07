"""Compile an attention kernel for a GPU target on any machine (no GPU needed) and report how its loops load.

Triton's software pipeliner turns a loop's loads into asynchronous copies issued iterations ahead; a load it cannot
turn (too narrow for a copy: a ``u8`` mask row) stays synchronous, and a copy whose predicate is such a load's value
waits on it every iteration. This prints, per ``scf.for`` loop of the kernel's final TTGIR, its asynchronous copies,
the synchronous loads an iteration waits on and those the pipeliner only prefetches into registers for a later
iteration (with the source line each comes from), compiled with the specialisations a real launch gets (16-byte
aligned pointers, head-dim strides divisible by 16, unit key strides):

    python scripts/kernel_ir.py fwd                         # forward, pair bias + key mask, ragged tiles, D=32
    python scripts/kernel_ir.py dq --in-range --d 48        # the dQ kernel on tiles in range
    python scripts/kernel_ir.py dkdv; python scripts/kernel_ir.py dbias   # the other backward passes
    python scripts/kernel_ir.py fwd --dump fwd.ttgir        # also write the TTGIR

Needs Triton's NVIDIA backend (it ships with the Linux wheel, ``ptxas`` included); not under ``TRITON_INTERPRET=1``
(the interpreter's kernels cannot be compiled). Targets: ``--arch 90`` (Hopper, default), 80 (Ampere).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Dict, List, Sequence

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# kernel -> (module, function name); the parameters named here get pointer types, the rest of the runtime ones int32
KERNELS = {"fwd": ("attn_ops.triton.forward", "attn_fwd_kernel"),
           "dq": ("attn_ops.triton.backward", "attn_bwd_dq_kernel"),
           "dkdv": ("attn_ops.triton.backward", "attn_bwd_dkdv_kernel"),
           "dbias": ("attn_ops.triton.dbias", "attn_bwd_dbias_kernel")}
POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Bias": "*bf16", "Out": "*bf16", "dOut": "*bf16",
            "dQ": "*bf16", "dK": "*bf16", "dV": "*bf16", "Mask": "*u8", "Lse": "*fp32", "Delta": "*fp32",
            "dQacc": "*fp32", "dBias": "*fp32", "dBiasPart": "*fp32", "QSeg": "*i32", "KSeg": "*i32"}
FLOATS = ("logit_scale", "scale", "qk_scale")
# strides a real launch specialises as divisible by 16 (multiples of the head width), and those it passes as 1
DIVISIBLE = re.compile(r"s_(q|k|v|o|d)[brhmn]$")
UNIT = ("s_bn", "s_mn", "s_gn")


def constexprs(kernel: str, mask: bool = True, bias: int = 3, in_range: bool = False, block_m: int = 64,
               block_n: int = 64, d: int = 32) -> Dict[str, object]:
    """The constexpr arguments of a key-masked (or unmasked) pair-bias launch of ``kernel``."""
    from attn_ops.triton.launch import _pow2

    block_d = _pow2(d)  # the launcher's head-dim block
    c = dict(HAS_BIAS=bias, HAS_MASK=1 if mask else 0, CAUSAL=False, HAS_SEG=False, EVEN_M=in_range,
             EVEN_N=in_range, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_d, D=d, Dv=d, ALIGN=16,
             BIAS_ALIGN=16)
    if kernel == "dq":
        c["DIRECT_DBIAS"] = 0
    elif kernel == "dkdv":  # the split backward's dK/dV pass (the shared bias's gradient by the dbias kernel)
        c.update(FUSED_DQ=False, DIRECT_DBIAS=0, ATOMIC_DBIAS=False, ROWS=1)
    elif kernel == "dbias":  # the deterministic reduction: one output tile per program, the batch loop over rows
        del c["HAS_BIAS"], c["BIAS_ALIGN"]
        c.update(LOOP_M=False, LOOP_N=False, LOOP_B=False)
    return c


def compile_ttgir(kernel: str, consts: Dict[str, object], arch: int = 90, num_warps: int = 4,
                  num_stages: int = 3) -> str:
    """The final TTGIR of ``kernel`` (a key of :data:`KERNELS`) compiled for ``cuda:<arch>`` with ``consts``."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1: the interpreter's kernels cannot be compiled; unset it")
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget

    module, name = KERNELS[kernel]
    fn = getattr(importlib.import_module(module), name)
    consts = dict(consts)
    sig, attrs = {}, {}
    for i, p in enumerate(fn.params):
        if p.name in consts:
            sig[p.name] = "constexpr"
        elif p.name in UNIT:
            sig[p.name], consts[p.name] = "constexpr", 1
        elif p.name in POINTERS:
            sig[p.name] = POINTERS[p.name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif p.name in FLOATS:
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "i32"
            if DIVISIBLE.match(p.name):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    return compiled.asm["ttgir"]


def _source_lines(ttgir: str) -> Dict[str, str]:
    """``#locN`` -> ``file:line`` (file name only) of the TTGIR's location table: a call site resolves to its callee's
    line (the innermost), a named location to the line it names."""
    raw = dict(re.findall(r"^(#loc\d*) = loc\((.*)\)\s*$", ttgir, re.M))
    out: Dict[str, str] = {}

    def resolve(key: str, seen=()) -> str:
        if key in out:
            return out[key]
        body = raw.get(key)
        where = "?"
        if body is not None and key not in seen:
            m = re.match(r'"([^"]+)":(\d+):\d+$', body)
            ref = re.match(r"callsite\((#loc\d*) at ", body) or re.search(r"\((#loc\d*)\)$", body)
            if m:
                where = f"{os.path.basename(m.group(1))}:{m.group(2)}"
            elif ref:
                where = resolve(ref.group(1), seen + (key,))
        out[key] = where
        return where

    for key in raw:
        resolve(key)
    return out


def _where(line: str, locs: Dict[str, str]) -> str:
    """The source ``file:line`` of a TTGIR op's location, "?" where it has none the table resolves."""
    m = re.search(r"loc\((#loc\d*)\)\s*$", line)
    return locs.get(m.group(1), "?") if m else "?"


_DEF = re.compile(r"\s*(%[\w.]+)(?::\d+)? = ")
_NAME = re.compile(r"%[\w.]+")


def _uses(name: str, line: str) -> bool:
    """Whether ``line`` reads SSA value ``name`` (not only defines it)."""
    m = _DEF.match(line)
    rest = line[m.end():] if m else line
    return re.search(re.escape(name) + r"(?![\w.])", rest) is not None


def _reaches_load(name: str, defs: Dict[str, str], seen=None) -> bool:
    """Whether SSA value ``name`` is computed (through any chain of ops in ``defs``) from a synchronous ``tt.load``."""
    seen = set() if seen is None else seen
    if name in seen or name not in defs:
        return False
    seen.add(name)
    line = defs[name]
    rhs = line[_DEF.match(line).end():]
    if rhs.startswith("tt.load "):
        return True
    return any(_reaches_load(n, defs, seen) for n in _NAME.findall(rhs.split(" loc(")[0]))


def loop_loads(ttgir: str) -> List[Dict[str, object]]:
    """Per ``scf.for`` loop (nested loops counted in their own entry only):

    - ``line``: the loop's first TTGIR line; ``async``: its asynchronous copies (``async_copy`` / TMA copies);
    - ``sync`` / ``prefetch``: the sources of its synchronous ``tt.load`` ops, split into those used in the iteration
      that loads them (the iteration waits on them) and those only handed to a later iteration by the loop's own
      ``scf.yield`` (the pipeliner's register prefetch, whose latency the iterations in between cover);
    - ``waiting_copies``: the sources of its asynchronous copies whose predicate (``mask``) is computed from a
      synchronous load: such a copy cannot be issued before that load's value arrives.
    """
    lines = ttgir.splitlines()
    locs = _source_lines(ttgir)
    defs = {m.group(1): ln.strip() for ln in lines for m in [_DEF.match(ln)] if m}
    loops, stack = [], []  # stack: (loop index, brace depth at which its body closes)
    depth = 0
    for no, line in enumerate(lines, 1):
        if stack and line.lstrip().startswith("scf.yield") and depth == stack[-1][1] + 1:
            loops[stack[-1][0]]["yield"] = line  # the innermost loop's own yield (not an scf.if's inside it)
        for idx, _ in stack:
            loops[idx]["body"].append(line)  # every enclosing loop sees the uses in its nested ones
        if stack:
            cur = loops[stack[-1][0]]
            if "async_copy_global_to_local" in line or "async_tma_copy" in line:
                cur["async"] += 1
                pred = re.search(r" mask (%[\w.]+)", line)
                if pred and _reaches_load(pred.group(1), defs):
                    cur["waiting"].append(_where(line, locs))
            else:
                m = _DEF.match(line)
                if m and line[m.end():].startswith("tt.load "):
                    cur["loads"].append((m.group(1), _where(line, locs)))
        if " scf.for " in line and line.rstrip().endswith("{"):
            loops.append({"line": no, "async": 0, "loads": [], "body": [], "yield": None, "waiting": []})
            stack.append((len(loops) - 1, depth))
        depth += line.count("{") - line.count("}")
        while stack and depth <= stack[-1][1]:
            stack.pop()
    out = []
    for loop in loops:
        sync, prefetch = [], []
        for name, where in loop["loads"]:
            uses = [ln for ln in loop["body"] if _uses(name, ln)]
            carried_only = bool(uses) and all(ln is loop["yield"] for ln in uses)
            (prefetch if carried_only else sync).append(where)
        out.append({"line": loop["line"], "async": loop["async"], "sync": sync, "prefetch": prefetch,
                    "waiting_copies": loop["waiting"]})
    return out


def main(argv: Sequence[str] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=sorted(KERNELS))
    ap.add_argument("--no-mask", action="store_true", help="no key mask (HAS_MASK 0)")
    ap.add_argument("--bias", type=int, default=3, choices=(0, 1, 3), help="HAS_BIAS (3: the padded-rows copy)")
    ap.add_argument("--in-range", action="store_true", help="tiles in range (EVEN_M / EVEN_N: tile-multiple lengths)")
    ap.add_argument("--block", type=int, nargs=2, default=(64, 64), metavar=("M", "N"))
    ap.add_argument("--d", type=int, default=32, help="head width")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dump", help="write the TTGIR to this file")
    args = ap.parse_args(argv)
    consts = constexprs(args.kernel, not args.no_mask, args.bias, args.in_range, *args.block, args.d)
    ttgir = compile_ttgir(args.kernel, consts, args.arch, args.warps, args.stages)
    if args.dump:
        with open(args.dump, "w") as fh:
            fh.write(ttgir)
    print(f"{args.kernel} sm_{args.arch} {consts}")
    for loop in loop_loads(ttgir):
        print(f"loop at TTGIR line {loop['line']}: {loop['async']} asynchronous copies; "
              f"{len(loop['sync'])} loads waited on in their iteration" +
              (f" ({', '.join(loop['sync'])})" if loop["sync"] else "") +
              f"; {len(loop['prefetch'])} register prefetches" +
              (f" ({', '.join(loop['prefetch'])})" if loop["prefetch"] else "") +
              f"; {len(loop['waiting_copies'])} copies predicated on a synchronous load" +
              (f" ({', '.join(loop['waiting_copies'])})" if loop["waiting_copies"] else ""))


if __name__ == "__main__":
    main()
