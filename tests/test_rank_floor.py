"""benchmarks/rank0.py's per-rank floor: its byte count equals one made independently, from
the shard's buffer shapes (``layout.buffers``), the mailbox's and the tail rows' dims and
the set of experts a drawn routing touches; a ``--rank0`` run's exit status from the
failures it counted."""

import math
import pathlib
import sys
from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from wide_moe_triton import WideMoEConfig, layout
from wide_moe_triton.kernels import mailbox as mailbox_k

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import rank0  # noqa: E402

CONFIGS = [WideMoEConfig.tiny(tp=t, wide_rows=128) for t in (1, 2, 4)] + [
    WideMoEConfig.kimi_k3(tp=t) for t in (8, 16)]


def nbytes(cfg, name, per_expert=False) -> int:
    shape, dtype = layout.buffers(cfg, cfg.tp)[name]
    return math.prod(shape[1:] if per_expert else shape) * dtype.itemsize


def independent_count(cfg, b, routing) -> int:
    """The bytes rank 0 moves, counted from buffers and dims rather than formulas."""
    T, H = cfg.tp, cfg.hidden
    touched = {e for row in routing for e in row}
    experts = sum(nbytes(cfg, n, per_expert=True) for n in
                  ("w13", "w13_scales", "w2", "w2_scales")) * len(touched)
    dense = sum(nbytes(cfg, n) for n in ("gate_weight", "latent_down", "shared_gate_up",
                                         "shared_down", "latent_up"))
    box = mailbox_k.mailbox_dims(cfg)
    mailbox = T * b * (box.columns * 2 // T) + b * box.columns * 2
    tail_dims = mailbox_k.tail_dims(cfg)
    tail = 2 * T * b * tail_dims.columns * 2
    return experts + dense + mailbox + tail + 2 * b * H * 2


@settings(max_examples=60, deadline=None)
@given(cfg=st.sampled_from(CONFIGS), data=st.data())
def test_rank_floor_counts_every_byte(cfg, data):
    b = data.draw(st.integers(1, 64))
    E, K = cfg.num_experts, cfg.top_k
    routing = [data.draw(st.lists(st.integers(0, E - 1), min_size=K, max_size=K, unique=True))
               for _ in range(b)]
    touched = len({e for row in routing for e in row})
    parts = rank0.rank_floor(cfg, b, touched)
    assert sum(parts.values()) == independent_count(cfg, b, routing)
    # every stage's share is a part of the floor, each part in exactly one share
    shared = sorted(k for keys in rank0.STAGE_FLOOR.values() for k in keys)
    assert shared == sorted(parts)


@given(failures=st.lists(st.sampled_from([
    "tp8 uniform b=65: rank 0 alone differs: not timed",
    "tp8 balanced b=80; a poll timed out: error word 2",
    "tp16 raised RuntimeError: out of memory"]), max_size=3))
def test_a_run_with_any_failure_exits_1(failures, tmp_path_factory):
    run = rank0.Rank0Run(None, SimpleNamespace(name="dry run"),
                         tmp_path_factory.mktemp("rank0"))
    assert run.exit_status() == 0
    for what in failures:
        run.failed(what)
    assert run.exit_status() == rank0.exit_status(failures) == (1 if failures else 0)
