"""The Lamport mailbox: publish, the polled route and plan over T simulated ranks (T local
buffers and a table of their pointers), re-arming, and the timeout error record."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DEVICE, examples, poison
from wide_moe_triton import mx, reference
from wide_moe_triton.kernels import mailbox as M
from wide_moe_triton.kernels import plan as P
from wide_moe_triton.kernels import route as R

WIDE_ROWS = 64
ROUTE_CFG = {"BLOCK_T": 32, "num_warps": 4, "ZERO_BLOCK": 8}
PLAN_CFG = {"BLOCK_ROWS": 32, "BLOCK_COLS": 128, "num_warps": 4}
PUBLISH_CFG = {"BLOCK_T": 32, "BLOCK_C": 64, "num_warps": 4}


class Ranks:
    """T simulated ranks: one mailbox buffer each, the pointer table, one generation."""

    def __init__(self, world: int, latent: int, experts: int, generation: int = 0):
        self.world, self.latent, self.experts = world, latent, experts
        dims = M.MailboxDims(WIDE_ROWS, latent, experts)
        self.buffers = [M.empty_mailbox(dims, DEVICE) for _ in range(world)]
        self.table = M.mailbox_table(self.buffers)
        self.generation = torch.full((1,), generation, dtype=torch.int32, device=DEVICE)
        self.fresh = M.empty_mailbox(dims, DEVICE)

    def front(self, rank: int, logits: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """Rank ``rank``'s front rows: its logits shard, then its latent shard."""
        e, l_ = self.experts // self.world, self.latent // self.world
        return torch.cat([logits[:, e * rank:e * (rank + 1)],
                          latent[:, l_ * rank:l_ * (rank + 1)]], dim=1).contiguous()

    def publish(self, rank, logits, latent):
        M.publish(self.front(rank, logits, latent), self.table, rank, self.world,
                  self.generation, self.latent, self.experts, wide_rows=WIDE_ROWS,
                  config=PUBLISH_CFG)

    def read(self, rank, rows, bias, top_k, error, spin_limit=16, lists=None, shared=False):
        """The polled route (claiming into ``lists`` if given) and plan of rank ``rank``,
        outputs poisoned first: two launches, or one ``shared`` launch."""
        ids = poison(torch.empty(rows, top_k, dtype=torch.int32, device=DEVICE))
        weights = poison(torch.empty(rows, top_k, dtype=torch.bfloat16, device=DEVICE))
        out = (poison(torch.empty(rows, self.latent, dtype=torch.uint8, device=DEVICE)),
               poison(torch.empty(rows, self.latent // 32, dtype=torch.uint8, device=DEVICE)))
        poll = dict(latent=self.latent, world=self.world, error=error, spin_limit=spin_limit)
        buf, gen = self.buffers[rank], self.generation
        if shared:
            R.route_and_plan_mailbox(buf, gen, rows, bias, top_k, True, 2.5, lists=lists,
                                     ids=ids, weights=weights, out=out,
                                     config=dict(ROUTE_CFG, **PLAN_CFG), **poll)
        else:
            R.route_mailbox(buf, gen, rows, bias, top_k, True, 2.5, lists=lists, ids=ids,
                            weights=weights, config=ROUTE_CFG, **poll)
            P.quantize_mxfp8_mailbox(buf, gen, rows, out=out, config=PLAN_CFG, **poll)
        return ids, weights, out[0], out[1]

    def parity_is_empty(self, rank: int, parity: int) -> bool:
        return torch.equal(self.buffers[rank][parity], self.fresh[parity])


def published_latent(latent: torch.Tensor) -> torch.Tensor:
    """What a reader finds in the mailbox: the latent rounded once to BF16, -0 as +0."""
    half = latent.to(torch.bfloat16)
    return torch.where(half == 0, torch.zeros_like(half), half)


def inputs(seed, rows, experts, latent, specials):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, experts, generator=gen) * 2.0
    lat = torch.randn(rows, latent, generator=gen)
    if specials and rows:
        logits[0, ::2] = -0.0
        logits[rows // 2] = torch.randint(-1, 2, (experts,), generator=gen).float()
        lat[0, :40] = -0.0                        # a whole block of -0 too
        lat[rows - 1, 32:64] = torch.tensor(2.0 ** -130)  # BF16 subnormals
        lat[rows // 2, 64:96] = float("nan")
        lat[rows // 2, 96:100] = -float("inf")
    return logits, lat


def assert_read_matches(ids, weights, q, s, logits, lat, bias, top_k):
    ref_ids, ref_w = reference.route(logits, bias.cpu(), top_k, True, 2.5)
    assert torch.equal(ids.cpu(), ref_ids)
    nan = weights.cpu().isnan() & ref_w.isnan()
    assert ((weights.cpu().view(torch.int16) == ref_w.view(torch.int16)) | nan).all()
    ref_q, ref_s = mx.quantize_mxfp8(published_latent(lat))
    assert torch.equal(q.cpu(), ref_q)
    assert torch.equal(s.cpu(), ref_s)


@settings(max_examples=examples(24))
@given(seed=st.integers(0, 2**31 - 1), world=st.sampled_from([1, 2, 4]),
       rows=st.integers(1, WIDE_ROWS), experts=st.sampled_from([16, 24, 128]),
       top_k=st.sampled_from([4, 16]), generation=st.integers(0, 3), specials=st.booleans(),
       shared=st.booleans())
def test_every_rank_reads_the_unsharded_route_and_plan(seed, world, rows, experts, top_k,
                                                       generation, specials, shared):
    latent = 128
    ranks = Ranks(world, latent, experts, generation)
    parity = generation & 1
    # The other parity holds a later call's data: the readers must leave it alone.
    other = torch.randint(-2**15, 2**15, ranks.fresh[0].shape, dtype=torch.int16)
    for b in ranks.buffers:
        b[1 - parity].copy_(other)
    logits, lat = inputs(seed, rows, experts, latent, specials)
    bias = (torch.randn(experts, generator=torch.Generator().manual_seed(seed)) * 0.05)
    bias = bias.to(DEVICE)
    for r in range(world):
        ranks.publish(r, logits.to(DEVICE), lat.to(DEVICE))
    error = M.new_error_record(DEVICE)
    for r in range(world):
        lists = R.RoutingLists.empty(experts, WIDE_ROWS, DEVICE, generation=ranks.generation)
        ids, weights, q, s = ranks.read(r, rows, bias, top_k, error, lists=lists,
                                        shared=shared)
        assert_read_matches(ids, weights, q, s, logits, lat, bias, top_k)
        counts, pairs = lists.counts[parity].cpu(), lists.pairs[parity].cpu()
        for e in range(experts):
            want = (ids.cpu() == e).flatten().nonzero().flatten().tolist()
            assert sorted(pairs[e, :counts[e]].tolist()) == want
        assert ranks.parity_is_empty(r, parity), "not re-armed"
        assert torch.equal(ranks.buffers[r][1 - parity].cpu(), other)
    M.check_mailbox_error(error)
    assert error.tolist() == [0, 0]


def test_negative_zero_inputs_are_published_as_positive_zero():
    ranks = Ranks(2, 64, 16)
    logits = torch.full((3, 16), -0.0, device=DEVICE)
    lat = torch.full((3, 64), -0.0, device=DEVICE)
    lat[1, 5] = -1e-45  # rounds to BF16 -0
    for r in range(2):
        ranks.publish(r, logits, lat)
    row = ranks.buffers[0][0, :3]
    assert (row == 0).all(), row  # +0 everywhere: latent halves and both halves of words
    error = M.new_error_record(DEVICE)
    ids, weights, q, s = ranks.read(0, 3, torch.zeros(16, device=DEVICE), 4, error,
                                    spin_limit=4)
    assert error.tolist() == [0, 0]  # nothing looked empty
    assert_read_matches(ids, weights, q, s, logits.cpu(), lat.cpu(),
                        torch.zeros(16), 4)
    assert (q == 0).all()  # +0 codes, not the -0 (0x80) a -0 would give


def special_floats(gen, n):
    """FP32 values whose BF16 rounding is delicate: ties both ways, values just off a tie,
    subnormals, the largest floats, infinities, NaNs, signed zeros."""
    hi = torch.randint(-2**15, 2**15, (n,), generator=gen, dtype=torch.int32) << 16
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000, 0x0001, 0xFFFF], dtype=torch.int32)
    bits = hi | low[torch.randint(0, len(low), (n,), generator=gen)]
    fixed = torch.tensor([0x7F7FFFFF, -0x00800001, 0x7F800000, -0x00800000, 0x7FC00000,
                          0x7F800001, -1, 0x00000001, -0x7FFFFFFF, 0x00008000, 0x00018000,
                          0x007FFFFF, 0, -0x80000000], dtype=torch.int32)
    bits[: len(fixed)] = fixed
    return bits.view(torch.float32)


@given(seed=st.integers(0, 2**31 - 1), world=st.sampled_from([1, 2]),
       rows=st.integers(1, 8))
def test_publish_rounds_like_torch_and_copies_logit_bits(seed, world, rows):
    experts, latent = 16, 256
    gen = torch.Generator().manual_seed(seed)
    logits = special_floats(gen, rows * experts).reshape(rows, experts)
    lat = torch.where(torch.rand(rows, latent, generator=gen) < 0.5,
                      special_floats(gen, rows * latent).reshape(rows, latent),
                      torch.randn(rows, latent, generator=gen) * 1e3)
    ranks = Ranks(world, latent, experts, generation=1)
    for r in range(world):
        ranks.publish(r, logits.to(DEVICE), lat.to(DEVICE))
    want_half = lat.to(torch.bfloat16).view(torch.int16)
    want_half = torch.where(want_half == M.SENTINEL_BF16, 0, want_half)
    want_word = torch.where(logits.view(torch.int32) == M.SENTINEL_WORD, 0,
                            logits.view(torch.int32))
    for buf in ranks.buffers:
        got_half = buf[1, :rows, :latent].cpu()
        nan = lat.isnan()
        assert torch.equal(got_half[~nan], want_half[~nan])
        assert got_half[nan].view(torch.bfloat16).isnan().all()
        got_word = buf[1, :rows, latent:].cpu().contiguous().view(torch.int32)
        assert torch.equal(got_word, want_word)
        assert torch.equal(buf[1, rows:].cpu(), ranks.fresh[1, rows:].cpu())  # rows >= b
        assert torch.equal(buf[0].cpu(), ranks.fresh[0].cpu())               # other parity


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("missing, generation", [(1, 0), (3, 1), (0, 1)])
def test_a_rank_that_never_publishes_times_out_and_is_named(missing, generation, shared):
    world, latent, experts, rows = 4, 128, 16, 5
    ranks = Ranks(world, latent, experts, generation)
    logits, lat = inputs(11, rows, experts, latent, False)
    for r in range(world):
        if r != missing:
            ranks.publish(r, logits.to(DEVICE), lat.to(DEVICE))
    error = M.new_error_record(DEVICE)
    bias = torch.zeros(experts, device=DEVICE)
    ids, weights, q, s = ranks.read(2, rows, bias, 4, error, spin_limit=3, shared=shared)
    assert error.tolist() == [1 << missing, (generation & 1) + 1]
    assert ((ids >= 0) & (ids < experts)).all()
    assert ranks.parity_is_empty(2, generation & 1)  # re-armed even so
    with pytest.raises(RuntimeError, match=rf"parity {generation & 1}.*\[{missing}\]"):
        M.check_mailbox_error(error, "layer 3")
    assert error.tolist() == [0, 0]
    # The late rank catches up; the next call of that parity works again.
    for r in range(world):
        ranks.publish(r, logits.to(DEVICE), lat.to(DEVICE))
    ids, weights, q, s = ranks.read(2, rows, bias, 4, error, spin_limit=3, shared=shared)
    assert error.tolist() == [0, 0]
    assert_read_matches(ids, weights, q, s, logits, lat, bias, 4)


def test_route_alone_times_out_naming_every_missing_rank():
    ranks = Ranks(4, 128, 16, generation=0)
    logits, lat = inputs(5, 3, 16, 128, False)
    ranks.publish(0, logits.to(DEVICE), lat.to(DEVICE))
    ranks.publish(2, logits.to(DEVICE), lat.to(DEVICE))
    error = M.new_error_record(DEVICE)
    ids, _ = R.route_mailbox(ranks.buffers[0], ranks.generation, 3,
                             torch.zeros(16, device=DEVICE), 4, True, 1.0, latent=128,
                             world=4, error=error, spin_limit=2, config=ROUTE_CFG)
    assert error.tolist() == [0b1010, 1]
    assert ((ids >= 0) & (ids < 16)).all()
    with pytest.raises(RuntimeError, match=r"\[1, 3\]"):
        M.check_mailbox_error(error)


def test_check_mailbox_error_is_quiet_when_clear():
    error = M.new_error_record(DEVICE)
    M.check_mailbox_error(error)
    assert error.tolist() == [0, 0]


def test_fresh_mailbox_is_all_sentinel():
    buf = M.empty_mailbox(M.MailboxDims(4, 64, 16), DEVICE).cpu()
    assert buf.shape == (2, 4, 96)
    assert (buf[:, :, :64] == M.SENTINEL_BF16).all()
    assert (buf[:, :, 64:].contiguous().view(torch.int32) == M.SENTINEL_WORD).all()
    table = M.mailbox_table([buf, buf.clone()])
    assert table.dtype == torch.int64 and table[0].item() == buf.data_ptr()


def _good_publish_args():
    ranks = Ranks(2, 64, 16)
    return dict(front=torch.zeros(3, 8 + 32, device=DEVICE), table=ranks.table, rank=1,
                world=2, generation=ranks.generation, latent=64, num_experts=16,
                wide_rows=WIDE_ROWS)


@pytest.mark.parametrize("change, name", [
    (dict(front=torch.zeros(3, 41)), "front"),
    (dict(front=torch.zeros(3, 40, dtype=torch.float64)), "front"),
    (dict(front=torch.zeros(WIDE_ROWS + 1, 40)), "wide_rows"),
    (dict(table=torch.zeros(3, dtype=torch.int64)), "table"),
    (dict(rank=2), "rank"),
    (dict(world=0), "world"),
    (dict(generation=torch.zeros(1, dtype=torch.int64)), "generation"),
    (dict(latent=63), "latent"),
    (dict(num_experts=15), "num_experts"),
])
def test_publish_argument_errors_name_the_argument(change, name):
    args = _good_publish_args()
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
                 for k, v in change.items()})
    with pytest.raises((TypeError, ValueError), match=name):
        M.publish(**args)


def test_reader_argument_errors_name_the_argument():
    ranks = Ranks(1, 64, 16)
    error = M.new_error_record(DEVICE)
    bias = torch.zeros(16, device=DEVICE)
    buf, gen = ranks.buffers[0], ranks.generation
    with pytest.raises(ValueError, match="rows"):
        R.route_mailbox(buf, gen, WIDE_ROWS + 1, bias, 4, True, 1.0, latent=64, world=1,
                        error=error)
    with pytest.raises(ValueError, match="spin_limit"):
        R.route_mailbox(buf, gen, 2, bias, 4, True, 1.0, latent=64, world=1, error=error,
                        spin_limit=0)
    with pytest.raises(ValueError, match="world"):
        R.route_mailbox(buf, gen, 2, bias, 4, True, 1.0, latent=64, world=3, error=error)
    with pytest.raises(TypeError, match="mailbox"):
        R.route_mailbox(buf.float(), gen, 2, bias, 4, True, 1.0, latent=64, world=1,
                        error=error)
    with pytest.raises(ValueError, match="error"):
        P.quantize_mxfp8_mailbox(buf, gen, 2, latent=64, world=1, error=error[:1])
    with pytest.raises(ValueError, match="latent"):
        P.quantize_mxfp8_mailbox(buf, gen, 2, latent=48, world=1, error=error)
    with pytest.raises(ValueError, match="dims.latent"):
        M.empty_mailbox((4, 63, 16), DEVICE)
    with pytest.raises(ValueError, match=r"buffers\[1\]"):
        M.mailbox_table([buf, buf[:, :2]])


def _route_with_rank_1_missing(error, every_rank=False, **poll):
    """A rank-0 route over 4 ranks of which rank 1 never published (``every_rank``: all
    four did, so no poll waits): (ids, seconds)."""
    import time

    ranks = Ranks(4, 128, 16, generation=0)
    logits, lat = inputs(5, 3, 16, 128, False)
    for r in (0, 1, 2, 3) if every_rank else (0, 2, 3):
        ranks.publish(r, logits.to(DEVICE), lat.to(DEVICE))
    start = time.monotonic()
    ids, _ = R.route_mailbox(ranks.buffers[0], ranks.generation, 3,
                             torch.zeros(16, device=DEVICE), 4, True, 1.0, latent=128,
                             world=4, error=error, config=ROUTE_CFG, **poll)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return ids, time.monotonic() - start


@pytest.mark.parametrize("place", [0, M.TAIL_LATENT])
def test_after_a_timeout_a_poll_reads_once_and_names_what_is_missing(place):
    # A place already timed out this call: the next poll does not wait (rounds enough
    # for hours in the interpreter, a minute on a GPU's clock) and still names rank 1.
    error = M.new_error_record(DEVICE)
    error[1] = 1 << place
    ids, seconds = _route_with_rank_1_missing(error, spin_limit=10 ** 9, poll_timeout=60.0)
    assert seconds < 30, seconds
    assert error.tolist() == [0b10, (1 << place) | 1]
    assert ((ids >= 0) & (ids < 16)).all()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton's interpreter has no clock in a "
                    "kernel: its polls are bounded in rounds (the host waits in seconds)")
@pytest.mark.parametrize("seconds", [0.3, 1.5])
def test_a_gpu_poll_waits_its_time_bound_then_names_the_missing_rank(seconds):
    # The same launch once with every rank published, untimed: from a cold cache the
    # route's compile (seconds) would otherwise count in the timed call's bound.
    warm = M.new_error_record(DEVICE)
    _route_with_rank_1_missing(warm, every_rank=True, poll_timeout=seconds)
    assert warm.tolist() == [0, 0]
    error = M.new_error_record(DEVICE)
    _, took = _route_with_rank_1_missing(error, poll_timeout=seconds)
    assert seconds <= took < seconds + 5, took
    assert error.tolist() == [0b10, 1]


def test_a_bad_poll_timeout_is_refused_by_name():
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match="poll_timeout"):
            M.poll_timeout_ns(bad)
    assert M.poll_timeout_ns(None) == int(M.DEFAULT_POLL_TIMEOUT_S * 1e9)
    assert M.poll_timeout_ns(2.5) == 2_500_000_000
