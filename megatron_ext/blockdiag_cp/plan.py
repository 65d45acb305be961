"""Doc ids + layout -> needed K/V, exchange counts and varlen segments (pure, host side).

Computed once per step from the replicated document ids; every rank computes the
same global tables (who sends what to whom), so every exchange decision is taken
identically on every rank without communication. Only this rank's kernel
segments are materialized.

Index conventions. Sequence-aligned tensors are flattened as ``s * R + row``
where R is the number of document-id rows (1 when every batch row shares them;
then the batch folds into the head dimension). A rank's K/V *buffer* is what the
exchange delivers:
- allgather: every rank's local K/V, rank-major ([cp * L] rows);
- halo / a2a: this rank's local K/V followed by the received positions, grouped
  by source rank in rank order, ascending global position within a source.
"""

from dataclasses import dataclass
from typing import List, Tuple

import torch

from .layout import Layout, document_starts, needed_mask


@dataclass(frozen=True)
class ExchangeTables:
    """Global, identical on every rank. counts[src, dst]: positions src sends dst."""

    counts: torch.Tensor  # [cp, cp] int64, zero diagonal
    send_index: List[torch.Tensor]  # this rank: per destination, local indices to send (ascending)
    recv_positions: List[torch.Tensor]  # this rank: per source, global positions received (ascending)
    halo_ok: bool
    halo_reason: str


@dataclass(frozen=True)
class KernelSegments:
    """This rank's per-document varlen segments (bottom-right causal)."""

    q_index: torch.Tensor  # [Nq] rows of the flattened local q (s * R + row)
    k_index: torch.Tensor  # [Nk] rows of the flattened K/V buffer (slot * R + row)
    cu_seqlens_q: torch.Tensor  # [n_seg + 1] int32
    cu_seqlens_k: torch.Tensor  # [n_seg + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_segments(self) -> int:
        return self.cu_seqlens_q.numel() - 1

    def lengths(self) -> Tuple[List[int], List[int]]:
        return (self.cu_seqlens_q.diff().tolist(), self.cu_seqlens_k.diff().tolist())


@dataclass(frozen=True)
class StepPlan:
    rank: int
    cp: int
    rows: int  # R, rows of document ids
    local_len: int
    needed_remote: torch.Tensor  # [cp] positions each rank needs and does not own (lower bound)
    work_per_rank: torch.Tensor  # [cp] query-key pairs (summed over rows)
    exchange: ExchangeTables
    segments: dict  # exchange kind ("allgather" | "sparse") -> KernelSegments

    def positions_moved(self, kind: str) -> Tuple[int, int]:
        """(sent, received) K/V positions of this rank per attention call."""
        if kind == "allgather":
            moved = (self.cp - 1) * self.local_len
            return moved, moved
        counts = self.exchange.counts
        return int(counts[self.rank].sum()), int(counts[:, self.rank].sum())


def _runs_predecessor_owners(positions: torch.Tensor, owner: torch.Tensor) -> set:
    """Owners of the position just before each contiguous run of ``positions``."""
    pos = positions.tolist()
    preds = set()
    for i, p in enumerate(pos):
        if p > 0 and (i == 0 or pos[i - 1] != p - 1):
            preds.add(int(owner[p - 1]))
    return preds


def build_plan(doc_ids: torch.Tensor, layout: Layout, rank: int) -> StepPlan:
    """doc_ids: [R, P] int64 (padded); all tables are global except this rank's indices."""
    R, P = doc_ids.shape
    cp, L = layout.cp, layout.local_len
    owner = layout.owner()
    local_index = layout.local_index()
    starts = document_starts(doc_ids)

    pos_work = torch.where(doc_ids > 0, torch.arange(P) - starts + 1, torch.zeros_like(starts)).sum(0)
    work_per_rank = pos_work[layout.positions].sum(1)

    counts = torch.zeros(cp, cp, dtype=torch.long)
    needed_remote = torch.zeros(cp, dtype=torch.long)
    send_index: List[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * cp
    recv_positions: List[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * cp
    halo_ok, halo_reason = True, "every straddling document comes from the neighbouring shard"
    for dst in range(cp):
        needed = needed_mask(doc_ids, starts, layout.positions[dst])
        remote = torch.nonzero(needed & (owner != dst)).flatten()
        src_of = owner[remote]
        needed_remote[dst] = remote.numel()
        counts[:, dst] = torch.bincount(src_of, minlength=cp)
        if remote.numel():
            preds = _runs_predecessor_owners(layout.positions[dst], owner)
            strays = sorted(set(src_of.unique().tolist()) - preds)
            if strays and halo_ok:
                halo_ok = False
                halo_reason = (f"rank {dst} needs K/V from rank(s) {strays}, which own no shard "
                               f"adjacent to its own (a document straddles more than one boundary)")
        for src in range(cp):
            mine = remote[src_of == src]
            if src == rank:
                send_index[dst] = local_index[mine]
            if dst == rank:
                recv_positions[src] = mine

    exchange = ExchangeTables(counts, send_index, recv_positions, halo_ok, halo_reason)

    # Buffer slot of every global position this rank may read, per exchange kind.
    allgather_slot = owner * L + local_index
    sparse_slot = torch.full((P,), -1, dtype=torch.long)
    sparse_slot[layout.positions[rank]] = torch.arange(L)
    received = torch.cat(recv_positions) if recv_positions else torch.empty(0, dtype=torch.long)
    sparse_slot[received] = L + torch.arange(received.numel())
    segments = {
        "allgather": _segments(doc_ids, starts, layout.positions[rank], allgather_slot),
        "sparse": _segments(doc_ids, starts, layout.positions[rank], sparse_slot),
    }
    return StepPlan(rank, cp, R, L, needed_remote, work_per_rank, exchange, segments)


def _segments(doc_ids: torch.Tensor, starts: torch.Tensor, positions: torch.Tensor,
              slot: torch.Tensor) -> KernelSegments:
    R = doc_ids.shape[0]
    L = positions.numel()
    q_parts, k_parts, q_lens, k_lens = [], [], [], []
    local = torch.arange(L)
    for row in range(R):
        d = doc_ids[row, positions]
        new_seg = torch.ones(L, dtype=torch.bool)
        new_seg[1:] = (d[1:] != d[:-1]) | (positions[1:] != positions[:-1] + 1)
        seg_id = new_seg.long().cumsum(0) - 1
        real = d > 0
        if not bool(real.any()):
            continue
        first = torch.nonzero(new_seg & real).flatten()  # local index of each segment's first query
        n_q = torch.bincount(seg_id[real], minlength=int(seg_id[-1]) + 1)[seg_id[first]]
        last_pos = positions[first + n_q - 1]
        key_start = starts[row, positions[first]]
        n_k = last_pos + 1 - key_start
        q_parts.append(local[real] * R + row)
        k_pos = _ranges(key_start, n_k)
        k_slot = slot[k_pos]
        assert bool((k_slot >= 0).all()), "plan bug: a needed key is not delivered"
        k_parts.append(k_slot * R + row)
        q_lens.append(n_q)
        k_lens.append(n_k)
    if not q_parts:
        empty = torch.empty(0, dtype=torch.long)
        zero = torch.zeros(1, dtype=torch.int32)
        return KernelSegments(empty, empty, zero, zero, 0, 0)
    q_lens_t, k_lens_t = torch.cat(q_lens), torch.cat(k_lens)
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), q_lens_t.cumsum(0)]).to(torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), k_lens_t.cumsum(0)]).to(torch.int32)
    return KernelSegments(torch.cat(q_parts), torch.cat(k_parts), cu_q, cu_k,
                          int(q_lens_t.max()), int(k_lens_t.max()))


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(s, s + n) for each (s, n)."""
    total = int(lengths.sum())
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - offsets, lengths) + torch.arange(total)


def segment_pairs(n_q: torch.Tensor, n_k: torch.Tensor) -> torch.Tensor:
    """Query-key pairs of bottom-right causal segments."""
    return n_q * (n_k - n_q) + n_q * (n_q + 1) // 2


def lower_bound_positions(plan: StepPlan) -> int:
    return int(plan.needed_remote[plan.rank])


__all__ = ["StepPlan", "KernelSegments", "ExchangeTables", "build_plan", "segment_pairs",
           "lower_bound_positions"]
