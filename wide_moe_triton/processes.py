"""Ranks as processes: what a rank of a ``torch.distributed`` group agrees on with its
peers when a layer is built, and the host's stand-in for symmetric memory.

Construction is collective. ``agree`` gathers every rank's identity of the layer it is
building (the config's fields, the tail's all-reduce, the checkpoint layer, a digest of
the weights every rank holds alike) and raises on every rank, with the same message
naming the first field that differs, before any buffer is made.

``SharedSegments`` (gloo and CPU tensors, ranks of one host): each rank's buffers live in
POSIX shared memory, one file under ``/dev/shm`` a buffer. Names come from a token rank 0
draws, so every rank knows every name before any exists: each creates its own, a
barrier, each maps every peer's (the kernels reach them through an int64 table of this
process's addresses of them), a barrier, then every rank unlinks every name. From then
on no name is left to leak, whatever happens to any process: the memory lives while a
process maps it and goes back to the system when the last one exits. If construction
fails anywhere (a peer died: the barrier raises), every surviving rank unlinks every
name of the group, a dead peer's too. Only if every rank is killed (SIGKILL, or a
SIGTERM while blocked in a barrier) between the first create and the unlink do files
stay behind; their names start with ``PREFIX``.

Peer liveness: each rank keeps its peers' process ids; ``gone`` says which of some
ranks' processes have exited (``/proc``), so a poll waiting on a dead peer stops at once
instead of at its time bound.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import socket

import torch

SHM_DIR = "/dev/shm"
PREFIX = "wide_moe_"


@dataclasses.dataclass(frozen=True)
class Peer:
    """What a rank tells its peers of its process: its host, process id and a fresh
    random token (rank 0's names the group's segments)."""

    host: str
    pid: int
    token: str


def identity(cfg, shard, *, all_reduce: str, device, layer: int | None = None) -> dict:
    """The fields every rank of a group must agree on to build one layer: the config's
    (``cfg.<field>``), the tail's all-reduce, the device type, the checkpoint layer (None
    for a module's weights) and a digest of the weights every rank holds alike (the
    router's bias and the latent norm's weight)."""
    fields = {f"cfg.{f.name}": getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    fields["all_reduce"] = all_reduce
    fields["device type"] = torch.device(device).type
    fields["checkpoint layer"] = layer
    fields["weights (bias, norm weight) sha256"] = digest(shard.bias, shard.norm_weight)
    return fields


def digest(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' bytes, in order (hex, 16 digits: a fingerprint)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def agree(group, fields: dict) -> None:
    """Gather every rank's ``fields`` over ``group`` and raise ValueError on every rank,
    with the same message, naming the first field (in rank 0's order) on which a rank
    differs from rank 0."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, fields, group=group)
    first = gathered[0]
    for name in list(first) + sorted(set().union(*gathered) - set(first)):
        values = [g.get(name, "<missing>") for g in gathered]
        odd = [r for r, v in enumerate(values) if v != values[0]]
        if odd:
            shown = ", ".join(f"rank {r}: {values[r]!r}" for r in odd[:4])
            raise ValueError(
                f"wide_moe_triton: the {world} ranks do not build the same layer: "
                f"{name} is {values[0]!r} on rank 0 but differs on {len(odd)} rank(s) "
                f"({shown}); every rank must pass the same config, checkpoint layer and "
                "weights")


def _gather(group, value) -> list:
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def segment_name(token: str, rank: int, key: str) -> str:
    """The file name (under ``SHM_DIR``) of rank ``rank``'s buffer ``key``."""
    return f"{PREFIX}{token}_r{rank}_{key}"


def _unlink(paths) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _create(path: str, nbytes: int) -> None:
    """A new file of ``nbytes`` zero bytes at ``path`` (refused if it exists)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def _map(path: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The file at ``path`` mapped shared (every process's stores are seen by every
    other's loads), as a tensor of ``shape``."""
    numel = 1
    for n in shape:
        numel *= n
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


def _state(pid: int) -> str | None:
    """The process's state letter from ``/proc`` (None if it does not exist or cannot be
    read there)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class SharedSegments:
    """Every rank's buffers ``shapes`` (key -> shape, ``dtype``) in POSIX shared memory,
    built collectively over ``group`` (gloo; every rank on one host): ``local[key]`` this
    rank's buffer, ``peers[key]`` every rank's as mapped here (rank order), ``table[key]``
    the int64 [T] table of their addresses in this process. ``names``: the group's file
    names, all unlinked once built (see the module's docstring)."""

    def __init__(self, group, shapes: dict, dtype: torch.dtype = torch.int16):
        import torch.distributed as dist

        if not os.path.isdir(SHM_DIR):
            raise RuntimeError(f"wide_moe_triton: shared memory between CPU ranks needs "
                               f"{SHM_DIR} (POSIX shared memory), absent here")
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        me = Peer(socket.gethostname(), os.getpid(), secrets.token_hex(6))
        peers = _gather(group, me)
        away = [r for r, p in enumerate(peers) if p.host != peers[0].host]
        if away:
            raise ValueError(f"wide_moe_triton: rank(s) {away} run on {peers[away[0]].host}, "
                             f"rank 0 on {peers[0].host}: the CPU ranks' mailbox is shared "
                             "memory, which joins the processes of one host")
        token = peers[0].token
        self.pids = [p.pid for p in peers]
        self.names = [segment_name(token, r, key) for r in range(self.world) for key in shapes]
        paths = [os.path.join(SHM_DIR, n) for n in self.names]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        try:
            for key, shape in shapes.items():
                nbytes = itemsize
                for n in shape:
                    nbytes *= n
                _create(os.path.join(SHM_DIR, segment_name(token, self.rank, key)), nbytes)
            dist.barrier(group=group)   # every segment exists
            self.peers = {key: [_map(os.path.join(SHM_DIR, segment_name(token, r, key)),
                                     tuple(shape), dtype) for r in range(self.world)]
                          for key, shape in shapes.items()}
            dist.barrier(group=group)   # every rank mapped every segment
        finally:
            # Built: no process needs a name any more. Failed (a peer died): the survivors
            # remove every name of the group, the dead peer's too.
            _unlink(paths)
        self.local = {key: bufs[self.rank] for key, bufs in self.peers.items()}
        self.table = {key: torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
                      for key, bufs in self.peers.items()}
        # Only peers whose process this one can see (one process-id namespace) are
        # watched; the others are waited for up to the time bound.
        self._watched = {r for r, pid in enumerate(self.pids) if _state(pid) is not None}

    def gone(self, ranks) -> list[int]:
        """Those of ``ranks`` whose process has exited (or is a zombie, killed but not
        yet reaped by its parent)."""
        return [r for r in ranks if r in self._watched and _state(self.pids[r]) in
                (None, "Z", "X", "x")]
