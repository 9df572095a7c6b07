"""Shared test utilities: random attention inputs and error bounds relative to plain PyTorch's own error."""
from __future__ import annotations

import torch

from attn_ops import registry
from attn_ops.reference import attention_reference

ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -23, torch.float64: 2.0 ** -52}


def make_inputs(batch, h, lq, lk, d, dv=None, dtype=torch.float32, bias_shape=None, mask_shape=None,
                hole_p=0.3, seed=0, device="cpu", requires_grad=True):
    """Fresh random q, k, v (+ bias of ``bias_shape``, + bool mask of ``mask_shape`` with ~hole_p holes)."""
    g = torch.Generator().manual_seed(seed)
    dv = dv or d

    def rnd(*shape):
        t = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
        return t.requires_grad_(requires_grad)

    q = rnd(*batch, h, lq, d)
    k = rnd(*batch, h, lk, d)
    v = rnd(*batch, h, lk, dv)
    bias = rnd(*bias_shape) if bias_shape is not None else None
    mask = None
    if mask_shape is not None:
        mask = (torch.rand(*mask_shape, generator=g) > hole_p).to(device)
    return q, k, v, bias, mask


def empty_some_rows(mask):
    """Make some (not all) query rows fully masked, in place: every key of the first broadcast slice of a key
    mask (Lq dim 1), else the first query row of every slice."""
    if mask.shape[-2] == 1:
        mask[(0,) * (mask.ndim - 2)] = False
    else:
        mask[..., 0, :] = False
    assert mask.any() and not mask.all(), "mask must keep some keys and hide some rows"
    return mask


def grads_of(out, lse, inputs, g_out, g_lse):
    """Gradients of <out, g_out> + <lse, g_lse> (lse's -inf rows ignored) w.r.t. the tensors in ``inputs``."""
    loss = (out.double() * g_out).sum()
    if lse is not None and g_lse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse.double(), 0.0) * g_lse).sum()
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    return torch.autograd.grad(loss, wanted, allow_unused=True)


def detached64(ts):
    return [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in ts]


def max_err(a, b):
    a, b = a.double(), b.double()
    finite = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), finite):
        return float("inf")
    return (a[finite] - b[finite]).abs().max().item() if finite.any() else 0.0


def bound(dtype, ref, torch_err, backend):
    tol = registry.get(backend).tolerance[dtype]
    scale = ref.double().abs().max().item() if ref.numel() else 1.0
    return tol * torch_err + 8 * ULP[dtype] * max(scale, 1.0)


def check_against_reference(backend, q, k, v, bias, mask, causal=False, lse_loss=True, seed=1, **options):
    """Compare outputs, lse and all gradients of ``backend`` to a float64 reference.

    The allowed error is ``tolerance * (error of plain PyTorch in the same dtype) + a few ulps``.
    """
    import attn_ops

    dtype = q.dtype
    leaves = [q, k, v, bias]
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in leaves)
    if not registry.get(backend).lse or (wants_grad and not registry.get(backend).lse_grad):
        lse_loss = False  # (a backend whose lse carries no gradient is compared on out and gradients only)
        out = attn_ops.attention(q, k, v, bias, mask, causal=causal, backend=backend, **options)
        lse = None
    else:
        out, lse = attn_ops.attention(q, k, v, bias, mask, causal=causal, return_lse=True, backend=backend,
                                      **options)
    g = torch.Generator().manual_seed(seed)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device)
    g_lse = torch.randn(out.shape[:-1], generator=g, dtype=torch.float64).to(out.device) if lse_loss else None
    needs_grad = any(t is not None and t.requires_grad for t in leaves)
    got = grads_of(out, lse, leaves, g_out, g_lse) if needs_grad else []

    leaves64 = detached64(leaves)
    ref_out, ref_lse = attention_reference(*leaves64[:3], leaves64[3], mask, causal=causal)
    ref = grads_of(ref_out, ref_lse, leaves64, g_out, g_lse) if needs_grad else []

    leaves_lp = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    lp_out, lp_lse = attention_reference(*leaves_lp[:3], leaves_lp[3], mask, causal=causal, upcast=False)
    lp = grads_of(lp_out, lp_lse, leaves_lp, g_out, g_lse) if needs_grad else []

    names = ["out", "lse"] + [n for n, t in zip("q k v bias".split(), leaves) if t is not None and t.requires_grad]
    if lse is None:
        names, ref_lse, lp_lse = names[:1] + names[2:], None, None
    outs = [t for t in (out, lse) if t is not None] + list(got)
    refs = [t for t in (ref_out, ref_lse) if t is not None] + list(ref)
    lps = [t for t in (lp_out, lp_lse) if t is not None] + list(lp)
    assert len(outs) == len(names), f"{backend}: expected {names}, got {len(outs)} tensors"
    assert out.dtype == dtype, f"{backend}: out dtype {out.dtype}, q dtype {dtype}"
    if lse is not None:
        want = torch.float64 if dtype == torch.float64 else torch.float32
        assert lse.dtype == want, f"{backend}: lse dtype {lse.dtype}, want {want}"
        finite = torch.isfinite(ref_lse)
        assert finite.any(), f"{backend}: every query row is fully masked: the comparison would be vacuous"
    for g, leaf in zip(got, [t for t in leaves if t is not None and t.requires_grad]):
        assert g is not None and g.dtype == leaf.dtype, f"{backend}: gradient dtype differs from its input's"
    for name, a, r, p in zip(names, outs, refs, lps):
        assert a is not None and a.shape == r.shape, f"{backend}: {name} missing or wrong shape"
        assert not torch.isnan(a).any(), f"{backend}: NaN in {name}"
        err, base = max_err(a, r), max_err(p, r)
        allowed = bound(dtype, r, base, backend)
        assert err <= allowed, f"{backend} {dtype}: {name} error {err:.3g} > allowed {allowed:.3g} (torch {base:.3g})"
    return out, lse, got


# (with_bias, triton options) for check_garbage_at_masked_keys
GARBAGE_RUNS = [
    (True, dict()),
    (True, dict(deterministic=False)),  # atomic dBias (two rows per program sharing each bias tile on the CPU)
    (True, dict(bwd="fused", deterministic=False)),
    (False, dict()),
]
GARBAGE_IDS = ["bias-split", "bias-atomic", "bias-fused", "no-bias"]


def check_garbage_at_masked_keys(with_bias, opts, dtype, device, lq=19, lk=21, rows=4):
    """Padding garbage at masked keys (NaN / inf in a shared bias's padded columns, NaN / inf in k's padded
    rows) must give exactly the bits of the same inputs with zeros there, as the reference's masked_fill would:
    output, lse and the gradients of q, k, v and bias of the triton backend, all finite. Gradients summed by
    atomics (``deterministic=False``) may differ from run to run in their last bits: those are compared within
    a few ulps instead."""
    from attn_ops.triton import triton_attention

    q, k, v, bias, mask = make_inputs((1, rows), 2, lq, lk, 16, dtype=dtype, device=device, seed=11,
                                      bias_shape=(1, 1, 2, lq, lk) if with_bias else None,
                                      mask_shape=(1, rows, 1, 1, lk))
    pad, gap, one = lk - 1, 7, 3
    mask[..., pad] = False  # a padded key: masked in every row
    mask[..., gap] = False
    mask[0, 1, ..., one] = False  # and a key masked in one row only
    dirty = [t.detach().clone() for t in (q, k, v)] + ([bias.detach().clone()] if with_bias else [None])
    clean = [None if t is None else t.clone() for t in dirty]
    with torch.no_grad():
        if with_bias:
            dirty[3][..., pad] = float("nan")
            dirty[3][..., 0, gap] = float("inf")
            dirty[3][..., 1, gap] = float("-inf")
            clean[3][..., pad] = 0.0
            clean[3][..., gap] = 0.0
        dirty[1][0, 1, :, one] = float("nan")  # k at the key masked only in row 1
        dirty[1][..., pad, :] = float("inf")
        clean[1][0, 1, :, one] = 0.0
        clean[1][..., pad, :] = 0.0
    g = torch.Generator().manual_seed(3)
    d_out = torch.randn(*q.shape[:-1], v.shape[-1], generator=g).to(device)
    d_lse = torch.randn(q.shape[:-1], generator=g).to(device)
    results = []
    for leaves in (dirty, clean):
        leaves = [None if t is None else t.requires_grad_() for t in leaves]
        out, lse = triton_attention(*leaves[:4], mask, 0.25, False, **opts)
        loss = (out.float() * d_out).sum() + (lse * d_lse).sum()
        grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
        results.append((out, lse, *grads))
    names = ["out", "lse", "dq", "dk", "dv", "dbias"]
    for name, got in zip(names, results[0]):
        assert torch.isfinite(got).all(), name
    exact = opts.get("deterministic", True)
    for name, got, want in zip(names, *results):
        if exact or name in ("out", "lse", "dk", "dv"):
            assert torch.equal(got, want), name
        else:  # sums by atomics (dbias; dq of the fused backward) differ run to run in the last bits
            tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7
            assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max(), name


def check_row_under_huge_additive_bias(fill, dtype, device, lq=20, lk=37, row=5):
    """The additive-mask convention: query row ``row``'s bias is ``fill`` (a huge negative number, e.g. the
    dtype's min) at every key, and that row gets no upstream gradient. Every output and gradient of the triton
    backend must be finite, and everything except that row's output and lse must have exactly the bits of the same
    call with an ordinary bias in that row: the row adds exactly 0 to every gradient either way, and the forward
    treats rows independently. (A float32-min logit overflows in the log2 domain: that row comes out empty, out 0
    and lse -inf, as a fully masked row.)"""
    import attn_ops

    q, k, v, bias, mask = make_inputs((2,), 2, lq, lk, 16, dtype=dtype, bias_shape=(1, 2, lq, lk),
                                      mask_shape=(2, 1, 1, lk), device=device, seed=3)
    huge = bias.detach().clone()
    huge[:, :, row, :] = fill
    g = torch.Generator().manual_seed(4)
    g_out = torch.randn(q.shape, generator=g, dtype=torch.float64).to(device)
    g_lse = torch.randn(q.shape[:-1], generator=g, dtype=torch.float64).to(device)
    g_out[..., row, :] = 0
    g_lse[..., row] = 0
    runs = []
    for b in (bias, huge):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, b)]
        out, lse = attn_ops.attention(*leaves[:3], leaves[3], mask, return_lse=True, backend="triton")
        runs.append((out, lse, grads_of(out, lse, leaves, g_out, g_lse)))
    (out0, lse0, grads0), (out1, lse1, grads1) = runs
    other = torch.arange(lq, device=device) != row
    assert torch.isfinite(out1).all(), "non-finite output"
    assert not torch.isnan(lse1).any() and torch.isfinite(lse1[..., other]).all(), "bad lse"
    assert torch.equal(out1[..., other, :], out0[..., other, :]), "other rows' outputs changed"
    assert torch.equal(lse1[..., other], lse0[..., other]), "other rows' lse changed"
    for name, a, b in zip("q k v bias".split(), grads1, grads0):
        assert torch.isfinite(a).all(), f"non-finite d{name}"
        assert torch.equal(a, b), f"d{name} changed: max diff {(a.double() - b.double()).abs().max().item():.3g}"


def ids_from_lengths(lengths, total):
    """Long [total]: sequence i's tokens get id i, in order; the rest (padding at the end) -1."""
    ids = torch.full((total,), -1, dtype=torch.long)
    pos = 0
    for i, n in enumerate(lengths):
        ids[pos:pos + n] = i
        pos += n
    assert pos <= total
    return ids


def have_cuda_compiler() -> bool:
    """Whether Triton's CUDA backend (with its ptxas) is installed: kernels can then be cross-compiled for a GPU on
    any machine (scripts/compile_cost.py)."""
    import os

    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas"))


# ---- other projects' modules against ours (integrations; Boltz-2, OpenFold3, Protenix Pairformers) ------------------
def randomize_(module, seed=0):
    """Random weights everywhere in ``module`` (other projects' inits zero some output layers and gates): matrices
    over sqrt(fan-in), norm scales near 1, other vectors small. Returns ``module``."""
    import math

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.ndim >= 2:
                p.copy_(r / math.sqrt(p.shape[-1]))
            elif name.endswith("weight"):  # norm scales
                p.copy_(1.0 + 0.2 * r)
            else:
                p.copy_(0.2 * r)
    return module


def padded_inputs(B=2, N=7, seed=0, c_s=32, c_z=8):
    """s, z and bool masks with a hole inside one sequence and padding at the end of the other; pair holes off the
    diagonal between real residues (so no real row or column of the pair mask is empty)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, N, c_s, generator=g)
    z = torch.randn(B, N, N, c_z, generator=g)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[0, 3] = False
    mask[1, N - 2:] = False
    holes = (torch.rand(B, N, N, generator=g) < 0.15) & ~torch.eye(N, dtype=torch.bool)
    pair_mask = mask[:, :, None] & mask[:, None, :] & ~holes
    assert holes[mask[:, :, None] & mask[:, None, :]].any(), "the pair mask must have real holes"
    return s, z, mask, pair_mask


def run_on(fn, s, z, grad=False):
    """``fn(s, z)`` on fresh copies of s and z (leaves that need grad when ``grad``): ((s, z), output)."""
    s, z = s.clone().requires_grad_(grad), z.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = fn(s, z)
    return (s, z), out


def real_err(out, ref, mask=None):
    """rel_err of s and z (``out`` against ``ref``) at the real positions of the bool [B, N] ``mask`` (None: all)."""
    from test_primitives import rel_err

    if mask is None:
        return rel_err(out[0].float(), ref[0]), rel_err(out[1].float(), ref[1])
    real_pairs = mask[:, :, None] & mask[:, None, :]
    return rel_err(out[0].float()[mask], ref[0][mask]), rel_err(out[1].float()[real_pairs], ref[1][real_pairs])


def loss_at_real(s_out, z_out, mask=None, seed=7):
    """A random weighted sum of s and z over real positions only (``mask`` None: all); padded ones are defined
    differently (see PairformerBlock)."""
    g = torch.Generator().manual_seed(seed)
    ws, wz = torch.randn(s_out.shape, generator=g), torch.randn(z_out.shape, generator=g)
    if mask is None:
        return (s_out * ws).sum() + (z_out * wz).sum()
    real_pairs = mask[:, :, None] & mask[:, None, :]
    return (s_out * ws * mask[..., None]).sum() + (z_out * wz * real_pairs[..., None]).sum()


def assert_parity(theirs, ours, s, z, mask=None, tol=1e-5):
    """``ours(s, z)`` against ``theirs(s, z)``: s and z out at the real positions of ``mask`` (None: all), and the
    gradients of the inputs s and z under :func:`loss_at_real`, each within ``tol`` (rel_err)."""
    from test_primitives import rel_err

    (ts, tz), ref = run_on(theirs, s, z, grad=True)
    (os_, oz), out = run_on(ours, s, z, grad=True)
    es, ez = real_err(out, ref, mask)
    assert es < tol and ez < tol, (es, ez)
    loss_at_real(*ref, mask).backward()
    loss_at_real(*out, mask).backward()
    assert rel_err(os_.grad, ts.grad) < tol
    assert rel_err(oz.grad, tz.grad) < tol


def assert_padded_parity(theirs, ours, N=7, tol=1e-5):
    """:func:`assert_parity` on :func:`padded_inputs` of length ``N``: ``theirs`` takes the masks as floats,
    ``ours`` as bools."""
    s, z, mask, pair_mask = padded_inputs(N=N)
    assert_parity(lambda s, z: theirs(s, z, mask.float(), pair_mask.float()), lambda s, z: ours(s, z, mask, pair_mask),
                  s, z, mask, tol)


def assert_round_trip(theirs, stack, export, load, again):
    """``export(stack)`` (``stack`` loaded from ``theirs``) gives back ``theirs``' state dict bit for bit and loads
    strictly into ``again`` (a fresh foreign module), whose ``export(load(again))`` is the same again."""
    sd, back = theirs.state_dict(), export(stack)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    again.load_state_dict(back, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(export(load(again)).values(), back.values()))


def assert_published_names(block, ours, export, num_blocks=48):
    """``export(ours)`` has the names and shapes of ``num_blocks`` copies of a one-block foreign state dict
    ``block`` (keys ``blocks.0...``): the foreign stack at its published size. Returns that state dict."""
    theirs = {f"blocks.{i}.{k[len('blocks.0.'):]}": v for i in range(num_blocks) for k, v in block.items()}
    back = export(ours)
    assert back.keys() == theirs.keys()
    assert all(back[k].shape == theirs[k].shape for k in theirs)
    return theirs


def assert_bad_keys_named_together(load, sd, missing, unexpected, misshapen, shape, expected):
    """``load`` of ``sd`` without ``missing``, with ``unexpected`` (zeros(8)) and ``misshapen`` of ``shape`` raises
    one ZooCheckpointError naming all three (``expected``: the shape the message must give for ``misshapen``)."""
    import pytest

    from attn_zoo.models.zoo_files import ZooCheckpointError

    sd = dict(sd)
    del sd[missing]
    sd[unexpected] = torch.zeros(8)
    sd[misshapen] = torch.zeros(shape)
    with pytest.raises(ZooCheckpointError) as e:
        load(sd)
    msg = str(e.value)
    assert f"1 missing key(s): {missing}" in msg
    assert f"1 unexpected key(s): {unexpected}" in msg
    assert f"{misshapen} {tuple(shape)} (expected {tuple(expected)})" in msg


# ---- live tensor bytes (a precise peak on any device, the CPU included) ---------------------------------------------
class LiveBytes:
    """A ``TorchDispatchMode`` that counts the bytes of the storages the ops under it allocate, while they live.

    Every op's outputs whose storage is new (not a view, not an in-place or ``out=`` write into a known storage, not
    an input) add their ``untyped_storage().nbytes()``, released when the storage is freed (a weakref finalizer).
    ``peak``: the most bytes live at once; ``peak_op``: the op that reached it; ``at_peak``: what was live then,
    ``(bytes, op, where)`` largest first, ``where`` the innermost frames of the allocating call (``frames``
    deep, from files whose path contains one of ``stack_from``) for storages of at least ``stack_min`` bytes.
    Tensors made before the mode (inputs, parameters) are not counted. Kernels' internal scratch buffers (never an
    op's output) are invisible to it."""

    def __init__(self, stack_from=("boltz", "attn_zoo", "models", "tests"), stack_min=1 << 20, frames=3):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.stack_from, self.stack_min, self.frames = stack_from, stack_min, frames
        self.live, self.peak, self.peak_op, self.at_peak, self._info = 0, 0, None, [], {}
        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                outer._saw(func, out, (args, kwargs))
                return out

        self._mode = _Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def _where(self) -> str:
        import traceback

        keep = [f for f in traceback.extract_stack()[:-3]
                if any(s in f.filename for s in self.stack_from) and "helpers.py" not in f.filename]
        return " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(keep[-self.frames:]))

    def _saw(self, func, out, inputs) -> None:
        import weakref

        from torch.utils._pytree import tree_leaves

        def storages(tree):
            return [t.untyped_storage() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]

        seen = {id(st) for st in storages(inputs)}  # views of inputs, in-place and out= writes
        grew = False
        for st in storages(out):
            key = id(st)
            if key in self._info or key in seen or st.nbytes() == 0:
                continue
            n = st.nbytes()
            self._info[key] = (n, str(func), self._where() if n >= self.stack_min else "")
            weakref.finalize(st, self._freed, key)
            self.live += n
            grew = True
        if grew and self.live > self.peak:
            self.peak, self.peak_op = self.live, str(func)
            self.at_peak = sorted(self._info.values(), key=lambda v: -v[0])

    def _freed(self, key) -> None:
        n = self._info.pop(key)[0]
        self.live -= n
