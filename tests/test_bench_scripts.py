"""The GPU benchmark scripts' backend tables, checked on CPU: a typo there would otherwise only show up on
the GPU machine."""
import os
import sys

import pytest
import torch

from attn_ops import registry

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench_blocks  # noqa: E402


@pytest.mark.parametrize("name", [b for b in bench_blocks.BACKENDS if not b.startswith("boltz")])
def test_every_block_bench_backend_maps_to_a_registered_backend(name):
    config = bench_blocks.attention_config(name)
    assert config["backend"] in registry.valid_names(), (name, config)
    assert set(config) <= {"backend", "deterministic"}, config


def test_block_bench_backend_options():
    """``-atomic`` and flex (whose bias gradient uses atomics) opt out of determinism; ``+compile`` changes nothing
    in the attention config."""
    assert bench_blocks.attention_config("triton") == {"backend": "triton"}
    assert bench_blocks.attention_config("triton-atomic+compile") == {"backend": "triton", "deterministic": False}
    assert bench_blocks.attention_config("flex+compile") == {"backend": "flex", "deterministic": False}
    assert bench_blocks.attention_config("torch+compile") == {"backend": "torch"}


@pytest.mark.parametrize("argv, dynamic", [([], False), (["--compile-dynamic"], True)])
def test_compiled_block_rows_compile_for_one_length_unless_asked(monkeypatch, argv, dynamic):
    """A +compile row is compiled for its own length (dynamic=False, not torch.compile's default, which turns to
    symbolic lengths once the code has met a second length) unless --compile-dynamic asks for symbolic lengths;
    eager rows are not compiled at all."""
    import torch

    seen = []
    monkeypatch.setattr(torch, "compile", lambda mod, **kw: seen.append(kw) or mod)
    args = bench_blocks.parse_args(["--cases", "pair299"] + argv)
    assert args.compile_dynamic is dynamic
    bench_blocks.build_case("pair299", "triton+compile", torch.device("cpu"), args.compile_mode, args.compile_dynamic)
    assert seen == [{"mode": None, "dynamic": dynamic}]
    bench_blocks.build_case("pair299", "triton", torch.device("cpu"))
    assert len(seen) == 1


def test_graphed_block_rows_capture_once_with_uncached_autocast(monkeypatch):
    """A +graphs row hands the block and (copies of) its step's inputs to make_graphed_callables once, at the first
    step, inside an autocast that does not cache casts (which CUDA graphs need), and replays every step."""
    import torch
    from attn_zoo.models import graphs

    captured, replays = [], []

    def stand_in(mod, args, num_warmup_iters):
        captured.append((mod, args, torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled()))
        mod.forward = lambda *a: replays.append(a) or (a[0] * 1.0, a[1] * 1.0)
        return mod

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", stand_in)
    monkeypatch.setattr(graphs, "CAPTURE_DEVICES", ("cpu",))
    mod, x, fwd = bench_blocks.build_case("pair299", "triton+graphs", torch.device("cpu"))
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fwd()
        assert torch.equal(out[1], x[1])
        out[0].sum().backward()  # (a call before the previous one's backward would run the block itself)
    assert len(captured) == 1 and captured[0][0] is mod and captured[0][2] is False
    assert [tuple(a.shape) for a in captured[0][1]] == [(1, 299, 384), (1, 299, 299, 128), (1, 299), (1, 299, 299)]
    assert len(replays) == 3


def test_attention_bench_heads_last_inputs():
    """``--layout heads-last``: q, k, v are [B, R, H, L, D] views of [B, R, L, H, D] leaves (the blocks' layout); the
    step's gradients land on those leaves, and peers that cannot take the views are skipped, not failed."""
    import bench_attention

    B, R, H, L, D = 1, 3, 4, 5, 8
    q, k, v, bias, mask, leaves = bench_attention.bias_inputs(B, R, H, L, D, 2, heads_last=True, device="cpu")
    assert q.shape == (B, R, H, L, D) and q.stride()[2:] == (D, H * D, 1)
    assert all(t.is_leaf and t.requires_grad for t in leaves) and leaves[3] is bias
    assert leaves[0].shape == (B, R, L, H, D) and q._base is leaves[0]
    assert mask[..., -2:].any().item() is False and mask[..., :-2].all().item()
    q2, _, _, _, _, leaves2 = bench_attention.bias_inputs(B, R, H, L, D, 0, device="cpu")
    assert leaves2[0] is q2 and q2.is_contiguous()
    cases = {(be, skip is not None) for _, _, be, _, _, skip in bench_attention.bias_cases(
        ["MSA rows 1,512,8,384,32"], ["triton", "triton-atomic", "flex"], heads_last=True)}
    assert cases == {("triton", False), ("triton-atomic", False), ("flex", True)}


def test_attention_bench_heads_last_step_fills_leaf_grads(monkeypatch):
    """The bench's ``make`` for an attn_ops backend, run on a tiny shape on the CPU: the step's gradients reach the
    heads-last leaves (what ``do_bench(grad_to_none=...)`` resets)."""
    import functools

    import bench_attention

    monkeypatch.setitem(bench_attention.BIAS_SHAPES, "tiny", (1, 2, 2, 8, 16, 1))
    monkeypatch.setattr(bench_attention, "bias_inputs", functools.partial(bench_attention.bias_inputs, device="cpu"))
    for _, _, be, make, _, skip in bench_attention.bias_cases(["tiny"], ["torch", "chunked"], heads_last=True):
        assert skip is None
        run, leaves = make()
        out = run()
        out.float().sum().backward()
        assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves), be


def test_packed_bench_draws_rows_within_the_budget():
    """scripts/bench_packed.py: first-fit rows of log-normal lengths stay within the token budget, ids in order."""
    import bench_packed

    rows = bench_packed.draw_rows(2, 4096)
    assert all(sum(r) <= 4096 and all(16 <= n <= 1024 for n in r) for r in rows) and sum(map(len, rows)) >= 8
    ids = bench_packed.ids_of(rows[0], 4096, "cpu")
    assert ids[0] == 0 and ids[-1] == -1 and int(ids.max()) == len(rows[0]) - 1


# ------------------------------------------------------------------------------------------ crop set
def test_crop_set_arguments_and_shapes():
    """``--set crop`` picks its own peers and a time limit; its shapes are the N and D sweeps, each once,
    with the last ~10% of keys padded."""
    import bench_attention as ba

    args = ba.parse_args(["--set", "crop"])
    assert args.backends == list(ba.CROP_BACKENDS) and args.time_limit == ba.CROP_TIME_LIMIT
    assert "triton-nondet" in args.backends and "flex" in args.backends
    args = ba.parse_args(["--set", "crop", "--backends", "triton", "flex", "--time-limit", "60"])
    assert args.backends == ["triton", "flex"] and args.time_limit == 60
    args = ba.parse_args([])
    assert args.set == "all" and args.backends == ba.DEFAULT_BACKENDS and args.time_limit == float("inf")
    with pytest.raises(SystemExit):
        ba.parse_args(["--set", "crops"])
    shapes = ba.crop_shapes()
    assert len(shapes) == len(set(shapes)) == 16
    assert {n for n, d in shapes if d == 32} == {128, 200, 256, 300, 384, 512}
    assert {d for n, d in shapes if n == 300} == {d for n, d in shapes if n == 384} == {8, 16, 24, 32, 48, 64}
    assert [ba.crop_pad(n) for n in (128, 200, 300, 512)] == [13, 20, 30, 51]


def test_crop_case_runs_on_cpu(monkeypatch):
    """A crop case's ``make`` for attn_ops backends on a tiny shape on the CPU: the triangle layout, a padded key
    mask, and gradients into q, k, v and the shared bias; the torch and chunked results agree."""
    import functools

    import bench_attention as ba

    monkeypatch.setattr(ba, "bias_inputs", functools.partial(ba.bias_inputs, device="cpu"))
    outs = {}
    cases = list(ba.crop_cases([(10, 8)], ["torch", "chunked", "cuequivariance", "sdpa cudnn"]))
    assert [c[4] for c in cases] == ["torch", "chunked", "cuequivariance", "sdpa cudnn"]
    assert cases[3][6] is not None and all(c[6] is None for c in cases[:3])
    for shape, n, d, pad, be, make, skip in cases[:2]:
        assert (shape, n, d, pad) == ("N=10 D=8", 10, 8, 1)
        run, leaves = make()
        out = run()
        assert out.shape == (1, 10, ba.CROP_H, 10, 8)
        out.float().sum().backward()
        assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves), be
        assert leaves[3].shape == (1, 1, ba.CROP_H, 10, 10)
        assert leaves[3].grad[..., -1].abs().max().item() == 0  # the padded key gets no bias gradient
        outs[be] = out.float()
    assert (outs["torch"] - outs["chunked"]).abs().max().item() < 0.05


def _crop_rows():
    def row(n, d, be, ms, note=""):
        return dict(shape=f"N={n} D={d}", n=str(n), d=str(d), pad="1", backend=be, fwdbwd_ms=ms,
                    host_ms=("0.2" if ms else ""), first_s=("3.5" if ms else ""), note=note)
    return [row(256, 32, "triton", "0.6"), row(256, 32, "flex", "1.2"), row(256, 32, "cuequivariance", "0.5"),
            row(300, 8, "triton", "", "error: ValueError: head dim 8 outside [16, 256] | x"),
            row(300, 8, "flex", "2.0"), row(300, 8, "cuequivariance", "1.0"),
            row(384, 32, "triton", "0.9"), row(384, 32, "flex", "1.0")]


def test_crop_tables_one_value_per_cell(tmp_path):
    """The markdown pivot: a row per shape, a column per peer, one value (or the peer's reason) per cell; ratios
    and the target column from triton's time against flex and cuEquivariance (N=256 D=32 also against 0.7 ms)."""
    import bench_attention as ba

    rows = _crop_rows()
    lines = ba.crop_table(rows, "fwdbwd_ms")
    assert lines[0] == ("| shape | triton | flex | cuequivariance | triton / flex | triton / cuequivariance | "
                        "target met |")
    body = {ln.split(" | ")[0][2:]: [c.strip() for c in ln.strip("|").split(" | ")] for ln in lines[2:]}
    assert all(len(c) == 7 for c in body.values())
    assert body["N=256 D=32"][1:] == ["0.600", "1.200", "0.500", "0.50x", "1.20x", "**no**"]
    assert body["N=300 D=8"][1].startswith("error: ValueError: head dim 8") and "\\|" in body["N=300 D=8"][1]
    assert body["N=300 D=8"][4:] == ["", "", ""]
    assert body["N=384 D=32"][1:] == ["0.900", "1.000", "", "0.90x", "", "yes"]
    host = ba.crop_table(rows, "host_ms")
    assert host[0] == "| shape | triton | flex | cuequivariance |"
    assert host[3] == "| N=300 D=8 | - | 0.200 | 0.200 |"
    rows[0]["fwdbwd_ms"] = "0.8"  # faster than flex, but over the 0.7 ms target
    rows[2]["fwdbwd_ms"] = "0.9"
    assert ba.crop_table(rows, "fwdbwd_ms")[2].endswith("| **no** |")
    rows[0]["fwdbwd_ms"] = "0.65"
    assert ba.crop_table(rows, "fwdbwd_ms")[2].endswith("| yes |")
    path = tmp_path / "crop.md"
    ba.write_crop_md(rows, str(path), "env line")
    text = path.read_text()
    assert text.count("| shape | triton |") == 3 and "env line" in text and "perf_counter" in text


# ------------------------------------------------------------------------------------------ varlen run
def test_varlen_arguments_and_lengths():
    """``--varlen``: triton, flex and Boltz-2 + cuEquivariance by default, a time limit of its own, 40 distinct lengths
    in [180, 520] fixed by the seed."""
    args = bench_blocks.parse_args(["--varlen"])
    assert args.varlen and args.varlen_backends == ["triton", "flex", "boltz-cueq"]
    assert args.time_limit == bench_blocks.VARLEN_TIME_LIMIT and args.varlen_count == 40
    assert bench_blocks.parse_args([]).time_limit == 400.0 and not bench_blocks.parse_args([]).varlen
    args = bench_blocks.parse_args(["--varlen", "--varlen-backends", "triton", "--time-limit", "30",
                                    "--varlen-count", "5", "--varlen-seed", "3"])
    assert args.varlen_backends == ["triton"] and args.time_limit == 30 and args.varlen_count == 5
    for bad in (["--varlen", "--varlen-backends", "triton+compile"], ["--varlen", "--varlen-count", "0"],
                ["--varlen", "--varlen-count", "400"]):
        with pytest.raises(SystemExit):
            bench_blocks.parse_args(bad)
    lengths = bench_blocks.varlen_lengths(40, 0)
    assert len(set(lengths)) == 40 and all(180 <= n <= 520 for n in lengths)
    assert lengths == bench_blocks.varlen_lengths(40, 0) != bench_blocks.varlen_lengths(40, 1)
    for b in bench_blocks.VARLEN_CHOICES:
        if not b.startswith("boltz"):
            assert bench_blocks.attention_config(b)["backend"] in registry.valid_names(), b


def test_crop_table_flex_dynamic_is_a_ratio_not_a_target():
    """flex compiled for symbolic lengths gets a ratio column; the target stays against per-length flex and
    cuEquivariance (a slower flex-dynamic cannot make a row pass, a faster one cannot make it fail)."""
    import bench_attention as ba

    def row(be, ms):
        return dict(shape="N=384 D=32", n="384", d="32", pad="38", backend=be, fwdbwd_ms=ms, host_ms="0.2",
                    first_s="1.0", note="")

    for flex, dyn, met in (("0.8", "1.2", "**no**"), ("1.0", "0.5", "yes")):
        lines = ba.crop_table([row("triton", "0.9"), row("flex", flex), row("flex-dynamic", dyn)], "fwdbwd_ms")
        assert lines[0] == ("| shape | triton | flex | flex-dynamic | triton / flex | triton / cuequivariance | "
                            "triton / flex-dynamic | target met |")
        cells = [c.strip() for c in lines[2].strip("|").split(" | ")]
        assert cells[-2] == f"{0.9 / float(dyn):.2f}x" and cells[-1] == met
    assert "flex-dynamic" in ba.CROP_BACKENDS
    (_, _, _, _, be, _, skip), = ba.crop_cases([(384, 32)], ["flex-dynamic"])  # a bias peer: run, not skipped
    assert (be, skip) == ("flex-dynamic", None)


@pytest.mark.slow
def test_varlen_run_on_cpu_and_tables(tmp_path):
    """The varlen rows of the torch-backend block at tiny sizes on the CPU: three steps per length, first and steady
    times, their ratio and the compile + tune share; the time limit skips lengths; the tables have one value per
    cell."""
    import torch

    lengths = [15, 20, 17, 22]
    rows = bench_blocks.varlen_run("torch", lengths, torch.device("cpu"), 1e9, c_s=32, c_z=16, log=lambda *a: None)
    assert [r["n"] for r in rows] == lengths and [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:  # (a full garbage collection may fall into a first step: the note names it)
        assert (r["note"] == "" or r["note"].startswith("first step: full gc ")) and r["steady_ms"] > 0
        assert r["ratio"] == pytest.approx(r["first_ms"] / r["steady_ms"])
        assert r["overhead_s"] == pytest.approx((r["first_ms"] - r["steady_ms"]) / 1e3)
    skipped = bench_blocks.varlen_run("torch", lengths, torch.device("cpu"), -1.0, c_s=32, c_z=16,
                                      log=lambda *a: None)
    assert [r["note"] for r in skipped] == ["skipped: time limit"] * 4
    with pytest.raises(ValueError, match="repeats"):
        bench_blocks.varlen_run("torch", lengths, torch.device("cpu"), 1e9, repeats=1)

    def row(be, i, first, steady, note=""):
        return dict(backend=be, step=i, n=lengths[i], first_ms=first, steady_ms=steady,
                    ratio=first / steady if steady else "", overhead_s=(first - steady) / 1e3 if steady else "",
                    note=note)
    fake = [row("triton", 0, 40000.0, 20.0), row("triton", 1, 30.0, 20.0), row("triton", 2, 25.0, 20.0),
            row("triton", 3, 32.0, 20.0),
            row("flex", 0, 9000.0, 30.0), row("flex", 1, 40.0, 30.0), row("flex", 2, 30.0, 30.0),
            dict(row("flex", 3, 0, 0), first_ms="", note="skipped: time limit")]
    summary = {s["backend"]: s for s in bench_blocks.varlen_summary(fake)}
    assert summary["triton"]["lengths"] == "4 / 4" and summary["triton"]["max_ratio"] == pytest.approx(1.6)
    assert summary["triton"]["over_target"] == 1
    assert summary["triton"]["compile_tune_s"] == pytest.approx((39980 + 10 + 5 + 12) / 1e3)
    assert summary["flex"]["lengths"] == "3 / 4" and summary["flex"]["max_ratio"] == ""
    path = tmp_path / "varlen.md"
    bench_blocks.write_varlen_markdown(str(path), fake, ["- env"], lengths)
    lines = path.read_text().splitlines()
    table = [ln for ln in lines if ln.startswith("| triton |")]
    assert table == ["| triton | 4 / 4 | 20.0 | 1.60 | 1 | 40.0 | **no** |"]
    steps = [ln for ln in lines if ln.startswith("| 3 | 22 |")]
    assert steps == ["| 3 | 22 | 32.0 | 20.0 | 1.60 | skipped: time limit | - | - |"]


@pytest.mark.slow
def test_varlen_length_multiple_and_warmup_on_cpu(tmp_path):
    """``--varlen-multiple`` pads each length to a multiple (rows keep the length and name the padded width);
    ``--varlen-warmup`` first steps once through every padded length of the range, a step -1 row whose time counts
    in compile + tune, and the tables say so."""
    import torch

    lengths = [15, 20, 17]
    rows = bench_blocks.varlen_run("torch", lengths, torch.device("cpu"), 1e9, c_s=32, c_z=16, log=lambda *a: None,
                                   multiple=8, warmup=(15, 22))
    warm, timed = rows[0], rows[1:]
    assert warm["step"] == -1 and warm["n"] == "16-24" and warm["note"].startswith("warm-up: 2 lengths; s each: 16: ")
    assert warm["overhead_s"] > 0 and warm["ratio"] == ""
    assert [(r["n"], r["width"]) for r in timed] == [(15, 16), (20, 24), (17, 24)]
    assert {r["backend"] for r in rows} == {"torch /8 +warm-up"}
    (summary,) = bench_blocks.varlen_summary(rows)
    assert summary["lengths"] == "3 / 3"
    assert summary["compile_tune_s"] == pytest.approx(warm["overhead_s"] + sum(r["overhead_s"] for r in timed))
    path = tmp_path / "varlen.md"
    bench_blocks.write_varlen_markdown(str(path), rows, ["- env"], lengths, multiple=8)
    text = path.read_text()
    assert "padded to a multiple of 8" in text and "warm-up: 2 lengths; s each: 16: " in text
    assert "| 1 | 20 -> 24 |" in text
    args = bench_blocks.parse_args(["--varlen", "--varlen-multiple", "32", "--varlen-warmup"])
    assert args.varlen_multiple == 32 and args.varlen_warmup
    for bad in (["--varlen", "--varlen-multiple", "0"], ["--varlen", "--varlen-no-ahead"],
                ["--varlen", "--varlen-warmup", "--varlen-ahead-processes", "4"]):
        with pytest.raises(SystemExit):
            bench_blocks.parse_args(bad)


def test_varlen_names_full_collections(tmp_path, monkeypatch):
    """A full (generation 2) collection during a length's first step is named in its row's note and listed under
    the markdown table; other rows have no note."""
    import gc

    import torch

    real_step, calls = bench_blocks._varlen_step, []

    def step(*a, **kw):  # a full collection inside the first step of the second length
        calls.append(1)
        if len(calls) == 4:
            gc.collect()
        return real_step(*a, **kw)

    monkeypatch.setattr(bench_blocks, "_varlen_step", step)
    enabled = gc.isenabled()
    gc.disable()  # only the collection above
    try:
        rows = bench_blocks.varlen_run("torch", [9, 11], torch.device("cpu"), 1e9, c_s=32, c_z=16,
                                       log=lambda *a: None)
    finally:
        if enabled:
            gc.enable()
    assert rows[0]["note"] == "" and rows[1]["note"].startswith("first step: full gc ") and "ms" in rows[1]["note"]
    path = tmp_path / "varlen.md"
    bench_blocks.write_varlen_markdown(str(path), rows, ["- env"], [9, 11])
    assert "- step 1 (torch, first/steady " in path.read_text()


@pytest.mark.slow
def test_varlen_backends_run_in_fresh_processes(monkeypatch):
    """Each backend's varlen rows come from a worker process of its own (tagged JSON on stdout); a worker that
    fails (here: no CUDA device) becomes an error naming its last stderr line."""
    import subprocess
    import types

    args = bench_blocks.parse_args(["--varlen", "--varlen-count", "3"])
    if not __import__("torch").cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            bench_blocks._varlen_in_subprocess("triton", args, [200, 300, 400], 5.0)
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        rows = [{"backend": cmd[cmd.index("--varlen-worker") + 1], "step": 0, "n": 200}]
        return types.SimpleNamespace(stdout="noise\n" + bench_blocks._WORKER_TAG + bench_blocks.json.dumps(rows),
                                     stderr="", returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert bench_blocks._varlen_in_subprocess("flex", args, [200], 7.0) == [{"backend": "flex", "step": 0, "n": 200}]
    assert seen[0][2:4] == ["--varlen-worker", "flex"] and "--time-limit" in seen[0]
    args = bench_blocks.parse_args(["--varlen", "--varlen-count", "3", "--varlen-multiple", "16", "--varlen-warmup"])
    bench_blocks._varlen_in_subprocess("triton", args, [200], 7.0)
    assert seen[1][seen[1].index("--varlen-multiple") + 1] == "16" and "--varlen-warmup" in seen[1]
    assert "--varlen-no-ahead" not in seen[1]
    args = bench_blocks.parse_args(["--varlen", "--varlen-warmup", "--varlen-no-ahead"])
    bench_blocks._varlen_in_subprocess("triton", args, [200], 7.0)
    assert "--varlen-no-ahead" in seen[2]


@pytest.mark.slow
def test_isolated_block_rows_run_in_fresh_processes(monkeypatch):
    """``--isolate``: each table row comes from a worker process of its own (tagged JSON on stdout) with the parent's
    compile options; a worker that prints no row (a real one without a GPU, here) becomes a row naming its exit
    code and last stderr line."""
    import subprocess
    import types

    import torch

    args = bench_blocks.parse_args(["--isolate", "--cases", "pair299", "--compile-dynamic", "--iters", "4",
                                    "--warmup", "2", "--compile-mode", "max-autotune"])
    assert args.isolate and args.row_worker is None
    if not torch.cuda.is_available():
        row = bench_blocks._row_in_subprocess("pair299", "triton", args)
        assert row["case"] == "pair299" and row["backend"] == "triton" and row["ms"] == ""
        assert row["note"] == "failed: worker exited with 1: bench_blocks.py needs a CUDA device", row
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        if "boltz-cueq" in cmd:
            return types.SimpleNamespace(stdout="", stderr="Traceback\nImportError: no boltz", returncode=1)
        case, backend = cmd[cmd.index("--row-worker") + 1:][:2]
        row = dict(case=case, backend=backend, ms=12.5, peak_gib=1.4, note="")
        return types.SimpleNamespace(stdout="noise\n" + bench_blocks._ROW_TAG + bench_blocks.json.dumps(row),
                                     stderr="", returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    got = bench_blocks._row_in_subprocess("pair299", "triton+compile", args)
    assert got == dict(case="pair299", backend="triton+compile", ms=12.5, peak_gib=1.4, note="")
    assert seen[0][2:5] == ["--row-worker", "pair299", "triton+compile"]
    assert "--compile-dynamic" in seen[0] and seen[0][seen[0].index("--iters") + 1] == "4"
    assert seen[0][seen[0].index("--warmup") + 1] == "2"
    assert seen[0][seen[0].index("--compile-mode") + 1] == "max-autotune"
    worker = bench_blocks.parse_args(seen[0][2:])  # the worker parses what it is given back into the same options
    assert (worker.row_worker, worker.iters, worker.warmup, worker.compile_mode, worker.compile_dynamic) == (
        ["pair299", "triton+compile"], 4, 2, "max-autotune", True)
    bad = bench_blocks._row_in_subprocess("pair299", "boltz-cueq", args)
    assert bad["ms"] == "" and bad["note"] == "failed: worker exited with 1: ImportError: no boltz"

    def hung(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(subprocess, "run", hung)
    late = bench_blocks._row_in_subprocess("pair299", "triton", args)
    assert late["case"] == "pair299" and late["ms"] == ""
    assert late["note"] == f"failed: worker timed out after {bench_blocks.ROW_WORKER_TIMEOUT_S} s"


def test_row_worker_measures_its_row_with_the_given_options(monkeypatch, capsys):
    """The hidden --row-worker mode measures one row with the options it was given (the compile's dynamic flag
    reaches build_case) and prints it as one tagged JSON line, which the parent reads back."""
    import json

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    built = []

    def fake_build(case, backend, dev, compile_mode=None, dynamic=False):
        built.append((case, backend, compile_mode, dynamic))
        return torch.nn.Linear(1, 1), [], lambda: ()

    monkeypatch.setattr(bench_blocks, "build_case", fake_build)
    monkeypatch.setattr(bench_blocks, "measure", lambda *a, **k: (12.5, 1.25))
    bench_blocks.main(["--row-worker", "pair299", "triton+compile", "--compile-dynamic", "--iters", "3"])
    assert built == [("pair299", "triton+compile", None, True)]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(bench_blocks._ROW_TAG)]
    assert len(lines) == 1
    row = json.loads(lines[0][len(bench_blocks._ROW_TAG):])
    assert (row["case"], row["backend"], row["ms"], row["peak_gib"]) == ("pair299", "triton+compile", 12.5, 1.25)
    assert row["note"].endswith("dynamic=True") and not row["note"].startswith("failed")


# ------------------------------------------------------------------------------------------ zoo bench
@pytest.mark.slow
def test_zoo_bench_smoke_runs_every_row(tmp_path):
    """scripts/bench_zoo.py --smoke end to end, every case: every row is measured or says why it was skipped; ours
    and the Hugging Face ESM C (same weights) agree on the first step's loss, ours and OpenFold3's / Protenix's
    Pairformers on the first step's outputs and input gradients; zoo.csv / zoo.md hold the rows."""
    import csv

    import torch

    pytest.importorskip("transformers")
    import bench_zoo

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # at smoke sizes waking intra-op threads costs more than the ops: half the run time
    try:
        rows = bench_zoo.main(["--smoke", "--out", str(tmp_path), "--iters", "1", "--warmup", "1",
                               "--cases", *bench_zoo.CASES])
    finally:
        torch.set_num_threads(threads)
    assert rows, "no rows"
    for r in rows:
        assert r.get("ms") or r.get("note", "").startswith(("skipped", "not measured")), r
        assert "failed" not in r.get("note", ""), r
    esmc = {r["variant"]: r for r in rows if r["case"] == "esmc"}
    ours = next(r for v, r in esmc.items() if v.startswith("ours"))
    assert esmc["HF sdpa"]["ms"] and float(ours["tokens_per_s"]) > 0 and float(ours["first_step_s"]) > 0
    # bf16 autocast on both sides: a wrong weight mapping would move the loss by far more
    assert float(ours["diff_vs_ref"]) < 1e-2, ours
    evo = [r for r in rows if r["case"] == "af2-evoformer"]
    assert all(float(r["diff_vs_ref"]) < 5e-2 for r in evo if r.get("diff_vs_ref")), evo  # bf16 vs bf16, not ~1
    assert {r["shape"].rsplit(", ", 1)[-1] for r in evo if r.get("ms")} == {"train step", "inference"}
    assert any("JAX" in r["variant"] and r["note"].startswith("not measured") for r in evo)
    for case in bench_zoo.PF_CASES:  # each original's default path and ours per shape, or one row saying why not
        pf = [r for r in rows if r["case"] == case]
        if len(pf) == 1 and "does not import" in pf[0]["note"]:
            continue
        ours = [r for r in pf if r["variant"].startswith("ours")]
        theirs = [r for r in pf if r.get("ms") and not r["variant"].startswith("ours")]
        assert len(ours) == len(theirs) == 2 and all(r["ms"] for r in ours), pf
        # bf16 autocast on both sides (fp32: 1e-6); a wrong weight or mask would move them by ~1
        assert all(float(r["diff_vs_ref"]) < 5e-2 for r in ours), ours
        assert all(r["note"].startswith("skipped") for r in pf if not r.get("ms")), pf  # kernels: CUDA only here
    with open(tmp_path / "zoo.csv") as f:
        assert list(csv.DictReader(f)) == [{k: r.get(k, "") for k in bench_zoo.FIELDS} for r in rows]
    assert (tmp_path / "zoo.md").read_text().count("\n| ") == len(rows) + 1


def test_cudnn_bench_needs_a_gpu_and_the_attention_bench_skips_cudnn_on_bias_shapes():
    import bench_attention
    import bench_cudnn

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            bench_cudnn.main(["--set", "op"])
    cases = {be: skip for _, _, be, _, _, skip in bench_attention.bias_cases(["triangle 1,256,4,256,32"],
                                                                              ["cudnn", "triton"])}
    assert cases == {"cudnn": "skipped: no bias path", "triton": None}
