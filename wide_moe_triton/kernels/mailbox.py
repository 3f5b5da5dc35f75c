"""The Lamport mailbox: publish (every rank writes its shards into every rank's buffer)
and the poll/re-arm helpers that the route and plan kernels read it with.

Layout (docs/design.md): each rank owns one buffer of BF16 columns, ``[2 parities, wide_rows,
L + 2E]`` (stored as int16 bits). Row t of parity p is ``[latent BF16, columns 0..L-1 |
logits as FP32 words, columns L..L+2E-1]``; rank r's latent shard starts at column
``(L/T)*r`` and its logits at column ``L + 2*(E/T)*r`` (FP32 word ``L/2 + (E/T)*r`` of the
int32 view of the row). A word is empty when it holds negative zero (0x8000 per BF16,
0x80000000 per FP32 word); publishers write +0 for -0, so a published word is never
empty. Readers poll until their words are all non-empty, then write the sentinel back
(re-arm), so the buffer is all-sentinel again once every word of a call has been read.
The parity of a call is ``generation[0] & 1``, read on the device by every kernel.

Tail rows (the tail's all-reduces, kernels/tail.py): a second buffer a rank, int16
``[wide_rows, T, L + H]``. Row t, slot s holds rank s's BF16 partial of token t: the latent
in columns ``[0, L)``, the hidden row in ``[L, L + H)``. Rank r publishes into slot r of
every rank's buffer (``publish_partial``); each rank polls its own buffer's T slots, sums
them and re-arms them. Same sentinel, bounded polls and error record as the mailbox. No
parity: every call exchanges the latent, then the hidden rows, and a rank publishes an
exchange only once it has completed the one before, which took every peer's publication
of it, and a peer publishes only after reading and re-arming the region it is leaving.
So a region is never written for call n + 1 before every rank has read it for call n:
the two regions alternate as the mailbox's two parities do, and CUDA graph replay needs
no counter for them.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..checks import check_tensor
from ..tuning import config_for
from . import _INTERPRETED, quiet
from .bits import f32_to_bf16_bits

KERNEL = "publish"
DEFAULT = {"BLOCK_T": 8, "BLOCK_C": 256, "num_warps": 4}
SPACE = [{"BLOCK_T": t, "BLOCK_C": c, "num_warps": w}
         for t in (1, 4, 8, 16) for c in (128, 256, 512, 1024) for w in (2, 4, 8)
         if t * c <= 8192]

SENTINEL_BF16 = -0x8000        # 0x8000 as int16: BF16 negative zero
SENTINEL_WORD = -0x80000000    # 0x80000000 as int32: FP32 negative zero
BF16_NAN = 0x7FC0              # the quiet NaN every kernel writes for a NaN
# The same, for the kernels.
EMPTY_HALF: tl.constexpr = tl.constexpr(SENTINEL_BF16)
EMPTY_WORD: tl.constexpr = tl.constexpr(SENTINEL_WORD)
# A compiled poll is bounded in time, by the GPU's clock (%globaltimer): a round's length
# varies (a time-sliced GPU runs a process's polls only in its slices), a wait's does
# not. Ten seconds: past any healthy peer's lag between two calls (no compile happens
# inside a call once ``WideMoE.warmup`` ran), short enough that a dead peer is reported
# while its job can still be restarted. Triton's interpreter cannot read the clock: its
# polls are bounded in rounds, and CPU ranks wait on the host in seconds
# (``await_published``) before a polling launch.
DEFAULT_POLL_TIMEOUT_S = 10.0
# Rounds: the bound of an interpreted poll; compiled, the clock ends the wait first.
DEFAULT_SPIN_LIMIT = (1 << 31) - 1
TIMED: tl.constexpr = tl.constexpr(not _INTERPRETED)
MAX_WORLD = 32                 # ranks are bits of the int32 error record
# The places a poll can time out in, bits of the error record's second word beside the
# mailbox's parities 0 and 1.
TAIL_LATENT, TAIL_HIDDEN = 2, 3
PLACES = {0: "mailbox parity 0", 1: "mailbox parity 1",
          TAIL_LATENT: "tail rows of the latent all-reduce",
          TAIL_HIDDEN: "tail rows of the hidden all-reduce"}
TAIL_KERNEL = "tail_publish"
TAIL_DEFAULT = {"BLOCK_T": 4, "BLOCK_C": 1024, "num_warps": 4}


def shape_key(experts_per_rank: int, latent_per_rank: int, world: int) -> str:
    return f"E{experts_per_rank}_L{latent_per_rank}_T{world}"


class MailboxDims(NamedTuple):
    """The sizes that fix a mailbox buffer's shape ``[2, wide_rows, latent + 2*num_experts]``."""

    wide_rows: int
    latent: int
    num_experts: int

    @property
    def columns(self) -> int:
        return self.latent + 2 * self.num_experts


def mailbox_dims(dims) -> MailboxDims:
    """``MailboxDims`` of a ``WideMoEConfig``, a ``MailboxDims`` or a 3-tuple
    (wide_rows, latent, num_experts)."""
    if hasattr(dims, "wide_rows") and hasattr(dims, "latent") and hasattr(dims, "num_experts"):
        out = MailboxDims(dims.wide_rows, dims.latent, dims.num_experts)
    else:
        try:
            out = MailboxDims(*dims)
        except TypeError:
            raise TypeError("dims must be a WideMoEConfig, a MailboxDims or a tuple "
                            f"(wide_rows, latent, num_experts), got {dims!r}") from None
    for name, value in out._asdict().items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"dims.{name} must be a positive int, got {value!r}")
    if out.latent % 2:
        raise ValueError(f"dims.latent ({out.latent}) must be even: the logits words "
                         "must sit on 4-byte boundaries")
    return out


def empty_mailbox(dims, device) -> torch.Tensor:
    """A fresh mailbox buffer: int16 ``[2, wide_rows, latent + 2*num_experts]``, all empty
    (latent columns 0x8000, logits words 0x80000000: low half 0x0000, high half 0x8000)."""
    d = mailbox_dims(dims)
    buffer = torch.empty((2, d.wide_rows, d.columns), dtype=torch.int16, device=device)
    return arm_mailbox(buffer, d.latent)


def arm_mailbox(buffer: torch.Tensor, latent: int) -> torch.Tensor:
    """Fill an existing buffer (e.g. one from symmetric memory) with the empty sentinels,
    in place, its first ``latent`` columns being the BF16 latent; returns it."""
    check_mailbox("buffer", buffer)
    if not isinstance(latent, int) or isinstance(latent, bool) or latent % 2 or not (
            0 < latent < buffer.shape[2]):
        raise ValueError(f"latent must be a positive even int below the buffer's "
                         f"{buffer.shape[2]} columns, got {latent!r}")
    halves = buffer.view(torch.int16)
    halves[:, :, :latent].fill_(SENTINEL_BF16)
    halves[:, :, latent:].view(torch.int32).fill_(SENTINEL_WORD)
    return buffer


def check_mailbox(name: str, buffer, dims: MailboxDims | None = None) -> None:
    """Raise unless ``buffer`` is a contiguous int16 or BF16 ``[2, rows, columns]`` tensor
    (of ``dims``' shape when given)."""
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dtype not in (torch.int16, torch.bfloat16):
        raise TypeError(f"{name} must be torch.int16 or torch.bfloat16, got {buffer.dtype}")
    shape = (2, None, None) if dims is None else (2, dims.wide_rows, dims.columns)
    check_tensor(name, buffer, buffer.dtype, shape)
    if buffer.shape[2] % 2:
        raise ValueError(f"{name} must have an even number of columns, got {buffer.shape[2]}")


def mailbox_table(buffers) -> torch.Tensor:
    """int64 ``[T]`` of the buffers' data pointers (rank order), on their device: what the
    kernels cast back to pointers to reach every rank's buffer."""
    return _pointer_table(buffers, check_mailbox, "mailbox")


def _pointer_table(buffers, check, what: str) -> torch.Tensor:
    buffers = list(buffers)
    if not buffers:
        raise ValueError(f"buffers must hold at least one {what} buffer")
    for i, b in enumerate(buffers):
        check(f"buffers[{i}]", b)
        if b.shape != buffers[0].shape or b.device != buffers[0].device:
            raise ValueError(f"buffers[{i}] is {list(b.shape)} on {b.device}, but buffers[0] "
                             f"is {list(buffers[0].shape)} on {buffers[0].device}")
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64,
                        device=buffers[0].device)


def new_error_record(device) -> torch.Tensor:
    """A cleared error record: int32 [2] = (bitmask of missing ranks, bitmask of the
    places that timed out: bit p for mailbox parity p, bits ``TAIL_LATENT`` and
    ``TAIL_HIDDEN`` for the tail rows)."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def check_mailbox_error(error: torch.Tensor, context: str = "") -> None:
    """Raise RuntimeError naming the places (mailbox parity, tail rows) and the ranks a
    poll timed out on, if the record ``error`` (int32 [2]) is set; the record is cleared
    first. Reads the record on the host (a device sync)."""
    check_tensor("error", error, torch.int32, (2,))
    raise_if_set(error, context)


def raise_if_set(error: torch.Tensor, context: str = "") -> None:
    """``check_mailbox_error`` of a record already known to be int32 [2]."""
    mask, places = (int(v) for v in error.tolist())
    if mask == 0 and places == 0:
        return
    error.zero_()
    ranks = [r for r in range(MAX_WORLD) if (mask >> r) & 1]
    where = f" in {context}" if context else ""
    named = ", ".join(PLACES.get(p, f"place {p}") for p in range(MAX_WORLD) if (places >> p) & 1)
    raise RuntimeError(
        f"wide_moe_triton: mailbox poll timed out{where}: {named} still empty in the "
        f"columns of rank(s) {ranks} (they never published this call); the results of "
        "this call are invalid")


# ----------------------------------------------------------------------------- host waits
# Where the kernels run in Triton's interpreter, one poll round takes milliseconds and
# spins a core that a peer process may need; ranks in processes on a CPU therefore wait
# on the host, with a bound in seconds, before launching a kernel that polls: it then
# finds every word published on its first read. A timeout is recorded as a kernel's is.

def missing_in_mailbox(mailbox: torch.Tensor, parity: int, rows: int, latent: int,
                       world: int) -> list[int]:
    """The ranks with a word still empty in rows 0..rows-1 of parity ``parity`` of this
    rank's ``mailbox`` (int16 ``[2, wide_rows, L + 2E]``, ``latent`` = L columns)."""
    row = mailbox[parity, :rows]
    halves = row[:, :latent]
    words = row[:, latent:].view(torch.int32)
    owners = torch.cat([
        (halves == SENTINEL_BF16).any(0).nonzero().flatten() // (latent // world),
        (words == SENTINEL_WORD).any(0).nonzero().flatten() // (words.shape[1] // world)])
    return sorted(set(owners.tolist()))


def missing_in_tail(tail: torch.Tensor, dims: TailDims, rows: int, which: str) -> list[int]:
    """The ranks whose slot of region ``which`` ("latent" or "hidden") still holds an
    empty word in rows 0..rows-1 of this rank's ``tail`` buffer."""
    region = tail_region(dims, which)
    part = tail[:rows, :, region.column:region.column + region.width]
    return (part == SENTINEL_BF16).any(2).any(0).nonzero().flatten().tolist()


def record(error: torch.Tensor, ranks, place: int) -> None:
    """OR the ranks and the place into the error record, as a kernel's timed-out poll
    does (``record_missing``)."""
    mask = sum(1 << r for r in ranks)
    signed = lambda v: v - (1 << 32) if v >= 1 << 31 else v  # noqa: E731  (int32 bits)
    error[0] |= signed(mask)
    error[1] |= signed(1 << place)


def await_published(missing, error: torch.Tensor, place: int, timeout: float,
                    gone=None) -> list[int] | None:
    """Wait on the host until ``missing()`` (the ranks whose words are still empty, e.g.
    ``missing_in_mailbox``) is empty: None then. Gives up after ``timeout`` seconds, or
    as soon as ``gone(ranks)`` (a callable, optional: which of the ranks' processes have
    exited) names every rank still missing (live peers late to publish are waited for):
    the missing ranks and ``place`` go to ``error`` and the ranks found gone are returned
    (an empty list: the time ran out)."""
    deadline = time.monotonic() + timeout
    pause = 5e-5
    while True:
        ranks = missing()
        if not ranks:
            return None
        dead = gone(ranks) if gone is not None else []
        if len(dead) == len(ranks) or time.monotonic() >= deadline:
            record(error, ranks, place)
            return dead
        # Sleeping, not spinning: on a CPU the peers being waited for need the cores.
        time.sleep(pause)
        pause = min(2 * pause, 5e-3)


# ----------------------------------------------------------------------------- jit helpers

@triton.jit
def publishable_bf16(x):
    """``f32_to_bf16_bits`` with a -0 result written as +0, so it never equals the sentinel."""
    half = f32_to_bf16_bits(x)
    return tl.where(half == EMPTY_HALF, 0, half).to(tl.int16)


@triton.jit
def publishable_word(bits):
    """FP32 bits (int32) with -0 written as +0, so a word never equals the sentinel."""
    return tl.where(bits == EMPTY_WORD, 0, bits)


@triton.jit
def clock_ns():
    """The GPU's global clock in nanoseconds (``%globaltimer``); 0 in Triton's
    interpreter, which has no inline assembly (its polls are bounded in rounds)."""
    if TIMED:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                         dtype=tl.int64, is_pure=False, pack=1)
    else:
        return 0


@triton.jit
def poll(ptrs, mask, column, per_rank, spin_limit, timeout_ns, error_ptr, parity,
         SENTINEL: tl.constexpr):
    """The words at ``ptrs`` (where ``mask``; masked-off lanes read 0) once published:
    volatile reads, repeated for the words still equal to ``SENTINEL`` until none is, or
    ``timeout_ns`` nanoseconds have passed on the GPU's clock, or ``spin_limit`` rounds
    (at least one) are done. While the error record names a place (a poll has timed out,
    until ``rearm()``), a poll reads once and does not wait: a silent peer costs one
    bound, not one a poll. On a timeout the still-empty words are returned as read (the
    sentinel) and their owners recorded (``record_missing``: ``column``, same shape, each
    word's column, ``per_rank`` columns a rank)."""
    values = tl.load(ptrs, mask=mask, other=0, volatile=True)
    # Both sentinels (-0 as BF16 or FP32 bits) are the least value of their integer type:
    # one min finds any empty word, and the per-word bookkeeping runs only then.
    if tl.min(values) == SENTINEL:
        empty = mask & (values == SENTINEL)
        # The loop's condition must be the same in every thread of the program (its
        # reductions are barriers), but the error word and the clock are read by each
        # thread at its own moment: both enter it only through a reduction.
        timed_out = tl.max(tl.load(error_ptr + 1 + tl.zeros_like(column), volatile=True))
        limit = tl.where(timed_out != 0, 1, spin_limit)
        rounds = 1
        start = clock_ns()
        while (tl.max((empty & (clock_ns() - start < timeout_ns)).to(tl.int32)) != 0) & (
                rounds < limit):
            again = tl.load(ptrs, mask=empty, other=SENTINEL, volatile=True)
            values = tl.where(empty, again, values)
            empty = empty & (values == SENTINEL)
            rounds += 1
        record_missing(error_ptr, empty, column, per_rank, parity)
    return values


@triton.jit
def record_missing(error_ptr, empty, column, per_rank, parity):
    """OR ``1 << owner`` of every still-empty word into error[0] and ``1 << parity`` (the
    place: a mailbox parity or ``TAIL_LATENT``/``TAIL_HIDDEN``) into error[1]; nothing
    when no word is empty. A word's owner is the rank of its
    ``column`` (same shape as ``empty``), ``per_rank`` columns a rank: divided here, on
    the timeout path only, not on every poll."""
    if tl.max(empty.to(tl.int32)) != 0:
        owner = column // per_rank
        tl.atomic_or(error_ptr + tl.zeros_like(owner), 1 << owner, mask=empty, sem="relaxed")
        tl.atomic_or(error_ptr + 1, 1 << parity, sem="relaxed")


@triton.jit
def rearm(ptrs, mask, SENTINEL: tl.constexpr):
    """Write ``SENTINEL`` back into the words at ``ptrs`` (where ``mask``)."""
    # Every thread of the program has read its words before any is overwritten: with a
    # replicated layout another thread may hold a copy of the same word.
    tl.debug_barrier()
    tl.store(ptrs, tl.full(ptrs.shape, SENTINEL, ptrs.dtype.element_ty), mask=mask)


@triton.jit
def take(ptrs, mask, column, per_rank, spin_limit, timeout_ns, error_ptr, parity,
         SENTINEL: tl.constexpr):
    """The words at ``ptrs`` (where ``mask``) once published (``poll``), the mailbox
    re-armed behind them."""
    values = poll(ptrs, mask, column, per_rank, spin_limit, timeout_ns, error_ptr, parity,
                  SENTINEL)
    rearm(ptrs, mask, SENTINEL)
    return values


@triton.jit
def _publish_kernel(front_ptr, front_stride, table_ptr, gen_ptr, rank, world, rows,
                    experts_per_rank, latent_per_rank, latent, row_stride, parity_stride,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_front = (t[:, None] < rows) & (c[None, :] < experts_per_rank + latent_per_rank)
    x = tl.load(front_ptr + t[:, None].to(tl.int64) * front_stride + c[None, :],
                mask=in_front, other=0.0)
    is_logit = c[None, :] < experts_per_rank
    word = publishable_word(x.to(tl.int32, bitcast=True))
    half = publishable_bf16(x)
    parity = tl.load(gen_ptr) & 1
    # Offsets in BF16 columns of the row; the row starts are even (columns are), so a
    # halved offset is the same place in the int32 view.
    row = parity.to(tl.int64) * parity_stride + t[:, None].to(tl.int64) * row_stride
    word_at = row // 2 + (latent // 2 + experts_per_rank * rank + c[None, :])
    half_at = row + (latent_per_rank * rank + c[None, :] - experts_per_rank)
    # One peer after another: multicast is not assumed.
    for d in range(world):
        base = tl.load(table_ptr + d)
        tl.store(base.to(tl.pointer_type(tl.int32)) + word_at, word, mask=in_front & is_logit)
        tl.store(base.to(tl.pointer_type(tl.int16)) + half_at, half,
                 mask=in_front & ~is_logit)


def _check_rank(rank, world) -> None:
    if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= MAX_WORLD:
        raise ValueError(f"world must be an int in [1, {MAX_WORLD}], got {world!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, world={world}), got {rank!r}")


def poll_timeout_ns(seconds: float | None) -> int:
    """A poll's time bound in nanoseconds, of ``seconds`` (None: ``DEFAULT_POLL_TIMEOUT_S``);
    refused unless a positive finite number."""
    if seconds is None:
        seconds = DEFAULT_POLL_TIMEOUT_S
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            0 < seconds < float("inf")):
        raise ValueError(f"poll_timeout must be a positive number of seconds or None, "
                         f"got {seconds!r}")
    return max(1, int(seconds * 1e9))


def check_generation(generation, device) -> None:
    check_tensor("generation", generation, torch.int32, (1,), device)


def check_poll_args(mailbox, generation, rows, world, error, spin_limit) -> torch.device:
    """The checks every polled reader (route, plan) makes of its mailbox arguments; the
    mailbox's device, which every other argument must share."""
    check_mailbox("mailbox", mailbox)
    device = mailbox.device
    if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= MAX_WORLD:
        raise ValueError(f"world must be an int in [1, {MAX_WORLD}], got {world!r}")
    if not isinstance(rows, int) or isinstance(rows, bool) or not 0 <= rows <= mailbox.shape[1]:
        raise ValueError(f"rows must be an int in [0, wide_rows={mailbox.shape[1]}], "
                         f"got {rows!r}")
    if not isinstance(spin_limit, int) or isinstance(spin_limit, bool) or spin_limit < 1:
        raise ValueError(f"spin_limit must be a positive int, got {spin_limit!r}")
    check_generation(generation, device)
    check_tensor("error", error, torch.int32, (2,), device)
    return device


def publish(front: torch.Tensor, table: torch.Tensor, rank: int, world: int,
            generation: torch.Tensor, latent: int, num_experts: int, *, wide_rows: int,
            config: dict | None = None) -> None:
    """Write this rank's shards of ``front`` into every rank's mailbox, parity
    ``generation[0] & 1``.

    ``front`` FP32 [b, E/T + L/T] (rows of stride(1) == 1): rank ``rank``'s logits shard,
    then its latent shard. ``table`` int64 [T]: every rank's buffer pointer
    (``mailbox_table``), buffers ``[2, wide_rows, L + 2E]``. For every row t < b and every
    destination d in turn it writes the logits' FP32 bits at word ``L/2 + (E/T)*rank`` of
    row t and the latent rounded once to BF16 (RNE, as torch; NaN -> 0x7FC0) at column
    ``(L/T)*rank``; a -0 (or a value rounding to -0) is written as +0.
    """
    _check_rank(rank, world)
    for name, value in (("latent", latent), ("num_experts", num_experts),
                        ("wide_rows", wide_rows)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_experts % world or latent % world:
        raise ValueError(f"num_experts ({num_experts}) and latent ({latent}) must be "
                         f"multiples of world ({world})")
    if latent % 2:
        raise ValueError(f"latent ({latent}) must be even")
    experts_per_rank, latent_per_rank = num_experts // world, latent // world
    check_tensor("front", front, torch.float32, ("b", experts_per_rank + latent_per_rank),
                 contiguous=False)
    if front.stride(1) != 1:
        raise ValueError("front must have contiguous rows (stride 1 along its last dim)")
    rows = front.shape[0]
    if rows > wide_rows:
        raise ValueError(f"front has {rows} rows, more than wide_rows ({wide_rows})")
    check_tensor("table", table, torch.int64, (world,), front.device)
    check_generation(generation, front.device)
    if rows == 0:
        return
    run = resolve_publish(rows, rank, world, latent, num_experts, wide_rows, front.device,
                          config)
    launch_publish(run, front, table, generation)


def resolve_publish(rows: int, rank: int, world: int, latent: int, num_experts: int,
                    wide_rows: int, device, config: dict | None = None) -> tuple:
    """(grid, arguments but the tensors) of ``publish`` of rows >= 1 rows (checked
    sizes): ``config`` as given or the tuned one."""
    experts_per_rank, latent_per_rank = num_experts // world, latent // world
    cfg = config or config_for(KERNEL, shape_key(experts_per_rank, latent_per_rank, world),
                               rows, DEFAULT, device)
    row_stride = latent + 2 * num_experts
    grid = (triton.cdiv(rows, cfg["BLOCK_T"]),
            triton.cdiv(experts_per_rank + latent_per_rank, cfg["BLOCK_C"]))
    return grid, dict(rank=rank, world=world, rows=rows, experts_per_rank=experts_per_rank,
                      latent_per_rank=latent_per_rank, latent=latent, row_stride=row_stride,
                      parity_stride=wide_rows * row_stride, BLOCK_T=cfg["BLOCK_T"],
                      BLOCK_C=cfg["BLOCK_C"], num_warps=cfg["num_warps"])


def launch_publish(run: tuple, front: torch.Tensor, table: torch.Tensor,
                   generation: torch.Tensor) -> None:
    """``publish`` of checked arguments with a resolved launch (``resolve_publish``)."""
    grid, args = run
    with quiet():
        _publish_kernel[grid](front_ptr=front, front_stride=front.stride(0), table_ptr=table,
                              gen_ptr=generation, **args)


# ----------------------------------------------------------------------------- tail rows

class TailDims(NamedTuple):
    """The sizes that fix a tail buffer's shape ``[wide_rows, world, latent + hidden]``."""

    wide_rows: int
    world: int
    latent: int
    hidden: int

    @property
    def columns(self) -> int:
        return self.latent + self.hidden


class TailRegion(NamedTuple):
    """Where one all-reduce's partials sit in a slot: ``width`` columns from ``column``;
    ``place``: its bit in the error record."""

    column: int
    width: int
    place: int


def tail_dims(cfg) -> TailDims:
    """``TailDims`` of a ``WideMoEConfig`` (world = cfg.tp)."""
    dims = TailDims(cfg.wide_rows, cfg.tp, cfg.latent, cfg.hidden)
    for name, value in dims._asdict().items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if dims.world > MAX_WORLD:
        raise ValueError(f"world must be at most {MAX_WORLD}, got {dims.world}")
    return dims


def tail_region(dims: TailDims, which: str) -> TailRegion:
    """The region of the ``"latent"`` or the ``"hidden"`` all-reduce."""
    if which == "latent":
        return TailRegion(0, dims.latent, TAIL_LATENT)
    if which == "hidden":
        return TailRegion(dims.latent, dims.hidden, TAIL_HIDDEN)
    raise ValueError(f"which must be 'latent' or 'hidden', got {which!r}")


def empty_tail(cfg, device) -> torch.Tensor:
    """A fresh tail buffer of ``cfg``'s dims: int16 ``[wide_rows, T, L + H]``, all empty."""
    d = tail_dims(cfg)
    return arm_tail(torch.empty((d.wide_rows, d.world, d.columns), dtype=torch.int16,
                                device=device))


def arm_tail(buffer: torch.Tensor) -> torch.Tensor:
    """Fill a tail buffer (e.g. one from symmetric memory) with the sentinel, in place;
    returns it."""
    check_tail("buffer", buffer)
    return buffer.fill_(SENTINEL_BF16)


def check_tail(name: str, buffer, dims: TailDims | None = None) -> None:
    """Raise unless ``buffer`` is a contiguous int16 ``[rows, world, columns]`` tensor (of
    ``dims``' shape when given)."""
    shape = (None, None, None) if dims is None else (dims.wide_rows, dims.world, dims.columns)
    check_tensor(name, buffer, torch.int16, shape)


def tail_table(buffers) -> torch.Tensor:
    """int64 ``[T]`` of the tail buffers' data pointers, rank order (as ``mailbox_table``)."""
    return _pointer_table(buffers, check_tail, "tail")


@triton.jit
def _publish_partial_kernel(src_ptr, src_stride, table_ptr, rank, world, rows, width,
                            column, row_stride, slot_stride,
                            BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (t[:, None] < rows) & (c[None, :] < width)
    half = tl.load(src_ptr + t[:, None].to(tl.int64) * src_stride + c[None, :], mask=mask,
                   other=0)
    half = tl.where(half == EMPTY_HALF, 0, half).to(tl.int16)  # -0 goes out as +0
    at = t[:, None].to(tl.int64) * row_stride + (rank * slot_stride + column + c[None, :])
    # One peer after another: multicast is not assumed.
    for d in range(world):
        base = tl.load(table_ptr + d)
        tl.store(base.to(tl.pointer_type(tl.int16)) + at, half, mask=mask)


def publish_partial(partial: torch.Tensor, table: torch.Tensor, rank: int, dims: TailDims,
                    which: str, *, config: dict | None = None) -> None:
    """Write this rank's BF16 ``partial`` [b, width] (``which`` = "latent": width L,
    "hidden": width H; rows of stride(1) == 1) into slot ``rank`` of rows 0..b-1 of every
    rank's tail buffer (``table``: ``tail_table``, buffers of ``dims``), each peer in
    turn; a -0 is written as +0, so a published value never equals the sentinel."""
    _check_rank(rank, dims.world)
    region = tail_region(dims, which)
    check_tensor("partial", partial, torch.bfloat16, (None, region.width), contiguous=False)
    if partial.stride(1) != 1:
        raise ValueError("partial must have contiguous rows (stride 1 along its last dim)")
    rows = partial.shape[0]
    if rows > dims.wide_rows:
        raise ValueError(f"partial has {rows} rows, more than wide_rows ({dims.wide_rows})")
    check_tensor("table", table, torch.int64, (dims.world,), partial.device)
    if rows == 0:
        return
    cfg = config_for(TAIL_KERNEL, f"N{region.width}_T{dims.world}", rows, TAIL_DEFAULT,
                     partial.device, given=config)
    grid = (triton.cdiv(rows, cfg["BLOCK_T"]), triton.cdiv(region.width, cfg["BLOCK_C"]))
    with quiet():
        _publish_partial_kernel[grid](
            partial.view(torch.int16), partial.stride(0), table, rank, dims.world, rows,
            region.width, region.column, dims.world * dims.columns, dims.columns,
            BLOCK_T=cfg["BLOCK_T"], BLOCK_C=cfg["BLOCK_C"], num_warps=cfg["num_warps"])
