"""The rank layout of a multi-node job: which global ranks one node's daemon hosts.

A pure function both ``wcache serve`` (:mod:`wcache.daemon.serve`) and readiness
(:mod:`wcache.daemon.ready`) use; it lives apart so neither imports the other.
"""

from __future__ import annotations

__all__ = ["local_ranks"]


def local_ranks(world: int, nnodes: int, node_rank: int) -> range:
    """The global ranks one node's daemon hosts: vLLM places ranks node by node,
    ``world // nnodes`` consecutive ranks per node.

    Raises:
        ValueError: ``world`` does not divide over ``nnodes`` or ``node_rank`` is out of range.
    """
    if nnodes < 1:
        raise ValueError(f"--nnodes {nnodes}: give 1 or more nodes")
    if world % nnodes:
        raise ValueError(
            f"--nnodes {nnodes}: {world} ranks (TP x PP) cannot be split over {nnodes} "
            f"nodes; give a --nnodes that divides {world}"
        )
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
    per_node = world // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)
