"""Re-laid attention: the step's rows move to the balanced layout for the attention, the output moves back.

    thd, cp = 2, documents A (8 positions), B (4), C (4): rank r owns chunks r and 2cp-1-r of each
        rank 0: A0 A1 A6 A7 B0 B3 C0 C3          rank 1: A2 A3 A4 A5 B1 B2 C1 C2
    balanced (short documents whole where the costs allow):
        rank 0: A0 .. A7                         rank 1: B0 .. B3 C0 .. C3
    q, k, v: one all-to-all-v each, the batch's rows -> the balanced rows; the streamed op on the
    balanced state (its own K/V exchange of what it still needs: here nothing); the output: one
    all-to-all-v back. A group of heads at a time (``head_groups``): the next group's rows travel
    while one is attended, its output goes home while the next one is.

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
gather before the all-to-all, one after (home: a scatter into the group's heads).

Three tiers, as megatron-core's ``tensor_parallel/mappings.py``: the row moves (``RowMove``, and
``RowMoves``: one all-to-all-v per group and tensor), the autograd Function that pipelines the head
groups (``head_groups``), ``relaid_attention``.
"""

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from .head_groups import Posted, head_group_attention, head_groups_for
from .layouts import Layout

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


class RowMoves:
    """The ``head_groups`` route of a re-laid call: one group of heads at a time, the rows from the batch's
    layout to the target's (``there``) and home (``back``), one ``all_to_all_single`` each: a gather before,
    a gather (or, home, a scatter into the caller's heads) after."""

    def __init__(self, there: RowMove, back: RowMove, group, rank: int, stats: Dict):
        self.there, self.back_move, self.group, self.rank, self.stats = there, back, group, rank, stats

    def to(self, x: torch.Tensor, groups: int, g: int, backward: bool = False) -> Posted:
        """x [L, b, H, D] in the batch's layout -> (posted) group g's heads [L, b, H / groups, D] in the target's."""
        h = x.shape[2] // groups
        sent = x[:, :, g * h:(g + 1) * h].index_select(0, self.there.send_order)
        return self._post(sent, self.there, backward, lambda received: received.index_select(0, self.there.placed))

    def back(self, y: torch.Tensor, into: torch.Tensor, groups: int, g: int, backward: bool = False) -> Posted:
        """y [L, b, h, D] group g's heads in the target's layout -> (posted) into ``into``'s heads of group g,
        [L, b, groups * h, D] in the batch's layout."""
        h = y.shape[2]
        sent = y.index_select(0, self.back_move.send_order)

        def place(received):  # home row there.send_order[i] takes received row i (back.placed's inverse)
            into[:, :, g * h:(g + 1) * h].index_copy_(0, self.there.send_order, received)

        return self._post(sent, self.back_move, backward, place)

    def _post(self, sent: torch.Tensor, move: RowMove, backward: bool, finish) -> Posted:
        prefix = "backward_" if backward else ""
        _count(self.stats, prefix + "relayout_bytes", sent, move, self.rank)
        # every rank holds L rows in either layout: as many come back as go
        return Posted.all_to_all(sent, self.group, finish, self.stats, prefix + "relayout_wait_seconds",
                                 move.send_counts, move.recv_counts)


def _count(stats: Dict, key: str, x: torch.Tensor, move: RowMove, rank: int) -> None:
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    sent, received = move.moved_rows(rank)
    stats[key + "_sent"] = stats.get(key + "_sent", 0) + sent * row
    stats[key + "_received"] = stats.get(key + "_received", 0) + received * row


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
    inner = relaid.state
    inner.kv_row_bytes = state.kv_row_bytes
    # The target's attention exchanges K / V per call: each group moves its own K / V heads
    groups = head_groups_for(q.shape[2], k.shape[2], exchanging=True)
    route = RowMoves(there, back, state.group, state.rank, stats)
    return head_group_attention(route, groups, inner, q, k, v, softmax_offset, backend, scale, dropout_p, window)


__all__ = ["RowMove", "RowMoves", "Relaid", "relaid_attention"]
