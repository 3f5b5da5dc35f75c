"""The routing lists the route kernel claims into and the experts kernels read: per
expert, a counter and a list of pair ids, for each of two parities (the call counter's
low bit), so a call claims in one parity while the other is zeroed for the next."""

from __future__ import annotations

import dataclasses

import torch

from ..checks import check_tensor


@dataclasses.dataclass
class RoutingLists:
    """Per-expert routing lists of both parities.

    ``counts`` int32 [2, E]: pairs listed per expert; ``pairs`` int32 [2, E, wide_rows]:
    ``pairs[p, e, :counts[p, e]]`` are the pair ids ``t*K + k`` routed to expert e in the
    call of parity p (in claim order, which varies run to run); ``generation`` int32 [1]:
    the call counter whose low bit is the parity the route claims in."""

    counts: torch.Tensor
    pairs: torch.Tensor
    generation: torch.Tensor

    @classmethod
    def empty(cls, num_experts: int, wide_rows: int, device, generation=None) -> "RoutingLists":
        """Zeroed lists (both parities) for ``num_experts`` experts of up to ``wide_rows``
        pairs each, with a fresh generation counter (0) unless one is given to share."""
        for name, value in (("num_experts", num_experts), ("wide_rows", wide_rows)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if generation is None:
            generation = torch.zeros(1, dtype=torch.int32, device=device)
        return cls(torch.zeros(2, num_experts, dtype=torch.int32, device=device),
                   torch.zeros(2, num_experts, wide_rows, dtype=torch.int32, device=device),
                   generation)

    @property
    def num_experts(self) -> int:
        return self.counts.shape[1]

    @property
    def wide_rows(self) -> int:
        return self.pairs.shape[2]

    def check(self, num_experts: int, device) -> None:
        """Raise naming the field unless the lists fit ``num_experts`` on ``device``."""
        check_tensor("lists.counts", self.counts, torch.int32, (2, num_experts), device)
        check_tensor("lists.pairs", self.pairs, torch.int32, (2, num_experts, None), device)
        check_tensor("lists.generation", self.generation, torch.int32, (1,), device)
