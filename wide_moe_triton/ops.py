"""One function a stage, torch tensors in and out (the kernels' launch wrappers).

    route(logits, bias, top_k, renormalize, scale) -> (ids int32 [b, K], weights bf16 [b, K])
    quantize_mxfp8(x)                              -> (codes uint8 [.., n], scales uint8 [.., n/32])
    finalize(rows, weights)                        -> bf16 [b, L]
    front_gemm(x, packed)                          -> fp32 [b, N]
    linear(x, weight)                              -> bf16 [b, N], bf16(x @ weight.T)
    shared_expert(x, interleave_gate_up(gate_up), down, beta, linear_beta)
                                                   -> bf16 [b, H]
    add_up_projection(normed, latent_up, shared)   -> shared, += normed @ latent_up.T in place
    experts(q, q_scales, weights, counts, pairs, generation, top_k, beta, linear_beta)
                                                   -> bf16 [b*K, L]
    rms_norm(x, weight, eps)                       -> bf16 [b, L]

Each checks its arguments and raises naming the one that is wrong. The GEMMs (front_gemm,
linear, shared_expert, add_up_projection) are batch invariant: a row's bits do not
depend on the other rows of its batch.
"""

from .checks import check_tensor
from .kernels.experts import experts, prepare_weights
from .kernels.finalize import finalize
from .kernels.front import front_gemm, linear, linear_situ, pack_front
from .kernels.mailbox import publish
from .kernels.plan import quantize_mxfp8 as _quantize_2d
from .kernels.route import RoutingLists, route
from .kernels.shared import interleave_gate_up, shared_expert
from .kernels.tail import add_up_projection, rms_norm


def quantize_mxfp8(x, **kwargs):
    """MXFP8 of ``x`` [..., n] (BF16 or FP32) along its last dim, bit-identical to
    ``wide_moe_triton.mx.quantize_mxfp8``: (codes uint8 [..., n], scales uint8 [..., n/32])."""
    check_tensor("x", x, None, None, contiguous=False)
    if x.dim() == 2:
        return _quantize_2d(x, **kwargs)
    if x.dim() < 1:
        raise ValueError(f"x must have shape [..., n], got {list(x.shape)}")
    lead = x.shape[:-1]
    q, s = _quantize_2d(x.reshape(-1, x.shape[-1]), **kwargs)
    return q.reshape(*lead, x.shape[-1]), s.reshape(*lead, x.shape[-1] // 32)


__all__ = ["route", "RoutingLists", "quantize_mxfp8", "finalize", "front_gemm", "pack_front",
           "linear", "linear_situ", "shared_expert", "interleave_gate_up", "experts",
           "prepare_weights", "rms_norm", "add_up_projection", "publish"]
