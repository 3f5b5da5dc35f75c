"""benchmarks/peers.py's driver of triton_kernels' ``matmul_ogs`` (the MXFP4 MoE peer).

Run by hand, not by CI (it lives beside the benchmark, outside ``tests/``):
``PYTHONPATH=.peers python -m pytest -q benchmarks/test_peers.py``; without triton_kernels
on the path it is skipped as a whole. On a GPU the peer runs as the benchmark runs
it (the Hopper layout on an H200). In Triton's interpreter it runs in the plain strided
layout (the Hopper one upcasts with inline PTX) under ``interpreted``, which adapts the
library to the interpreter without changing what its kernels compute.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from wide_moe_triton import mx  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton_kernels.matmul_ogs",
                    reason="triton_kernels absent (PYTHONPATH=.peers, see benchmarks/NOTES.md)")
import peers  # noqa: E402

# 2I and L at least 256: the Hopper scale layout (8 warps) needs 256-column tiles.
E, L, I, K, B = 16, 256, 128, 4, 9
INTERPRETED = DEVICE.type == "cpu"


def expert_weights(seed=0):
    """Stock MXFP4 experts (reference.expert_rows' layout) and a routing of B tokens."""
    gen = torch.Generator().manual_seed(seed)
    w13, s13 = mx.quantize_mxfp4(torch.randn(E, 2 * I, L, generator=gen) * L ** -0.5)
    w2, s2 = mx.quantize_mxfp4(torch.randn(E, L, I, generator=gen) * I ** -0.5)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(B)]).int()
    weights = torch.rand(B, K, generator=gen).bfloat16()
    x = torch.randn(B, L, generator=gen).bfloat16()
    return [t.to(DEVICE) for t in (w13, s13, w2, s2, x, ids, weights)]


def _interpreter_specialize(fn, module, constants, tuples, name=None, do_not_specialize=()):
    """Stands for triton_kernels' ``specialize``, which rewrites a kernel's source into a
    compiled JITFunction with its activation and epilogue as constants: the interpreter
    has no compiled kernels, so this launches the original kernel with the constants and
    the argument tuples passed back in, and its Tensor wrappers unwrapped to torch."""
    glob = fn.fn.__globals__
    for key, value in list(glob.items()):
        # The interpreter cannot compute int % constexpr (MXFP_BLOCK_SIZE is one).
        if type(value).__name__ == "constexpr" and isinstance(value.value, int):
            glob[key] = value.value
    call_params = []
    for p in inspect.signature(fn.fn).parameters:
        if p not in constants:
            call_params.extend(tuples.get(p, [p]))

    def unwrap(a):
        return a.storage.data if hasattr(getattr(a, "storage", None), "data") else a

    class Launcher:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                bound = dict(zip(call_params, map(unwrap, args)))
                bound.update({k: unwrap(v) for k, v in kwargs.items()})
                for p, names in tuples.items():
                    bound[p] = tuple(bound.pop(n) for n in names)
                return fn[grid](**bound, **constants)
            return launch
    return Launcher()


@pytest.fixture
def interpreted(monkeypatch):
    """matmul_ogs made runnable in Triton's interpreter: kernels launched unspecialized,
    opt flags fixed (its heuristics query the CUDA device), masks cast to bool (the
    interpreter hands its C load an int32 mask for ``block & scalar``)."""
    if not INTERPRETED:
        yield
        return
    import triton.runtime.interpreter as interp

    if not hasattr(interp.InterpreterBuilder, "create_dot_scaled"):
        pytest.skip("this Triton's interpreter has no dot_scaled (3.6 has none; 3.9 has)")
    tk = peers.triton_kernels()
    monkeypatch.setattr(tk.matmul_ogs, "specialize", _interpreter_specialize)
    monkeypatch.setattr(tk.matmul_ogs, "_kernels", {})
    flags = tk.opt_flags.OptFlags(
        block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=1, group_m=1,
        xcd_swizzle=1, w_cache_modifier=None, split_k=1, is_persistent=False,
        fused_scatter=False, idle_sms=0, epilogue_subtile=1, arch=None,
        target_kernel_kwargs={})
    monkeypatch.setattr(tk.opt_flags, "_opt_flags", flags)
    load = interp.InterpreterBuilder.create_masked_load

    def bool_mask_load(self, ptrs, mask, other, *args, **kwargs):
        if mask.data.dtype != bool:
            mask = interp.TensorHandle(mask.data.astype(bool), mask.dtype)
        return load(self, ptrs, mask, other, *args, **kwargs)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_load", bool_mask_load)
    yield


@pytest.mark.parametrize("kind", ["hopper", "strided"])
def test_weights_convert_losslessly(kind):
    """Our [E, N, K/2] MXFP4 bytes and [E, N, K/32] scales come back unchanged out of the
    library's own unswizzle (the torch mirror of its kernels' in-register decode) as its
    [E, K/2, N] and [E, K/32, N], W13's rows interleaved gate, up, gate, up."""
    w13, s13, w2, s2 = (t.cpu() for t in expert_weights()[:4])
    w13_il, s13_il = peers.interleave_gate_up(w13), peers.interleave_gate_up(s13)
    assert torch.equal(w13_il[:, 0::2], w13[:, :I]) and torch.equal(w13_il[:, 1::2], w13[:, I:])
    for packed, scales in ((w13_il, s13_il), (w2, s2)):
        w, s = peers.to_matmul_ogs(packed, scales, kind)
        assert w.shape == [E, packed.shape[2] * 2, packed.shape[1]]
        assert w.storage.data.stride(-2) == 1  # K contiguous: the kernel's W_TRANSPOSE
        assert torch.equal(w.storage.layout.unswizzle_data(w.storage.data),
                           packed.transpose(1, 2))
        back = s.storage.layout.unswizzle_data(s.storage.data)
        groups, n = scales.shape[2], scales.shape[1]
        assert torch.equal(back[:, :groups, :n], scales.transpose(1, 2))
        assert not back[:, groups:, :n].any()  # the Hopper layout's K-group padding


def test_routing_sorts_pairs_by_expert():
    """The routing data of (ids, weights) is the stable sort of pairs t*K + k by expert:
    gather = that order, scatter = its inverse, counts and gammas to match."""
    *_, ids, weights = expert_weights()
    r = peers.make_routing(ids, weights, E)
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    assert torch.equal(r.gather.src_indx.long(), order)
    assert torch.equal(r.scatter.src_indx.long(), torch.argsort(order))
    assert torch.equal(r.data.expt_hist.long(), torch.bincount(flat, minlength=E))
    assert torch.equal(r.data.gate_scal, weights.reshape(-1)[order])


def test_matmul_ogs_matches_float64(interpreted):
    """Up GEMM, fused SwiGLU, down GEMM with gammas and combine, each within the
    benchmark's tolerance of float64 math from our stock weights."""
    w13, s13, w2, s2, x, ids, weights = expert_weights()
    peer = peers.MatmulOgsExperts(w13, s13, w2, s2)
    check = peers.check_matmul_ogs(peer, x, ids, weights, w13, s13, w2, s2)
    assert check.ok, str(check)
    assert check.tokens == B
    out = peer(x, ids, weights)
    assert out.shape == (B, L) and out.dtype == torch.bfloat16
    assert torch.equal(out, peer.gemms(x, peer.route(ids, weights)))


def test_check_rejects_a_misconfigured_peer(interpreted, monkeypatch):
    """W13 converted without the gate/up interleave SwiGLU expects: the check fails, so
    the benchmark would not time it."""
    w13, s13, w2, s2, x, ids, weights = expert_weights()
    monkeypatch.setattr(peers, "interleave_gate_up", lambda t: t)
    peer = peers.MatmulOgsExperts(w13, s13, w2, s2)
    check = peers.check_matmul_ogs(peer, x, ids, weights, w13, s13, w2, s2)
    assert not check.ok and check.up > 0.1, str(check)
