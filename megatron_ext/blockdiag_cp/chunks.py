"""The streamed attention plan: this rank's kernel calls, one K/V chunk at a time (host side).

A rank attends its queries to one chunk of keys at a time and merges the partial
outputs by their log-sum-exp, so it never holds more than a few chunks of remote
K/V. A chunk is a key range of one source rank's K/V, at most ``chunk_rows``
positions (half a shard): a long document's keys arrive in pieces, so the
buffers in flight stay a fraction of a shard however many ranks it spans.

    step 0         the rank's own K/V (nothing to wait for)
    step s >= 1    (round i, piece j): piece j of the K/V of source (rank - i) mod cp,
                   in flight while step s - 1 computes

Each chunk is attended with at most two varlen calls, whose every segment is
either *full* (all its keys precede all its queries) or *causal* (a square block on
the diagonal: the same positions as queries and keys, where top-left and
bottom-right alignment coincide):

    query piece [pa, pb) of a document starting at ds, on this rank
    ---------------------------------------------------------------
    chunk of another rank:  full   over that rank's positions in [ds, pa) in the chunk
    own chunk:              full   over this rank's positions in [ds, pa)   (earlier local pieces)
                            causal over [pa, pb) itself

Without a window, pieces of one document that touch in local storage (zigzag's two
pieces of a long document, THD's two chunks of every document) take their own chunk
as one causal block over all of them (in local order a later piece sees every key of
an earlier one), with the full segment over the own positions before the first.

A remote chunk never holds a position of this rank's queries, so it needs no mask
at all. Pieces of one document that see the same keys of a chunk (zigzag's two
pieces of a long document, for the keys before the first) share one segment: the
keys are gathered once per chunk, not once per piece.

Chunk buffers (``slot`` = row within a source's whole delivery; a step holds
slots [first, first + chunk_len)):
- ring (all-gather): the source's local K/V in its local order, slot = local
  index on the source; a step holds the rows of piece j some rank attends
  (``RingReach.span``). Piece j of every source travels the ring before piece
  j + 1 (steps ordered piece-major, each piece's hops in order, some pieces the
  other way round: ``RingReach``), so a rank forwards only the piece it just
  received;
- needed (a2a / halo): exactly the source's positions inside this rank's needed
  intervals, ascending, slot = rank among them (what ``ExchangeTables`` sends);
  steps ordered round-major. Every rank walks the same steps (a round has as many
  pieces as its largest transfer needs), so each pair's transfers pair up in order.

Sequence-aligned rows flatten as ``slot * R + row`` (R rows of document ids; the
batch folds into heads when R = 1), as in ``plan``. Everything is interval
arithmetic over runs (``intervals``), vectorized over (source, piece) pairs, and
the calls' index tensors are slices of two shared tensors (``_emit``).
"""

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .intervals import (DocRuns, RankRuns, clip_np, expand_np, map_ranges, np64, ranges, ranges_np,
                        repeat_arange, search)

CHUNK_KINDS = ("ring", "needed")


@dataclass(frozen=True)
class CallPlan:
    """One varlen kernel call: segments over this rank's queries and one chunk's keys."""

    causal: bool  # every segment square and on the diagonal; else every key precedes every query
    q_index: torch.Tensor  # [Nq] rows of the flattened local q (local * R + row), each at most once
    k_index: torch.Tensor  # [Nk] rows of the flattened chunk buffer (slot * R + row)
    q_lens: Tuple[int, ...]
    k_lens: Tuple[int, ...]
    # A sliding window in the kernels' bottom-right convention: a segment's query i sees keys
    # j >= i + (n_k - n_q) - window (flash's window_size[0]). None: no lower bound.
    window: Optional[int] = None

    @property
    def num_segments(self) -> int:
        return len(self.q_lens)

    @property
    def pairs(self) -> int:
        """Query-key pairs this call attends (the work it stands for)."""
        total = 0
        for nq, nk in zip(self.q_lens, self.k_lens):
            i = torch.arange(nq)
            hi = i + 1 if self.causal else torch.full_like(i, nk)  # keys [lo, hi) per query
            lo = (i + nk - nq - self.window).clamp(min=0) if self.window is not None else torch.zeros_like(i)
            total += int((hi - lo).clamp(min=0).sum())
        return total


# A source's K/V arrives in chunks of at most ceil(local_len / CHUNKS_PER_SHARD) positions. A query row
# merges once per chunk it sees, so the chunk's keys set what a merge costs against the kernel (on an
# H200 a float32 merge pass costs about as much as attending ~1k keys: bench gpu_model). With 2, the
# buffers a rank holds while the steps stream (the chunk computing, the next in flight, its gradient and
# the last one going home) are four half shards of K/V at most: O(S / cp), but twice its own K/V where
# eighths held half of it (bench memory: the peak at cp 4 is 0.45-0.83x the one at cp 2).
CHUNKS_PER_SHARD = 2


def chunk_rows_for(local_len: int) -> int:
    return max(1, -(-local_len // CHUNKS_PER_SHARD))


@dataclass(frozen=True)
class Step:
    """One chunk this rank attends, and where it sits in its source's delivery."""

    round: int  # i: 0 = own K/V; the source is (rank - i) mod cp
    piece: int  # j: which chunk of that round's delivery
    source: int
    first: int  # slot of the chunk's first row in the source's whole delivery
    chunk_len: int  # positions this rank receives in this step (0: it only sends, or nothing moves)
    calls: Tuple[CallPlan, ...]  # full (then banded, with a window) before causal; remote: <= chunk_rows queries

    @property
    def pairs(self) -> int:
        return sum(c.pairs for c in self.calls)

    def reads_each_row_once(self, rows: int) -> bool:
        """Whether the calls read every row of the chunk ([chunk_len * rows] flattened) exactly once: each
        row's K / V gradient then has one writer. True of every needed-only chunk without a window (each
        needed key lies in one segment); a ring chunk holds rows nobody here attends."""
        n = self.chunk_len * rows
        if n == 0 or not self.calls:
            return False
        read = np.concatenate([call.k_index.numpy() for call in self.calls])
        return bool(read.size == n and (np.bincount(read, minlength=n) == 1).all())


@dataclass(frozen=True)
class StreamPlan:
    """Every step of one rank for one chunk kind ("ring" or "needed"), the same steps on every rank."""

    kind: str
    rank: int
    cp: int
    rows: int  # R
    local_len: int
    chunk_rows: int  # the most positions one remote step moves
    steps: Tuple[Step, ...]  # own K/V first, then the remote steps in transfer order
    reach: Optional["RingReach"] = None  # the ring's directions and reach (kind "ring" only)

    @property
    def key_rows(self) -> int:
        """K/V rows the kernels read, summed over steps (each step's are gone before the next's)."""
        return sum(int(c.k_index.numel()) for step in self.steps for c in step.calls)

    @property
    def max_chunk_rows(self) -> int:
        """The largest remote chunk (positions): what one step holds besides the local K/V."""
        return max((step.chunk_len for step in self.steps[1:]), default=0)


@dataclass(frozen=True)
class RingReach:
    """Which way each piece of K/V goes around the ring, and how far: alike on every rank, from the
    global tables.

    Piece j of source s (its local rows [j c, (j + 1) c)) goes downstream, to s + 1 then s + 2 ...
    or, where ``reverse[j]``, to s - 1 then s - 2 ...: the same way for every source, the ways that
    leave the busiest rank the fewest rows to move (``_ways``). ``far[s][j]``: the last hop at which
    a rank attends one of its rows, counted that way (0: none does). The hops past it would carry
    keys nobody further attends, so they are not posted:

        cp = 4, zigzag, short documents: rank r holds chunks r and 7 - r of 8
          piece 0 (chunk r), attended by r + 1:       0 -> 1               (hops 2, 3 not posted)
          piece 1 (chunk 7 - r), attended by r - 1:   0 -> 3               (reverse; hops 2, 3 not posted)

    A piece travels only its rows some rank attends: ``span[s][j]``, the local rows [lo, hi) of source
    s from the first row any rank attends to the last (a short document's straddling keys: the tail
    of the piece; a long document's: all of it).

    A step keeps its plan label (i, j): piece j of source r - i. Downstream that is hop i; reverse,
    hop cp - i, so a reverse piece's steps run i = cp - 1 down to 1. At hop h rank r receives from
    its upstream neighbour where h <= far[r - i][j], and sends its downstream neighbour the piece that
    neighbour receives at hop h where that one's entry allows: the two ends of a hop ask the same
    entry. A forwarded piece was received the hop before (far >= h > h - 1), so what goes on always
    came.
    """

    far: Tuple[Tuple[int, ...], ...]  # [cp][pieces], hops in the piece's direction
    reverse: Tuple[bool, ...]  # [pieces]: the piece goes to r - 1
    span: Tuple[Tuple[Tuple[int, int], ...], ...]  # [cp][pieces] local rows [lo, hi) that travel

    @classmethod
    def of(cls, runs: RankRuns, intervals, chunk_rows: int) -> "RingReach":
        """From every rank's needed ranges ``intervals`` (dst, a, b: positions [a, b) rank dst attends, the
        plan's global table) and the layout's runs: each source's local rows in each range, by piece."""
        dst, a, b = (np.asarray(x) for x in intervals)
        cp, L = runs.cp, runs.local_len
        pieces = -(-L // chunk_rows)
        far = np.zeros((2, cp, pieces), dtype=np.int64)  # [downstream / reverse, source, piece]
        start = np.arange(pieces) * chunk_rows
        span = np.stack([np.broadcast_to(start, (cp, pieces))] * 2, -1).copy()  # [cp, pieces, 2]: none read
        if dst.size:
            first_row = (np.arange(cp) * L)[:, None]
            lo, hi = runs.flat_before_np(a) - first_row, runs.flat_before_np(b) - first_row  # [cp, n] src's rows
            down = (dst[None, :] - np.arange(cp)[:, None]) % cp  # [cp, n] 0: the source's own range
            met = (hi > lo) & (down > 0)
            first, last = lo // chunk_rows, (hi - 1) // chunk_rows
            for j in range(pieces):
                attends = met & (first <= j) & (last >= j)
                far[0, :, j] = np.where(attends, down, 0).max(1)
                far[1, :, j] = np.where(attends, (cp - down) % cp, 0).max(1)
                read = attends.any(1)
                end = min(L, start[j] + chunk_rows)
                span[read, j, 0] = np.where(attends, np.maximum(lo, start[j]), end).min(1)[read]
                span[read, j, 1] = np.where(attends, np.minimum(hi, end), 0).max(1)[read]
        rows = span[..., 1] - span[..., 0]  # [cp, pieces]
        reverse = cls._ways(far, rows)
        chosen = np.where(np.array(reverse)[None, :], far[1], far[0])
        return cls(tuple(tuple(row) for row in chosen.tolist()), reverse,
                   tuple(tuple(tuple(x) for x in row) for row in span.tolist()))

    @staticmethod
    def _ways(far: np.ndarray, rows: np.ndarray) -> Tuple[bool, ...]:
        """Which pieces go the other way: of every choice (a shard has at most ``CHUNKS_PER_SHARD`` pieces),
        the one whose busiest rank sends or receives the fewest rows, then the fewest rows in all, then
        the most pieces downstream. ``far``: [2 (downstream, reverse), cp, pieces]; ``rows``: [cp, pieces],
        the rows each piece travels."""
        _, cp, pieces = far.shape
        h = np.arange(1, cp)[None, :]  # [1, cp - 1]
        r = np.arange(cp)[:, None]  # [cp, 1]
        moved = {}  # (way, piece) -> ([cp] rows received, [cp] rows sent)
        for way, d in ((0, 1), (1, -1)):
            for j in range(pieces):
                src = (r - d * h) % cp  # hop h brings r piece j of r - d h
                received = np.where(far[way, src, j] >= h, rows[src, j], 0).sum(1)
                src = (r + d - d * h) % cp  # what r + d receives at hop h
                sent = np.where(far[way, src, j] >= h, rows[src, j], 0).sum(1)
                moved[way, j] = received, sent
        best = None
        for choice in np.ndindex(*(2,) * pieces):
            received = sum(moved[way, j][0] for j, way in enumerate(choice))
            sent = sum(moved[way, j][1] for j, way in enumerate(choice))
            score = (int(np.maximum(received, sent).max()), int(received.sum()), sum(choice))
            if best is None or score < best[0]:
                best = (score, choice)
        return tuple(bool(way) for way in best[1])

    @classmethod
    def every_hop(cls, cp: int, local_len: int, chunk_rows: int) -> "RingReach":
        """The full ring: every piece whole, downstream, to every rank."""
        pieces = -(-local_len // chunk_rows)
        span = tuple((j * chunk_rows, min(local_len, (j + 1) * chunk_rows)) for j in range(pieces))
        return cls(((cp - 1,) * pieces,) * cp, (False,) * pieces, (span,) * cp)

    def rows(self, source: int, piece: int) -> slice:
        """The local rows of ``source``'s piece that travel."""
        return slice(*self.span[source][piece])

    def size(self, source: int, piece: int) -> int:
        """How many rows of ``source``'s piece travel."""
        lo, hi = self.span[source][piece]
        return hi - lo

    def is_reverse(self, piece: int) -> bool:
        return self.reverse[piece]

    def hop(self, step) -> int:
        """How many hops the piece of ``step`` took to get here."""
        i, j = step
        return len(self.far) - i if self.is_reverse(j) else i

    def steps(self, piece: int) -> List[Tuple[int, int]]:
        """The steps of ``piece``, hop 1 first."""
        cp = len(self.far)
        return [(cp - h if self.is_reverse(piece) else h, piece) for h in range(1, cp)]

    def step_before(self, step) -> Tuple[int, int]:
        """The step whose piece ``step`` forwards (one hop fewer)."""
        i, j = step
        return (i + 1, j) if self.is_reverse(j) else (i - 1, j)

    def downstream(self, rank: int, piece: int) -> int:
        return (rank + (-1 if self.is_reverse(piece) else 1)) % len(self.far)

    def upstream(self, rank: int, piece: int) -> int:
        return (rank - (-1 if self.is_reverse(piece) else 1)) % len(self.far)

    def receives(self, rank: int, step) -> bool:
        i, j = step
        return self.hop(step) <= self.far[(rank - i) % len(self.far)][j]

    def sends(self, rank: int, step) -> bool:
        """Whether ``rank`` sends at ``step`` (the hop its downstream neighbour receives at that hop)."""
        return self.hop(step) <= self.far[self.sent_source(rank, step)][step[1]]

    def sent_source(self, rank: int, step) -> int:
        """The source of the piece ``rank`` sends at ``step`` (what its downstream neighbour receives)."""
        h = self.hop(step)
        return (rank + h - 1) % len(self.far) if self.is_reverse(step[1]) else (rank + 1 - h) % len(self.far)

    def positions(self, rank: int) -> Tuple[int, int]:
        """(sent, received) K/V positions of ``rank`` per layer call, over every step."""
        cp, pieces = len(self.far), len(self.far[0])
        steps = [(i, j) for j in range(pieces) for i in range(1, cp)]
        return (sum(self.size(self.sent_source(rank, step), step[1]) for step in steps if self.sends(rank, step)),
                sum(self.size((rank - step[0]) % cp, step[1]) for step in steps if self.receives(rank, step)))


def _pieces(runs: RankRuns, rows: Sequence[DocRuns], rank: int) -> List[np.ndarray]:
    """This rank's real query pieces, in (row, position) order: row, doc, ds, pa, pb, q rows start
    (int64 numpy arrays: the stream plan stays in numpy up to its index tensors)."""
    mine = runs.of_rank(rank)
    r_start = np64(runs.start)[mine]
    r_end, r_local = r_start + np64(runs.length)[mine], np64(runs.local)[mine]
    parts = []
    # In numpy (the clip's own arrays): a dozen small torch ops per row cost more than the clip at 128k.
    for row, (d_start, d_end, d_id) in enumerate(rows):
        run, doc, pa, pb = clip_np(r_start, r_end, d_start, d_end)
        real = (np64(d_id)[doc] > 0).nonzero()[0]
        if real.size < doc.size:
            run, doc, pa, pb = run[real], doc[real], pa[real], pb[real]
        parts.append((np.full(doc.size, row, dtype=np.int64), doc, np64(d_start)[doc], pa, pb,
                      r_local[run] + pa - r_start[run]))
    return [x[0] if len(x) == 1 else np.concatenate(x) for x in zip(*parts)]


def _needed_offsets(runs: RankRuns, rank: int, dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    ds: np.ndarray, before_ds: Optional[np.ndarray] = None, mine_flat=None
                    ) -> Tuple[np.ndarray, np.ndarray]:
    """([cp, n] slot of position ds in each source's needed chunk for this rank, ``runs.flat_before(ds)``),
    numpy arrays.

    The chunk holds the source's positions inside this rank's needed intervals
    (sorted, disjoint), ascending: slot(x) = (source positions in earlier
    intervals) + (source positions in [a_j, x)) for the interval j holding x.
    ``before_ds`` (``runs.flat_before(ds)``) and ``mine_flat`` (``flat_before`` of this
    rank's interval starts and ends, [cp, J] numpy arrays) when the caller has them already.
    """
    # In numpy: its masks and column gathers cost a quarter to a half of torch's at [cp, pieces].
    mine = dst.numpy() == rank
    a, b = a.numpy()[mine], b.numpy()[mine]
    if a.size == 0:
        return np.zeros((runs.cp, ds.size), dtype=np.int64), \
            runs.flat_before_np(ds) if before_ds is None else before_ds
    before_a, before_b = mine_flat if mine_flat is not None else (runs.flat_before_np(x) for x in (a, b))
    count = before_b - before_a  # [cp, J]
    offset = count.cumsum(1) - count  # [cp, J]
    j = a.searchsorted(ds, side="right") - 1  # every ds lies in one of this rank's intervals
    if before_ds is None and np.array_equal(a[j], ds):
        # Full attention, one row: a piece's document start is its interval's start, so its
        # flat_before is the interval's (no second search over every source) and its slot the offset.
        return offset.take(j, 1), before_a.take(j, 1)
    before_ds = runs.flat_before_np(ds) if before_ds is None else before_ds
    return offset.take(j, 1) + before_ds - before_a.take(j, 1), before_ds


def _before_pieces(runs: RankRuns, rank: int, intervals, pa: np.ndarray, n_q: np.ndarray,
                   before_ends: np.ndarray) -> np.ndarray:
    """``runs.flat_before(pa)`` [cp, n] of this rank's pieces [pa, pa + n_q), read off ``before_ends``
    (``flat_before`` of this rank's interval ends, [cp, J]) where a piece ends where an interval does.

    Another source owns nothing inside this rank's piece, so its count at pa is its count at the
    piece's end; a document's last piece on this rank ends its interval (every piece under THD at
    rank cp - 1, whose two chunks touch). Only this rank's own row and the other pieces are searched:
    the cp searches per piece were the largest search of a 1M / cp 64 THD plan. numpy in and out.
    """
    dst, _, b = intervals
    ends = b.numpy()[dst.numpy() == rank]  # ascending: one rank's intervals are disjoint, sorted
    if ends.size == 0:
        return runs.flat_before_np(pa)
    pb = pa + n_q
    at = np.minimum(ends.searchsorted(pb), ends.size - 1)
    hit = ends[at] == pb
    if hit.all():
        out = before_ends.take(at, axis=1)
    else:
        out = np.empty((runs.cp, pa.size), dtype=np.int64)
        found = hit.nonzero()[0]
        out[:, found] = before_ends.take(at[found], axis=1)
        searched = (~hit).nonzero()[0]
        out[:, searched] = runs.flat_before_np(pa[searched])
    out[rank] = runs.flat_before_np(pa, rank)
    return out


def _split_at_chunks(src, slot, n_k, piece, rank: int, chunk_rows: int):
    """Cut each (source, piece) key range at multiples of ``chunk_rows`` (not the own source's).

    Returns (source, chunk index, piece, slot, length) sorted by (source, chunk, piece).
    """
    if src.numel() == 0:
        return src, src, src, src, src
    return tuple(torch.from_numpy(x) for x in _split_at_chunks_np(src.numpy(), slot.numpy(), n_k.numpy(),
                                                                   piece.numpy(), rank, chunk_rows))


def _split_at_chunks_np(s, start, n_k, p, rank: int, chunk_rows: int):
    """``_split_at_chunks`` of int64 numpy arrays (not empty), to numpy arrays (some may be inputs)."""
    # In numpy, the own source's few ranges fixed up after: torch's where over the (source, piece)
    # pairs (cp x pieces of them in a THD plan) cost more than the rest of the split.
    end = start + n_k
    own = (s == rank).nonzero()[0]
    first, last = start // chunk_rows, (end - 1) // chunk_rows
    first[own] = 0  # the own chunk is never cut
    last[own] = 0
    if s.size < 1 << 13:  # few ranges: every one expanded to its chunks
        count = last - first + 1  # 0: an empty range at a chunk's start, in no chunk
        which, chunk = expand_np(first, count)
        at, end_at = start[which], end[which]
        lo, hi = np.maximum(at, chunk * chunk_rows), np.minimum(end_at, (chunk + 1) * chunk_rows)
        own_at = (count.cumsum() - count)[own]  # each own range is one entry
        lo[own_at], hi[own_at] = at[own_at], end_at[own_at]
        s, p = s[which], p[which]
    else:
        # Almost every range lies in one chunk (189 of 131k cross a boundary in a 1M / cp 64 THD
        # plan): it is its own entry, only the others' later pieces are made and inserted after it
        # (expanding every range cost most of the split; below a few thousand ranges the inserts'
        # fixed costs outweigh that).
        if not bool((last >= first).all()):  # an empty range at a chunk's start lies in no chunk
            keep = (last >= first).nonzero()[0]
            s, start, end, p, first, last = s[keep], start[keep], end[keep], p[keep], first[keep], last[keep]
        chunk, lo, hi = first, start, end
        cut = (last > first).nonzero()[0]
        if cut.size:
            extra = last[cut] - first[cut]  # pieces after a cut range's first
            at = np.repeat(cut + 1, extra)  # np.insert keeps the order of values inserted at one index
            more = ranges_np(first[cut] + 1, extra)  # their chunks
            more_hi = np.minimum(np.repeat(end[cut], extra), (more + 1) * chunk_rows)
            hi = end.copy()
            hi[cut] = (first[cut] + 1) * chunk_rows
            s, p = np.insert(s, at, np.repeat(s[cut], extra)), np.insert(p, at, np.repeat(p[cut], extra))
            chunk, lo = np.insert(chunk, at, more), np.insert(lo, at, more * chunk_rows)
            hi = np.insert(hi, at, more_hi)
    key = s * (int(chunk.max()) + 1)  # (s, chunk, p) as one number, in one array (fresh memory)
    key += chunk
    key *= int(p.max()) + 1
    key += p
    if key.size > 1 and not bool((key[1:] >= key[:-1]).all()):  # keys are distinct: sorted is the order
        order = np.argsort(key)
        s, chunk, p, lo, hi = s[order], chunk[order], p[order], lo[order], hi[order]
    hi -= lo  # hi is this function's own array (never an input)
    return s, chunk, p, lo, hi


@dataclass
class _Segments:
    """Every call of one rank before capping (segments in call order, pairs in segment order), numpy int64.

    A segment's queries are the concatenation of its pairs' ranges of ``diag`` (this rank's real
    query rows in piece order: piece p's rows are diag[q_off[p], q_off[p] + n_q[p])), so a call's
    q_index is a slice of ``diag`` wherever its ranges touch, and a copy only where they do not.
    Its keys are the chunk rows [slot, slot + n_k) of one row of ids, flattened slot * R + row.
    """

    call_src: np.ndarray  # [calls] source rank
    call_chunk: np.ndarray  # [calls] chunk of that source's delivery
    call_window: np.ndarray  # [calls] the kernels' window, -1: full
    call_seg: np.ndarray  # [calls + 1] first segment of each call
    seg_pair: np.ndarray  # [segments + 1] first pair of each segment
    seg_q: np.ndarray  # [segments] query rows
    seg_k: np.ndarray  # [segments] key rows
    seg_slot: np.ndarray  # [segments] first key's slot in the chunk
    seg_row: np.ndarray  # [segments] row of ids
    pair_a: np.ndarray  # [pairs] start of each pair's range in diag
    pair_n: np.ndarray  # [pairs] its rows

    @classmethod
    def empty(cls) -> "_Segments":
        z = np.zeros(0, dtype=np.int64)
        one = np.zeros(1, dtype=np.int64)
        return cls(z, z, z, one, one, z, z, z, z, z, z)


def _exclusive(x: np.ndarray) -> np.ndarray:
    """[n + 1] prefix sums starting at 0."""
    out = np.zeros(x.size + 1, dtype=np.int64)
    x.cumsum(out=out[1:])
    return out


def _emit(t: _Segments, diag: torch.Tensor, rank: int, R: int
          ) -> Dict[Tuple[int, int], Tuple[CallPlan, ...]]:
    """Per (source, chunk), its kernel calls, each call whole: every query row that sees the chunk's keys
    through one segment table, so a chunk costs at most two kernel calls (and a row one merge per chunk).

    Index tensors: a call's q_index is a slice of ``diag`` when its rows form one range of it,
    else a slice of one gather of every such call's rows; k_index a slice of an arange when its
    segments' keys form one range of slots (R = 1), else of the concatenated keys of the segments
    that need it.
    """
    n_calls, n_seg = t.call_src.size, t.seg_q.size
    if n_calls == 0:
        return {}
    seg_voff = _exclusive(t.seg_q)  # each segment's first row in the virtual concatenation of all
    seg_lo, seg_hi = t.call_seg[:-1], t.call_seg[1:]  # [calls] each call's segments [lo, hi) (never empty)
    seg_call = repeat_arange(seg_hi - seg_lo)  # [segments] the call of each

    # Query rows: each segment cut at its pairs' starts; each piece lies in one segment and one pair, so
    # maps to diag linearly; touching pieces of one call merge into one range.
    if t.pair_n.size == n_seg and bool((t.pair_n > 0).all()):
        # One pair per segment (every segment has one): a segment is one piece, and the searches below
        # (most of the cost at cp x documents segments: THD) are not needed.
        piece_len, piece_call, piece_a = t.seg_q, seg_call, t.pair_a
    else:
        pair_v = _exclusive(t.pair_n)[:-1]
        first = pair_v.searchsorted(seg_voff[:-1], side="right") - 1
        count = pair_v.searchsorted(seg_voff[1:] - 1, side="right") - first
        seg = repeat_arange(count)
        pair = np.arange(seg.size) - _exclusive(count)[seg] + first[seg]
        x = np.maximum(seg_voff[seg], pair_v[pair])
        piece_len = np.minimum(seg_voff[seg + 1], pair_v[pair] + t.pair_n[pair]) - x
        piece_call = seg_call[seg]
        piece_a = t.pair_a[pair] + x - pair_v[pair]
    new = np.ones(piece_a.size, dtype=bool)
    new[1:] = (piece_call[1:] != piece_call[:-1]) | (piece_a[1:] != piece_a[:-1] + piece_len[:-1])
    heads = new.nonzero()[0]
    r_a, r_len, r_call = piece_a[heads], np.add.reduceat(piece_len, heads), piece_call[heads]
    n_ranges = np.bincount(r_call, minlength=n_calls)
    r_first = _exclusive(n_ranges)
    many = n_ranges[r_call] > 1
    gathered = ranges(torch.from_numpy(r_a[many]), torch.from_numpy(r_len[many]))
    gathered = diag[gathered] if gathered.numel() else gathered
    call_rows = np.add.reduceat(t.seg_q, seg_lo)
    g_off = _exclusive(np.where(n_ranges > 1, call_rows, 0)).tolist()

    # Keys: a slice of one arange when R = 1 and the call's segments' key ranges touch in order (one
    # segment, or consecutive documents of one chunk: ~99.8% of a 1M / cp 64 THD plan's segments), so
    # concatenated only for the other calls' segments (every one when R > 1). Concatenating them all
    # built ~0.6M key rows (two int64 temporaries) per rank of a 1M / cp 64 THD plan: ~6 of its ~20 ms.
    gap = np.zeros(n_seg, dtype=bool)  # [segments] where a key range does not follow the one before
    np.not_equal(t.seg_slot[1:], t.seg_slot[:-1] + t.seg_k[:-1], out=gap[1:])
    gap_before = gap.cumsum()  # [segments] gaps up to each segment
    one_seg = (gap_before[seg_hi - 1] == gap_before[seg_lo]) & (R == 1)  # [calls] keys: one range
    if one_seg.all():  # every call's keys one range (each of a 1M / cp 64 THD plan's): nothing to join
        joined, key_lo, key_hi = None, None, None
    else:
        mark = np.zeros(n_seg + 1, dtype=np.int64)
        np.add.at(mark, seg_lo[~one_seg], 1)
        np.add.at(mark, seg_hi[~one_seg], -1)
        kept = np.where(mark[:-1].cumsum() > 0, t.seg_k, 0)
        koff = _exclusive(kept)
        joined = ranges(torch.from_numpy(t.seg_slot), torch.from_numpy(kept))
        if R > 1:
            joined = joined * R + torch.repeat_interleave(torch.from_numpy(t.seg_row), torch.from_numpy(kept))
        key_lo, key_hi = koff[seg_lo].tolist(), koff[seg_hi].tolist()  # per call: its slice of ``joined``
    base = torch.arange(int((t.seg_slot + t.seg_k).max())) if one_seg.any() else None
    k_all = _exclusive(t.seg_k)
    k_span = (k_all[seg_hi] - k_all[seg_lo]).tolist()  # [calls] keys of each (one range or not)

    seg_lo_l, seg_hi_l, one_l = seg_lo.tolist(), seg_hi.tolist(), one_seg.tolist()
    q_lens, k_lens = t.seg_q.tolist(), t.seg_k.tolist()
    slot_l = t.seg_slot[seg_lo].tolist()  # per call: the first key slot of its (first) segment
    single_a, single_n = r_a[r_first[:-1]].tolist(), r_len[r_first[:-1]].tolist()
    counts = n_ranges.tolist()
    windows = [None if w < 0 else w for w in t.call_window.tolist()]
    # A call of one query range and one segment (R = 1) is fixed by (range, key slots, window): the
    # steps of a long document repeat the same few (every chunk before it seen by the same rows),
    # so they share one CallPlan (immutable), as calls share their index tensors.
    # Query rows too repeat (a piece's rows see many chunks): one view per range of ``diag``.
    same: Dict[tuple, CallPlan] = {}
    key_views: Dict[Tuple[int, int], torch.Tensor] = {}
    query_views: Dict[Tuple[int, int], torch.Tensor] = {}
    plans: List[CallPlan] = []
    for u in range(n_calls):
        s0, s1 = seg_lo_l[u], seg_hi_l[u]
        ql = tuple(q_lens[s0:s1])
        w = windows[u]
        if one_l[u] and s1 - s0 > 1:  # several segments, keys one range: a view of ``base``
            q = _view(query_views, diag, single_a[u], single_n[u]) if counts[u] == 1 else \
                gathered[g_off[u]:g_off[u + 1]]
            call = CallPlan(False, q, _view(key_views, base, slot_l[u], k_span[u]), ql, tuple(k_lens[s0:s1]), w)
        elif one_l[u]:
            a, n, ks, kn = single_a[u], single_n[u], slot_l[u], k_lens[s0]
            if counts[u] == 1:
                call = same.get((a, n, ks, kn, w))
                if call is None:
                    call = same[(a, n, ks, kn, w)] = CallPlan(False, _view(query_views, diag, a, n),
                                                              _view(key_views, base, ks, kn), ql, (kn,), w)
            else:
                call = CallPlan(False, gathered[g_off[u]:g_off[u + 1]], _view(key_views, base, ks, kn), ql, (kn,), w)
        else:
            q = _view(query_views, diag, single_a[u], single_n[u]) if counts[u] == 1 else \
                gathered[g_off[u]:g_off[u + 1]]
            call = CallPlan(False, q, joined[key_lo[u]:key_hi[u]], ql, tuple(k_lens[s0:s1]), w)
        plans.append(call)
    # Calls of one (source, chunk) are adjacent (segments are sorted by it).
    out: Dict[Tuple[int, int], Tuple[CallPlan, ...]] = {}
    src_l, chunk_l = t.call_src.tolist(), t.call_chunk.tolist()
    ci = 0
    while ci < n_calls:
        cj = ci + 1
        while cj < n_calls and src_l[cj] == src_l[ci] and chunk_l[cj] == chunk_l[ci]:
            cj += 1
        out[(src_l[ci], chunk_l[ci])] = tuple(plans[ci:cj])
        ci = cj
    return out


def _view(views: Dict[Tuple[int, int], torch.Tensor], rows: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """rows[start:start + count], one view per (start, count) in ``views`` (~2 us a torch slice; calls
    read their index tensors, never write them, so they can share one)."""
    view = views.get((start, count))
    if view is None:
        view = views[(start, count)] = rows[start:start + count]
    return view


def _full_segments(kind: str, runs: RankRuns, rank: int, intervals, c: int, R: int, row, doc, ds, pa,
                   q_off, n_q, mine_flat=None) -> _Segments:
    """Per (source, chunk), one full call: the keys of [ds, pa) that source holds in that chunk.

    Consecutive pieces of one document that see the same keys of a chunk form one segment
    (their visible sets are nested, so equal counts mean equal keys).
    """
    cp, L = runs.cp, runs.local_len
    # In numpy (cp x pieces cells, ~10^5 under THD at 1M / cp 64): a half to a third of torch's op costs.
    if kind == "ring":
        before_ds = runs.flat_before_np(ds)  # [cp, n]
        slot = before_ds - (np.arange(cp) * L)[:, None]
    else:
        slot, before_ds = _needed_offsets(runs, rank, *intervals, ds, None, mine_flat)
        slot[rank] = before_ds[rank] - rank * L  # own chunk: local order
    before_pa = runs.flat_before_np(pa) if mine_flat is None else \
        _before_pieces(runs, rank, intervals, pa, n_q, mine_flat[1])
    n_k = before_pa - before_ds  # [cp, n]: each source's positions in [ds, pa)
    cell = (n_k.reshape(-1) > 0).nonzero()[0]  # source-major, pieces ascending: src * n + piece
    if cell.size == 0:
        return _Segments.empty()
    src, piece = np.divmod(cell, n_k.shape[1])
    src, chunk, piece, lo, n = _split_at_chunks_np(src, slot.reshape(-1)[cell], n_k.reshape(-1)[cell],
                                                   piece, rank, c)
    # In place where it can (fresh memory: each array of every cell costs ~1 ms of page faults there).
    new = np.ones(src.size, dtype=bool)
    np.not_equal(src[1:], src[:-1], out=new[1:])
    for x in [chunk, doc[piece], n, lo] + ([row[piece]] if R > 1 else []):  # one row: all 0
        new[1:] |= x[1:] != x[:-1]
    head = new.nonzero()[0]
    nq_piece = n_q[piece]
    seg_q = np.add.reduceat(nq_piece, head)  # a segment's pieces are adjacent, from its head on
    src_h, chunk_h = src[head], chunk[head]
    seg_slot = lo[head]
    seg_slot -= np.where(src_h == rank, 0, chunk_h * c)  # the chunk's first slot (own chunk: 0)
    seg_k = n[head]
    seg_row = np.zeros(head.size, dtype=np.int64) if R == 1 else row[piece[head]]
    call_new = np.ones(head.size, dtype=bool)
    call_new[1:] = (src_h[1:] != src_h[:-1]) | (chunk_h[1:] != chunk_h[:-1])
    call_head = call_new.nonzero()[0]
    return _Segments(src_h[call_head], chunk_h[call_head], np.full(call_head.size, -1, dtype=np.int64),
                     np.append(call_head, head.size), np.append(head, src.size),
                     seg_q, seg_k, seg_slot, seg_row, q_off[piece], nq_piece)


def _windowed_segments(kind: str, runs: RankRuns, rank: int, intervals, window: int, c: int, R: int,
                       row, ds, pa, pb, q_off, mine_flat=None) -> _Segments:
    """Per (source, chunk): the full and banded calls of a sliding window.

    Piece [pa, pb) of a document starting at ds needs keys [max(ds, pa - window), pa)
    from other pieces; each run of a source's positions in that range, cut at chunk
    boundaries, is one segment [ka, kb) for the piece's queries that see any of it,
    [pa, min(pb, kb + window)). Where the last of them still sees ka, every query sees
    every key (full); else the band's lower edge is the window in bottom-right terms,
    window - (q_end - kb), and segments sharing that value share a call (full first,
    then by that value).
    """
    L = runs.local_len
    lo = torch.maximum(ds, pa - window)
    by_start, by_len, by_run = runs.by_position()
    piece, k_start, n = map_ranges(by_start, by_len, by_start, lo, pa - lo)  # key position runs, split at runs
    if piece.numel() == 0:
        return _Segments.empty()
    owner_run = search(by_start, k_start, right=True) - 1
    src = runs.rank[by_run[owner_run]]
    flat = runs.flat_before(k_start)  # [cp, m]
    cols = torch.arange(k_start.numel())
    if kind == "ring":
        slot = flat[src, cols] - src * L
    else:
        slot = torch.from_numpy(_needed_offsets(runs, rank, *intervals, k_start.numpy(), flat.numpy(),
                                                mine_flat)[0])[src, cols]
        own = src == rank
        slot = torch.where(own, flat[src, cols] - src * L, slot)
    remote = src != rank
    first = torch.where(remote, slot // c, torch.zeros_like(slot))
    last = torch.where(remote, (slot + n - 1) // c, torch.zeros_like(slot))
    which = torch.repeat_interleave(torch.arange(src.numel()), last - first + 1)
    chunk = ranges(first, last - first + 1)
    s_lo = torch.where(remote[which], torch.maximum(slot[which], chunk * c), slot[which])
    s_hi = torch.where(remote[which], torch.minimum((slot + n)[which], (chunk + 1) * c), (slot + n)[which])
    ka = k_start[which] + s_lo - slot[which]
    kb = ka + (s_hi - s_lo)
    p = piece[which]
    q_end = torch.minimum(pb[p], kb + window)
    band = ka < q_end - 1 - window
    win = torch.where(band, window - (q_end - kb), torch.full_like(kb, -1))  # -1: full
    s_src = src[which]
    chunk_first = torch.where(s_src == rank, torch.zeros_like(chunk), chunk * c)
    call = (s_src * (int(chunk.max()) + 1) + chunk) * (window + 2) + win + 1  # (source, chunk, window)
    # A piece can see several runs of one source inside one chunk (zigzag's and thd's two pieces per
    # rank): each is its own segment, and a call holds a query row at most once (the merge indexes
    # rows), so the n-th segment of a piece within a (source, chunk, window) goes to the n-th call.
    by_piece = torch.sort(call * (int(p.max()) + 1) + p, stable=True)
    repeat = torch.ones_like(call, dtype=torch.bool)
    repeat[1:] = by_piece.values[1:] == by_piece.values[:-1]
    position = torch.arange(call.numel())
    run_start = torch.cummax(torch.where(repeat, torch.zeros_like(position), position), 0).values
    occurrence = torch.empty_like(call)
    occurrence[by_piece.indices] = position - run_start
    call = call * (int(occurrence.max()) + 1) + occurrence
    order = torch.argsort(call * (p.numel() + 1) + torch.arange(p.numel()))
    k_first, nk, nq = (s_lo - chunk_first)[order], (kb - ka)[order], (q_end - pa[p])[order]
    call, s_src, chunk, win, p = call[order], s_src[order], chunk[order], win[order], p[order]
    call_new = torch.ones_like(call, dtype=torch.bool)
    call_new[1:] = call[1:] != call[:-1]
    heads = torch.nonzero(call_new).flatten()
    m = int(call.numel())
    return _Segments(s_src[heads].numpy(), chunk[heads].numpy(), win[heads].numpy(),
                     np.append(heads.numpy(), m), np.arange(m + 1, dtype=np.int64), nq.numpy(), nk.numpy(),
                     k_first.numpy(), row[p].numpy(), q_off[p].numpy(), nq.numpy())


def _touching(row, doc, q_first, n_q) -> np.ndarray:
    """[groups] the first piece of each run of pieces of one document (and row of ids) that touch in
    local storage, one after the other (zigzag's two pieces of a long document: the end of the first
    half of the shard and the start of the second; THD's two chunks of every document)."""
    new = np.ones(n_q.size, dtype=bool)
    new[1:] = (row[1:] != row[:-1]) | (doc[1:] != doc[:-1]) | (q_first[1:] != q_first[:-1] + n_q[:-1])
    return new.nonzero()[0]


def _joined_own_calls(runs: RankRuns, rank: int, R: int, heads, row, ds, pa, q_off, n_q, diag
                      ) -> Tuple[CallPlan, ...]:
    """The own step (no window) with each run of touching pieces as one causal segment.

    The pieces of a run hold increasing positions of one document, so in local order a causal block
    over the run is exactly what its queries see of its keys: a later piece sees every key of an
    earlier one. The run then takes one call where it took two (a full segment over the earlier
    pieces, the causal blocks), and its later rows no merge. The keys between the pieces belong to
    other ranks and stay with the remote chunks. Full segments keep the own positions in [ds, pa)
    before the run's first piece.
    """
    L = runs.local_len
    g_nq = np.add.reduceat(n_q, heads)
    g_ds, g_pa = ds[heads], pa[heads]
    before_ds = runs.flat_before_np(g_ds, rank)
    n_k = runs.flat_before_np(g_pa, rank) - before_ds
    has = (n_k > 0).nonzero()[0]
    full: Tuple[CallPlan, ...] = ()
    if has.size:
        seg_row = row[heads][has] if R > 1 else np.zeros(has.size, dtype=np.int64)
        segs = _Segments(np.array([rank]), np.zeros(1, dtype=np.int64), np.full(1, -1, dtype=np.int64),
                         np.array([0, has.size]), np.arange(has.size + 1), g_nq[has], n_k[has],
                         before_ds[has] - rank * L, seg_row, q_off[heads][has], g_nq[has])
        full = _emit(segs, diag, rank, R)[(rank, 0)]
    lens = tuple(g_nq.tolist())
    return full + (CallPlan(True, diag, diag, lens, lens, None),)


# A call whose query rows fall in at most this many runs of the local rows, each break between two of its
# segments, is cut into a call per run: each then reads q (in backward also dout, out and the lse) and writes
# its output where they lie, where one call over every run gathers them first and scatters its output
# (bench gpu_model: the balanced layout at 32k / cp 2 over the heavy-tailed mix, whose remote chunk meets
# two runs, gathers 0.10 ms of backward's 3.55 so). Past that, one call (with the gathers) keeps calls few.
RUN_CALLS = 2


def calls_by_runs(call: CallPlan) -> Tuple[CallPlan, ...]:
    """``call`` cut where its query rows break into runs, if into at most ``RUN_CALLS`` and each break falls
    between segments; else ``call`` alone. Causal and windowed calls stay whole."""
    if call.causal or call.window is not None:
        return (call,)
    q = call.q_index.numpy()
    breaks = np.flatnonzero(q[1:] != q[:-1] + 1) + 1  # where a new run of rows starts
    q_lens, k_lens = np.asarray(call.q_lens, dtype=np.int64), np.asarray(call.k_lens, dtype=np.int64)
    seg_q, seg_k = _exclusive(q_lens), _exclusive(k_lens)  # [segments + 1] each segment's first query, key row
    cut = np.searchsorted(seg_q[:-1], breaks)  # the segment starting at each break
    if (breaks.size == 0 or breaks.size >= RUN_CALLS or not (cut < q_lens.size).all()
            or not (seg_q[cut] == breaks).all()):
        return (call,)
    bounds = np.r_[0, cut, q_lens.size].tolist()
    return tuple(CallPlan(False, call.q_index[seg_q[a]:seg_q[b]], call.k_index[seg_k[a]:seg_k[b]],
                          tuple(q_lens[a:b].tolist()), tuple(k_lens[a:b].tolist()))
                 for a, b in zip(bounds[:-1], bounds[1:]))


def with_calls_by_runs(stream: "StreamPlan") -> "StreamPlan":
    """``stream`` with each remote step's one call cut by ``calls_by_runs`` (a step with more calls, a window's
    full and banded ones, keeps them: at most two calls a chunk)."""
    steps = tuple(replace(step, calls=calls_by_runs(step.calls[0])) if step.round and len(step.calls) == 1 else step
                  for step in stream.steps)
    return replace(stream, steps=steps)


def build_stream_plan(kind: str, runs: RankRuns, rows: Sequence[DocRuns], rank: int,
                      counts: torch.Tensor, intervals: Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                      window: Optional[int] = None, mine_flat=None) -> StreamPlan:
    """This rank's steps for chunk ``kind``; ``counts``/``intervals`` are the plan's global tables.

    ``mine_flat``: ``RankRuns.flat_before`` of this rank's interval starts and ends ([cp, J]
    each), when the caller computed them already (``plan.build_plan`` does, for its receive tables).

    ``window``: a sliding window (query p sees keys from p - window), see ``_windowed_segments``.
    Segments, bits and ranges are vectorized tables; Python loops only over the kernel calls it
    returns. Query indices are slices of one tensor of this rank's rows (a copy only where a
    call's rows do not touch), key indices slices of one tensor of every segment's chunk rows:
    a long document's pieces see every chunk before them, and materializing each call's rows
    cost cp * L per rank (the builder before, tests/engine/stream_reference.py, which this one equals).
    Calls share those tensors: they are read, never written.
    """
    if kind not in CHUNK_KINDS:
        raise KeyError(f"unknown chunk kind {kind!r}; known: {CHUNK_KINDS}")
    cp, L, R = runs.cp, runs.local_len, len(rows)
    c = chunk_rows_for(L)
    row, doc, ds, pa, pb, q_first = _pieces(runs, rows, rank)
    n_q = pb - pa
    if mine_flat is not None:
        mine_flat = tuple(x.numpy() for x in mine_flat)
    own: Tuple[CallPlan, ...] = ()
    calls: Dict[Tuple[int, int], Tuple[CallPlan, ...]] = {}
    if row.size:
        # [real query rows] piece p's rows at q_off[p]: the causal call's
        diag = torch.from_numpy(ranges_np(q_first, n_q))
        if R > 1:
            diag = diag * R + torch.from_numpy(np.repeat(row, n_q))
        q_off = n_q.cumsum() - n_q
        if window is not None:
            segs = _windowed_segments(kind, runs, rank, intervals, window, c, R,
                                      *(torch.from_numpy(x) for x in (row, ds, pa, pb, q_off)), mine_flat)
        else:
            segs = _full_segments(kind, runs, rank, intervals, c, R, row, doc, ds, pa, q_off, n_q, mine_flat)
        calls = _emit(segs, diag, rank, R)
        joined = _touching(row, doc, q_first, n_q) if window is None else None
        if joined is not None and joined.size < n_q.size:
            own = _joined_own_calls(runs, rank, R, joined, row, ds, pa, q_off, n_q, diag)
        else:
            lens = tuple(n_q.tolist())
            causal = CallPlan(True, diag, diag, lens, lens,
                              window if window is not None and int(n_q.max()) > window + 1 else None)
            own = calls.get((rank, 0), ()) + (causal,)
    steps: List[Step] = [Step(0, 0, rank, 0, L, own)]
    received = counts[:, rank].tolist()
    reach = RingReach.of(runs, intervals, c) if kind == "ring" else None
    for i, j in remote_steps(kind, counts, L, c, reach):
        src = (rank - i) % cp
        steps.append(remote_step(i, j, src, received[src], c, R, calls.get((src, j), ()), reach))
    return StreamPlan(kind, rank, cp, R, L, c, tuple(steps), reach)


def remote_step(i: int, j: int, src: int, delivered: int, chunk_rows: int, R: int, calls: Tuple[CallPlan, ...],
                reach: Optional[RingReach] = None) -> Step:
    """Step (i, j): piece j of what ``src`` delivers this rank. needed: ``delivered`` rows cut ``chunk_rows`` at
    a time. ring (``reach``): the piece's rows that travel (``RingReach.span``), the calls' keys counted from
    its first."""
    if reach is None:
        return Step(i, j, src, j * chunk_rows, max(0, min(chunk_rows, delivered - j * chunk_rows)), calls)
    lo, hi = reach.span[src][j]
    shift = (lo - j * chunk_rows) * R  # the calls' keys: slot * R + row, slots from the piece's start
    if shift:
        calls = tuple(replace(call, k_index=call.k_index - shift) for call in calls)
    return Step(i, j, src, lo, hi - lo, calls)


def remote_steps(kind: str, counts: torch.Tensor, local_len: int, chunk_rows: int,
                 reach: Optional[RingReach] = None) -> List[Tuple[int, int]]:
    """(round, piece) of every remote step, in transfer order; the same on every rank.

    ring: piece-major (each piece goes around the ring before the next starts), each piece's hops
    in order (``reach``: which pieces go the other way; None: every piece downstream);
    needed: round-major, a round having as many pieces as its largest transfer.
    """
    cp = counts.shape[0]
    if kind == "ring":
        pieces = -(-local_len // chunk_rows)
        if reach is None:
            return [(i, j) for j in range(pieces) for i in range(1, cp)]
        return [step for j in range(pieces) for step in reach.steps(j)]
    if cp == 1:
        return []
    # Round i moves counts[s, (s + i) % cp] from every s: one gather of the [cp, cp - 1] table, not cp - 1
    # rounds of small torch ops (~2 ms of a 1M / cp 64 plan).
    src = np.arange(cp)[:, None]
    largest = counts.numpy()[src, (src + np.arange(1, cp)) % cp].max(0)  # [cp - 1] round 1 .. cp - 1
    return [(i, j) for i, n in enumerate((-(-largest // chunk_rows)).tolist(), 1) for j in range(n)]


def chunk_kind(kv_exchange: str) -> str:
    """The chunk buffers an exchange delivers: the ring's whole local K/V, or the needed rows."""
    return "ring" if kv_exchange == "allgather" else "needed"


__all__ = ["CallPlan", "RingReach", "Step", "StreamPlan", "build_stream_plan", "calls_by_runs", "chunk_kind", "chunk_rows_for",
           "remote_step", "remote_steps", "with_calls_by_runs", "CHUNK_KINDS", "CHUNKS_PER_SHARD", "RUN_CALLS"]
