"""The launcher's placement of ranks on a node's GPUs (``launch._device``), with the
node's GPU count faked: one GPU a rank as long as there are enough; with --share-gpus
on fewer GPUs than ranks, rank r on GPU r % G; refusals by name otherwise."""

import argparse
import contextlib
import os
from unittest import mock

import pytest
import torch
from hypothesis import given, strategies as st

from wide_moe_triton import launch


def args(**kw):
    base = dict(device=None, share_gpus=False, all_reduce="mailbox")
    return argparse.Namespace(**dict(base, **kw))


@contextlib.contextmanager
def node(gpu_count: int, ranks: int):
    """This process sees ``gpu_count`` GPUs on a node of ``ranks`` ranks; yields the
    list of the devices set."""
    chosen = []
    with mock.patch.object(torch.cuda, "is_available", lambda: gpu_count > 0), \
            mock.patch.object(torch.cuda, "device_count", lambda: gpu_count), \
            mock.patch.object(torch.cuda, "set_device", chosen.append), \
            mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": str(ranks)}):
        yield chosen


@given(world=st.integers(1, 16), gpu_count=st.integers(1, 16), share=st.booleans(),
       data=st.data())
def test_a_rank_goes_on_its_own_gpu_or_shares_one_when_asked(world, gpu_count, share, data):
    local = data.draw(st.integers(0, world - 1), label="local rank")
    with node(gpu_count, world) as chosen:
        if gpu_count < world and not share and local >= gpu_count:
            with pytest.raises(launch.Failed, match="--share-gpus") as e:
                launch._device(args(share_gpus=share), local)
            assert e.value.code == launch.EXIT_USAGE
            return
        device, shared = launch._device(args(share_gpus=share), local)
    assert shared == (share and gpu_count < world)
    assert device == torch.device("cuda", local % gpu_count if shared else local)
    assert chosen == [device.index]


def test_nccl_is_refused_by_name_where_ranks_share_a_gpu():
    with node(1, 4), pytest.raises(launch.Failed, match="--all-reduce nccl does not go "
                                                         "with --share-gpus") as e:
        launch._device(args(share_gpus=True, all_reduce="nccl"), 2)
    assert e.value.code == launch.EXIT_USAGE
    with node(4, 4):  # a GPU a rank: NCCL as ever
        assert launch._device(args(share_gpus=True, all_reduce="nccl"), 2) == (
            torch.device("cuda", 2), False)


def test_share_gpus_is_refused_with_cpu_ranks():
    p = launch.parser()
    with pytest.raises(SystemExit):
        launch.check_layer_arguments(p, p.parse_args(["--tp", "2", "--share-gpus", "--device",
                                                      "cpu"]), 2)
    with pytest.raises(SystemExit):
        launch.check_layer_arguments(p, p.parse_args(["--tp", "2", "--experts", "8",
                                                      "--checkpoint", "x", "--layer", "1"]), 2)
