"""Re-laid attention: the step's rows move to the balanced layout for the attention, the output moves back.

    thd, cp = 2, documents A (8 positions), B (4), C (4): rank r owns chunks r and 2cp-1-r of each
        rank 0: A0 A1 A6 A7 B0 B3 C0 C3          rank 1: A2 A3 A4 A5 B1 B2 C1 C2
    balanced (short documents whole where the costs allow):
        rank 0: A0 .. A7                         rank 1: B0 .. B3 C0 .. C3
    q, k, v: one all-to-all-v each (all three in flight at once), the batch's rows -> the balanced
    rows; the streamed op on the balanced state (its own K/V exchange of what it still needs: here
    nothing); the output: one all-to-all-v back.

Why: TE's THD partition cuts every document into 2 * cp chunks, so at high cp each short
document's rows are on every rank. Every rank then needs (cp - 1) / cp of every document's keys,
and merges one partial output per source rank into every row. Moving q, k, v and the output
costs (cp - 1) / cp of (Hq + 2 Hkv) + Hq head rows per local row, whatever the documents; the
balanced layout then keeps short documents whole and exchanges keys only for the documents it
cuts. Worth it when a document is short against S / cp (``docs/user_guide/knobs.md``); a long
document's rows come back to the same cut and move for nothing.

Every rank computes the same two layouts from the replicated doc ids, so the split sizes of
every all-to-all are known on every rank without a count exchange. Both layouts list a rank's
rows in ascending global position, so rows from one source arrive in the target's order: one
gather before the all-to-all, one after.

Three tiers, as megatron-core's ``tensor_parallel/mappings.py``: the row all-to-all primitive,
one autograd Function (forward one way, backward the other), ``relaid_attention``.
"""

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from .exchange import all_to_alls, needed_gradients
from .layouts import Layout
from .streamed import streamed_attention

# ---------------------------------------------------------------------------
# Primitives
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RowMove:
    """This rank's rows from one layout's local order to another's (host tensors).

    ``send_order``: [L] the source-local rows, grouped by destination rank, each group ascending;
    ``placed``: [L] for each target-local row, its place in the received buffer (grouped by
    source rank). Both are permutations of range(L); ``send_counts[j]`` rows go to rank j,
    ``recv_counts[i]`` come from rank i.
    """

    send_order: torch.Tensor
    placed: torch.Tensor
    send_counts: List[int]
    recv_counts: List[int]

    @classmethod
    def pair(cls, source: Layout, target: Layout, rank: int) -> Tuple["RowMove", "RowMove"]:
        """(source -> target, target -> source) for ``rank``: one is the other read backwards (what one
        sends, the other receives), so both come from the same two owner lookups."""
        if source.padded_len != target.padded_len or source.cp != target.cp:
            raise ValueError(f"a row move needs two layouts of one padded length and cp, got "
                             f"{source.padded_len} / cp {source.cp} and {target.padded_len} / cp {target.cp}")
        cp = source.cp
        mine = source.rank_positions(rank)  # [L] global positions, ascending
        theirs = target.rank_positions(rank)  # [L]
        dest = target.owner()[mine]  # [L] where each of ours goes
        origin = source.owner()[theirs]  # [L] where each of the target's rows comes from
        # Stable sorts by rank keep each group in ascending global position: the order the other
        # layout lists those rows in too.
        by_dest = torch.sort(dest, stable=True).indices  # send slot -> source-local row
        by_source = torch.sort(origin, stable=True).indices  # buffer slot -> target-local row
        to_dest = torch.bincount(dest, minlength=cp).tolist()
        from_source = torch.bincount(origin, minlength=cp).tolist()
        return (cls(by_dest, _inverse(by_source), to_dest, from_source),
                cls(by_source, _inverse(by_dest), from_source, to_dest))

    def moved_rows(self, rank: int) -> Tuple[int, int]:
        """(rows sent to other ranks, rows received from them): all but the rank's own block."""
        return (sum(self.send_counts) - self.send_counts[rank], sum(self.recv_counts) - self.recv_counts[rank])

    def to(self, device: torch.device) -> "RowMove":
        return RowMove(self.send_order.to(device), self.placed.to(device), self.send_counts, self.recv_counts)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """[L] the inverse permutation: slot i of ``order`` holds row order[i], so row r is at slot inv[r]."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return inverse


def _move_rows(xs: Tuple[torch.Tensor, ...], move: RowMove, group) -> Tuple[torch.Tensor, ...]:
    """Each [L, ...] of ``xs``, rows in the source layout's local order -> [L, ...] in the target's: a
    gather, the all-to-alls in flight together (``exchange.all_to_alls``), a gather."""
    return all_to_alls((x.index_select(0, move.send_order) for x in xs), group,
                       lambda i, received: received.index_select(0, move.placed), move.send_counts, move.recv_counts)


def _count(stats: Dict, key: str, x: torch.Tensor, move: RowMove, rank: int) -> None:
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    sent, received = move.moved_rows(rank)
    stats[key + "_sent"] = stats.get(key + "_sent", 0) + sent * row
    stats[key + "_received"] = stats.get(key + "_received", 0) + received * row


# ---------------------------------------------------------------------------
# Autograd Function
# ---------------------------------------------------------------------------


class _MoveRows(torch.autograd.Function):
    """Forward: the rows of every tensor from one layout to the other (``there``), all moves in flight at
    once. Backward: their gradients back (``back``), likewise."""

    @staticmethod
    def forward(ctx, there: RowMove, back: RowMove, group, rank: int, stats: Dict, *xs):
        ctx.back, ctx.group, ctx.rank, ctx.stats = back, group, rank, stats
        for x in xs:
            _count(stats, "relayout_bytes", x, there, rank)
        return _move_rows(xs, there, group)

    @staticmethod
    def backward(ctx, *grads):
        def move(picked):
            for grad in picked:
                _count(ctx.stats, "backward_relayout_bytes", grad, ctx.back, ctx.rank)
            return _move_rows(picked, ctx.back, ctx.group)

        return (None,) * 5 + needed_gradients(grads, ctx.needs_input_grad[5:], move)


# ---------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------


@dataclass
class Relaid:
    """A state's re-laid attention: the state of the target layout and this rank's row moves."""

    state: object  # step.BlockDiagCPState of the target layout (same group, exchange and knobs)
    there: RowMove  # the batch's layout -> the target's
    back: RowMove  # the target's -> the batch's
    _on: Dict[torch.device, Tuple[RowMove, RowMove]]

    @classmethod
    def build(cls, inner, source: Layout, rank: int) -> "Relaid":
        return cls(inner, *RowMove.pair(source, inner.layout, rank), {})

    def on(self, device: torch.device) -> Tuple[RowMove, RowMove]:
        """The two moves with their indices on ``device`` (one copy each per step and device)."""
        if device not in self._on:
            self._on[device] = (self.there.to(device), self.back.to(device))
        return self._on[device]


def relaid_attention(q, k, v, softmax_offset, state, backend: str, scale: float, dropout_p: float,
                     window) -> torch.Tensor:
    """q: [L, b, Hq, Dqk], k: [L, b, Hkv, Dqk], v: [L, b, Hkv, Dv] in the batch's layout -> [L, b, Hq, Dv]
    in the batch's layout, attended in ``state.relaid``'s. Every CP rank calls it with the same shapes."""
    relaid = state.relaid
    there, back = relaid.on(q.device)
    stats = state.comm_stats
    for key in [key for key in stats if key.startswith("relayout_")]:
        del stats[key]  # this call's figures only (a model's layers share the state)
    q_t, k_t, v_t = _MoveRows.apply(there, back, state.group, state.rank, stats, q, k, v)
    inner = relaid.state
    inner.kv_row_bytes = state.kv_row_bytes
    out_t = streamed_attention(q_t, k_t, v_t, softmax_offset, inner, backend, scale, dropout_p, window)
    out, = _MoveRows.apply(back, there, state.group, state.rank, stats, out_t)
    return out


__all__ = ["RowMove", "Relaid", "relaid_attention"]
