"""The streamed attention plan: this rank's kernel calls, one K/V chunk at a time (host side).

A rank attends its queries to one chunk of keys at a time and merges the partial
outputs by their log-sum-exp, so it never holds more than a chunk or two of
remote K/V. A chunk is the K/V of one source rank:

    round 0        the rank's own K/V (nothing to wait for)
    round i >= 1   the K/V of source (rank - i) mod cp, in flight while round i - 1 computes

and each chunk is attended with at most two varlen calls, whose every segment is
either *full* (all its keys precede all its queries) or *causal* (a square block on
the diagonal: the same positions as queries and keys, where top-left and
bottom-right alignment coincide):

    query piece [pa, pb) of a document starting at ds, on this rank
    ---------------------------------------------------------------
    chunk from another rank:  full   over that rank's positions in [ds, pa)
    own chunk:                full   over this rank's positions in [ds, pa)   (earlier local pieces)
                              causal over [pa, pb) itself

A remote chunk never holds a position of this rank's queries, so it needs no mask
at all. Pieces of one document that see the same keys of a chunk (zigzag's two
pieces of a long document, for the keys before the first) share one segment: the
keys are gathered once per chunk, not once per piece.

Chunk buffers (what the round delivers, ``slot`` = row within it):
- ring (all-gather): the source's whole local K/V in its local order, slot =
  local index on the source;
- needed (a2a / halo): exactly the source's positions inside this rank's needed
  intervals, ascending, slot = rank among them (what ``ExchangeTables`` sends).

Sequence-aligned rows flatten as ``slot * R + row`` (R rows of document ids; the
batch folds into heads when R = 1), as in ``plan``. Everything is interval
arithmetic over runs (``intervals``), vectorized over (source, piece) pairs.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .intervals import DocRuns, RankRuns, clip, ranges

CHUNK_KINDS = ("ring", "needed")


@dataclass(frozen=True)
class CallPlan:
    """One varlen kernel call: segments over this rank's queries and one chunk's keys."""

    causal: bool  # every segment square and on the diagonal; else every key precedes every query
    q_index: torch.Tensor  # [Nq] rows of the flattened local q (local * R + row), each at most once
    k_index: torch.Tensor  # [Nk] rows of the flattened chunk buffer (slot * R + row)
    q_lens: Tuple[int, ...]
    k_lens: Tuple[int, ...]

    @property
    def num_segments(self) -> int:
        return len(self.q_lens)

    @property
    def pairs(self) -> int:
        """Query-key pairs this call attends (the work it stands for)."""
        if self.causal:
            return sum(n * (n + 1) // 2 for n in self.q_lens)
        return sum(a * b for a, b in zip(self.q_lens, self.k_lens))


@dataclass(frozen=True)
class Round:
    """Round i: the chunk this rank attends, and what it moves to get it."""

    index: int  # 0 = own K/V
    source: int  # whose K/V this chunk is
    chunk_len: int  # positions in the chunk buffer
    calls: Tuple[CallPlan, ...]  # 0-2 calls, full before causal

    @property
    def pairs(self) -> int:
        return sum(c.pairs for c in self.calls)


@dataclass(frozen=True)
class StreamPlan:
    """Every round of one rank for one chunk kind ("ring" or "needed")."""

    kind: str
    rank: int
    cp: int
    rows: int  # R
    local_len: int
    rounds: Tuple[Round, ...]  # round 0, then 1 .. cp - 1 (all of them: empty ones cost nothing)

    @property
    def key_rows(self) -> int:
        """K/V rows the kernels read, summed over rounds (each round's are gone before the next's)."""
        return sum(int(c.k_index.numel()) for r in self.rounds for c in r.calls)

    @property
    def max_chunk_rows(self) -> int:
        """The largest remote chunk (positions): what one round holds besides the local K/V."""
        return max((r.chunk_len for r in self.rounds[1:]), default=0)


def _pieces(runs: RankRuns, rows: Sequence[DocRuns], rank: int):
    """This rank's real query pieces, in (row, position) order: row, doc, ds, pa, pb, q rows start."""
    mine = runs.of_rank(rank)
    r_start, r_len, r_local = runs.start[mine], runs.length[mine], runs.local[mine]
    parts = []
    for row, (d_start, d_end, d_id) in enumerate(rows):
        run, doc, pa, pb = clip(r_start, r_start + r_len, d_start, d_end)
        real = d_id[doc] > 0
        run, doc, pa, pb = run[real], doc[real], pa[real], pb[real]
        parts.append((torch.full_like(doc, row), doc, d_start[doc], pa, pb, r_local[run] + pa - r_start[run]))
    return [torch.cat(x) for x in zip(*parts)]


def _needed_offsets(runs: RankRuns, rank: int, dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    ds: torch.Tensor) -> torch.Tensor:
    """[cp, n] slot of position ds in each source's needed chunk for this rank.

    The chunk holds the source's positions inside this rank's needed intervals
    (sorted, disjoint), ascending: slot(x) = (source positions in earlier
    intervals) + (source positions in [a_j, x)) for the interval j holding x.
    """
    mine = dst == rank
    a, b = a[mine], b[mine]
    if a.numel() == 0:
        return torch.zeros(runs.cp, ds.numel(), dtype=torch.long)
    before_a = runs.flat_before(a)  # [cp, J]
    count = runs.flat_before(b) - before_a
    offset = torch.cumsum(count, 1) - count  # [cp, J]
    j = torch.searchsorted(a, ds, right=True) - 1  # every ds lies in one of this rank's intervals
    return offset[:, j] + runs.flat_before(ds) - before_a[:, j]


def _group_calls(src: torch.Tensor, row: torch.Tensor, doc: torch.Tensor, n_k: torch.Tensor,
                 slot: torch.Tensor, q_first: torch.Tensor, n_q: torch.Tensor, R: int
                 ) -> Dict[int, CallPlan]:
    """Full calls per source from (source, piece) pairs sorted by (source, row, position).

    Consecutive pieces of one document that see the same number of a source's keys
    see the same keys (the visible sets are nested): they form one segment.
    """
    if src.numel() == 0:
        return {}
    new = torch.ones_like(src, dtype=torch.bool)
    new[1:] = (src[1:] != src[:-1]) | (row[1:] != row[:-1]) | (doc[1:] != doc[:-1]) | (n_k[1:] != n_k[:-1])
    head = torch.nonzero(new).flatten()
    group = torch.cumsum(new.long(), 0) - 1
    seg_q = torch.zeros(head.numel(), dtype=torch.long).index_add_(0, group, n_q)
    seg_k, seg_slot, seg_row, seg_src = n_k[head], slot[head], row[head], src[head]
    q_index = ranges(q_first, n_q) * R + torch.repeat_interleave(row, n_q)
    k_index = ranges(seg_slot, seg_k) * R + torch.repeat_interleave(seg_row, seg_k)
    # Split per source: pieces, segments and their rows are all source-major.
    sources, seg_per_src = torch.unique_consecutive(seg_src, return_counts=True)
    q_split = torch.zeros(sources.numel(), dtype=torch.long).index_add_(
        0, torch.repeat_interleave(torch.arange(sources.numel()), seg_per_src), seg_q)
    k_split = torch.zeros_like(q_split).index_add_(
        0, torch.repeat_interleave(torch.arange(sources.numel()), seg_per_src), seg_k)
    calls = {}
    for s, qi, ki, ql, kl in zip(sources.tolist(), q_index.split(q_split.tolist()),
                                 k_index.split(k_split.tolist()), seg_q.split(seg_per_src.tolist()),
                                 seg_k.split(seg_per_src.tolist())):
        calls[s] = CallPlan(False, qi, ki, tuple(ql.tolist()), tuple(kl.tolist()))
    return calls


def build_stream_plan(kind: str, runs: RankRuns, rows: Sequence[DocRuns], rank: int,
                      counts: torch.Tensor, intervals: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                      ) -> StreamPlan:
    """This rank's rounds for chunk ``kind``; ``counts``/``intervals`` are the plan's global tables."""
    if kind not in CHUNK_KINDS:
        raise KeyError(f"unknown chunk kind {kind!r}; known: {CHUNK_KINDS}")
    cp, L, R = runs.cp, runs.local_len, len(rows)
    row, doc, ds, pa, pb, q_first = _pieces(runs, rows, rank)
    n_q = pb - pa
    calls: Dict[int, CallPlan] = {}
    causal: Optional[CallPlan] = None
    if row.numel():
        before_ds = runs.flat_before(ds)  # [cp, n]
        n_k = runs.flat_before(pa) - before_ds  # [cp, n]: each source's positions in [ds, pa)
        if kind == "ring":
            slot = before_ds - (torch.arange(cp) * L).unsqueeze(1)
        else:
            slot = _needed_offsets(runs, rank, *intervals, ds)
            slot[rank] = before_ds[rank] - rank * L  # own chunk: local order
        src, piece = torch.nonzero(n_k > 0, as_tuple=True)  # source-major, pieces ascending
        calls = _group_calls(src, row[piece], doc[piece], n_k[src, piece], slot[src, piece],
                             q_first[piece], n_q[piece], R)
        diag = ranges(q_first, n_q) * R + torch.repeat_interleave(row, n_q)
        lens = tuple(n_q.tolist())
        causal = CallPlan(True, diag, diag, lens, lens)
    rounds: List[Round] = []
    for i in range(cp):
        src = (rank - i) % cp
        if i == 0:
            chunk_len = L
            round_calls = tuple(c for c in (calls.get(src), causal) if c is not None)
        else:
            chunk_len = L if kind == "ring" else int(counts[src, rank])
            round_calls = (calls[src],) if src in calls else ()
        rounds.append(Round(i, src, chunk_len, round_calls))
    return StreamPlan(kind, rank, cp, R, L, tuple(rounds))


def chunk_kind(kv_exchange: str) -> str:
    """The chunk buffers an exchange delivers: the ring's whole local K/V, or the needed rows."""
    return "ring" if kv_exchange == "allgather" else "needed"


__all__ = ["CallPlan", "Round", "StreamPlan", "build_stream_plan", "chunk_kind", "CHUNK_KINDS"]
