"""Rank -> daemon mapping for multi-rank and (simulated) multi-node layouts, without a network."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from wcache.daemon.ranks import local_ranks
from wcache.vllm.key import device_id

MODEL = SimpleNamespace(
    hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
    dtype=torch.bfloat16,
    quantization="awq",
)


def _layout(rank: int, tp: int, pp: int) -> dict[str, int]:
    return {
        "tp_size": tp,
        "tp_rank": rank % tp,
        "pp_size": pp,
        "pp_rank": rank // tp,
        "dp_size": 1,
        "dp_rank": 0,
    }


def test_two_nodes_host_disjoint_ranks():
    """With TP=4 over 2 nodes, node 0's daemon hosts ranks 0-1 and node 1's ranks 2-3."""
    assert list(local_ranks(4, 2, 0)) == [0, 1]
    assert list(local_ranks(4, 2, 1)) == [2, 3]
    assert list(local_ranks(8, 2, 1)) == [4, 5, 6, 7]


@pytest.mark.parametrize(
    "world, nnodes, node_rank, message",
    [
        (3, 2, 0, "cannot be split over 2 nodes"),
        (4, 2, 2, "outside 0..1"),
    ],
)
def test_bad_node_layouts_are_refused(world, nnodes, node_rank, message):
    """A world that does not split evenly, or a node rank out of range, fails with the reason."""
    with pytest.raises(ValueError, match=message):
        local_ranks(world, nnodes, node_rank)


def test_each_node_serves_exactly_the_sockets_its_engine_ranks_ask_for():
    """Simulated 2-node TP=2 x PP=2: every engine rank finds its own node's daemon socket,
    and no socket name is shared by two ranks."""
    tp, pp, nnodes = 2, 2, 2
    world = tp * pp
    cpu = torch.device("cpu")
    served = {
        node: {device_id(cpu, MODEL, _layout(r, tp, pp)) for r in local_ranks(world, nnodes, node)}
        for node in range(nnodes)
    }
    wanted = {
        node: {
            device_id(cpu, MODEL, _layout(node * (world // nnodes) + local, tp, pp))
            for local in range(world // nnodes)
        }
        for node in range(nnodes)
    }
    assert served == wanted
    assert len(served[0] | served[1]) == world


def test_two_jobs_on_one_host_never_share_a_socket():
    """The same rank of two jobs (different job names, or different quantization) gets two sockets."""
    cpu = torch.device("cpu")
    lay = _layout(0, 2, 1)
    assert device_id(cpu, MODEL, lay, job="a") != device_id(cpu, MODEL, lay, job="b")
    other = SimpleNamespace(**{**vars(MODEL), "quantization": "gptq"})
    assert device_id(cpu, MODEL, lay) != device_id(cpu, other, lay)
    assert device_id(cpu, MODEL, lay) != device_id(cpu, MODEL, _layout(1, 2, 1))
