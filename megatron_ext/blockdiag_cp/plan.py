"""Doc ids + layout -> needed K/V, exchange counts and varlen segments (pure, host side).

Computed once per step from the replicated document ids; every rank computes the
same global tables (who sends what to whom), so every exchange decision is taken
identically on every rank without communication. Only this rank's kernel
segments are materialized. Everything is interval arithmetic on the layout's
runs and the documents' runs (``intervals``), never a mask over ``P`` per rank;
the THD layout's counts have a closed form (``layout.thd_exchange_counts``).

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

from .intervals import (RankRuns, clip, document_runs, flat_ranges, map_ranges, overlap_counts, ranges,
                        work_and_intervals)
from .layout import Layout, thd_exchange_counts


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
    Works on the layout's runs and each row's document runs (``intervals``): one
    pass over the doc ids, the rest over runs, documents and this rank's indices.
    """
    R, P = doc_ids.shape
    cp, L = layout.cp, layout.local_len
    runs = layout.runs
    rows = [document_runs(doc_ids[row]) for row in range(R)]
    work_per_rank, dst, a, b = work_and_intervals(runs, rows)

    # What every rank needs is its intervals; counts are their overlaps with every owner.
    if layout.name == "thd" and R == 1 and cp > 1:  # every rank needs every document: closed form
        counts = thd_exchange_counts(doc_ids[0], cp)
    else:
        counts = overlap_counts(runs, dst, a, b)
    needed_remote = counts.sum(0)

    # This rank as the source: its local rows inside every other rank's intervals.
    empty = torch.empty(0, dtype=torch.long)
    send_index: List[torch.Tensor] = [empty] * cp
    recv_positions: List[torch.Tensor] = [empty] * cp
    out = dst != rank
    if bool(out.any()):
        lo, hi = flat_ranges(runs, a[out], b[out], rank)
        n = hi - lo
        local = ranges(lo - rank * L, n)
        per_dst = torch.zeros(cp, dtype=torch.long).index_add_(0, dst[out], n)
        send_index = list(torch.split(local, per_dst.tolist()))
    # This rank as the destination: every other owner's positions inside its own intervals,
    # source-major; flat index ranges map to positions through the runs (sorted by flat index).
    mine = dst == rank
    recv_start, recv_len = empty, empty
    if bool(mine.any()):
        lo, hi = flat_ranges(runs, a[mine], b[mine])  # [cp, n_mine]
        n = hi - lo
        n[rank] = 0
        _, recv_start, recv_len = map_ranges(runs.flat, runs.length, runs.start, lo.reshape(-1), n.reshape(-1))
        recv_positions = list(torch.split(ranges(recv_start, recv_len), n.sum(1).tolist()))

    halo_ok, halo_reason = _halo_check(runs, counts)
    exchange = ExchangeTables(counts, send_index, recv_positions, halo_ok, halo_reason)

    def make(kind: str) -> KernelSegments:
        # The buffer as disjoint position ranges sorted by position, each with its first slot.
        if kind == "allgather":
            start, length, run = runs.by_position()
            slots = (start, length, runs.flat[run])  # rank-major buffer: owner * L + local index
        else:
            mine_runs = runs.of_rank(rank)
            offsets = torch.cumsum(recv_len, 0) - recv_len
            start = torch.cat([runs.start[mine_runs], recv_start])
            order = torch.argsort(start)
            slots = (start[order], torch.cat([runs.length[mine_runs], recv_len])[order],
                     torch.cat([runs.local[mine_runs], L + offsets])[order])
        return _segments(rows, runs, rank, slots)

    segments = _Segments(make)
    for kind in kinds:
        segments[kind]
    return StepPlan(rank, cp, R, L, needed_remote, work_per_rank, exchange, segments)


def _halo_check(runs: RankRuns, counts: torch.Tensor) -> Tuple[bool, str]:
    """Halo works when every rank's sources own the position just before one of its runs."""
    cp = runs.cp
    by_start, _, by_run = runs.by_position()
    first = runs.start > 0
    before = runs.start[first] - 1
    owner = runs.rank[by_run[torch.searchsorted(by_start, before, right=True) - 1]]
    adjacent = torch.zeros(cp, cp, dtype=torch.bool)  # [dst, src]
    adjacent[runs.rank[first], owner] = True
    strays = (counts.t() > 0) & ~adjacent  # [dst, src]
    bad = torch.nonzero(strays.any(1)).flatten()
    if bad.numel() == 0:
        return True, "every straddling document comes from the neighbouring shard"
    dst = int(bad[0])
    srcs = torch.nonzero(strays[dst]).flatten().tolist()
    return False, (f"rank {dst} needs K/V from rank(s) {srcs}, which own no shard "
                   f"adjacent to its own (a document straddles more than one boundary)")


def _segments(rows, runs: RankRuns, rank: int, slots) -> KernelSegments:
    """Per row: this rank's runs cut at the row's documents; one segment per real piece.

    A piece [pa, pb) of a document starting at s reads keys [s, pb), looked up
    in the buffer's slot table ``slots`` = (start, length, first slot).
    """
    R = len(rows)
    mine = runs.of_rank(rank)
    r_start, r_len, r_local = runs.start[mine], runs.length[mine], runs.local[mine]
    q_parts, k_parts, q_lens, k_lens = [], [], [], []
    for row, (d_start, d_end, d_id) in enumerate(rows):
        run, doc, pa, pb = clip(r_start, r_start + r_len, d_start, d_end)
        real = d_id[doc] > 0
        if not bool(real.any()):
            continue
        run, doc, pa, pb = run[real], doc[real], pa[real], pb[real]
        n_q = pb - pa
        key_start = d_start[doc]
        n_k = pb - key_start
        q_parts.append(ranges(r_local[run] + pa - r_start[run], n_q) * R + row)
        which, slot, n = map_ranges(*slots, key_start, n_k)
        delivered = torch.zeros_like(n_k).index_add_(0, which, n)
        assert torch.equal(delivered, n_k), "plan bug: a needed key is not delivered"
        k_parts.append(ranges(slot, n) * R + row)
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
