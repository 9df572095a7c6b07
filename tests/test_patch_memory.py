"""The peak memory of a patched Boltz-2 PairformerLayer's inference, measured on the CPU by the live bytes of the
tensors it allocates (``helpers.LiveBytes``, a dispatch mode: exact, unlike the resident set), in units of one pair
tensor z (N * N * c_z * 4 bytes): at most our own PairformerBlock's memory-bounded path at the same widths and
row chunk, and far below Boltz's own layer, whose forward holds the full-size update, the residual sum and the
pair transition's 4 * c_z-wide hidden layer at once. All three take their inputs from outside the measurement and
are given the same chunk of rows (Boltz's ``chunk_size_tri_attn``, our block's ``chunk_size``)."""
import pytest
import torch

import attn_zoo
from attn_zoo.models.pairformer import PairformerBlock
from helpers import LiveBytes, randomize_

pf = pytest.importorskip("boltz.model.layers.pairformer", reason="boltz==2.2.1 (--no-deps) is a test dependency")

N, CHUNK = 128, 8
WIDTHS = dict(token_s=384, token_z=128, num_heads=16, pairwise_head_width=32, pairwise_num_heads=4)  # Boltz-2's


def peak(fn) -> int:
    with torch.no_grad(), LiveBytes(stack_min=1 << 40) as m:
        out = fn()
    del out
    return m.peak


def test_live_bytes_counts_new_storages_while_they_live():
    a = torch.randn(1000, 1000)
    mb = a.numel() * 4
    with LiveBytes() as m:
        b = a + 1  # new: 1
        c = a.t()  # a view of an input: 0
        b += a  # in place: 0
        torch.mul(a, 2, out=b)  # out=: 0
        d = b * 2  # new: 2 live, the peak
        e = d[:10]  # a view of a counted storage: 0
        del b
        f = torch.empty(500, 1000)  # 1.5 live
    assert (m.peak, m.live, m.peak_op) == (2 * mb, 3 * mb // 2, "aten.mul.Tensor")
    assert [n for n, _, _ in m.at_peak] == [mb, mb]
    del c, d, e, f
    assert m.live == 0


def test_patched_boltz2_layer_peak_within_our_bounded_block():
    torch.manual_seed(0)
    layer = randomize_(pf.PairformerLayer(**WIDTHS, v2=True)).eval()
    ours = PairformerBlock(c_s=384, c_z=128, num_heads_single=16, num_heads_pair=4, c_hidden_pair=32,
                           attention="torch", variant="boltz2").eval()
    g = torch.Generator().manual_seed(1)
    s, z = torch.randn(1, N, 384, generator=g), torch.randn(1, N, N, 128, generator=g)
    mask = torch.ones(1, N)
    mask[:, -5:] = 0
    pair_mask = mask[:, :, None] * mask[:, None, :]
    z_size = z.numel() * z.element_size()

    def boltz():
        return layer(s, z, mask, pair_mask, chunk_size_tri_attn=CHUNK)

    own = peak(boltz) / z_size
    attn_zoo.patch(layer, backend="torch")
    patched = peak(boltz) / z_size
    bounded = peak(lambda: ours.forward_inference(s, z, mask > 0, pair_mask > 0, chunk_size=CHUNK,
                                                  mode="bounded")) / z_size
    sizes = dict(boltz=own, patched=patched, bounded=bounded)
    # ours: the result z and triangle multiplication's stored projection, plus a chunk's temporaries
    assert 1.0 < bounded < 3.0, sizes
    assert patched <= bounded + 0.25, sizes
    assert patched < own / 4, sizes
