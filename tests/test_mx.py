"""The MX reference quantizers against the OCP MX v1.0 rules and float64 math."""

import math

import torch
from hypothesis import given, strategies as st

from wide_moe_triton import mx

# Codes 0x00..0x7E in order: the non-negative E4M3 values, index = code (LSB = mantissa LSB).
E4M3_GRID = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_even(value: float, grid: list[float]) -> float:
    """Round |value| to the nearest point of a non-negative grid, ties to the point of
    even index (even mantissa), by plain float64 search: the spec's rule, written out."""
    mag = abs(value)
    best = min(grid, key=lambda g: (abs(g - mag), grid.index(g) % 2))
    return math.copysign(best, value)


def spec_quantize(block: list[float], emax: int, grid: list[float], limit: float):
    """OCP MX v1.0 §6.3 for one finite block, in float64: (scale exponent, values)."""
    amax = max(abs(v) for v in block)
    if amax == 0:
        return -127, [math.copysign(0.0, v) for v in block]
    exponent = max(-127, min(127, math.floor(math.log2(amax)) - emax))
    scaled = [max(-limit, min(limit, v / 2.0 ** exponent)) for v in block]
    return exponent, [nearest_even(v, grid) for v in scaled]


# Values on a grid of halves and quarters hit E4M3/E2M1 midpoints often.
floats = st.one_of(st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32),
                   st.integers(-2000, 2000).map(lambda n: n / 4.0))
blocks = st.lists(floats, min_size=32, max_size=32)


@given(st.lists(blocks, min_size=1, max_size=4), st.integers(-30, 30))
def test_mxfp8_matches_spec_in_float64(rows, shift):
    x = torch.tensor(rows, dtype=torch.float32) * 2.0 ** shift
    codes, scales = mx.quantize_mxfp8(x.reshape(1, -1))
    values = codes.view(torch.float8_e4m3fn).float().reshape(len(rows), 32)
    for i, block in enumerate(x.tolist()):
        exponent, expect = spec_quantize(block, 8, E4M3_GRID, 448.0)
        assert scales[0, i].item() == exponent + 127
        assert values[i].tolist() == expect
        # The error is at most half the top binade's step (32 * 2**e), or the saturation
        # of values in (448, 512) * 2**e that FLOOR-mode scales leave.
        deq = mx.dequantize_mxfp8(codes, scales).reshape(len(rows), 32)[i].double()
        exact = torch.tensor(block, dtype=torch.float64)
        bound = torch.clamp(exact.abs() - 448 * 2.0 ** exponent, min=16 * 2.0 ** exponent)
        assert torch.all((deq - exact).abs() <= bound)


@given(st.lists(blocks, min_size=1, max_size=4), st.integers(-30, 30))
def test_mxfp4_matches_spec_in_float64(rows, shift):
    x = torch.tensor(rows, dtype=torch.float32) * 2.0 ** shift
    packed, scales = mx.quantize_mxfp4(x.reshape(1, -1))
    values = mx.unpack_e2m1(packed).reshape(len(rows), 32)
    for i, block in enumerate(x.tolist()):
        exponent, expect = spec_quantize(block, 2, E2M1_GRID, 6.0)
        assert scales[0, i].item() == exponent + 127
        got = values[i].tolist()
        assert [abs(g) for g in got] == [abs(e) for e in expect]
        assert all(math.copysign(1, g) == math.copysign(1, e) or e == 0
                   for g, e in zip(got, expect))


def test_spec_examples():
    # E4M3: max 448, saturation past it, the smallest subnormal 2**-9.
    x = torch.tensor([[448.0, 460.0, -500.0, 2.0 ** -9, 2.0 ** -10 * 3] + [0.0] * 27])
    codes, scales = mx.quantize_mxfp8(x)
    assert scales.tolist() == [[127]]  # floor(log2(500)) - 8 = 0
    got = codes.view(torch.float8_e4m3fn).float()[0, :5].tolist()
    assert got == [448.0, 448.0, -448.0, 2.0 ** -9, 2.0 ** -8]  # 1.5 * 2**-9 ties up to even
    # E2M1 values {0, 0.5, 1, 1.5, 2, 3, 4, 6}; midpoints go to the even code.
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, -0.5] + [0.0] * 22])
    packed, scales = mx.quantize_mxfp4(x)
    assert scales.tolist() == [[127]]  # floor(log2(7)) - 2 = 0
    assert mx.unpack_e2m1(packed)[0, :10].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0,
                                                        6.0, 6.0, -0.5]


def test_special_blocks():
    x = torch.zeros(1, 128)
    x[0, 32:64] = -0.0
    x[0, 64] = float("nan")
    x[0, 96] = float("inf")
    codes, scales = mx.quantize_mxfp8(x)
    assert scales[0].tolist() == [0, 0, 255, 255]
    assert codes[0, :32].eq(0).all() and codes[0, 32:64].eq(0x80).all()
    assert codes[0, 64:].eq(0x7F).all()
    deq = mx.dequantize_mxfp8(codes, scales)
    assert deq[0, :64].eq(0).all() and deq[0, 64:].isnan().all()
    packed, scales4 = mx.quantize_mxfp4(x)
    assert scales4[0].tolist() == [0, 0, 255, 255]
    assert mx.dequantize_mxfp4(packed, scales4)[0, 64:].isnan().all()


@given(st.integers(-127, 127))
def test_power_of_two_amax_and_scale_values(exponent):
    # amax exactly 2**(e+8) maps to 256 in E4M3 (exact): the scale is 2**e.
    e = max(-127, min(119, exponent))
    x = torch.zeros(1, 32, dtype=torch.float64)
    x[0, 0] = 2.0 ** (e + 8)
    codes, scales = mx.quantize_mxfp8(x.float())
    assert scales.item() == e + 127
    assert mx.dequantize_mxfp8(codes, scales)[0, 0].item() == float(x[0, 0].float())
    assert mx.scale_values(torch.tensor([exponent + 127], dtype=torch.uint8)).item() == \
        2.0 ** exponent


def test_shape_errors():
    import pytest

    with pytest.raises(ValueError, match="multiple of 32"):
        mx.quantize_mxfp8(torch.zeros(2, 33))


@given(lead=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       blocks=st.integers(1, 4), piece=st.integers(1, 300), seed=st.integers(0, 2 ** 16),
       specials=st.booleans())
def test_mxfp4_in_pieces_equals_at_once(lead, blocks, piece, seed, specials):
    # quantize_mxfp4 cuts its input into pieces of whole rows (bounded memory); a row's
    # blocks never straddle two pieces, so every piece size gives the bits of one pass,
    # NaN and Inf blocks included.
    x = torch.randn(*lead, 32 * blocks, generator=torch.Generator().manual_seed(seed)) * 4
    if specials:
        x.view(-1)[seed % x.numel()] = float("nan")
        x.view(-1)[(seed * 7) % x.numel()] = float("-inf")
    whole = mx._quantize_mxfp4(x)
    default, mx.PIECE_ELEMENTS = mx.PIECE_ELEMENTS, piece
    try:
        pieces = mx.quantize_mxfp4(x)
    finally:
        mx.PIECE_ELEMENTS = default
    for got, want in zip(pieces, whole):
        assert got.shape == want.shape and torch.equal(got, want)
