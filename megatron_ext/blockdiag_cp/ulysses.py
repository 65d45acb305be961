"""Head-parallel CP (DeepSpeed-Ulysses): every rank attends the whole pack on 1/cp of the heads.

    sequence shards (the layout's)              head shards
    rank r: [L, b, H, D], its L positions  -->  rank r: [P, b, H / cp, D], every position, heads
                                                [r * H / cp, (r + 1) * H / cp)

    cp = 2, H = 4 heads (0 1 2 3), positions of a zigzag layout a b | c d:
        rank 0 holds a d, heads 0-3      -->  rank 0 holds a b c d, heads 0 1
        rank 1 holds b c, heads 0-3      -->  rank 1 holds a b c d, heads 2 3

Two all-to-alls replace the K/V exchange: q, k and v go from sequence shards to head shards (the
three in flight at once), the output comes back the same way. In between each rank runs the
engine's single-rank op over the padded pack in global order: one plan of every document of every
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

Three tiers, as megatron-core's ``tensor_parallel/mappings.py``: the all-to-all primitives, one
autograd Function for the all-to-alls (either direction; backward is the other), and
``ulysses_attention``.
"""

from math import gcd
from typing import Optional, Sequence, Tuple

import torch

from .agreement import BlockDiagCPError
from .exchange import all_to_alls, needed_gradients
from .streamed import streamed_attention

# ---------------------------------------------------------------------------
# Primitives
# ---------------------------------------------------------------------------


def _sequence_to_heads(xs: Sequence[torch.Tensor], group, cp: int, order: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Each [L, b, H, D] this rank's positions, every head -> [cp * L, b, H / cp, D] every rank's positions,
    this rank's heads, rows in ``order`` (of the source-rank-major rows)."""
    def heads(i, received):
        L, b, H, D = xs[i].shape
        return received.reshape(cp * L, b, H // cp, D).index_select(0, order)

    # [cp, L, b, H / cp, D] block j: the heads of rank j
    return all_to_alls((x.reshape(x.shape[0], x.shape[1], cp, x.shape[2] // cp, x.shape[3]).permute(2, 0, 1, 3, 4)
                        for x in xs), group, heads)


def _heads_to_sequence(ys: Sequence[torch.Tensor], group, cp: int, order: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Each [cp * L, b, h, D] every rank's positions, this rank's heads, taken in ``order`` to source-rank-major
    rows -> [L, b, cp * h, D] this rank's positions, every head: the inverse of ``_sequence_to_heads``."""
    def sequence(i, received):  # [cp, L, b, h, D] block i: heads of rank i
        P, b, h, D = ys[i].shape
        return received.permute(1, 2, 0, 3, 4).reshape(P // cp, b, cp * h, D)

    return all_to_alls((y.index_select(0, order).reshape(cp, y.shape[0] // cp, *y.shape[1:]) for y in ys),
                       group, sequence)


# ---------------------------------------------------------------------------
# Autograd Functions
# ---------------------------------------------------------------------------


class _AllToAllHeads(torch.autograd.Function):
    """Forward: sequence shards -> head shards (``to_heads``) or back, every tensor's all-to-all in flight
    at once. Backward: their gradients the other direction, likewise.

    ``to_local`` orders the head shards' source-rank-major rows as the heads state's local ones, and
    ``to_ranks`` back (two inverse permutations): the all-to-all's rows and the state's are one gather
    apart, each way."""

    @staticmethod
    def forward(ctx, group, cp: int, stats: dict, to_heads: bool, to_local, to_ranks, *xs):
        ctx.group, ctx.cp, ctx.stats, ctx.to_heads = group, cp, stats, to_heads
        ctx.to_local, ctx.to_ranks = to_local, to_ranks
        for x in xs:
            _count(stats, "", x, cp)
        if to_heads:
            return _sequence_to_heads(xs, group, cp, to_local)
        return _heads_to_sequence(xs, group, cp, to_ranks)

    @staticmethod
    def backward(ctx, *grads):
        def move(picked):
            for grad in picked:
                _count(ctx.stats, "backward_", grad, ctx.cp)
            if ctx.to_heads:
                return _heads_to_sequence(picked, ctx.group, ctx.cp, ctx.to_ranks)
            return _sequence_to_heads(picked, ctx.group, ctx.cp, ctx.to_local)

        return (None,) * 6 + needed_gradients(grads, ctx.needs_input_grad[6:], move)


def _count(stats: dict, prefix: str, x: torch.Tensor, cp: int) -> None:
    """Bytes this rank sends (and receives: the all-to-all is symmetric) for ``x``: all but its own block."""
    moved = x.numel() * x.element_size() * (cp - 1) // cp
    for key in ("bytes_sent", "bytes_received"):
        stats[prefix + key] = stats.get(prefix + key, 0) + moved


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
    # [n, b, H / cp, D] in the heads state's local order: global order in one dimension, the ring layout's in two
    q_h, k_h, v_h = _AllToAllHeads.apply(group, cp, stats, True, to_local, to_ranks, q, k, v)
    if two_dim:
        heads_state.kv_row_bytes = k_h[0].numel() * k_h.element_size() + v_h[0].numel() * v_h.element_size()
    sink = None
    if softmax_offset is not None:
        share, place = q.shape[2] // cp, state.rank % cp  # place in the Ulysses group
        sink = softmax_offset[place * share:(place + 1) * share]  # [Hq / cp]: this rank's heads
    out_h = streamed_attention(q_h, k_h, v_h, sink, heads_state, backend, scale, dropout_p, window)  # [n, b, Hq / cp, Dv]
    out, = _AllToAllHeads.apply(group, cp, stats, False, to_local, to_ranks, out_h)
    return out


__all__ = ["ulysses_attention", "kv_head_repeats"]
