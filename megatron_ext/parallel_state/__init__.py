"""Adapter to ``megatron.core.parallel_state``: the CP group, rank, size and node topology.

Order of preference for the context-parallel group:
1. megatron-core's CP group when its model-parallel state is initialized;
2. otherwise the default process group, when ``torch.distributed`` is initialized;
3. otherwise no group: ``get_cp_group()`` returns None (a single process, CP = 1),
   and ``require_cp_group()`` raises with the fix.
"""

import os
import sys
from typing import Optional, Tuple

import torch.distributed as dist


def _megatron_parallel_state():
    # Only a megatron-core that is already imported can be initialized; looking it up
    # in sys.modules keeps the engine from paying megatron's import time.
    return sys.modules.get("megatron.core.parallel_state")


def megatron_initialized() -> bool:
    mpu = _megatron_parallel_state()
    return bool(mpu is not None and mpu.model_parallel_is_initialized())


def get_cp_group() -> Optional["dist.ProcessGroup"]:
    """The CP process group, or None when no process group exists (one process)."""
    if megatron_initialized():
        return _megatron_parallel_state().get_context_parallel_group()
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def require_cp_group() -> "dist.ProcessGroup":
    group = get_cp_group()
    if group is None:
        raise RuntimeError(
            "context parallelism was requested but no process group exists: call "
            "megatron.core.parallel_state.initialize_model_parallel(context_parallel_size=...) "
            "or torch.distributed.init_process_group(...) first, or pass cp_group=..."
        )
    return group


def group_size(group: Optional["dist.ProcessGroup"]) -> int:
    """The group's size; a list of global ranks (a group not created yet) counts its ranks."""
    if isinstance(group, (list, tuple)):
        return len(group)
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional["dist.ProcessGroup"]) -> int:
    return 0 if group is None else dist.get_rank(group)


def get_cp_world_size() -> int:
    return group_size(get_cp_group())


def get_cp_rank() -> int:
    return group_rank(get_cp_group())


def get_cp_global_ranks(group: Optional["dist.ProcessGroup"] = None) -> list:
    """Global ranks of the CP group, in CP-rank order."""
    group = get_cp_group() if group is None else group
    if group is None:
        return [0]
    if isinstance(group, (list, tuple)):  # the global ranks of a group not created yet
        return list(group)
    return dist.get_process_group_ranks(group)


def get_tp_world_size() -> int:
    if megatron_initialized():
        return _megatron_parallel_state().get_tensor_model_parallel_world_size()
    return 1


def get_tp_group() -> Optional["dist.ProcessGroup"]:
    """megatron's TP group once parallel_state is initialized, else None (no TP)."""
    if megatron_initialized():
        return _megatron_parallel_state().get_tensor_model_parallel_group()
    return None


def local_world_size() -> int:
    """Processes per node (torchrun's LOCAL_WORLD_SIZE, SLURM's tasks per node)."""
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 1


def cp_spans_nodes(group: Optional["dist.ProcessGroup"] = None) -> bool:
    """Whether the CP group crosses a node boundary (ranks are assumed node-major)."""
    per_node = local_world_size()
    nodes = {rank // per_node for rank in get_cp_global_ranks(group)}
    return len(nodes) > 1


def cp_ranks_per_node(group: Optional["dist.ProcessGroup"] = None) -> int:
    """CP ranks per node when the group's ranks form equal node blocks in CP-rank order, else 0.

    Global ranks are node-major (``LOCAL_WORLD_SIZE`` / ``SLURM_NTASKS_PER_NODE`` processes
    per node, as torchrun and srun number them); with tensor parallelism inside a node a CP
    group holds fewer ranks per node (TP 2 x CP 8 on 8-GPU nodes: 4 CP ranks per node).
    The two-level cost model (``CostModel.two_level``) needs CP rank r on node r // g.
    """
    per_node = local_world_size()
    nodes = [rank // per_node for rank in get_cp_global_ranks(group)]
    g = nodes.count(nodes[0])
    if len(nodes) % g or any(nodes[i] != nodes[(i // g) * g] for i in range(len(nodes))) \
            or len({nodes[i] for i in range(0, len(nodes), g)}) != len(nodes) // g:
        return 0
    return g


def ulysses_subgroup_ranks(ranks: list, ulysses_size: int) -> Tuple[list, list]:
    """(global ranks of this rank's Ulysses group, of its ring group) in a CP group of global ``ranks``
    (CP-rank order) with CP rank c = j * u + i: Ulysses group j holds u consecutive CP ranks (one node's
    when ranks are node-major), ring group i the CP ranks at place i of every Ulysses group, as
    megatron-core's ``create_hierarchical_groups`` levels 0 and 1 of sizes [u, r]."""
    me = ranks.index(dist.get_rank()) if len(ranks) > 1 else 0
    u = ulysses_size
    j, i = divmod(me, u)
    return ranks[j * u:(j + 1) * u], ranks[i::u]


def ulysses_subgroups(group, ulysses_size: int):
    """(this rank's Ulysses group, its ring group) of the CP ``group`` (``ulysses_subgroup_ranks``).

    megatron-core's hierarchical CP groups when it built them for sizes [u, cp / u] on this CP
    group (``--hierarchical-context-parallel-sizes``); otherwise created once per CP group and size
    with ``new_group(..., use_local_synchronization=True)``, so only the members take part; every CP
    rank creates its Ulysses group first, then its ring group, so creations never cross. Kept in
    ``_SUBGROUPS`` for the process's life, as megatron-core keeps its groups.
    """
    ranks = get_cp_global_ranks(group)
    u_ranks, r_ranks = ulysses_subgroup_ranks(ranks, ulysses_size)
    if megatron_initialized():
        mpu = _megatron_parallel_state()
        levels = mpu.get_hierarchical_context_parallel_groups(check_initialized=False)
        if levels and len(levels) == 2 and [dist.get_process_group_ranks(g) for g in levels] == [u_ranks, r_ranks]:
            return levels[0], levels[1]
    key = (tuple(ranks), ulysses_size)
    if key not in _SUBGROUPS:
        u_group = dist.new_group(u_ranks, use_local_synchronization=True)
        r_group = dist.new_group(r_ranks, use_local_synchronization=True)
        _SUBGROUPS[key] = (u_group, r_group)
    return _SUBGROUPS[key]


# (CP group's global ranks, Ulysses size) -> (Ulysses group, ring group), created on first use.
_SUBGROUPS: dict = {}
