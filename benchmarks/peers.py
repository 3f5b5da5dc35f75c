"""The experts stage's peers that need code from outside this repository (PEERS.md),
built over our own weights and routing so that bench_layer.py checks, then times, them
beside our engine.

- **triton_kernels ``matmul_ogs``** (Triton's own MoE library; vLLM's MXFP4 path on
  Hopper). ``MatmulOgsExperts`` converts one rank's stock MXFP4 experts into its layout
  once, as vLLM does at load time, and then runs per call what vLLM runs per forward:
  routing metadata from (ids, weights), the up GEMM with its fused SwiGLU, the down GEMM
  with the router weights (gammas) and the top-K combine. Its code is not ours and is
  never committed: it is imported only when ``triton_kernels`` is importable (on the GPU
  machine: ``PYTHONPATH=.peers``, the folder vLLM 0.33.0's wheel ships as
  ``vllm/third_party/triton_kernels``; benchmarks/NOTES.md says how it got there). This
  module targets that copy's API generation (``routing_from_bitmatrix``, no
  ``SparseMatrix``: vLLM calls it "3.5.1").
- **vLLM ``fused_moe``**: cannot run; ``FUSED_MOE_ABSENT`` says why.
- **FlashInfer's CUTLASS fused MoE** (MXFP4 x BF16 on SM90): cannot run;
  ``FLASHINFER_ABSENT`` says why.

Activation: the peer fuses its own SwiGLU (``gelu*sigmoid(1.702*gelu)*(linear+1)``,
clamped at 7, vLLM's gpt-oss defaults) where we apply SiTU; the costs are alike (a few
FLOPs a hidden value in a memory-bound GEMM), the values are not, so the check below
holds each GEMM to float64 math separately instead of comparing with our layer.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from wide_moe_triton import mx  # noqa: E402

SWIGLU_ALPHA = 1.702  # vLLM's triton_kernel_fused_experts defaults (gpt-oss)
SWIGLU_LIMIT = 7.0
CHECK_TOLERANCE = 2e-2  # relative norm error: BF16 outputs are ~3e-3 off; a wrong layout ~1
MATMUL_OGS = "triton_kernels matmul_ogs mxfp4"
FUSED_MOE = "vLLM fused_moe"
FLASHINFER = "FlashInfer cutlass_fused_moe mxfp4 x bf16"

FUSED_MOE_ABSENT = (
    "not run: it is no standalone kernel. vllm/model_executor/layers/fused_moe/"
    "fused_moe.py imports vllm._custom_ops (compiled moe_align_block_size, moe_sum), "
    "vllm.envs and vllm.platforms, i.e. the whole vllm package; vllm 0.33.0 pins "
    "torch==2.14.0 and ships ~660 MB of compiled extensions built against it, while the "
    "GPU machine has torch 2.11, no internet and a 64 MiB carry. Nor does it take MXFP4 "
    "weights: its functional fused_experts raises NotImplementedError for an "
    "ocp_mx_scheme, and vLLM sends MXFP4 MoE on Hopper to the triton_kernels path "
    "measured here (or Marlin)."
)

FLASHINFER_ABSENT = (
    "not run: its SM90 kernels are compiled by nvcc on first use, and the fused-MoE "
    "module is 248 translation units (220 generated CUTLASS GEMM files at 115-270 s each "
    "with nvcc 13.0: about 11 CPU-hours, over 40 minutes on the GPU machine's 16 cores, "
    "against 10 minutes a command); its prebuilt kernels (flashinfer-jit-cache, 295 MB "
    "for SM90a) are not on PyPI and exceed the 64 MiB carry. At TP16 it could not run at "
    "all: the down GEMM's K = 192 gives 6 scale groups a row, which its SM90 scale "
    "interleave refuses (benchmarks/NOTES.md, Peers)."
)


class PeerUnavailable(RuntimeError):
    """A peer that cannot run on this machine; the message says why."""


# ----------------------------------------------------------------------- the library

@dataclasses.dataclass(frozen=True)
class _TritonKernels:
    """The parts of triton_kernels this module uses, imported once."""

    path: str
    matmul_ogs: object       # triton_kernels.matmul_ogs (matmul_ogs, PrecisionConfig, ...)
    routing: object          # triton_kernels.routing (routing_from_bitmatrix)
    tensor: object           # triton_kernels.tensor (Tensor, Bitmatrix, FP4, ...)
    layout: object           # triton_kernels.tensor_details.layout
    numerics: object         # triton_kernels.numerics (InFlexData)
    opt_flags: object        # triton_kernels.matmul_ogs_details.opt_flags
    swiglu_fn: object        # the JIT function matmul_ogs fuses as its activation


_TK: _TritonKernels | None = None


def triton_kernels() -> _TritonKernels:
    """triton_kernels' modules, or ``PeerUnavailable`` naming what is missing."""
    global _TK
    if _TK is not None:
        return _TK
    try:
        mods = {name: importlib.import_module(f"triton_kernels.{name}") for name in (
            "matmul_ogs", "routing", "tensor", "tensor_details.layout", "numerics",
            "matmul_ogs_details.opt_flags", "swiglu")}
    except ImportError as err:
        raise PeerUnavailable(
            f"triton_kernels not importable ({err}); put vllm 0.33.0's "
            "vllm/third_party/triton_kernels on PYTHONPATH (benchmarks/NOTES.md, "
            "Peers)") from err
    if hasattr(mods["tensor"], "SparseMatrix") or not hasattr(mods["routing"],
                                                               "routing_from_bitmatrix"):
        raise PeerUnavailable(
            f"triton_kernels at {mods['routing'].__file__} has another API generation than "
            "vllm 0.33.0's copy (routing_from_bitmatrix, no SparseMatrix) that this "
            "benchmark drives")
    _TK = _TritonKernels(
        path=str(pathlib.Path(mods["routing"].__file__).parent),
        matmul_ogs=mods["matmul_ogs"], routing=mods["routing"], tensor=mods["tensor"],
        layout=mods["tensor_details.layout"], numerics=mods["numerics"],
        opt_flags=mods["matmul_ogs_details.opt_flags"], swiglu_fn=mods["swiglu"].swiglu_fn)
    return _TK


def availability() -> dict[str, str]:
    """{peer: "available (where)" or "not run: why"} for the header of a benchmark run."""
    try:
        where = f"available ({triton_kernels().path})"
    except PeerUnavailable as err:
        where = f"not run: {err}"
    return {MATMUL_OGS: where, FUSED_MOE: FUSED_MOE_ABSENT, FLASHINFER: FLASHINFER_ABSENT}


# ------------------------------------------------------------------ weights, routing

def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, X] with the gate rows then the up rows -> rows g0, u0, g1, u1, ...: the
    order matmul_ogs's fused SwiGLU reads (gate at even output columns, up at odd)."""
    E, two_i = t.shape[:2]
    return t.reshape(E, 2, two_i // 2, *t.shape[2:]).transpose(1, 2).reshape(t.shape).contiguous()


def deinterleave_columns(y: torch.Tensor) -> torch.Tensor:
    """[.., 2I] in g0, u0, g1, u1 order -> [.., 2I] gate columns then up columns."""
    return torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1)


def layouts(kind: str):
    """(value layout, its options, scale layout, its options, K-group padding) of
    ``kind``: "hopper" is what vLLM picks on SM90 (``make_default_matmul_mxfp4_w_layout
    (mx_axis=1)``, the scale layout with 8 warps, scale groups padded to a multiple of
    4 as vLLM's workaround "#47303" does); "strided" is the plain layout (any GPU, and Triton's interpreter,
    which cannot run the Hopper layout's inline PTX upcast)."""
    lay = triton_kernels().layout
    if kind == "hopper":
        return (lay.HopperMXValueLayout, {"mx_axis": 1},
                lay.HopperMXScaleLayout, {"mx_axis": 1, "num_warps": 8}, 4)
    if kind == "strided":
        return lay.StridedLayout, {}, lay.StridedLayout, {}, 1
    raise ValueError(f"layout must be 'hopper' or 'strided', got {kind!r}")


def to_matmul_ogs(packed: torch.Tensor, scales: torch.Tensor, kind: str):
    """(weight, scale) as matmul_ogs takes them, from our MXFP4 [E, N, K/2] (low nibble
    first along K) and E8M0 [E, N, K/32]: its weight is [E, K, N] FP4 with K the packed,
    contiguous axis (the transpose of ours, no byte changes), then swizzled into
    ``kind``'s layout; the scale likewise [E, K/32, N]."""
    tk = triton_kernels()
    value_layout, value_opts, scale_layout, scale_opts, group_pad = layouts(kind)
    pad = -scales.shape[-1] % group_pad
    if pad:
        scales = torch.nn.functional.pad(scales, (0, pad))
    w = tk.tensor.wrap_torch_tensor(packed.transpose(-2, -1), dtype=tk.tensor.FP4)
    s = tk.tensor.wrap_torch_tensor(scales.transpose(-2, -1))
    return (tk.tensor.convert_layout(w, value_layout, **value_opts),
            tk.tensor.convert_layout(s, scale_layout, **scale_opts))


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _expert_bits_kernel(ids_ptr, bits_ptr, K: tl.constexpr, WORDS: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
    """Row t of the routing bitmatrix: bit e % 32 of word e // 32 set for each e in ids[t]."""
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    e = tl.load(ids_ptr + t * K + k, mask=k < K, other=-1)
    word = tl.arange(0, BLOCK_W)
    hit = (e[:, None] >= 0) & ((e[:, None] >> 5) == word[None, :])
    one = tl.full([BLOCK_K, BLOCK_W], 1, tl.uint32)
    bits = tl.where(hit, one << (e[:, None] & 31).to(tl.uint32), 0).to(tl.uint32)
    tl.store(bits_ptr + t * WORDS + word, tl.reduce(bits, 0, _or), mask=word < WORDS)


def expert_bitmatrix(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """uint32 [b, ceil(E/32)]: which experts each token chose, one bit an expert (the
    form triton_kernels' routing sums into per-expert counts). One launch."""
    b, K = ids.shape
    words = triton.cdiv(num_experts, 32)
    bits = torch.empty(b, words, dtype=torch.uint32, device=ids.device)
    _expert_bits_kernel[(b,)](ids, bits, K, words, triton.next_power_of_2(K),
                              triton.next_power_of_2(words))
    return bits


@dataclasses.dataclass
class Routing:
    """matmul_ogs's view of one routing: pairs p = t*K + k sorted by expert.
    ``gather.src_indx[i]`` is the pair at sorted position i; ``scatter.src_indx[p]`` is
    pair p's sorted position; ``data.gate_scal`` the router weights in sorted order."""

    data: object      # triton_kernels.routing.RoutingData (expert counts, tile maps)
    gather: object    # GatherIndx
    scatter: object   # ScatterIndx


def make_routing(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Routing:
    """triton_kernels' routing data of ids int32 [b, K] and BF16 weights [b, K] (what
    vLLM's make_routing_data builds each forward: a bitmatrix, then the library's sort)."""
    tk = triton_kernels()
    ids, weights = ids.contiguous(), weights.contiguous()
    b, K = ids.shape
    bits = expert_bitmatrix(ids, num_experts)
    bitmatrix = tk.tensor.Bitmatrix(bits, shape=[b, bits.shape[1] * 32], shape_max=[b, None],
                                    scratchpad=None)
    data, gather, scatter = tk.routing.routing_from_bitmatrix(bitmatrix, weights, ids,
                                                              num_experts, K)
    return Routing(data, gather, scatter)


# ------------------------------------------------------------------------- the peer

class MatmulOgsExperts:
    """Triton's ``matmul_ogs`` MoE over one rank's stock MXFP4 experts.

    w13 [E, 2I, L/2] + scales [E, 2I, L/32] (gate rows then up rows), w2 [E, L, I/2] +
    [E, L, I/32], as ``reference.expert_rows`` takes them; they are converted once.
    ``layout``: "hopper" or "strided"; None picks "hopper" on an SM90 GPU (as vLLM does,
    with its ``split_k=1`` constraint) and "strided" elsewhere.
    """

    def __init__(self, w13, w13_scales, w2, w2_scales, layout: str | None = None,
                 alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT):
        tk = triton_kernels()
        if layout is None:
            hopper = w13.is_cuda and torch.cuda.get_device_capability(w13.device)[0] == 9
            layout = "hopper" if hopper else "strided"
        self.layout = layout
        self.num_experts = w13.shape[0]
        if layout == "hopper":
            # vLLM's _swizzle_mxfp4 on SM90: the Hopper layouts take no split-K.
            tk.opt_flags.update_opt_flags_constraints({"split_k": 1})
        ogs = tk.matmul_ogs
        self.w13, s13 = to_matmul_ogs(interleave_gate_up(w13), interleave_gate_up(w13_scales),
                                      layout)
        self.w2, s2 = to_matmul_ogs(w2, w2_scales, layout)
        flex = ogs.FlexCtx(rhs_data=tk.numerics.InFlexData())
        self.precision13 = ogs.PrecisionConfig(weight_scale=s13, flex_ctx=flex)
        self.precision2 = ogs.PrecisionConfig(weight_scale=s2, flex_ctx=flex)
        self.swiglu = ogs.FusedActivation(
            ogs.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit")), (alpha, limit), 2)
        self.alpha, self.limit = alpha, limit

    def route(self, ids: torch.Tensor, weights: torch.Tensor) -> Routing:
        return make_routing(ids, weights, self.num_experts)

    def up(self, x: torch.Tensor, routing: Routing, activation: bool = True) -> torch.Tensor:
        """BF16 [b*K, I] in sorted pair order: SwiGLU(x[token] @ W13_e) fused; with
        ``activation=False`` the GEMM alone, [b*K, 2I] with gate/up columns interleaved."""
        return triton_kernels().matmul_ogs.matmul_ogs(
            x, self.w13, None, routing.data, gather_indx=routing.gather,
            precision_config=self.precision13,
            fused_activation=self.swiglu if activation else None)

    def down(self, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        """BF16 [b, L]: out[t] = sum_k w[t, k] * (hidden[pos(t, k)] @ W2_e), the down GEMM
        with the router weights (gammas) and the top-K combine."""
        return triton_kernels().matmul_ogs.matmul_ogs(
            hidden, self.w2, None, routing.data, scatter_indx=routing.scatter,
            precision_config=self.precision2, gammas=routing.data.gate_scal)

    def gemms(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Up GEMM + SwiGLU + down GEMM + combine over a routing built beforehand."""
        return self.down(self.up(x, routing), routing)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """Routing + up GEMM + SwiGLU + down GEMM + combine: BF16 [b, L]."""
        return self.gemms(x, self.route(ids, weights))


# ------------------------------------------------------------------------ the check

def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def swiglu64(y: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """float64 SwiGLU of [.., 2I] interleaved columns, as matmul_ogs's fused one defines it."""
    gelu = y[..., 0::2].double().clamp(max=limit)
    linear = y[..., 1::2].double().clamp(-limit, limit)
    return gelu * torch.sigmoid(alpha * gelu) * (linear + 1)


def per_expert_matmul(a: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor,
                      scales: torch.Tensor) -> torch.Tensor:
    """float64 rows ``a[i] @ W_{experts[i]}.T`` with W our MXFP4 [E, N, K/2] dequantized
    exactly (FP32 holds every E2M1 value times its scale)."""
    out = torch.empty(a.shape[0], packed.shape[1], dtype=torch.float64, device=a.device)
    for e in torch.unique(experts).tolist():
        rows = (experts == e).nonzero().squeeze(1)
        out[rows] = a[rows].double() @ mx.dequantize_mxfp4(packed[e], scales[e]).double().t()
    return out


@dataclasses.dataclass
class Check:
    """Relative errors of the peer on the first ``tokens`` rows, each against float64
    math from the same inputs: up GEMM (before activation) vs x @ W13 from our stock
    weights; fused SwiGLU vs SwiGLU of its own up output; down GEMM + gammas + combine
    vs sum_k w * (hidden @ W2) over its own hidden."""

    tokens: int
    up: float
    act: float
    down: float

    @property
    def ok(self) -> bool:
        return max(self.up, self.act, self.down) < CHECK_TOLERANCE

    def __str__(self):
        return f"up {self.up:.1e} act {self.act:.1e} down {self.down:.1e}"


def check_matmul_ogs(peer: MatmulOgsExperts, x, ids, weights, w13, w13_scales, w2,
                     w2_scales, tokens: int = 65) -> Check:
    """``Check`` of ``peer`` on x [b, L] BF16, ids int32 [b, K], weights BF16 [b, K]
    against our stock weights (the ones ``peer`` was converted from)."""
    b, K = ids.shape
    n = min(b, tokens)
    routing = peer.route(ids, weights)
    up = peer.up(x, routing, activation=False)
    hidden = peer.up(x, routing)
    out = peer.down(hidden, routing)
    pair = routing.gather.src_indx.long()  # the pair at each sorted position
    sel = (pair // K < n).nonzero().squeeze(1)
    experts = ids.reshape(-1).long()[pair[sel]]
    up_ref = per_expert_matmul(x[pair[sel] // K], experts, w13, w13_scales)
    err_up = rel_err(deinterleave_columns(up[sel]), up_ref)
    err_act = rel_err(hidden[sel], swiglu64(up[sel], peer.alpha, peer.limit))
    pos = routing.scatter.src_indx.long()[: n * K]  # sorted position of pairs 0 .. n*K-1
    rows = per_expert_matmul(hidden[pos], ids[:n].reshape(-1).long(), w2, w2_scales)
    out_ref = (weights[:n].double().unsqueeze(-1) * rows.reshape(n, K, -1)).sum(1)
    return Check(n, err_up, err_act, rel_err(out[:n], out_ref))
