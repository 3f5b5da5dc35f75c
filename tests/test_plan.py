"""The MXFP8 plan: bit-identical to ``mx.quantize_mxfp8``, plain and out of the mailbox."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import DEVICE, poison
from wide_moe_triton import mx
from wide_moe_triton.kernels import mailbox as M
from wide_moe_triton.kernels import plan as P

FAST = {"BLOCK_ROWS": 16, "BLOCK_COLS": 128, "num_warps": 4}
INF, NAN = float("inf"), float("nan")


def edge_block(kind: str, gen: torch.Generator) -> torch.Tensor:
    """One block of 32 FP32 values of a delicate kind."""
    x = torch.randn(32, generator=gen)
    if kind == "zeros":
        return torch.where(torch.rand(32, generator=gen) < 0.5, 0.0, -0.0)
    if kind == "subnormal":   # FP32 subnormals (BF16 keeps them too): amax < 2**-126
        return x * 2.0 ** -135
    if kind == "tiny":        # the scale clamps at 2**-127: elements go E4M3-subnormal
        return x * 2.0 ** -120
    if kind == "pow2":        # amax exactly a power of two
        x = x.clamp(-0.99, 0.99)
        x[int(torch.randint(0, 32, (1,), generator=gen))] = -8.0
        return x
    if kind == "clamp":       # values at and past 448 after the scale: amax in [256, 512)
        x = x.abs().clamp(max=1.0) * 448.0
        x[:4] = torch.tensor([448.0, 464.0, 480.0, 511.9])
        return x * torch.where(torch.rand(32, generator=gen) < 0.5, 1.0, -1.0)
    if kind == "huge":        # the scale clamps at 2**127
        return x.clamp(-2, 2) * 2.0 ** 126
    if kind == "nan":         # either sign: the scale sees |x| as bits
        x[int(torch.randint(0, 32, (1,), generator=gen))] = NAN
        x[int(torch.randint(0, 32, (1,), generator=gen))] = -NAN
        return x
    if kind == "inf":
        x[int(torch.randint(0, 32, (1,), generator=gen))] = -INF
        return x
    if kind == "ties":        # halfway between E4M3 neighbours at every binade
        k = torch.randint(-9, 8, (32,), generator=gen).float()
        m = torch.randint(8, 16, (32,), generator=gen).float() + 0.5
        x = m * 2.0 ** (k - 3)
        x[0] = 448.0
        return x
    return x * 10.0 ** float(torch.randint(-3, 4, (1,), generator=gen))


KINDS = ["zeros", "subnormal", "tiny", "pow2", "clamp", "huge", "nan", "inf", "ties",
         "normal"]


def edge_rows(seed: int, rows: int, blocks: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, blocks * 32)
    for r in range(rows):
        for b in range(blocks):
            kind = KINDS[int(torch.randint(0, len(KINDS), (1,), generator=gen))]
            out[r, b * 32:(b + 1) * 32] = edge_block(kind, gen)
    return out


def poisoned_out(rows, cols):
    return (poison(torch.empty(rows, cols, dtype=torch.uint8, device=DEVICE)),
            poison(torch.empty(rows, cols // 32, dtype=torch.uint8, device=DEVICE)))


@given(seed=st.integers(0, 2**31 - 1), rows=st.sampled_from([0, 1, 2, 7, 33]),
       blocks=st.integers(1, 9), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       config=st.sampled_from([None, FAST]))
def test_quantize_mxfp8_matches_reference(seed, rows, blocks, dtype, config):
    x = edge_rows(seed, rows, blocks).to(dtype).to(DEVICE)
    out = poisoned_out(rows, blocks * 32)
    q, s = P.quantize_mxfp8(x, out=out, config=config)
    ref_q, ref_s = mx.quantize_mxfp8(x.cpu())
    assert torch.equal(q.cpu(), ref_q)
    assert torch.equal(s.cpu(), ref_s)


def test_quantize_mxfp8_row_stride():
    x = edge_rows(3, 5, 4)
    wide = torch.zeros(5, 200)
    wide[:, :128] = x
    q, s = P.quantize_mxfp8(wide[:, :128].to(DEVICE), config=FAST)
    ref_q, ref_s = mx.quantize_mxfp8(x)
    assert torch.equal(q.cpu(), ref_q) and torch.equal(s.cpu(), ref_s)


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 24),
       world=st.sampled_from([1, 2, 4]), generation=st.integers(0, 3))
def test_polled_plan_matches_reference(seed, rows, world, generation):
    latent, experts, wide_rows = 256, 16, 32
    lat = edge_rows(seed, rows, latent // 32)
    buffers = [M.empty_mailbox((wide_rows, latent, experts), DEVICE) for _ in range(world)]
    table = M.mailbox_table(buffers)
    gen = torch.full((1,), generation, dtype=torch.int32, device=DEVICE)
    e, l_ = experts // world, latent // world
    logits = torch.randn(rows, experts)
    for r in range(world):
        front = torch.cat([logits[:, e * r:e * (r + 1)], lat[:, l_ * r:l_ * (r + 1)]], dim=1)
        M.publish(front.to(DEVICE), table, r, world, gen, latent, experts, wide_rows=wide_rows)
    error = M.new_error_record(DEVICE)
    half = lat.to(torch.bfloat16)
    half = torch.where(half == 0, torch.zeros_like(half), half)  # published -0 is +0
    ref_q, ref_s = mx.quantize_mxfp8(half)
    for r in range(world):
        out = poisoned_out(rows, latent)
        q, s = P.quantize_mxfp8_mailbox(buffers[r], gen, rows, latent=latent, world=world,
                                        error=error, out=out, config=FAST)
        assert torch.equal(q.cpu(), ref_q)
        assert torch.equal(s.cpu(), ref_s)
        # The latent columns are re-armed; the logits words were never touched.
        assert (buffers[r][generation & 1, :, :latent] == M.SENTINEL_BF16).all()
        words = buffers[r][generation & 1, :rows, latent:].contiguous().view(torch.int32)
        assert torch.equal(words.cpu(), torch.where(logits == 0, 0.0, logits).view(torch.int32))
    assert error.tolist() == [0, 0]


def test_polled_plan_zero_rows_is_a_no_op():
    buf = M.empty_mailbox((4, 64, 16), DEVICE)
    gen = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    q, s = P.quantize_mxfp8_mailbox(buf, gen, 0, latent=64, world=1,
                                    error=M.new_error_record(DEVICE))
    assert q.shape == (0, 64) and s.shape == (0, 2)


@pytest.mark.parametrize("x, match", [
    (torch.zeros(4, 48), "multiple of 32"),
    (torch.zeros(4, 64, dtype=torch.float16), "x must be"),
    (torch.zeros(64), r"shape \[rows, n\]"),
    (torch.zeros(64, 4).t(), "contiguous"),
])
def test_quantize_mxfp8_argument_errors(x, match):
    with pytest.raises((TypeError, ValueError), match=match):
        P.quantize_mxfp8(x.to(DEVICE))


def test_quantize_mxfp8_out_errors_name_the_buffer():
    x = torch.zeros(4, 64, device=DEVICE)
    bad = (torch.empty(4, 64, dtype=torch.uint8, device=DEVICE),
           torch.empty(4, 3, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match=r"out\[1\]"):
        P.quantize_mxfp8(x, out=bad)
