"""What the balanced search places: units (ranges on which no row changes document) and their work."""

import bisect
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from ...cost import WindowMix
from ...intervals import DocRuns, repeat_arange, window_pairs
from ..base import RunSpec
from .tuning import DEFAULT_TUNING

Owned = List[List[Tuple[int, int]]]  # per rank, the [a, b) ranges it owns
Span = Tuple[int, int]  # [a, b)
Spans = List[Tuple[int, int]]  # the global ranges a search lays out (all of [0, P), or one node's)
Flat = Tuple[np.ndarray, np.ndarray, np.ndarray]  # (rank, a, b) of a candidate's ranges, by rank


class UnitTable:
    """The row(s) cut where any row changes document: (start, end, alpha, beta) numpy arrays over
    [0, P) (every reader is numpy).

    ``windows``: the model's sliding windows (``cost.WindowMix``), which every score prices.
    """

    def __init__(self, rows: Sequence[DocRuns], P: int, windows: Optional[WindowMix] = None):
        self.rows, self.P = list(rows), P
        self.windows = WindowMix() if windows is None else windows
        if len(rows) == 1:  # the units are the row's documents
            starts, ends, doc = (x.numpy() for x in rows[0])
            alpha = (doc > 0).astype(np.float64)
            beta = alpha * (1 - starts).astype(np.float64)
            # Where the document of each unit ends: a piece ending before it has later readers.
            self.doc_end = ends
        else:
            starts = torch.unique(torch.cat([r[0] for r in rows]))
            ends = torch.cat([starts[1:], torch.tensor([P])])
            alpha = torch.zeros(starts.numel(), dtype=torch.float64)
            beta = torch.zeros_like(alpha)
            for row_starts, _, row_doc in rows:
                which = torch.searchsorted(row_starts, starts, right=True) - 1
                real = (row_doc[which] > 0).double()
                alpha += real
                beta += real * (1 - row_starts[which]).double()
            starts, ends, alpha, beta = (x.numpy() for x in (starts, ends, alpha, beta))
            self.doc_end = ends
        self.start, self.end, self.alpha, self.beta = starts, ends, alpha, beta


class Units:
    """What the candidates of one search place: the units of ``spans`` (Python lists, global
    positions) with their work coefficients; runs of consecutive tiny documents are bundled into
    one unit of at most ``bundle_fraction`` of a rank's share (never split, so the search loops over
    fewer units)."""

    def __init__(self, table: UnitTable, spans: Spans, cp: int, bundle: int = 0,
                 bundle_fraction: float = DEFAULT_TUNING.bundle_fraction):
        self.rows, self.P, self.spans, self.windows = table.rows, table.P, spans, table.windows
        self.tokens = sum(b - a for a, b in spans)
        # The table's units cut at the spans (``intervals.clip`` of a few spans), in numpy: a handful
        # of small array ops, where torch's dispatch per op cost more than the arithmetic.
        sa = np.array([a for a, _ in spans], dtype=np.int64)
        sb = np.array([b for _, b in spans], dtype=np.int64)
        t_start = table.start
        which, unit = pieces_np(sa, sb, t_start)
        starts = np.maximum(sa[which], t_start[unit])
        ends = np.minimum(sb[which], table.end[unit])
        alpha, beta = table.alpha[unit], table.beta[unit]
        read_later = ends < table.doc_end[unit]
        n = (ends - starts).astype(np.float64)
        work = alpha * ((starts + ends - 1).astype(np.float64) * n / 2) + beta * n
        # Windows (one row of ids, where a unit is a piece of one document): the layers' mix of windowed
        # work. Several rows: the full-attention coefficients guide the packing; scores stay exact.
        self.mix = None if table.windows.full_only or len(table.rows) > 1 else table.windows.shares
        doc_start = t_start[unit] if len(table.rows) == 1 else starts
        if self.mix is not None:
            s_t, e_t, d_t = (torch.from_numpy(x) for x in (starts, ends, doc_start))
            work = (torch.from_numpy(alpha) * sum(f * window_pairs(s_t, e_t, d_t, w).double()
                                                  for w, f in self.mix)).numpy()
        work = torch.from_numpy(work)  # summed by torch, as the search always has
        self.total = float(work.sum())
        work = work.numpy()
        cap = bundle or max(1, int(self.tokens // cp * bundle_fraction))
        # Bundles: a tiny piece joins the bundle before it if it follows a tiny piece that touches it
        # and the bundle stays within cap. Only the cap is sequential: looped over the joinable pieces.
        tiny = (alpha > 0) & (ends - starts <= cap) & ~read_later
        joinable = np.flatnonzero(tiny[1:] & tiny[:-1] & (ends[:-1] == starts[1:])) + 1
        head = np.ones(starts.size, dtype=bool)  # [pieces]: begins a unit
        if joinable.size:
            start_l, end_l = starts.tolist(), ends.tolist()
            bundle_start = 0
            for k in joinable.tolist():
                if head[k - 1]:
                    bundle_start = start_l[k - 1]
                if end_l[k] - bundle_start <= cap:
                    head[k] = False
        first = np.flatnonzero(head)
        last = np.empty_like(first)  # each unit's last piece
        last[:-1] = first[1:] - 1
        last[-1:] = starts.size - 1
        self.doc_start, self.start, self.end = doc_start[first].tolist(), starts[first].tolist(), ends[last].tolist()
        self.alpha, self.beta = alpha[first].tolist(), beta[first].tolist()
        self.bundle, self.shared = tiny[first].tolist(), read_later[first].tolist()
        self.work = work[first].tolist()
        if first.size < starts.size:  # a bundle's work: its pieces' summed in order, as they join
            pieces, first_l, last_l = work.tolist(), first.tolist(), last.tolist()
            for u in np.flatnonzero(last > first).tolist():
                w = pieces[first_l[u]]
                for k in range(first_l[u] + 1, last_l[u] + 1):
                    w += pieces[k]
                self.work[u] = w
        self.by_work = sorted(range(len(self.start)), key=[-w for w in self.work].__getitem__)
        length = ends[last] - starts[first]
        self.neg_len = (-length).tolist()  # minus each unit's tokens: a sort key
        self.length = length.tolist()
        self.range = list(zip(self.start, self.end))  # each unit's (start, end): placed whole as is
        self._splittable = {}  # L -> (units ``light`` can reject, by work; those it rejects at any limit)
        self._halves = {}  # (unit, m) -> ``halves``
        self._arrays = None  # ``arrays``

    def arrays(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start, length, work) of every unit as numpy arrays (``pack_lockstep``), made once."""
        if self._arrays is None:
            self._arrays = (np.array(self.start, dtype=np.int64), np.array(self.length, dtype=np.int64),
                            np.array(self.work, dtype=np.float64))
        return self._arrays

    def splittable(self, L: int) -> Tuple[List[int], List[float], List[int]]:
        """(the units ``light`` can reject, by work; minus their work; the positions in that list of
        those it rejects at any limit: longer than L or read later)."""
        if L not in self._splittable:
            order = [i for i in self.by_work if self.alpha[i] != 0 and not self.bundle[i]]
            fixed = [k for k, i in enumerate(order) if self.end[i] - self.start[i] > L or self.shared[i]]
            self._splittable[L] = (order, [-self.work[i] for i in order], fixed)
        return self._splittable[L]

    def heavy(self, limit: float, L: int) -> List[int]:
        """The units ``light(i, limit, L)`` rejects, in ``by_work`` order, without a call per unit: the
        ones over ``limit`` are a prefix of the rest (sorted by work), the others are fixed by L."""
        order, neg_work, fixed = self.splittable(L)
        over = bisect.bisect_left(neg_work, -limit)  # order[:over]: work > limit
        return order[:over] + [order[k] for k in fixed if k >= over]

    def next_heavy(self, k: int, limit: float, L: int) -> Optional[int]:
        """The first position >= k in ``splittable(L)``'s order of a unit ``light(., limit, L)``
        rejects (None: none left): a unit over ``limit`` if k is still inside that prefix, else the
        next one rejected at any limit."""
        order, neg_work, fixed = self.splittable(L)
        if k < bisect.bisect_left(neg_work, -limit):
            return k
        f = bisect.bisect_left(fixed, k)
        return fixed[f] if f < len(fixed) else None

    def halves(self, i: int, m: int) -> List[Tuple[int, Optional[Span], float, Optional[Span], float]]:
        """Unit i cut into 2m equal chunks, rank k of m taking chunks k and 2m-1-k (a ``zigzag`` split):
        per k, (its tokens, head range, its work, tail range, its work), an empty range as None. The
        same (unit, m) recurs across one search's thresholds: kept per unit."""
        key = (i, m)
        if key not in self._halves:
            a, n = self.start[i], self.end[i] - self.start[i]
            bounds = [a + (n * j) // (2 * m) for j in range(2 * m + 1)]
            span = self.span if self.mix is not None else None
            al, be = self.alpha[i], self.beta[i]
            out = []
            for k in range(m):
                ha, hb, ta, tb = bounds[k], bounds[k + 1], bounds[2 * m - 1 - k], bounds[2 * m - k]
                if span is None:  # ``span`` inline: one method call less per chunk
                    head_work = al * (hb * (hb - 1) - ha * (ha - 1)) / 2 + be * (hb - ha)
                    tail_work = al * (tb * (tb - 1) - ta * (ta - 1)) / 2 + be * (tb - ta)
                else:
                    head_work, tail_work = span(i, ha, hb), span(i, ta, tb)
                out.append((hb - ha + tb - ta, (ha, hb) if hb > ha else None, head_work,
                            (ta, tb) if tb > ta else None, tail_work))
            self._halves[key] = out
        return self._halves[key]

    def light(self, i: int, limit: float, L: int) -> bool:
        """Placed whole: padding, a bundle, or at most L tokens and ``limit`` work, and not a head of a
        document whose later pieces (on other ranks) read it: one owner would send it to all of them."""
        return self.alpha[i] == 0 or self.bundle[i] or (
            self.end[i] - self.start[i] <= L and self.work[i] <= limit and not self.shared[i])

    def span(self, i: int, x: int, y: int) -> float:
        """Work of positions [x, y) of unit i (a split unit: never a bundle)."""
        if self.mix is not None:
            return self.alpha[i] * sum(f * _pairs(x, y, self.doc_start[i], w) for w, f in self.mix)
        return self.alpha[i] * (y * (y - 1) - x * (x - 1)) / 2 + self.beta[i] * (y - x)


def _pairs(x: int, y: int, s: int, window: Optional[int]) -> int:
    """``intervals.window_pairs`` of one piece: queries [x, y) of a document starting at s."""
    lo, hi = x - s + 1, y - s
    if window is None:
        return (lo + hi) * (hi - lo + 1) // 2
    w = window + 1
    top = min(hi, w)
    grow = (lo + top) * (top - lo + 1) // 2 if top >= lo else 0
    return grow + max(0, hi - max(lo - 1, w)) * w


def pieces_np(a: np.ndarray, b: np.ndarray, starts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Nonempty ranges [a, b) against a partition of [0, P) (its parts' starts, ascending): (range, part)
    of every piece, in range order (``intervals.clip``'s two binary searches, in numpy)."""
    first = np.searchsorted(starts, a, side="right") - 1
    count = np.searchsorted(starts, b - 1, side="right") - first
    which = repeat_arange(count)
    # Piece t of range i is part first[i] + t - (i's first piece): one gather and an add, where
    # ``expand_np``'s general ranges cost a few more passes (these counts are never zero).
    end = np.cumsum(count)
    return which, np.arange(end[-1] if end.size else 0) + (first + count - end)[which]
