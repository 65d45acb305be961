"""Head-parallel CP (DeepSpeed-Ulysses): every rank attends the whole pack on 1/cp of the heads.

    sequence shards (the layout's)              head shards
    rank r: [L, b, H, D], its L positions  -->  rank r: [P, b, H / cp, D], every position, heads
                                                [r * H / cp, (r + 1) * H / cp)

    cp = 2, H = 4 heads (0 1 2 3), positions of a zigzag layout a b | c d:
        rank 0 holds a d, heads 0-3      -->  rank 0 holds a b c d, heads 0 1
        rank 1 holds b c, heads 0-3      -->  rank 1 holds a b c d, heads 2 3

All-to-alls replace the K/V exchange: q, k and v go from sequence shards to head shards, the output
comes back the same way, a group of the rank's heads at a time (``head_groups``: the next group's
move travels while one is attended, its output goes home while the next is; K / V heads fewer than
the groups move whole first). In between each rank runs the engine's single-rank op over the padded
pack in global order: one plan of every document of every
row (windows as bottom-right windows, sinks as the rank's share of ``softmax_offset``), so the
kernel path (te -> flash -> dense), dropout replay and kernel-failure handling are the engine's own. No
merge, no plan of needed keys, every rank does the same work whatever the documents; the
price is bytes that do not shrink with short documents: (cp - 1) / cp of the local q, k, v
and out per layer forward.

Two dimensions (``ulysses_size`` u, 1 < u < cp; Megatron's ``a2a+p2p`` with
``--hierarchical-context-parallel-sizes u r``): the all-to-alls run inside each Ulysses group of u
consecutive CP ranks (one node's), and on the head shards the engine's streamed op runs with the
ring level's state: cp / u ranks (this rank's place in every group), the layout whose rank j owns
group j's positions (``layouts/two_dim.py``), the configured exchange (a2a, halo, allgather,
hierarchical) of the needed K/V rows of H / u heads between the groups:

    cp = 4 as 2 x 2, zigzag chunks a..h:   groups (0 1) (2 3), ring level (0 2) (1 3)
        rank 0 holds a h, rank 1 b g   -->  ranks 0, 1 hold a b g h on heads [0, H/2), [H/2, H)
        rank 2 holds c f, rank 3 d e   -->  ranks 2, 3 hold c d e f on heads [0, H/2), [H/2, H)
        then ranks 0 and 2 exchange the K/V rows they need of heads [0, H/2); 1 and 3 of the rest

Heads: the query heads must split over the group (``Hq % u == 0``, u = cp in one dimension;
refused with the numbers otherwise). K/V heads split when ``Hkv % u == 0``; otherwise every K/V
head is repeated ``r = u / gcd(Hkv, u)`` times first, so each rank's query heads keep their own
K/V heads; the repeat's gradient sums back through autograd.

Three tiers, as megatron-core's ``tensor_parallel/mappings.py``: the all-to-all route (``HeadShards``),
the autograd Function that pipelines the head groups (``head_groups``), and ``ulysses_attention``.
"""

from math import gcd
from typing import Optional, Tuple

import torch

from .agreement import BlockDiagCPError
from .head_groups import Posted, head_group_attention, head_groups_for

# ---------------------------------------------------------------------------
# Primitives
# ---------------------------------------------------------------------------


class HeadShards:
    """The ``head_groups`` route of the Ulysses group: one group of heads at a time, every rank's sequence
    shard <-> this rank's head shard, one ``all_to_all_single`` each way.

    ``to_local`` orders the head shard's source-rank-major rows as the heads state's local ones, and
    ``to_ranks`` back (two inverse permutations): the all-to-all's rows and the state's are one gather
    apart, each way. Rank j's block of a tensor's H heads is [j * H / cp, (j + 1) * H / cp); group g of
    ``groups`` is the g-th slice of every block."""

    def __init__(self, group, cp: int, to_local: torch.Tensor, to_ranks: torch.Tensor, stats: dict):
        self.group, self.cp, self.to_local, self.to_ranks, self.stats = group, cp, to_local, to_ranks, stats

    def to(self, x: torch.Tensor, groups: int, g: int, backward: bool = False) -> Posted:
        """x [L, b, H, D] this rank's positions, every head -> (posted) [cp * L, b, H / cp / groups, D] every
        rank's positions of group g's heads of this rank, rows in ``to_local`` order."""
        L, b, H, D = x.shape
        h = H // self.cp // groups
        sent = x.reshape(L, b, self.cp, groups, h, D)[:, :, :, g].permute(2, 0, 1, 3, 4).contiguous()  # [cp, L, b, h, D]
        return self._post(sent, backward, lambda received: received.view(self.cp * L, b, h, D).index_select(
            0, self.to_local))

    def back(self, y: torch.Tensor, into: torch.Tensor, groups: int, g: int, backward: bool = False) -> Posted:
        """y [P, b, h, D] every rank's positions of this rank's group g heads, in ``to_local`` order -> (posted)
        into ``into`` [L, b, cp * groups * h, D], this rank's positions, group g's heads of every rank."""
        P, b, h, D = y.shape
        L = P // self.cp
        sent = y.index_select(0, self.to_ranks).view(self.cp, L, b, h, D)  # block j: rank j's positions

        def place(received):  # [cp, L, b, h, D] block i: rank i's heads of group g
            into.view(L, b, self.cp, groups, h, D)[:, :, :, g].copy_(received.permute(1, 2, 0, 3, 4))

        return self._post(sent, backward, place)

    def _post(self, sent, backward: bool, finish) -> Posted:
        prefix = "backward_" if backward else ""
        moved = sent.numel() * sent.element_size() * (self.cp - 1) // self.cp  # all but its own block, each way
        for key in ("bytes_sent", "bytes_received"):
            self.stats[prefix + key] = self.stats.get(prefix + key, 0) + moved
        return Posted.all_to_all(sent, self.group, finish, self.stats, prefix + "wait_seconds")


# ---------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------


def kv_head_repeats(q_heads: int, kv_heads: int, cp: int, size_name: str = "cp") -> Tuple[int, str]:
    """(how many times each K/V head is repeated so the K/V heads split over cp ranks, the error or '').

    With ``Hq = G * Hkv`` and ``cp | Hq``, ``r = cp / gcd(Hkv, cp)`` divides G (cp / gcd is coprime to
    Hkv / gcd), so the repeated heads always line up with the query heads: only ``cp | Hq`` is asked.
    ``size_name`` names the group in the error (``ulysses_size`` for two dimensions).
    """
    if q_heads % cp:
        fix = ("a cp that divides the query heads or another kv exchange (--cp-kv-exchange a2a)"
               if size_name == "cp" else f"a {size_name} that divides the query heads")
        return 1, (f"kv exchange 'ulysses' splits the {q_heads} query heads over the {size_name}={cp} ranks, and "
                   f"{q_heads} % {cp} = {q_heads % cp}; use {fix}")
    return cp // gcd(kv_heads, cp), ""


def ulysses_attention(q, k, v, softmax_offset: Optional[torch.Tensor], state, backend: str, scale: float,
                      dropout_p: float, window: Optional[int]) -> torch.Tensor:
    """q: [L, b, Hq, Dqk], k: [L, b, Hkv, Dqk], v: [L, b, Hkv, Dv] (this rank's positions, the layout's
    order) -> [L, b, Hq, Dv]. Every CP rank calls it with the same shapes (agreed before)."""
    cp, group = state.ulysses_size, state.ulysses_group  # the Ulysses group (the CP group in one dimension)
    two_dim = state.ring_state is not None
    repeats, error = kv_head_repeats(q.shape[2], k.shape[2], cp, "ulysses_size" if two_dim else "cp")
    if error:  # the shapes were agreed: every rank raises this, before any all-to-all
        raise BlockDiagCPError(error)
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
    heads_state, to_local, to_ranks = state.ulysses_on(q.device)
    stats = state.comm_stats
    for key in [key for key in stats if not key.startswith("backward_")]:
        del stats[key]  # this call's figures only (a model's layers share the state)
    hq, hkv = q.shape[2] // cp, k.shape[2] // cp  # this rank's heads
    if two_dim:  # the ring level's K / V rows: this rank's heads of one position
        heads_state.kv_row_bytes = (k.shape[1] * hkv * (k.shape[3] + v.shape[3])) * k.element_size()
    sink = None
    if softmax_offset is not None:
        place = state.rank % cp  # place in the Ulysses group
        sink = softmax_offset[place * hq:(place + 1) * hq]  # [Hq / cp]: this rank's heads
    # A ring level exchanges K / V per call: K / V moved whole would cross it once per group
    groups = head_groups_for(hq, hkv, exchanging=two_dim)
    route = HeadShards(group, cp, to_local, to_ranks, stats)
    return head_group_attention(route, groups, heads_state, q, k, v, sink, backend, scale, dropout_p, window)


__all__ = ["ulysses_attention", "kv_head_repeats"]
