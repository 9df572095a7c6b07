"""Memory-bounded inference benchmark: per-block time and extra peak memory, and the longest N of whole stacks.

1. One PairformerBlock forward (bf16 weights and inputs, no_grad, eval, triton backend) at N = 1024, 2048, 4096, ...
   (until out of memory or the time cap): the memory-bounded path (``forward_inference``, planned from the free
   memory; and ``inplace=True``), today's path with ``chunk_size=128``, and Boltz-2's ``PairformerLayer`` (bf16
   autocast, fp32 weights as Boltz runs; cuequivariance kernels if they import, triangle-attention chunk 128) in
   the same process. Extra peak = ``max_memory_allocated`` during one forward minus the allocation before it
   (parameters, inputs); the output counts, as it is new memory.
2. A 48-block PairformerStack (random weights) forward at ``--stack-n`` (8192), then its longest N with z on the
   device and with ``offload`` (z passed in pageable host memory; the stack keeps one host copy, pinned when its
   power-of-two block fits): the plan's estimate (device and host memory) proposes an N, probes (the 48 blocks'
   parameters resident, ``--probe-blocks`` of them run: the in-place path's peak is the same for every block)
   walk it up or down by ``--step`` until an N that runs sits below one that does not. A probe the plan refuses
   ("does not fit", no run) or that runs out of device or host (pinned) memory ("OOM", with the reason) counts as
   not fitting; refusals cost no probe of ``--max-probes``.
3. An EvoformerStack (AF2 widths, 512 sequences) at N=4096: ``--evo-blocks`` blocks, time per block (run before
   the stack section, whose probes take what time is left).

Writes ``memory.csv`` and ``memory.md`` to ``--out`` row by row. Under 9 minutes on an H100 with the defaults
(``--time-limit`` stops starting new items). Boltz-2 / cuequivariance install as in scripts/bench_blocks.py:

    mkdir -p .site_blocks && python3 -m pip install -q --upgrade --no-index --no-deps --target .site_blocks \\
        .peers/*.whl && tar xJf .peers/cue.tar.xz -C .site_blocks
    PYTHONPATH=$PWD/.site_blocks python scripts/bench_memory.py --out $OUT
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attn_zoo.models import inference  # noqa: E402
from attn_zoo.models.evoformer import EvoformerStack  # noqa: E402
from attn_zoo.models.pairformer import PairformerBlock, PairformerStack  # noqa: E402

GIB = 2.0 ** 30
PADDED = 13  # padded residues at the end of every sequence
FIELDS = ["section", "impl", "n", "n_seq", "blocks_run", "ms", "ms_per_block", "extra_gib", "extra_over_z",
          "peak_gib", "z_gib", "chunk", "status", "note"]


class Bench:
    def __init__(self, args):
        self.args = args
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.t0 = time.time()
        self.rows = []
        os.makedirs(args.out, exist_ok=True)
        self.csv_path = os.path.join(args.out, "memory.csv")
        with open(self.csv_path, "w", newline="") as f:
            csv.DictWriter(f, FIELDS).writeheader()
        self.widths = TINY if args.tiny else FULL

    # -- bookkeeping ------------------------------------------------------------------------------
    def left(self) -> float:
        return self.args.time_limit - (time.time() - self.t0)

    def add(self, **row):
        row = {k: ("" if row.get(k) is None else row.get(k, "")) for k in FIELDS}
        for k in ("ms", "ms_per_block", "extra_gib", "extra_over_z", "peak_gib", "z_gib"):
            if isinstance(row[k], float):
                row[k] = round(row[k], 3 if k != "ms" else 1)
        self.rows.append(row)
        with open(self.csv_path, "a", newline="") as f:
            csv.DictWriter(f, FIELDS).writerow(row)
        print(" | ".join(f"{k}={v}" for k, v in row.items() if v != ""), flush=True)
        self.write_markdown()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def free(self):
        """Release cached device memory and cached pinned host blocks (torch keeps freed pinned blocks page-locked:
        a 64 GiB block from one probe would be reused or stay locked for the next)."""
        import gc

        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(
                torch._C, "_host_emptyCache", None)
            if empty_host is not None:
                empty_host()

    def measure(self, fn, iters: int, warmup: int = 1):
        """(median ms, extra peak bytes beyond what is allocated before the call, absolute peak bytes)."""
        for _ in range(warmup):
            out = fn()
            del out
        self.sync()
        extra = peak = None
        if self.cuda:
            self.free()
            base = torch.cuda.memory_allocated(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
        out = fn()
        self.sync()
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.dev)
            extra = peak - base
        del out
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            out = fn()
            self.sync()
            times.append((time.perf_counter() - t) * 1e3)
            del out
        return statistics.median(times) if times else float("nan"), extra, peak

    # -- inputs -----------------------------------------------------------------------------------
    def masks(self, n):
        real = torch.arange(n, device=self.dev) < n - min(PADDED, n // 4)
        single = real[None].clone()  # [1, N]
        return single, single[:, :, None] & single[:, None, :]

    def pair_inputs(self, n, dtype=torch.bfloat16, z_device=None):
        w = self.widths
        g = torch.Generator(device=self.dev).manual_seed(0)
        s = torch.randn(1, n, w["c_s"], device=self.dev, generator=g).to(dtype)
        z = torch.empty(1, n, n, w["c_z"], device=self.dev, dtype=dtype)
        for i in range(0, n, 256):  # by rows: no fp32 [N, N, c_z] temporary
            z[:, i:i + 256].normal_(generator=g)
        if z_device is not None and z_device.type == "cpu":
            # pageable, exactly z's bytes: a pinned input would take a power-of-two block (64 GiB for a 36 GiB z)
            # besides the stack's own host copy
            host = torch.empty(z.shape, dtype=dtype)
            host.copy_(z)
            del z
            z = host
        return s, z

    def z_bytes(self, n, dtype=torch.bfloat16):
        return n * n * self.widths["c_z"] * torch.empty((), dtype=dtype).element_size()

    # -- 1. blocks --------------------------------------------------------------------------------
    def pairformer_block(self):
        w = self.widths
        blk = PairformerBlock(c_s=w["c_s"], c_z=w["c_z"], num_heads_single=w["heads_s"], num_heads_pair=w["heads_z"],
                              c_hidden_pair=w["c_pair"], c_hidden_mul=w["c_z"], attention=self.args.backend)
        return randomize(blk).to(self.dev, torch.bfloat16).eval()

    def boltz_layer(self):
        from boltz.model.layers.pairformer import PairformerLayer

        w = self.widths
        mod = PairformerLayer(w["c_s"], w["c_z"], num_heads=w["heads_s"], dropout=0.25, pairwise_head_width=w["c_pair"],
                              pairwise_num_heads=w["heads_z"], v2=True)
        use_kernels = False
        try:
            import cuequivariance_torch  # noqa: F401

            use_kernels = self.cuda
        except ImportError:
            pass
        return randomize(mod).to(self.dev).eval(), use_kernels

    def blocks(self):
        impls = ["bounded", "bounded-inplace", "plain-chunk128", "boltz"]
        dead = set()
        blk = self.pairformer_block()
        boltz = boltz_err = None
        try:
            boltz = self.boltz_layer()
        except Exception as exc:  # noqa: BLE001 - any import / build failure skips the Boltz rows, with the reason
            boltz_err = f"{type(exc).__name__}: {exc}"
        last_ms = {}
        for n in self.args.block_n:
            for impl in impls:
                row = dict(section="block", impl=impl, n=n, blocks_run=1, z_gib=self.z_bytes(n) / GIB)
                if impl in dead:
                    continue
                if impl == "boltz" and boltz is None:
                    if n == self.args.block_n[0]:
                        self.add(**row, status="skipped", note=boltz_err)
                    continue
                # predicted time from the last N (triangle ops grow as N^3): skip what cannot finish
                pred = last_ms.get(impl, 0.0) * (n / last_ms.get(impl + "_n", n)) ** 3 / 1e3 * (self.args.iters + 2)
                if pred > self.left() or self.left() < 0:
                    self.add(**row, status="skipped", note=f"time cap (about {pred:.0f} s needed)")
                    continue
                s, z = None, None
                try:
                    s, z = self.pair_inputs(n)
                    single, pair = self.masks(n)
                    chunk = ""
                    if impl.startswith("bounded"):
                        inplace = impl.endswith("inplace")
                        plan = inference.plan_inference(inference.Dims.of(blk), n,
                                                        inference.free_device_memory(self.dev), inplace=inplace)
                        chunk = plan.chunk_size
                        fn = lambda: blk.forward_inference(s, z, single, pair, inplace=inplace,  # noqa: E731
                                                           mode="bounded")
                    elif impl == "plain-chunk128":
                        fn = lambda: blk(s, z, single, pair, chunk_size=128)  # noqa: E731
                        chunk = 128
                    else:
                        mod, use_kernels = boltz
                        sf, pf = single.float(), pair.float()
                        # Boltz keeps s in fp32; z stays bf16 under autocast (fp32 on the CPU: no autocast here)
                        s, z = s.float(), (z if self.cuda else z.float())

                        def fn():
                            with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.cuda):
                                return mod(s, z, sf, pf, chunk_size_tri_attn=128, use_kernels=use_kernels)
                        row["note"] = "cuequivariance kernels" if use_kernels else "no kernels (cuequivariance missing)"
                        chunk = 128
                    with torch.no_grad():
                        ms, extra, peak = self.measure(fn, self.args.iters if n <= 4096 else 1)
                    last_ms[impl], last_ms[impl + "_n"] = ms, n
                    self.add(**row, ms=ms, ms_per_block=ms, chunk=chunk, status="ok",
                             extra_gib=None if extra is None else extra / GIB,
                             extra_over_z=None if extra is None else extra / self.z_bytes(n),
                             peak_gib=None if peak is None else peak / GIB)
                except torch.cuda.OutOfMemoryError:
                    dead.add(impl)
                    self.add(**row, status="OOM")
                except ValueError as exc:  # the plan says it does not fit
                    dead.add(impl)
                    self.add(**row, status="does not fit", note=str(exc)[:200])
                except RuntimeError as exc:
                    dead.add(impl)
                    self.add(**row, status="error", note=f"{type(exc).__name__}: {str(exc)[:160]}")
                finally:
                    del s, z
                    fn = None  # noqa: F841
                    self.free()
        del blk, boltz
        self.free()

    # -- 2. the 48-block stack ---------------------------------------------------------------------
    def plan(self, stack, n, offload):
        """The plan run_stack makes (95% of the free device memory; with offload 95% of the available host memory
        less the probe's own input z, which waits on the host): raises ValueError when N does not fit."""
        free = inference.free_device_memory(self.dev)
        host = inference.available_host_memory() if offload else None
        host_budget = None if host is None else max(1, int(0.95 * (host - self.z_bytes(n))))
        return stack.plan_inference(n, None if free is None else int(0.95 * free), offload=offload,
                                    host_budget=host_budget, z_on_host=True, pin=self.cuda)

    def stack_forward(self, stack, n, offload, blocks_run):
        """Run ``blocks_run`` of the stack's blocks (all of them resident) on fresh inputs at ``n``."""
        plan = self.plan(stack, n, offload)  # before the inputs: a refusal costs nothing
        s, z = self.pair_inputs(n, z_device=torch.device("cpu") if offload else None)
        single, _ = self.masks(n)
        all_blocks = stack.blocks
        stack.blocks = torch.nn.ModuleList(list(all_blocks)[:blocks_run])
        stack.configure_inference(offload=offload, mode="bounded")
        try:
            self.sync()
            if self.cuda:
                base = torch.cuda.memory_allocated(self.dev)
                torch.cuda.reset_peak_memory_stats(self.dev)
            t = time.perf_counter()
            with torch.no_grad():
                out = stack(s, z, single)
            self.sync()
            ms = (time.perf_counter() - t) * 1e3
            extra = peak = None
            if self.cuda:
                peak = torch.cuda.max_memory_allocated(self.dev)
                extra = peak - base
            del out
            return ms, extra, peak, plan
        finally:
            stack.blocks = all_blocks
            del s, z
            self.free()

    def stack_row(self, stack, n, offload, blocks_run, impl):
        """One probe row; returns (status, ms per block): status "ok", "does not fit" (the plan refused, nothing
        ran), "OOM" (device or host memory ran out) or "error"."""
        row = dict(section="stack", impl=impl, n=n, blocks_run=f"{blocks_run} of {len(stack.blocks)}",
                   z_gib=self.z_bytes(n) / GIB)
        try:
            ms, extra, peak, plan = self.stack_forward(stack, n, offload, blocks_run)
            note = ""
            if offload:
                note = (f"z on the host between blocks: one {'pinned' if plan.pinned else 'pageable'} copy, "
                        f"{plan.estimate.host / GIB:.1f} GiB")
            self.add(**row, ms=ms, ms_per_block=ms / blocks_run, chunk=plan.chunk_size, status="ok",
                     extra_gib=None if extra is None else extra / GIB,
                     extra_over_z=None if extra is None else extra / self.z_bytes(n),
                     peak_gib=None if peak is None else peak / GIB, note=note)
            return "ok", ms / blocks_run
        except Exception as exc:  # classified below; anything else is re-raised
            status, note = classify_failure(exc)
            if status is None:
                raise
            self.add(**row, status=status, note=note)
        finally:
            self.free()
        return status, None

    def predicted_longest(self, stack, offload):
        """Largest multiple of --step whose planned device peak fits the device (parameters included) and, with
        offload, whose host copy of z fits the available host memory besides the probe's input z."""
        if not self.cuda:
            return self.args.stack_n
        total = torch.cuda.get_device_properties(self.dev).total_memory
        params = sum(p.numel() * p.element_size() for p in stack.parameters())
        avail = total - params - 2 * GIB  # the CUDA context and allocator slack
        host = inference.available_host_memory() if offload else None
        n = self.args.step
        while True:
            m = n + self.args.step
            host_budget = None if host is None else max(1, int(0.95 * (host - self.z_bytes(m))))
            try:
                plan = stack.plan_inference(m, avail, offload=offload, host_budget=host_budget, pin=True)
            except ValueError:
                return n
            if plan.estimate.peak > avail:
                return n
            n = m

    def longest(self, stack, offload, name, per_block):
        """Walk from the predicted N by --step: up while probes run, down while they do not, until an N that ran
        sits just below one that did not (or the probe limit / time cap stops it: then a bound, said so)."""
        step = self.args.step
        n = self.predicted_longest(stack, offload)
        last_ok = None
        fail_n, fail_why = None, ""  # the smallest N that failed
        probes, stop = 0, ""
        while True:
            if n <= 0:
                stop = "reached N=0"
                break
            if probes >= self.args.max_probes:
                stop = f"probe limit ({self.args.max_probes})"
                break
            pb = per_block.get(n) or max(per_block.values(), default=0.0) * 2
            if self.left() < pb * self.args.probe_blocks / 1e3 * 1.5 + 5:
                self.add(section="stack", impl=name, n=n, status="skipped", note="time cap")
                stop = "time cap"
                break
            status, ms = self.stack_row(stack, n, offload, self.args.probe_blocks, name + " (probe)")
            if status != "does not fit":  # the plan's refusals run nothing
                probes += 1
            if status == "ok":
                per_block[n] = ms
                last_ok = n
                if fail_n is not None and fail_n <= n + step:
                    break
                n += step
            else:
                row = self.rows[-1]
                fail_n, fail_why = n, f"{status}: {row['note']}"[:120]
                if last_ok is not None:
                    break
                n -= step
        if last_ok is not None and fail_n == last_ok + step:
            status, note = "result", f"longest N that ran; N={fail_n} did not ({fail_why})"
        elif last_ok is not None:
            status, note = "result", f"a lower bound: {stop} before a failure above it"
        else:
            status, note = "none fits", (f"no probe ran ({stop})" + (f"; last failure N={fail_n} ({fail_why})"
                                                                      if fail_n else ""))
        self.add(section="stack", impl=name, n=last_ok or "", status=status,
                 note=f"{note} (step {step}; all blocks' parameters resident)")

    def stack(self):
        w = self.widths
        stack = PairformerStack(c_s=w["c_s"], c_z=w["c_z"], num_blocks=self.args.stack_blocks,
                                num_heads_single=w["heads_s"], num_heads_pair=w["heads_z"], c_hidden_pair=w["c_pair"],
                                c_hidden_mul=w["c_z"], attention=self.args.backend)
        stack = randomize(stack, gain=0.5).to(self.dev, torch.bfloat16).eval()
        per_block = {}
        # a probe block first: its time decides whether the whole stack can run within the cap
        n = self.args.stack_n
        if self.left() > 0:
            try:  # compile and tuning at this N happen here, not in the timed probe the decision rests on
                self.stack_forward(stack, n, False, 1)
            except (torch.cuda.OutOfMemoryError, ValueError, RuntimeError):
                self.free()  # the probe below reports it
            status, ms = self.stack_row(stack, n, False, self.args.probe_blocks, "stack probe")
            ok = status == "ok"
            if ok:  # a failed probe leaves no time (None would break the time predictions below)
                per_block[n] = ms
            if ok and per_block[n] * self.args.stack_blocks / 1e3 < self.left() - self.args.reserve_s:
                self.stack_row(stack, n, False, self.args.stack_blocks, f"stack {self.args.stack_blocks} blocks")
            elif ok:
                self.add(section="stack", impl=f"stack {self.args.stack_blocks} blocks", n=n, status="skipped",
                         note=f"time cap: about {per_block[n] * self.args.stack_blocks / 1e3:.0f} s needed")
        for offload in (False, True):
            name = "longest N, offload" if offload else "longest N, z on device"
            self.longest(stack, offload, name, per_block)
        del stack
        self.free()

    # -- 3. Evoformer stack -------------------------------------------------------------------------
    def evoformer(self):
        w = self.widths
        n, S = self.args.evo_n, self.args.evo_seq
        row = dict(section="evoformer", impl="EvoformerStack AF2 widths", n=n, n_seq=S,
                   blocks_run=f"{self.args.evo_blocks} of 48", z_gib=self.z_bytes(n) / GIB)
        if self.left() < 30:
            self.add(**row, status="skipped", note="time cap")
            return
        stack = EvoformerStack(c_m=w["c_m"], c_z=w["c_z"], num_blocks=48, attention=self.args.backend,
                               num_heads_pair=w["heads_z"], c_hidden_pair=w["c_pair"], c_hidden_mul=w["c_z"])
        stack = randomize(stack, gain=0.5).to(self.dev, torch.bfloat16).eval().configure_inference(mode="bounded")
        stack.blocks = torch.nn.ModuleList(list(stack.blocks)[: self.args.evo_blocks])
        try:
            g = torch.Generator(device=self.dev).manual_seed(1)
            m = torch.randn(1, S, n, w["c_m"], device=self.dev, generator=g).bfloat16()
            _, z = self.pair_inputs(n)
            msa_mask = torch.rand(1, S, n, device=self.dev, generator=g) > 0.1
            _, pair = self.masks(n)
            self.sync()
            if self.cuda:
                base = torch.cuda.memory_allocated(self.dev)
                torch.cuda.reset_peak_memory_stats(self.dev)
            t = time.perf_counter()
            with torch.no_grad():
                out = stack(m, z, msa_mask, pair)
            self.sync()
            ms = (time.perf_counter() - t) * 1e3
            extra = None if not self.cuda else torch.cuda.max_memory_allocated(self.dev) - base
            plan = stack.plan_inference(n, inference.free_device_memory(self.dev), n_seq=S)
            del out
            self.add(**row, ms=ms, ms_per_block=ms / self.args.evo_blocks, status="ok",
                     chunk=f"{plan.chunk_size}/{plan.msa_chunk_size}",
                     extra_gib=None if extra is None else extra / GIB,
                     extra_over_z=None if extra is None else extra / self.z_bytes(n),
                     peak_gib=None if not self.cuda else torch.cuda.max_memory_allocated(self.dev) / GIB,
                     note="first block includes kernel tuning" if self.args.evo_blocks == 1 else "")
        except torch.cuda.OutOfMemoryError:
            self.add(**row, status="OOM")
        except ValueError as exc:
            self.add(**row, status="does not fit", note=str(exc)[:200])
        del stack
        self.free()

    # -- output -----------------------------------------------------------------------------------
    def write_markdown(self):
        with open(os.path.join(self.args.out, "memory.md"), "w") as f:
            f.write("# Memory-bounded inference (scripts/bench_memory.py)\n\n" + "\n".join(env_lines(self)) + "\n\n")
            f.write("| section | impl | N | blocks run | ms | ms / block | extra GiB | extra / z | peak GiB | z GiB | "
                    "chunk | status | note |\n" + "|---" * 13 + "|\n")
            for r in self.rows:
                f.write("| " + " | ".join(str(r[k]) for k in FIELDS if k != "n_seq") + " |\n")


def classify_failure(exc):
    """(status, note) of a probe's exception: the plan's refusal ("does not fit"), running out of device memory in
    torch's allocator or of memory outside it, e.g. cudaHostAlloc for pinned host memory ("OOM"), another
    RuntimeError ("error"); (None, None) for anything else (a bug: re-raised)."""
    msg = str(exc).splitlines()[0] if str(exc) else ""
    if isinstance(exc, ValueError):
        return "does not fit", str(exc)[:200]
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "OOM", f"device (torch's allocator): {msg[:160]}"
    if isinstance(exc, RuntimeError):  # torch.AcceleratorError is one
        if "out of memory" in str(exc).lower() or "cudaErrorMemoryAllocation" in str(exc):
            frames = traceback.extract_tb(exc.__traceback__)
            last = frames[-1] if frames else None
            where = f" at {os.path.basename(last.filename)}:{last.lineno} {last.name}" if last else ""
            return "OOM", (f"CUDA runtime out of memory outside torch's device allocator (pinned host memory, "
                           f"cudaHostAlloc, or a library's device allocation){where}: {type(exc).__name__}: "
                           f"{msg[:80]}")
        return "error", f"{type(exc).__name__}: {msg[:160]}"
    return None, None


FULL = dict(c_s=384, c_z=128, heads_s=16, heads_z=4, c_pair=32, c_m=256)
TINY = dict(c_s=32, c_z=16, heads_s=2, heads_z=2, c_pair=16, c_m=16)


def randomize(mod, gain=1.0):
    """AF2's zero-init final layers would make every update 0; random weights make each module do its work."""
    with torch.no_grad():
        for p in mod.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, gain * p.shape[-1] ** -0.5)
    return mod


def env_lines(bench):
    import triton

    lines = [f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M')}"]
    if bench.cuda:
        props = torch.cuda.get_device_properties(bench.dev)
        lines.append(f"- GPU: {props.name}, {props.total_memory / GIB:.0f} GiB")
    lines += [
        f"- torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, "
        f"python {platform.python_version()}; attention backend {bench.args.backend}",
        "- forward only, torch.no_grad, eval; ours: bf16 weights and inputs; Boltz-2: fp32 weights, bf16 autocast;",
        f"  {PADDED} padded residues; extra = peak allocated during the call minus the allocation before it",
        "  (params, inputs); z = N*N*c_z*2 bytes; ms = median of --iters forwards (stack rows: one forward).",
    ]
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="triton")
    p.add_argument("--block-n", type=int, nargs="+", default=[1024, 2048, 4096, 6144, 8192])
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--stack-n", type=int, default=8192)
    p.add_argument("--stack-blocks", type=int, default=48)
    p.add_argument("--probe-blocks", type=int, default=1)
    p.add_argument("--step", type=int, default=512)
    p.add_argument("--max-probes", type=int, default=4)
    p.add_argument("--evo-n", type=int, default=4096)
    p.add_argument("--evo-seq", type=int, default=512)
    p.add_argument("--evo-blocks", type=int, default=2)
    p.add_argument("--sections", nargs="+", default=["blocks", "evoformer", "stack"],
                   choices=["blocks", "stack", "evoformer"])
    p.add_argument("--time-limit", type=float, default=470.0, help="start nothing new after this many s")
    p.add_argument("--reserve-s", type=float, default=90.0,
                   help="time kept for the longest-N probes when deciding on the 48-block run")
    p.add_argument("--tiny", action="store_true", help="small widths (a smoke run, e.g. on the CPU)")
    args = p.parse_args(argv)
    bench = Bench(args)
    for section in args.sections:
        try:
            getattr(bench, {"blocks": "blocks", "stack": "stack", "evoformer": "evoformer"}[section])()
        except Exception:  # noqa: BLE001 - one failing section must not lose the others' rows
            traceback.print_exc()
            bench.add(section=section, status="error", note=traceback.format_exc().splitlines()[-1][:200])
    print(f"wrote {bench.csv_path} and memory.md in {time.time() - bench.t0:.0f} s")
    return bench


if __name__ == "__main__":
    main()
