"""The node layout of a job for hierarchical 1-bit averaging: which ranks share a node, and their process groups.

Launchers number ranks node-major: torchrun, Lightning's own launcher and SLURM give rank ``node * L + local_rank``
with ``L`` processes per node (``LOCAL_WORLD_SIZE``; Lightning's ``num_processes``). Hierarchical averaging
(:class:`~lightning_accel.comm.allreduce.HierarchicalOneBitAllreduce`) needs two kinds of groups: the ``L`` ranks of
one node (the *intra* group: a fast link, fp32 is cheap there) and the ``K`` ranks, one per node, that hold the same
local rank (the *cross* group: the slow link, where only compressed bytes go). Grouping ranks otherwise would still
average correctly; only the traffic would cross the slow link where it need not.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch.distributed as dist

from lightning_accel._utils.checks import check_choice, check_int

__all__ = [
    "HIERARCHICAL_CHOICES",
    "Hierarchical",
    "NodeTopology",
    "destroy_group",
    "node_topology",
    "resolve_hierarchical",
]

#: hierarchical averaging: ``"auto"`` (when there are several nodes and several processes per node), or forced
Hierarchical: TypeAlias = bool | Literal["auto"]
HIERARCHICAL_CHOICES: tuple[Hierarchical, ...] = (True, False, "auto")


@dataclass(frozen=True)
class NodeTopology:
    """This rank's place in a ``nodes x local_size`` job and the two process groups of hierarchical averaging.

    Attributes:
        local_size: ``L``, processes per node.
        nodes: ``K``, number of nodes.
        local_rank: this rank's index inside its node.
        node: this rank's node.
        intra: the group of this node's ``L`` ranks (local-rank order).
        cross: the group of the ``K`` ranks with this ``local_rank`` (node order).
    """

    local_size: int
    nodes: int
    local_rank: int
    node: int
    intra: dist.ProcessGroup
    cross: dist.ProcessGroup

    @property
    def place(self) -> tuple[int, int, int, int]:
        """``(local_size, nodes, local_rank, node)``: what buffers and shards depend on (not the groups)."""
        return (self.local_size, self.nodes, self.local_rank, self.node)

    def duplicate(self, backend: str | None = None) -> NodeTopology:
        """The same layout over new process groups (collective over the default group: every rank must call it at
        the same point). A thread that issues its own collectives needs groups of its own, so that the order of
        each group's collectives is the same on every rank."""
        return node_topology(self.local_size, backend=backend)

    def destroy(self) -> None:
        """Destroy the two process groups, on every rank at the same point (``torch.distributed`` asks that of
        ``destroy_process_group``, though on gloo it exchanges nothing). Whoever made the layout destroys it when
        done: each ``new_group`` stays registered, with its connections, until destroyed or until the default group
        goes, so a process that fits again and again (a tuning loop, a notebook) would pile them up. The layout's
        numbers stay readable; the groups must not be used again. Nothing happens once the default group is gone (it
        took these with it)."""
        for group in (self.intra, self.cross):
            destroy_group(group)


def destroy_group(group: dist.ProcessGroup) -> None:
    """Destroy ``group`` (a group this process made with ``new_group``; never the default one), called on every rank
    at the same point. Nothing happens once the default group is gone (it took ``group`` with it) or when ``group``
    was destroyed already."""
    if not dist.is_initialized():
        return
    # raised for a group no longer registered (destroyed already, or a default group made anew since)
    with contextlib.suppress(ValueError):
        dist.destroy_process_group(group)


def resolve_hierarchical(hierarchical: Hierarchical, world_size: int, local_size: int | None) -> bool:
    """Whether to average hierarchically in a job of ``world_size`` ranks with ``local_size`` per node.

    ``"auto"``: when there are several processes per node and several nodes (``1 < local_size < world_size``, and
    ``local_size`` divides ``world_size``). ``True`` insists (and raises when the layout cannot be split into several
    nodes: ``local_size`` does not divide ``world_size``, or every rank is on one node); ``False``: the flat exchange
    between all ranks.

    Raises:
        ValueError: ``hierarchical=True`` without a layout of several nodes of equal size, or a bad value.
    """
    check_choice("hierarchical", hierarchical, HIERARCHICAL_CHOICES, fix="Use 'auto'.")
    if hierarchical is False:
        return False
    fits = local_size is not None and 1 <= local_size <= world_size and world_size % local_size == 0
    if hierarchical == "auto":
        return fits and local_size is not None and 1 < local_size < world_size
    if not fits:
        raise ValueError(
            f"`hierarchical=True` needs the processes per node to divide the world size, got {local_size!r} "
            f"processes per node for {world_size} processes. Give `processes_per_node=`, or use "
            "`hierarchical='auto'`."
        )
    if local_size == world_size:
        # one node: the 1-bit exchange between nodes would have no peer, and everything would travel in fp32
        raise ValueError(
            f"`hierarchical=True` needs several nodes, got one node of {world_size} processes (processes per node: "
            f"{local_size}). Give `processes_per_node=` (the processes each node runs) if the job spans several "
            "nodes, or use `hierarchical='auto'` or `False`."
        )
    return True


def node_topology(local_size: int, *, backend: str | None = None) -> NodeTopology:
    """Make the intra-node and cross-node groups of a node-major job with ``local_size`` processes per node.

    Collective over the default group (every rank creates every group, in the same order, as
    ``torch.distributed.new_group`` requires).

    Raises:
        ValueError: ``local_size`` does not divide the world size.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    check_int("local_size", local_size, low=1)
    if world % local_size:
        raise ValueError(
            f"`processes_per_node`={local_size} does not divide the world size {world}. Give the number of processes "
            "each node runs."
        )
    nodes = world // local_size
    node, local = divmod(rank, local_size)
    intra_ranks = [[n * local_size + i for i in range(local_size)] for n in range(nodes)]
    cross_ranks = [[n * local_size + i for n in range(nodes)] for i in range(local_size)]
    intra, _ = dist.new_subgroups_by_enumeration(intra_ranks, backend=backend)
    cross, _ = dist.new_subgroups_by_enumeration(cross_ranks, backend=backend)
    # this rank is in one group of each enumeration
    assert isinstance(intra, dist.ProcessGroup) and isinstance(cross, dist.ProcessGroup)
    return NodeTopology(local_size, nodes, local, node, intra, cross)
