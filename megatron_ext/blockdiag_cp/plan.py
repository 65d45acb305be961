"""Doc ids + layout -> needed K/V, exchange counts and the streamed kernel calls (pure, host side).

Computed once per step from the replicated document ids; every rank computes the
same global tables (who sends what to whom), so every exchange decision is taken
identically on every rank without communication. Only this rank's kernel calls
(``chunks``: one round per source rank) are materialized. The global tables come from the layout's strategy
(``layouts.LayoutTables``): interval arithmetic on the layout's runs and the documents' runs
(``intervals``), never a mask over ``P`` per rank, or a closed form where the layout has one (THD's).

Index conventions. Sequence-aligned tensors are flattened as ``s * R + row``
where R is the number of document-id rows (1 when every batch row shares them;
then the batch folds into the head dimension). What a round delivers from a
source is described in ``chunks``: the source's whole local K/V (the all-gather
ring) or the source's positions this rank needs, ascending (halo / a2a; what
``ExchangeTables.send_index`` sends).
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .chunks import CHUNK_KINDS, StreamPlan, build_stream_plan, chunk_kind, with_calls_by_runs
from .intervals import RankRuns, document_runs, ranges, take
from .layouts import LAYOUT_STRATEGIES, Layout


@dataclass(frozen=True)
class ExchangeTables:
    """Global, identical on every rank. counts[src, dst]: positions src sends dst."""

    counts: torch.Tensor  # [cp, cp] int64, zero diagonal
    send_index: List[torch.Tensor]  # this rank: per destination, local indices to send (ascending)
    recv_positions: List[torch.Tensor]  # this rank: per source, global positions received (ascending)
    halo_ok: bool
    halo_reason: str


@dataclass(frozen=True)
class StepPlan:
    rank: int
    cp: int
    rows: int  # R, rows of document ids
    local_len: int
    needed_remote: torch.Tensor  # [cp] positions each rank needs and does not own (lower bound)
    work_per_rank: torch.Tensor  # [cp] query-key pairs (summed over rows)
    exchange: ExchangeTables
    stream: Mapping  # chunk kind ("ring" | "needed") -> StreamPlan (the streamed op's steps), lazily
    window: Optional[int] = None  # the sliding window this plan is for (None: whole documents)
    doc_runs: Sequence = ()  # per row of doc ids, its ``intervals.document_runs`` (what the plan was built on)
    intervals: Tuple = ()  # (dst, a, b): every rank's needed position ranges [a, b), global (``ring_reach``)

    def positions_moved(self) -> Tuple[int, int]:
        """(sent, received) K/V positions of this rank per attention call over a needed-only exchange (the
        ring's hops: ``exchange.RingReach.positions``)."""
        counts = self.exchange.counts
        return int(counts[self.rank].sum()), int(counts[:, self.rank].sum())


class _Lazy(Mapping):
    """kind -> what ``make`` builds for it, on first access (only the exchange in use pays)."""

    def __init__(self, make, kinds: Sequence[str]):
        self._make = make
        self._kinds = tuple(kinds)
        self._built: Dict[str, object] = {}

    def __getitem__(self, kind: str):
        if kind not in self._kinds:
            raise KeyError(f"unknown chunk kind {kind!r}; known: {self._kinds}")
        if kind not in self._built:
            self._built[kind] = self._make(kind)
        return self._built[kind]

    def __iter__(self):
        return iter(self._kinds)

    def __len__(self) -> int:
        return len(self._kinds)


def build_plan(doc_ids: torch.Tensor, layout: Layout, rank: int,
               kinds: Sequence[str] = CHUNK_KINDS, window: Optional[int] = None,
               doc_runs: Optional[Sequence] = None) -> StepPlan:
    """doc_ids: [R, P] int64 (padded); all tables are global except this rank's indices.

    ``kinds``: the chunk kinds whose steps are built now; any other is built on first access.
    ``window``: a sliding window (query p sees keys [max(start, p - window), p]): work,
    needed K/V, exchange tables and kernel calls count only keys inside the windows.
    Works on the layout's runs and each row's document runs (``intervals``): one
    pass over the doc ids, the rest over runs, documents and this rank's indices.
    ``doc_runs``: ``intervals.document_runs`` of every row, when the caller has them.
    """
    return plan_with_tables(doc_ids, layout, rank, kinds, window, doc_runs)[0]


def plan_with_tables(doc_ids: torch.Tensor, layout: Layout, rank: int, kinds: Sequence[str] = CHUNK_KINDS,
                     window: Optional[int] = None, doc_runs: Optional[Sequence] = None, known=None):
    """``build_plan``, and the global tables it made that a hierarchical route needs too: (plan,
    (dst, a, b) needed intervals, counts by interval overlap or None where a closed form gave them).

    ``known``: (work, (dst, a, b), counts) of this layout and window, when already computed (the
    balanced search's exact pricing of the layout it chose)."""
    R, P = doc_ids.shape
    cp, L = layout.cp, layout.local_len
    runs = layout.runs
    rows = [document_runs(doc_ids[row]) for row in range(R)] if doc_runs is None else list(doc_runs)
    tables = LAYOUT_STRATEGIES[layout.name].plan_tables(layout, doc_ids, rows, window)
    if known is None:
        work_per_rank, dst, a, b, doc = tables.work_and_intervals()
    else:
        work_per_rank, (dst, a, b), _ = known
        doc = None

    # What every rank needs is its intervals; counts are their overlaps with every owner.
    counts, overlap = tables.exchange_counts(dst, a, b, None if known is None else known[2])
    needed_remote = counts.sum(0)

    # This rank as the source: its local rows inside every other rank's intervals.
    empty = torch.empty(0, dtype=torch.long)
    send_index: List[torch.Tensor] = [empty] * cp
    recv_positions: List[torch.Tensor] = [empty] * cp
    to_dst = dst.numpy()
    out = torch.from_numpy((to_dst != rank).nonzero()[0])
    if out.numel():
        lo, hi = tables.send_ranges(rank, take(a, out), take(b, out), None if doc is None else take(doc, out))
        n = hi - lo
        local = ranges(lo - rank * L, n)
        per_dst = np.zeros(cp, dtype=np.int64)
        np.add.at(per_dst, to_dst[out.numpy()], n.numpy())
        send_index = list(torch.split(local, per_dst.tolist()))
    # This rank as the destination: every other owner's positions inside its own intervals,
    # source-major; flat index ranges map to positions through the runs (sorted by flat index).
    mine = torch.from_numpy((to_dst == rank).nonzero()[0])
    recv_start, recv_len = empty, empty
    mine_flat = None
    if mine.numel():
        lo, hi, _, recv_start, recv_len = tables.owned_ranges(take(a, mine), take(b, mine), rank)  # [cp, n_mine]
        mine_flat = lo, hi
        n = hi.numpy() - lo.numpy()
        n[rank] = 0
        recv_positions = list(torch.split(ranges(recv_start, recv_len), n.sum(1).tolist()))

    halo_ok, halo_reason = _halo_check(runs, counts)
    exchange = ExchangeTables(counts, send_index, recv_positions, halo_ok, halo_reason)

    stream = _Lazy(lambda kind: with_calls_by_runs(
        build_stream_plan(kind, runs, rows, rank, counts, (dst, a, b), window, mine_flat)), CHUNK_KINDS)
    for kind in kinds:
        stream[kind]
    return StepPlan(rank, cp, R, L, needed_remote, work_per_rank, exchange, stream, window, tuple(rows),
                    (dst, a, b)), (dst, a, b), \
        overlap


def _halo_check(runs: RankRuns, counts: torch.Tensor) -> Tuple[bool, str]:
    """Halo works when every rank's sources own the position just before one of its runs."""
    cp = runs.cp
    # The runs partition [0, P): the position before a run's start is the end of the run before it,
    # found through a table of which rank's run ends where (no sort of the runs by position).
    rank, start = runs.rank.numpy(), runs.start.numpy()
    # The narrowest dtype that holds a rank: the table is as long as the sequence, written once (fresh memory).
    ends_at = np.empty(runs.padded_len + 1, dtype=np.int8 if cp < 2 ** 7 else np.int16 if cp < 2 ** 15 else np.int64)
    ends_at[start + runs.length.numpy()] = rank.astype(ends_at.dtype)  # read below at run starts: all written but 0
    # The run at 0 has none before it: its own rank there makes it adjacent to itself, the diagonal, never a
    # stray (counts' is zero); no mask of the runs after 0 and its copies (fresh memory: ~4 ms at 1M / cp 64 THD).
    ends_at[0] = rank[np.argmin(start)]
    adjacent = np.zeros(cp * cp, dtype=bool)  # [dst, src] flat
    pair = rank * cp
    pair += ends_at[start]
    adjacent[pair] = True
    strays = (counts.numpy().T > 0) & ~adjacent.reshape(cp, cp)  # [dst, src]
    bad = strays.any(1).nonzero()[0]
    if bad.size == 0:
        return True, "every straddling document comes from the neighbouring shard"
    dst = int(bad[0])
    srcs = strays[dst].nonzero()[0].tolist()
    return False, (f"rank {dst} needs K/V from rank(s) {srcs}, which own no shard "
                   f"adjacent to its own (a document straddles more than one boundary)")


@dataclass(frozen=True)
class PairRuns:
    """Which of this rank's needed-only pairs move one run of the source's local rows (host, once per step).

        source's local rows   0 ........................... L
        sends dst             ======                           a run: K rows and V rows as they lie
        sends dst'                 ==  ===    =  ==           scattered: a gather into a send buffer

    ``sent_from[dst]``: the first local row of the run this rank sends ``dst`` (None: none, or not a run);
    ``received_run[src]``: whether ``src``'s rows for this rank are a run of ``src``'s. The receiver reads
    it off its received positions and ``src``'s runs of the layout, the sender off its send index: the
    same rows, so both ends of a pair decide alike without asking each other."""

    sent_from: Tuple[Optional[int], ...]
    received_run: Tuple[bool, ...]

    @classmethod
    def of(cls, plan: StepPlan, runs: RankRuns) -> "PairRuns":
        rank, L = plan.rank, plan.local_len
        sent_from: List[Optional[int]] = []
        for dst, index in enumerate(plan.exchange.send_index):
            n = index.numel()
            first = int(index[0]) if n else 0
            sent_from.append(first if dst != rank and n and int(index[-1]) - first + 1 == n else None)
        received_run = []
        for src, positions in enumerate(plan.exchange.recv_positions):
            n = positions.numel()
            if src == rank or not n:
                received_run.append(False)
                continue
            # src's local rows of our first and last positions: a run where they span exactly n rows
            ends = runs.flat_before_np(np.array([int(positions[0]), int(positions[-1])]), src)
            received_run.append(bool(ends[1] - ends[0] + 1 == n))
        return cls(tuple(sent_from), tuple(received_run))


def lower_bound_positions(plan: StepPlan) -> int:
    return int(plan.needed_remote[plan.rank])


__all__ = ["StepPlan", "ExchangeTables", "PairRuns", "build_plan", "chunk_kind", "lower_bound_positions",
           "CHUNK_KINDS", "StreamPlan"]
