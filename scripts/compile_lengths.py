"""Train compiled blocks through a sequence of protein lengths and report every step (CUDA, bf16 autocast).

    python scripts/compile_lengths.py --model pairformer --modes default,dynamic,reduce-overhead
    python scripts/compile_lengths.py --model esm2 --lengths 447:21,768,300:13 --modes reduce-overhead

A crop-based training run meets a new length at almost every step; the compiler recompiles once with symbolic
sizes and must then serve every later length from that graph. Each mode is one compile of a fresh model with
``attn_zoo.models.compiling.compile_module`` (``--plain``: ``torch.compile`` itself; ``default``: no keywords;
``dynamic``: ``dynamic=True``; ``reduce-overhead``: CUDA graphs) trained
with AdamW through ``--lengths`` (``N:P`` = length N whose last P positions are padding). Prints one markdown row per
step: the first call's wall time (compiles included) and the median of ``--reps`` more steps at that length.
Exits non-zero if any mode failed. Needs torch, triton and einops only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

DEFAULT_LENGTHS = "447:21,768,300:13,512,1024,257"
MODES = {"default": {}, "dynamic": {"dynamic": True}, "reduce-overhead": {"mode": "reduce-overhead"}}


def parse_lengths(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        n, _, pad = item.partition(":")
        n, pad = int(n), int(pad or 0)
        if n < 1 or not 0 <= pad < n:
            raise ValueError(f"--lengths item {item!r}: need N >= 1 and 0 <= padding < N")
        out.append((n, pad))
    return out


def build(name: str, attention: str, device: str):
    """(model, step_inputs(n, pad) -> args, loss(outputs, args) -> scalar)."""
    from attn_zoo.models.esm2 import ESM2
    from attn_zoo.models.evoformer import EvoformerBlock
    from attn_zoo.models.pairformer import PairformerBlock
    from attn_zoo.models.transformer import TransformerLM

    def real(n, pad, b=1):
        m = torch.ones(b, n, dtype=torch.bool, device=device)
        if pad:
            m[:, n - pad:] = False
        return m

    if name == "pairformer":  # AF3 widths
        model = PairformerBlock(attention=attention)

        def inputs(n, pad):
            m = real(n, pad)
            return (torch.randn(1, n, 384, device=device), torch.randn(1, n, n, 128, device=device), m,
                    m[:, :, None] & m[:, None, :])
        return model, inputs, lambda out, args: out[0].float().square().mean() + out[1].float().square().mean()
    if name == "evoformer":  # AF2 widths, 128 sequences
        model = EvoformerBlock(attention=attention)

        def inputs(n, pad):
            m = real(n, pad)
            return (torch.randn(1, 128, n, 256, device=device), torch.randn(1, n, n, 128, device=device),
                    m[:, None, :].expand(1, 128, n), m[:, :, None] & m[:, None, :])
        return model, inputs, lambda out, args: out[0].float().square().mean() + out[1].float().square().mean()
    if name == "transformer":  # a bidirectional 8-layer LM, 2 rows, the second one padded
        model = TransformerLM(33, 512, 8, 8, causal=False, attention=attention)

        def inputs(n, pad):
            m = real(n, 0, 2)
            m[1, n - max(pad, 1):] = False
            return torch.randint(0, 33, (2, n), device=device), m
        return model, inputs, lambda out, args: torch.nn.functional.cross_entropy(
            out.float().flatten(0, 1), args[0].flatten())
    if name == "esm2":  # ESM-2 150M widths, 4 rows, one half padding, a masked-LM loss
        model = ESM2(num_layers=30, embed_dim=640, attention_heads=20, attention=attention)

        def inputs(n, pad):
            tok = torch.randint(4, 24, (4, n), device=device)
            tok[:, 0], tok[:, -1] = model.cls_idx, model.eos_idx
            tok[1, n // 2:] = model.padding_idx
            return (tok,)
        return model, inputs, lambda out, args: torch.nn.functional.cross_entropy(
            out["logits"].float().flatten(0, 1), args[0].flatten(), ignore_index=model.padding_idx)
    raise ValueError(f"--model must be pairformer, evoformer, transformer or esm2, got {name!r}")


def run_mode(name: str, mode: str, lengths, attention: str, reps: int, options: dict, plain: bool) -> bool:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs, loss_fn = build(name, attention, "cuda")
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if plain:  # torch.compile as a user would call it, without the blocks' Inductor setting
        compiled = torch.compile(model, **MODES[mode], **({"options": options} if options else {}))
    else:
        from attn_zoo.models.compiling import compile_module
        compiled = compile_module(model, **MODES[mode], options=options)

    def step(args):
        with torch.autocast("cuda", torch.bfloat16):
            loss = loss_fn(compiled(*args), args)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for n, pad in lengths:
        try:
            args = inputs(n, pad)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(args)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                step(args)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
        except Exception as e:  # report and go on with the next mode
            print(f"| {name} | {mode} | {n} ({pad} padded) | FAILED: {type(e).__name__}: {str(e)[:200]} | |",
                  flush=True)
            traceback.print_exc(limit=-8)
            return False
        print(f"| {name} | {mode} | {n} ({pad} padded) | {first:.1f} | {statistics.median(times):.2f} |", flush=True)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pairformer", help="pairformer, evoformer, transformer or esm2")
    p.add_argument("--modes", default="default,dynamic,reduce-overhead", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma list of N or N:padding (default %(default)s)")
    p.add_argument("--attention", default="triton", help="attention backend (default %(default)s)")
    p.add_argument("--reps", type=int, default=3, help="timed steps after the first at each length")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an Inductor option for torch.compile(options=...), e.g. triton.coalesce_tiling_analysis=0")
    p.add_argument("--plain", action="store_true",
                   help="plain torch.compile, not attn_zoo.models.compiling.compile_module (its Inductor setting)")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {list(MODES)}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    lengths = parse_lengths(a.lengths)
    options = {}
    for item in a.option:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--option {item!r}: expected KEY=VALUE")
        options[key] = {"0": False, "1": True, "false": False, "true": True}.get(value.lower(), value)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, attention {a.attention}, "
          f"{'plain torch.compile' if a.plain else 'compile_module'}, options {options}")
    print("| model | mode | N | first call (s) | step (ms) |\n|---|---|---|---|---|", flush=True)
    ok = [run_mode(a.model, m, lengths, a.attention, a.reps, options, a.plain) for m in modes]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
