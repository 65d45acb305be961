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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from .intervals import needed_intervals, overlap_counts, rank_keys, ranges
from .layout import Layout, document_starts


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
    segments: Mapping  # exchange kind ("allgather" | "sparse") -> KernelSegments, built lazily

    def positions_moved(self, kind: str) -> Tuple[int, int]:
        """(sent, received) K/V positions of this rank per attention call."""
        if kind == "allgather":
            moved = (self.cp - 1) * self.local_len
            return moved, moved
        counts = self.exchange.counts
        return int(counts[self.rank].sum()), int(counts[:, self.rank].sum())


class _Segments(Mapping):
    """exchange kind -> KernelSegments, built on first access (only the exchange in use pays)."""

    def __init__(self, make):
        self._make = make
        self._built: Dict[str, KernelSegments] = {}

    def __getitem__(self, kind: str) -> KernelSegments:
        if kind not in SEGMENT_KINDS:
            raise KeyError(f"unknown segment kind {kind!r}; known: {SEGMENT_KINDS}")
        if kind not in self._built:
            self._built[kind] = self._make(kind)
        return self._built[kind]

    def __iter__(self):
        return iter(SEGMENT_KINDS)

    def __len__(self) -> int:
        return len(SEGMENT_KINDS)


SEGMENT_KINDS = ("allgather", "sparse")


def segment_kind(kv_exchange: str) -> str:
    """The segments an exchange reads: allgather's rank-major buffer, or the needed-only one."""
    return "allgather" if kv_exchange == "allgather" else "sparse"


def build_plan(doc_ids: torch.Tensor, layout: Layout, rank: int,
               kinds: Sequence[str] = SEGMENT_KINDS) -> StepPlan:
    """doc_ids: [R, P] int64 (padded); all tables are global except this rank's indices.

    ``kinds``: the segment kinds built now; any other is built on first access.
    """
    R, P = doc_ids.shape
    cp, L = layout.cp, layout.local_len
    positions = layout.positions
    flat = positions.reshape(-1)
    starts = document_starts(doc_ids)

    pos_work = torch.where(doc_ids > 0, torch.arange(P) - starts + 1, torch.zeros_like(starts)).sum(0)
    work_per_rank = pos_work[flat].view(cp, L).sum(1)

    # What every rank needs, as disjoint intervals; counts are their overlaps with each owner.
    keys = rank_keys(positions, P)
    dst, a, b = needed_intervals(doc_ids, starts, positions)
    counts, lo, hi = overlap_counts(dst, a, b, keys, cp, P)
    needed_remote = counts.sum(0)

    # This rank as the source: its local rows inside every other rank's intervals.
    empty = torch.empty(0, dtype=torch.long)
    send_index: List[torch.Tensor] = [empty] * cp
    recv_positions: List[torch.Tensor] = [empty] * cp
    out = dst != rank
    if bool(out.any()):
        n = (hi[out, rank] - lo[out, rank])
        local = ranges(lo[out, rank] - rank * L, n)
        per_dst = torch.zeros(cp, dtype=torch.long).index_add_(0, dst[out], n)
        send_index = list(torch.split(local, per_dst.tolist()))
    # This rank as the destination: every other owner's positions inside its own intervals.
    mine = dst == rank
    if bool(mine.any()):
        n = (hi[mine] - lo[mine]).t().contiguous()  # [cp, n_mine], source-major
        n[rank] = 0
        got = flat[ranges(lo[mine].t().reshape(-1), n.reshape(-1))]
        recv_positions = list(torch.split(got, n.sum(1).tolist()))

    halo_ok, halo_reason = _halo_check(positions, counts, P)
    exchange = ExchangeTables(counts, send_index, recv_positions, halo_ok, halo_reason)

    def make(kind: str) -> KernelSegments:
        if kind == "allgather":
            slot = torch.empty(P, dtype=torch.long)
            slot[flat] = torch.arange(cp * L)  # rank-major buffer: owner * L + local index
        else:
            slot = torch.full((P,), -1, dtype=torch.long)
            slot[positions[rank]] = torch.arange(L)
            received = torch.cat(recv_positions)
            slot[received] = L + torch.arange(received.numel())
        return _segments(doc_ids, starts, positions[rank], slot)

    segments = _Segments(make)
    for kind in kinds:
        segments[kind]
    return StepPlan(rank, cp, R, L, needed_remote, work_per_rank, exchange, segments)


def _halo_check(positions: torch.Tensor, counts: torch.Tensor, P: int) -> Tuple[bool, str]:
    """Halo works when every rank's sources own the position just before one of its runs."""
    cp, L = positions.shape
    flat = positions.reshape(-1)
    owner = torch.empty(P, dtype=torch.long)
    rank_of = torch.arange(cp).repeat_interleave(L)
    owner[flat] = rank_of
    run_start = torch.ones_like(flat, dtype=torch.bool)
    run_start[1:] = flat[1:] != flat[:-1] + 1
    run_start[::L] = True
    run_start &= flat > 0
    adjacent = torch.zeros(cp, cp, dtype=torch.bool)  # [dst, src]
    adjacent[rank_of[run_start], owner[flat[run_start] - 1]] = True
    strays = (counts.t() > 0) & ~adjacent  # [dst, src]
    bad = torch.nonzero(strays.any(1)).flatten()
    if bad.numel() == 0:
        return True, "every straddling document comes from the neighbouring shard"
    dst = int(bad[0])
    srcs = torch.nonzero(strays[dst]).flatten().tolist()
    return False, (f"rank {dst} needs K/V from rank(s) {srcs}, which own no shard "
                   f"adjacent to its own (a document straddles more than one boundary)")


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
        k_pos = ranges(key_start, n_k)
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


def segment_pairs(n_q: torch.Tensor, n_k: torch.Tensor) -> torch.Tensor:
    """Query-key pairs of bottom-right causal segments."""
    return n_q * (n_k - n_q) + n_q * (n_q + 1) // 2


def lower_bound_positions(plan: StepPlan) -> int:
    return int(plan.needed_remote[plan.rank])


__all__ = ["StepPlan", "KernelSegments", "ExchangeTables", "build_plan", "segment_pairs",
           "segment_kind", "lower_bound_positions", "SEGMENT_KINDS"]
