"""The experts' SASS model (benchmarks/diagnostics/sass_count.py --table) and the decode
search (decode_search.py), on what they compute without compiling: the tiles a routing
makes, programs a SM, code a loop branches over, dependency chains, and the search's
exactness."""

import pathlib
import sys

from hypothesis import given, strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
                       / "diagnostics"))
import decode_search  # noqa: E402
import sass_count  # noqa: E402


def kernel_tiles(count, block_m, half_tile):
    """The tiles the experts kernels walk for one list (``tiles._full_tiles`` and the
    kernels' two loops), as (full, half)."""
    full_end = count
    last = count % block_m
    if half_tile and 0 < last <= block_m // 2:
        full_end = count - last
    full = len(range(0, full_end, block_m))
    half = len(range(full_end, count, block_m // 2)) if half_tile else 0
    return full, half


@given(st.lists(st.integers(0, 80), min_size=1, max_size=40), st.sampled_from([16, 32]),
       st.booleans())
def test_tiles_are_the_kernels(counts, block_m, half_tile):
    full, half = sass_count.tiles(counts, block_m, half_tile)
    walked = [kernel_tiles(c, block_m, half_tile) for c in counts]
    assert (full, half) == (sum(f for f, _ in walked), sum(h for _, h in walked))
    # every pair has a row, and no tile is wholly padding
    assert full * block_m + half * (block_m // 2) >= sum(counts)
    assert full + half <= sum(-(-c // (block_m // 2)) for c in counts)


@given(st.integers(16, 255), st.integers(0, 200 * 1024), st.sampled_from([128, 256]))
def test_occupancy_never_grows_with_resources(registers, shared, threads):
    here = sass_count.occupancy(registers, shared, threads)
    assert sass_count.occupancy(min(registers + 8, 255), shared, threads) <= here
    assert sass_count.occupancy(registers, shared + 4096, threads) <= here
    # what the SM holds: 64K registers, 228 KB of shared memory
    per_warp = -(-registers * 32 // 256) * 256
    assert here * per_warp * threads // 32 <= 65536
    assert here * (shared + 1024) <= 228 * 1024


def test_occupancy_of_the_tables_register_caps():
    # CUDA's occupancy rules for 4-warp programs with little shared memory
    assert [sass_count.occupancy(r, 30 * 1024, 128) for r in (96, 128, 168, 255)] == \
        [5, 4, 3, 2]


def _sass(lines):
    return [(16 * i, line) for i, line in enumerate(lines)]


@given(st.integers(1, 6), st.integers(0, 5))
def test_branched_over_is_what_a_forward_branch_skips(skipped, after):
    head = ["LDS R4, [R2]", "LOP3.LUT R5, R4, 0xff, RZ, 0xc0, !PT"]
    body = head + [f"@P0 BRA 0x{16 * (len(head) + skipped + 1):x}"]
    body += [f"IADD3 R{10 + i}, R{10 + i}, 0x1, RZ" for i in range(skipped)]
    body += [f"MOV R{30 + i}, R{31 + i}" for i in range(after)] + ["@P1 BRA 0x0"]
    loop = _sass(body)
    got = sass_count.branched_over(loop)
    assert got == {16 * (len(head) + 1 + i) for i in range(skipped)}


@given(st.integers(1, 12))
def test_dependency_chain_adds_the_latencies_of_a_chain(n):
    # a load, then n dependent logic operations, then a pair multiply: one chain;
    # independent instructions beside it add nothing
    body = ["LDS R4, [R2]"] + [f"LOP3.LUT R4, R4, 0xff, RZ, 0xc0, !PT" for _ in range(n)]
    body += ["HMUL2.BF16_V2 R6, R4, R7", "IADD3 R20, R21, 0x1, RZ", "MOV R22, R23"]
    assert sass_count.dependency_chain(body) == 30 + 4 * n + 5


def test_decode_search_finds_the_shipped_code_and_nothing_cheaper():
    # the check that the search can find a code: the shipped kind costs 9 a word
    shipped = decode_search.covers(
        1, decode_search.word_transforms(0) + [decode_search.shipped_fourth_pair()], 10)
    assert shipped and min(cost for cost, _ in shipped) == 9
    assert decode_search.covers(1, decode_search.word_transforms(0), 9) == []


@given(st.integers(0, 31))
def test_every_rotation_preimage_is_the_fields_moved(r):
    transforms = {name: bits for _, name, bits in decode_search.word_transforms(0)}
    moved = frozenset((i + r) % 32 for i in decode_search.FIELDS)
    assert (transforms.get(f"rot(a, {r})", moved) if r else transforms["a & mask"]) == moved
