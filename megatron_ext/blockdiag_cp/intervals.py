"""Interval arithmetic over runs: layouts and documents as ranges, never as per-position masks.

Two kinds of run describe a step. A layout is a set of *rank runs*: rank r owns
the global positions [start, start + length), its runs sorted ascending and
merged where they touch, so a rank's local order is its runs end to end. A row
of doc ids is a set of *document runs*: maximal ranges of one id (0 =
padding). Everything the plan needs is arithmetic on their intersections
(pieces):

- a rank's queries in a document need that document's keys [start, last query],
  one interval per (rank, document);
- what rank src sends rank dst is the overlap of dst's intervals with src's
  runs: a prefix count "src positions before x" evaluated at interval ends;
- a key's slot in a K/V buffer is a piecewise-linear map of its position
  through a table of disjoint ranges.

Cost: one pass over each row of doc ids to find its document runs; the rest is
vectorized over runs, documents and intervals (thousands), plus the size of
what the caller asks for (this rank's indices), never ``cp`` passes over ``P``.
"""

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence, Tuple

import numpy as np
import torch


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(s, s + n) for each (s, n): one cumsum over steps of 1 and jumps.

    In numpy (zero-copy views of the same memory): torch's CPU cumsum, masking and scatter
    were several times slower, and at 1M rows this was most of a plan's index building.
    """
    return torch.from_numpy(ranges_np(np64(starts), np64(lengths)))


def ranges_np(s: np.ndarray, n: np.ndarray) -> np.ndarray:
    """``ranges`` of int64 numpy arrays, to a numpy array (for callers that stay in numpy)."""
    # ndarray methods, not numpy's functions: their dispatch costs as much as the work on a few ranges.
    keep = n > 0
    if not keep.all():
        s, n = s[keep], n[keep]
    if n.size == 0:
        return np.zeros(0, dtype=np.int64)
    ends = n.cumsum()
    steps = np.empty(int(ends[-1]), dtype=np.int64)
    steps.fill(1)
    steps[0] = s[0]
    steps[ends[:-1]] = s[1:] - (s[:-1] + n[:-1] - 1)
    steps.cumsum(out=steps)
    return steps


def np64(x) -> np.ndarray:
    """An int64 numpy view of a CPU tensor or array (a copy only if it is not int64)."""
    return (x if isinstance(x, np.ndarray) else x.numpy()).astype(np.int64, copy=False)


def true_at(mask: torch.Tensor) -> torch.Tensor:
    """``torch.nonzero(mask).flatten()`` of a 1-D mask, through numpy (several times faster on one core):
    index once, then ``take`` every tensor the mask selects, instead of one boolean index per tensor."""
    return torch.from_numpy(np.flatnonzero(mask.numpy()))


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` along dim 0 for an int64 index tensor: ``index_select``, about four times faster
    on CPU than advanced indexing, which builds a general gather."""
    return x.index_select(0, index)


def keep_where(mask: torch.Tensor, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Each of ``xs`` at the entries where the 1-D ``mask`` holds (``xs`` themselves when it holds at
    every one, the usual case): one index for all of them, each taken by ``take``."""
    if bool(mask.all()):
        return xs
    keep = true_at(mask)
    return tuple(take(x, keep) for x in xs)


def repeat_index(count: torch.Tensor) -> torch.Tensor:
    """``torch.repeat_interleave(torch.arange(n), count)``: each i repeated count[i] times (``repeat_arange``)."""
    return torch.from_numpy(repeat_arange(np64(count)))


def repeat_arange(count: np.ndarray) -> np.ndarray:
    """``np.repeat(np.arange(n), count)`` (int64, count >= 0), fast for many short repeats too.

    numpy's repeat pays per entry: with counts of one or two (runs against documents, pieces
    against chunks, bits per segment) it was 2-3x slower than counting where each index ends
    (a bincount of the counts' prefix sums) and summing those up (a cumsum); with long repeats
    (few entries, long outputs) numpy's is the faster, so it stays for those.
    """
    n = count.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    ends = count.cumsum()
    total = int(ends[-1])
    if total > 4 * n:  # one more temporary of the output's size: worth it only for short repeats
        return np.repeat(np.arange(n, dtype=np.int64), count)
    # out[t] = number of entries ending at or before t; entry i ends at ends[i] (the last ends at total).
    return np.bincount(ends[:-1], minlength=total)[:total].cumsum()


def search(table: torch.Tensor, x: torch.Tensor, right: bool = False) -> torch.Tensor:
    """``torch.searchsorted(table, x, right=right)`` for a 1-D table, through numpy.

    About twice as fast on one core, more on ascending x (numpy narrows each search from the
    last), which is how the planner asks: runs of one rank, pieces, intervals in order.
    """
    t, q = table.numpy(), x.numpy()
    if q.dtype != t.dtype:
        q = q.astype(t.dtype)
    return torch.from_numpy(np.searchsorted(t, q, side="right" if right else "left"))


def expand(first: torch.Tensor, count: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(owner, index): for each i, index runs over first[i] .. first[i] + count[i] - 1."""
    return tuple(torch.from_numpy(x) for x in expand_np(np64(first), np64(count)))


def expand_np(first: np.ndarray, count: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``expand`` of int64 numpy arrays, to numpy arrays (for callers that stay in numpy)."""
    return repeat_arange(count), ranges_np(first, count)


@dataclass(frozen=True)
class RankRuns:
    """A layout as runs: rank-major, ascending within a rank, touching runs merged.

    ``local`` is the local index of a run's first position (its offset in the
    owner's order); ``flat`` = rank * L + local is its index in a rank-major
    [cp * L] buffer (all-gather's).
    """

    cp: int
    padded_len: int
    rank: torch.Tensor  # [n] int64
    start: torch.Tensor  # [n] int64
    length: torch.Tensor  # [n] int64, > 0
    local: torch.Tensor  # [n] int64

    @classmethod
    def build(cls, cp: int, padded_len: int, rank: torch.Tensor, start: torch.Tensor,
              length: torch.Tensor) -> "RankRuns":
        """Sort by (rank, start), drop empty runs, merge runs that touch; every rank must own P / cp."""
        rank, start, length = (torch.as_tensor(x, dtype=torch.long).reshape(-1) for x in (rank, start, length))
        # In numpy (a THD layout has 2 * cp runs per document): a half to a third of torch's op costs.
        r, s, n = rank.numpy(), start.numpy(), length.numpy()
        if not (n > 0).all():
            keep = (n > 0).nonzero()[0]
            r, s, n = r[keep], s[keep], n[keep]
            rank, start, length = torch.from_numpy(r), torch.from_numpy(s), torch.from_numpy(n)
        # One scratch array of every run, for the sort key, then run ends, then r * L: each fresh
        # array of a THD layout's 2 * cp runs per document costs ~2 ms of page faults at 1M / cp 64.
        key = r * (padded_len + 1)
        key += s
        if key.size > 1 and not (key[1:] > key[:-1]).all():
            order = torch.argsort(torch.from_numpy(key))
            rank, start, length = take(rank, order), take(start, order), take(length, order)
            r, s, n = rank.numpy(), start.numpy(), length.numpy()
        if r.size > 1:
            touch = np.zeros(r.size, dtype=bool)
            np.equal(r[1:], r[:-1], out=touch[1:])
            touch[1:] &= s[1:] == np.add(s[:-1], n[:-1], out=key[:-1])
            if touch.any():
                head = (~touch).nonzero()[0]
                r, s, n = r[head], s[head], np.add.reduceat(n, head)
                rank, start, length = torch.from_numpy(r), torch.from_numpy(s), torch.from_numpy(n)
        L = padded_len // cp
        local = n.cumsum()  # positions up to each run's end; rank-major: the ranks' ends below
        count = np.bincount(r, minlength=cp)
        has = count > 0
        owned = np.zeros(count.size, dtype=np.int64)
        owned[has] = np.diff(local[count.cumsum()[has] - 1], prepend=0)  # each rank's last end - the last before
        if owned.size != cp or not (owned == L).all():
            raise ValueError(f"layout bug: ranks own {owned.tolist()} positions, expected {L} each")
        local -= n
        local -= np.multiply(r, L, out=key[:r.size])
        local = torch.from_numpy(local)
        return cls(cp, padded_len, rank, start, length, local)

    @property
    def local_len(self) -> int:
        return self.padded_len // self.cp

    @property
    def flat(self) -> torch.Tensor:
        return self.rank * self.local_len + self.local

    def of_rank(self, rank: int) -> slice:
        """The slice of runs ``rank`` owns (runs are rank-major)."""
        lo, hi = self.rank.numpy().searchsorted((rank, rank + 1)).tolist()
        return slice(lo, hi)

    def positions(self, rank: int = None) -> torch.Tensor:
        """[cp, L] every rank's positions, or [L] one rank's."""
        if rank is None:
            return ranges(self.start, self.length).view(self.cp, self.local_len)
        s = self.of_rank(rank)
        return ranges(self.start[s], self.length[s])

    def by_position(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(start, length, run index) sorted by start: the runs as a partition of [0, P)."""
        return self._by_position

    @cached_property
    def _by_position(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Starts are distinct and rank-major runs are cp sorted lists: numpy's stable sort (a merge)
        # gives the same order as any sort, three times faster than torch's at 512k runs (THD).
        order = torch.from_numpy(np.argsort(self.start.numpy(), kind="stable"))
        return take(self.start, order), take(self.length, order), order

    @cached_property
    def _prefix_tables(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per rank src, padded to the most runs K: (starts [cp, K], base, cap [cp, K + 1]), and
        every source's starts in one ascending [cp * K] table (``_entries``) with each source's
        offset in it [cp, 1]. numpy arrays: the planner reads them in numpy, a few times per plan.

        flat_before(src, x) = min(x + base[src, i], cap[src, i]) with i = number of
        src's run starts <= x: entry i describes src's run i - 1, entry 0 the
        empty prefix (src * L). int32 where positions fit (half the memory traffic).
        """
        cp, P, L = self.cp, self.padded_len, self.local_len
        # The one-table search shifts source s by s * (P + 2): int32 where that fits too.
        np_dtype = np.int32 if cp * (P + 2) < 2**31 - 1 else np.int64
        rank, start, length = self.rank.numpy(), self.start.numpy(), self.length.numpy()
        count = np.bincount(rank, minlength=cp)
        K = int(count.max())
        flat = rank * L + self.local.numpy()
        run_base, run_cap = flat - start, flat + length
        starts = np.full((cp, K), P + 1, dtype=np_dtype)  # padding sorts after every x <= P
        base = np.repeat((np.arange(cp, dtype=np_dtype) * L)[:, None], K + 1, axis=1)
        cap = base.copy()
        first = count.cumsum() - count  # [cp] each rank's first run (runs are rank-major)
        if rank.size < 8 * cp:  # a few runs per rank (contiguous, zigzag): one scatter of every run
            col = np.arange(rank.size) - first[rank]
            starts.reshape(-1)[rank * K + col] = start
            entry = rank * (K + 1) + col + 1
            base.reshape(-1)[entry], cap.reshape(-1)[entry] = run_base, run_cap
        else:  # many (THD: 2 per document): each rank's runs are one slice, cp slice copies cost less
            for r, (lo, hi) in enumerate(zip(first.tolist(), (first + count).tolist())):
                starts[r, :hi - lo] = start[lo:hi]
                base[r, 1:hi - lo + 1] = run_base[lo:hi]
                cap[r, 1:hi - lo + 1] = run_cap[lo:hi]
        # Source s's starts shifted by s * (P + 2) lie in [s (P + 2), s (P + 2) + P + 1]: one ascending
        # table, where x + s * (P + 2) (x in [0, P]) lands among source s's starts only.
        shift = (np.arange(cp, dtype=np_dtype) * (P + 2))[:, None]  # [cp, 1]
        return starts, base, cap, (starts + shift).reshape(-1), shift

    def flat_before(self, x: torch.Tensor, src: Optional[int] = None) -> torch.Tensor:
        """src * L + (number of src's positions < x): the flat index of src's first position >= x.

        x: [n] positions in [0, P]. src None: [cp, n] for every source; fastest
        with x ascending (the binary searches then walk each table in order).
        """
        return torch.from_numpy(self.flat_before_np(x.numpy(), src))

    def flat_before_np(self, x: np.ndarray, src: Optional[int] = None) -> np.ndarray:
        """``flat_before`` of a numpy array, to an int64 numpy array (for callers that stay in numpy)."""
        # In numpy, whose gathers and elementwise ops cost a half to a third of torch's on one core.
        starts, base, cap = self._prefix_tables[:3]
        q = x.astype(starts.dtype, copy=False)
        if src is not None:
            i = starts[src].searchsorted(q, side="right")
            return np.minimum(q + base[src][i], cap[src][i]).astype(np.int64)
        i = self._entries(q, right=True)
        return np.minimum(q + base.reshape(-1)[i], cap.reshape(-1)[i]).astype(np.int64)

    def _entries(self, x: np.ndarray, right: bool) -> np.ndarray:
        """[cp, n] flat indices into the row-major [cp, K + 1] prefix tables: every source's entry
        for each x (after its last run starting at or before x, right; before x, not right)."""
        t, _, _, shifted, shift = self._prefix_tables
        x = x.astype(t.dtype, copy=False)
        side = "right" if right else "left"
        if x.size * self.cp < 1 << 16:  # small: one search of the shifted table, not one per source
            # Source s's entries start at s * (K + 1) and its starts at s * K in the shifted table.
            i = shifted.searchsorted(x + shift, side=side)  # [cp, n]
            i += np.arange(self.cp)[:, None]
            return i
        i = np.stack([t[s].searchsorted(x, side=side) for s in range(self.cp)])
        return i + np.arange(0, self.cp * (t.shape[1] + 1), t.shape[1] + 1)[:, None]


DocRuns = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (starts, ends, ids) of one row


def document_runs(row: torch.Tensor) -> DocRuns:
    """(starts, ends, ids) of the maximal runs of equal ids in one row [P] (0 = padding)."""
    P = row.numel()
    if row.device.type == "cpu" and P > 0:  # numpy finds the changes several times faster on one core
        r = row.numpy()
        change = np.flatnonzero(r[1:] != r[:-1]) + 1
        starts = torch.from_numpy(np.concatenate([np.zeros(1, dtype=np.int64), change]))
        return starts, torch.from_numpy(np.append(change, P)), take(row, starts)
    change = torch.nonzero(row[1:] != row[:-1]).flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.long), change])
    ends = torch.cat([change, torch.tensor([P])])
    return starts, ends, row[starts]


def clip(a: torch.Tensor, b: torch.Tensor, part_starts: torch.Tensor, part_ends: torch.Tensor
         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ranges [a, b) cut at the parts of a sorted partition: (range index, part index, pa, pb).

    In range order, ascending within a range; every range non-empty.
    """
    return tuple(torch.from_numpy(x) for x in clip_np(a, b, part_starts, part_ends))


def clip_np(a, b, part_starts, part_ends) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``clip`` of tensors or arrays, as int64 numpy arrays: numpy's elementwise ops and gathers cost
    a half to a third of torch's on one core (a THD layout clips 2 * cp runs per document)."""
    a, b, part_starts, part_ends = np64(a), np64(b), np64(part_starts), np64(part_ends)
    part_of = _part_lookup(a, b, part_starts, part_ends)
    if part_of is not None:
        first, last = part_of[a].astype(np.int64), part_of[b - 1].astype(np.int64)
    else:
        first = part_starts.searchsorted(a, side="right") - 1
        last = part_starts.searchsorted(b - 1, side="right") - 1
    count = last - first + 1
    which, part = expand_np(first, count)
    return which, part, np.maximum(a[which], part_starts[part]), np.minimum(b[which], part_ends[part])


def _part_lookup(a, b, part_starts, part_ends) -> Optional[np.ndarray]:
    """[end] the part holding each position, when that beats two binary searches: many ranges (a THD
    layout's 2 * cp per document) against a partition of [0, end) that covers every range; else None.
    Tensors or arrays in, an array out (numpy: its checks cost a fraction of torch's small ops).

    One pass over the positions instead of ~log2(parts) cache-missing steps per range end."""
    a, b, part_starts, part_ends = np64(a), np64(b), np64(part_starts), np64(part_ends)
    n, end = part_starts.size, int(part_ends[-1]) if part_ends.size else 0
    if n == 0 or a.size == 0 or a.size * 4 * n.bit_length() < end or int(part_starts[0]) != 0 \
            or int(b.max()) > end:
        return None
    if not (part_starts[1:] == part_ends[:-1]).all():
        return None
    # int32 where the parts fit: half the memory of a table as long as the positions, written and
    # read once (numpy's repeat of int32 was also several times faster than of int64 here).
    dtype = np.int32 if n < 2 ** 31 else np.int64
    return np.repeat(np.arange(n, dtype=dtype), part_ends - part_starts)


def map_ranges(tab_start: torch.Tensor, tab_len: torch.Tensor, tab_value: torch.Tensor,
               q_start: torch.Tensor, q_len: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query ranges through a table of disjoint ranges sorted by start, each mapped linearly.

    Returns the non-empty pieces (query index, value start, length) in query
    order, ascending within a query; a query's uncovered parts give no piece.
    """
    # In numpy: its elementwise ops and gathers cost a half to a third of torch's on one core.
    q_start, q_len, tab_start, tab_len = np64(q_start), np64(q_len), np64(tab_start), np64(tab_len)
    q_end = q_start + q_len
    tab_of = _part_lookup(q_start, q_end, tab_start, tab_start + tab_len)
    if tab_of is not None and ((q_len == 0) | (q_start >= 0)).all():
        # Empty queries give no piece whatever their j: clamped only to stay inside the lookup.
        last = tab_of.size - 1
        j0 = tab_of[np.clip(q_start, 0, last)].astype(np.int64)
        j1 = tab_of[np.clip(q_end - 1, 0, last)].astype(np.int64)
    else:
        j0 = np.maximum(np.searchsorted(tab_start, q_start, side="right") - 1, 0)
        j1 = np.searchsorted(tab_start, q_end) - 1  # last table range starting < q_end
    count = np.where(q_len > 0, np.maximum(j1 - j0 + 1, 0), 0)
    which, j = expand_np(j0, count)
    t_start = tab_start[j]
    lo = np.maximum(q_start[which], t_start)
    n = np.maximum(np.minimum(q_end[which], t_start + tab_len[j]) - lo, 0)
    if not (n > 0).all():
        keep = np.flatnonzero(n > 0)
        which, j, lo, n, t_start = which[keep], j[keep], lo[keep], n[keep], t_start[keep]
    return torch.from_numpy(which), torch.from_numpy(np64(tab_value)[j] + lo - t_start), torch.from_numpy(n)


def _real_pieces(run: torch.Tensor, doc: torch.Tensor, pa: torch.Tensor, pb: torch.Tensor, d_id: torch.Tensor
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pieces of ``clip`` that lie in real documents (id > 0), in the same order."""
    return keep_where(take(d_id, doc) > 0, run, doc, pa, pb)


def needed_intervals(rank: np.ndarray, doc: np.ndarray, doc_start: np.ndarray, pb: np.ndarray
                     ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(dst, a, b, doc): [document start, last query + 1) per (rank, document) from real pieces (numpy),
    and that document.

    Pieces in rank-major, ascending order (as ``clip`` of rank runs gives them):
    a rank's pieces of one document are adjacent, its last one ends the interval.
    """
    last = np.ones(rank.size, dtype=bool)
    last[:-1] = (doc[1:] != doc[:-1]) | (rank[1:] != rank[:-1])
    last = last.nonzero()[0]
    return rank[last], doc_start[last], pb[last], doc[last]


def window_pairs(pa: torch.Tensor, pb: torch.Tensor, s: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """Query-key pairs of queries [pa, pb) of a document starting at s: query p sees keys
    [max(s, p - window), p], min(p - s + 1, window + 1) of them (all p - s + 1 without a window;
    then numpy arrays work as well as tensors)."""
    lo, hi = pa - s + 1, pb - s  # each query's key count before the window, first and last
    if window is None:
        return (lo + hi) * (hi - lo + 1) // 2
    w = window + 1
    top = torch.minimum(hi, torch.full_like(hi, w))  # counts that grow: lo .. top
    grow = torch.where(top >= lo, (lo + top) * (top - lo + 1) // 2, torch.zeros_like(lo))
    flat = (hi - torch.maximum(lo - 1, torch.full_like(lo, w))).clamp(min=0) * w
    return grow + flat


def work_and_intervals(runs: RankRuns, rows: Sequence[DocRuns], window: Optional[int] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(work [cp], dst, a, b): attention pairs per rank and every rank's disjoint needed intervals.

    ``rows``: ``document_runs`` of each row of doc ids; intervals sorted by (dst, a).
    ``window``: a sliding window (query p sees keys from p - window): a piece [pa, pb)
    then needs [max(start, pa - window), pb), not its whole document's prefix.
    """
    return work_intervals_and_docs(runs, rows, window)[:4]


def work_intervals_and_docs(runs: RankRuns, rows: Sequence[DocRuns], window: Optional[int] = None
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``work_and_intervals``, and with one row and full attention each interval's document (its
    index in the row's runs: a = starts[doc]), else None (intervals of several rows or windows merge).
    """
    cp = runs.cp
    run_start = np64(runs.start)
    run_end = run_start + np64(runs.length)
    rank = runs.rank.numpy()
    work = np.zeros(cp, dtype=np.int64)
    parts = []
    # In numpy (a THD layout has 2 * cp runs per document): a half to a third of torch's op costs.
    for d_start, d_end, d_id in rows:
        run, doc, pa, pb = clip_np(run_start, run_end, d_start, d_end)
        real = (np64(d_id)[doc] > 0).nonzero()[0]
        if real.size < doc.size:
            run, doc, pa, pb = run[real], doc[real], pa[real], pb[real]
        owner, s = rank[run], np64(d_start)[doc]
        pairs = window_pairs(pa, pb, s, None) if window is None else \
            window_pairs(*(torch.from_numpy(x) for x in (pa, pb, s)), window).numpy()
        np.add.at(work, owner, pairs)
        if window is None:
            parts.append(needed_intervals(owner, doc, s, pb))
        else:
            parts.append((owner, np.maximum(s, pa - window), pb, doc))
    dst, a, b, doc = (torch.from_numpy(np.concatenate(x)) for x in zip(*parts))
    if len(rows) > 1 or window is not None:
        dst, a, b = merge_intervals(dst, a, b, runs.padded_len)
        doc = None
    return torch.from_numpy(work), dst, a, b, doc


def merge_intervals(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, padded_len: int
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Union per dst of possibly overlapping intervals (several rows): disjoint, sorted by (dst, a)."""
    if dst.numel() == 0:
        return dst, a, b
    key_a = dst * (padded_len + 1) + a
    order = torch.argsort(key_a)
    key_a, key_b, dst = key_a[order], (dst * (padded_len + 1) + b)[order], dst[order]
    reach = torch.cummax(key_b, 0).values
    new = torch.ones_like(key_a, dtype=torch.bool)
    new[1:] = key_a[1:] > reach[:-1]
    first = torch.nonzero(new).flatten()
    last = torch.cat([first[1:] - 1, torch.tensor([key_a.numel() - 1])])
    dst = dst[first]
    return dst, key_a[first] - dst * (padded_len + 1), reach[last] - dst * (padded_len + 1)


def overlap_counts(runs: RankRuns, dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """counts[src, dst]: positions src owns inside dst's intervals (zero diagonal).

    Sum over dst's intervals of before_src(b) - before_src(a), ``before_src(x)``
    counting src's positions < x. Interval starts are document starts, shared by
    every rank that needs the document: with many intervals they are evaluated
    once per distinct start ([cp, starts] @ [starts, cp]) and ends for every
    source in ascending order; with few, both are searched as they come and
    summed per dst in numpy (the sort, unique and matmul cost more than they save
    there: 0.24-0.30 -> 0.15-0.19 ms at 128k / cp 8).
    """
    cp = runs.cp
    if dst.numel() * cp < 1 << 13:
        d = dst.numpy()
        counts = np.zeros((cp, cp), dtype=np.int64)
        if d.size:
            inside = runs.flat_before_np(b.numpy()) - runs.flat_before_np(a.numpy())  # [cp, n]
            if bool((d[1:] >= d[:-1]).all()):  # sorted by dst (as work_and_intervals gives them)
                head = np.concatenate(([True], d[1:] != d[:-1])).nonzero()[0]
                counts[:, d[head]] = np.add.reduceat(inside, head, axis=1)
            else:
                np.add.at(counts, (slice(None), d), inside)
        np.fill_diagonal(counts, 0)
        return torch.from_numpy(counts)
    b_sorted, order = torch.sort(b, stable=True)
    counts = torch.zeros(cp, cp, dtype=torch.long).index_add_(1, dst[order], runs.flat_before(b_sorted))
    starts, which = torch.unique(a, return_inverse=True)
    uses = torch.zeros(starts.numel(), cp, dtype=torch.float64).index_put_(
        (which, dst), torch.ones(1, dtype=torch.float64), accumulate=True)  # [n_starts, dst]
    # Exact: integers far below 2**53.
    counts -= (runs.flat_before(starts).double() @ uses).round().long()
    counts.fill_diagonal_(0)
    return counts


def flat_ranges(runs: RankRuns, a: torch.Tensor, b: torch.Tensor, src: Optional[int] = None,
                at_docs: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi): the flat index range of src's positions in [a, b) ([cp, n] for every src).

    ``at_docs``: (starts, doc) with a = starts[doc], where the ranges start at document starts
    (``work_intervals_and_docs``): lo is then searched once per document, not per range (a THD
    plan's ranges are cp per document).
    """
    if at_docs is None:
        return runs.flat_before(a, src), runs.flat_before(b, src)
    starts, doc = at_docs
    lo = runs.flat_before(starts, src)  # [D] or [cp, D]
    return lo.index_select(lo.dim() - 1, doc), runs.flat_before(b, src)


def owned_ranges(runs: RankRuns, a: torch.Tensor, b: torch.Tensor, skip: int
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every source's positions in each of the ranges [a, b): (lo, hi) [cp, n], ``flat_ranges``, and
    (src, start, length), those positions as ranges with their source, source-major, by range,
    ascending (none of ``skip``).

    The pieces come from the binary searches that give (lo, hi): the entry a search lands on names
    src's last run starting at or before a (its first run meeting [a, b), or the next when a is past
    its end) and, searched from the left, its last run starting before b. ``map_ranges`` of the
    flat ranges through the runs would search (or tabulate) the runs again.
    """
    _, base, cap = runs._prefix_tables[:3]
    cp, width = runs.cp, base.shape[1]
    base, cap = base.reshape(-1), cap.reshape(-1)
    qa, qb = a.numpy().astype(base.dtype), b.numpy().astype(base.dtype)
    # [cp, n] entries of the row-major [cp, K + 1] tables: src's entry i describes its run i - 1.
    row = np.arange(0, cp * width, width)[:, None]
    ea, eb = runs._entries(qa, right=True), runs._entries(qb, right=False)
    lo, cap_a = np.minimum(qa + base[ea], cap[ea]), cap[ea]
    hi = np.minimum(qb + base[eb], cap[eb])  # the same count as searched from the right
    # The global index of the run an entry describes: runs are rank-major, src's first at its offset.
    count = np.bincount(runs.rank.numpy(), minlength=cp)
    shift = (count.cumsum() - count - 1)[:, None] - row
    first = ea + shift + (lo == cap_a)  # a past the run's end (or before src's first): the next run
    last = eb + shift
    n = np.where(hi > lo, last - first + 1, 0)  # an empty [a, b) inside a run would meet it
    n[skip] = 0
    which, run = expand_np(first.reshape(-1), n.reshape(-1))
    src, which = np.divmod(which, qa.size)
    run_start, run_len = np64(runs.start), np64(runs.length)
    start = np.maximum(np64(a)[which], run_start[run])
    end = np.minimum(np64(b)[which], run_start[run] + run_len[run])
    return tuple(torch.from_numpy(x) for x in (lo.astype(np.int64), hi.astype(np.int64), src, start, end - start))


def needed_remote(runs: RankRuns, rows: Sequence[DocRuns], window: Optional[int] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(work [cp], needed [cp]): attention pairs and K/V positions each rank needs and does not own."""
    work, dst, a, b = work_and_intervals(runs, rows, window)
    counts = overlap_counts(runs, dst, a, b)
    return work, counts.sum(0)


def overlap_pieces(tab_start: torch.Tensor, tab_end: torch.Tensor, q_start: torch.Tensor, q_end: torch.Tensor
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query ranges against a table of disjoint ranges sorted by start: (query, table index, lo, hi).

    Every non-empty intersection, in query order, ascending within a query
    (``map_ranges`` without the linear map, keeping which table range it is).
    """
    j0 = (search(tab_start, q_start, right=True) - 1).clamp(min=0)
    j1 = search(tab_start, q_end) - 1  # last table range starting < q_end
    count = torch.where(q_end > q_start, (j1 - j0 + 1).clamp(min=0), torch.zeros_like(j0))
    which, j = expand(j0, count)
    lo = torch.maximum(take(q_start, which), take(tab_start, j))
    hi = torch.minimum(take(q_end, which), take(tab_end, j))
    return keep_where(hi > lo, which, j, lo, hi)


def _sum_tables(runs: RankRuns) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per rank, padded to the most runs K: starts, lengths [cp, K], positions and position sums of
    the complete runs before each run [cp, K] (exclusive prefix)."""
    cp, P = runs.cp, runs.padded_len
    count = torch.bincount(runs.rank, minlength=cp)
    col = torch.arange(runs.rank.numel()) - (torch.cumsum(count, 0) - count)[runs.rank]
    K = max(int(count.max()), 1)
    starts = torch.full((cp, K), P + 1, dtype=torch.long)
    lengths = torch.zeros(cp, K, dtype=torch.long)
    starts[runs.rank, col] = runs.start
    lengths[runs.rank, col] = runs.length
    sums = lengths * starts.clamp(max=P) + lengths * (lengths - 1) // 2
    before = torch.cumsum(lengths, 1) - lengths
    sums_before = torch.cumsum(sums, 1) - sums
    return starts, lengths, before, sums_before


def count_and_sum_before(runs: RankRuns, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """([cp, n], [cp, n]): for every rank, how many of its positions are < x and their sum."""
    starts, lengths, before, sums_before = _sum_tables(runs)
    xx = x.view(1, -1).expand(runs.cp, -1).contiguous()
    j = (torch.searchsorted(starts, xx, right=True) - 1).clamp(min=0)  # the run starting at or before x
    st, ln = starts.gather(1, j), lengths.gather(1, j)
    c = (xx - st).clamp(min=0)
    c = torch.minimum(c, ln)
    count = before.gather(1, j) + c
    total = sums_before.gather(1, j) + c * st.clamp(max=runs.padded_len) + c * (c - 1) // 2
    return count, total


def pair_work(runs: RankRuns, rows: Sequence[DocRuns], window: Optional[int] = None) -> torch.Tensor:
    """work[src, dst]: causal query-key pairs of dst's queries on the keys src owns (diagonal: local).

    A query p of a document starting at s attends the keys [s, p]; with B(x) the
    number of src's positions < x, a piece [pa, pb) of dst's queries reads
    sum over p of B(p + 1) - B(s) of src's keys, and sum_{y < x} B(y) =
    (x - 1) * B(x) - (sum of src's positions < x): closed forms on src's runs.
    With a ``window`` a query sees [max(s, p - window), p]: the queries before
    c = s + window + 1 subtract B(s), the others B(p - window).
    Columns sum to the per-rank work of ``work_and_intervals``.
    """
    cp = runs.cp
    out = torch.zeros(cp, cp, dtype=torch.long)
    run_end = runs.start + runs.length
    for d_start, d_end, d_id in rows:
        run, doc, pa, pb = _real_pieces(*clip(runs.start, run_end, d_start, d_end), d_id)
        if run.numel() == 0:
            continue
        s = d_start[doc]
        n = pa.numel()
        if window is None:
            c = pb  # every query subtracts B(s)
            x = torch.cat([pb + 1, pa + 1])
        else:
            c = torch.minimum(torch.maximum(s + window + 1, pa), pb)
            x = torch.cat([pb + 1, pa + 1, pb - window, c - window])
        B, Q = count_and_sum_before(runs, torch.cat([x, s]))  # [cp, len(x) + n]
        H = (x.view(1, -1) - 1) * B[:, :x.numel()] - Q[:, :x.numel()]  # sum_{y < x} B(y)
        pairs = H[:, :n] - H[:, n:2 * n] - (c - pa).view(1, -1) * B[:, x.numel():]  # [src, piece]
        if window is not None:
            pairs -= H[:, 2 * n:3 * n] - H[:, 3 * n:]
        out.index_add_(1, runs.rank[run], pairs)
    return out
