"""Argument checks shared by every launch wrapper: one clear error naming the argument.

The policy for bad input, the same for ``WideMoE``, ``LatentMoE`` and every op: a value
that is not a tensor, or a tensor of the wrong dtype, is a ``TypeError``; a wrong shape,
device or value range a ``ValueError`` whose message names the accepted shape
(``[b, 256]``). A layer's input may be non-contiguous (``check_input`` copies it); an
op's buffers must be contiguous where its docstring says so.
"""

from __future__ import annotations

import torch


def check_tensor(name: str, t, dtype: torch.dtype | None = None, shape: tuple | None = None,
                 device: torch.device | None = None, contiguous: bool = True) -> None:
    """Raise TypeError/ValueError unless ``t`` is a tensor of ``dtype`` and ``shape``
    (None entries match any size, shown as ``*``; a string entry too, shown as itself,
    e.g. ``("b", 256)`` reads ``[b, 256]``) on ``device``, contiguous if asked."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(
            s is None or isinstance(s, str) or s == n for s, n in zip(shape, t.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def same_device(**tensors: torch.Tensor) -> torch.device:
    """The one device all ``tensors`` live on; ValueError naming the odd one out."""
    names = list(tensors)
    first = tensors[names[0]].device
    for name in names[1:]:
        if tensors[name].device != first:
            raise ValueError(f"{name} is on {tensors[name].device} but {names[0]} is on {first}")
    return first


def check_input(x, hidden: int, device: torch.device | None = None) -> torch.Tensor:
    """A layer's input ``x``, BF16 [b, hidden] (on ``device`` if given), made contiguous
    (a copy only where it is not); the layer's one check of it."""
    check_tensor("x", x, torch.bfloat16, ("b", hidden), contiguous=False)
    if device is not None and x.device != device:
        raise ValueError(f"x is on {x.device} but this layer lives on {device}")
    return x.contiguous()
