"""Split-and-pack: heavy units split over a few ranks, the rest packed whole, cut at multiples of L."""

import bisect
import heapq
import math
from itertools import chain
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ...intervals import repeat_arange
from .units import Flat, Owned, Units, pieces_np


class _Ranks:
    """Per-rank owned ranges, free tokens and load (work + q * needed keys) while building."""

    def __init__(self, cp: int, L: int):
        self.owned: Owned = [[] for _ in range(cp)]
        self.room = [L] * cp
        self.load = [0.0] * cp

    def copy(self) -> "_Ranks":
        other = _Ranks(len(self.room), 0)
        other.owned = [list(o) for o in self.owned]
        other.room, other.load = list(self.room), list(self.load)
        return other

    def cut_in(self, spans: Sequence[Tuple[int, int]], order: Optional[Sequence[int]] = None) -> None:
        """Fill the ranks' free tokens (ranks in ``order``) with these ranges, cutting where one is full."""
        order = range(len(self.room)) if order is None else order
        room, owned = self.room, self.owned
        k = 0
        r = order[0] if order else 0
        for span in spans:
            a, b = span
            if a >= b:
                continue
            while room[r] == 0:
                k += 1
                r = order[k]
            if room[r] >= b - a:  # the usual case: it fits the current rank whole
                owned[r].append(span)
                room[r] -= b - a
                continue
            while a < b:
                while room[r] == 0:
                    k += 1
                    r = order[k]
                take = room[r] if room[r] < b - a else b - a
                owned[r].append((a, a + take))
                room[r] -= take
                a += take
        assert not any(room), room  # every rank full (room is never negative)


def split_and_pack(units: Units, cp: int, theta: float, style: str,
                   seen: Optional[set] = None) -> Optional[Tuple[Owned, Owned]]:
    """Split heavy documents by ``style``, pack the rest whole, cut at multiples of L.

    1. A unit whose tokens exceed a rank's share, or whose work exceeds ``theta``
       of a rank's work share, is split over m ranks (``zigzag``: 2m chunks,
       rank i of m takes chunks i and 2m-1-i; ``need``: zigzag over the fewest
       least loaded ranks whose missing work covers it).
    2. The other units, largest work first, go whole to the rank that keeps
       max(work / share, tokens / L) smallest.
    3. The ranks' units are laid end to end (largest first within a rank) and
       cut at exact multiples of L.
    Also returned: 2-3 done strictly (each unit whole to the least loaded rank
    it fits in; those that fit nowhere cut into the least loaded free tokens).
    None when step 1 split exactly as a call with the same ``seen`` set did.
    """
    split = split_heavy(units, cp, theta, style, seen)
    return None if split is None else pack(units, *split)


def split_heavy(units: Units, cp: int, theta: float, style: str,
                seen: Optional[set] = None) -> Optional[Tuple["_Ranks", List[int]]]:
    """Step 1 of ``split_and_pack``: the ranks after it and the units left whole (by_work order);
    None when it split exactly as a call with the same ``seen`` set did."""
    L = units.tokens // cp
    target = max(units.total / cp, 1e-9)
    ranks = _Ranks(cp, L)
    load, room = ranks.load, ranks.room
    # Only the heavy units are visited (the light ones only go whole); every unit not split then
    # goes whole, in by_work order. zigzag: which units are heavy is fixed by theta. need: it moves
    # as ranks fill (the limit, theta of the least loaded rank's missing work, only falls), so the
    # next heavy unit is looked up after each split (``next_heavy``) instead of testing every unit.
    split = set()
    if style == "need":
        order = units.splittable(L)[0]

        def heavy_units():
            k = -1
            while (k := units.next_heavy(k + 1, theta * max(target - min(load), 0.0), L)) is not None:
                yield order[k], 0  # m: from the ranks' loads when it is reached
        heavy = heavy_units()
    else:
        # zigzag: each heavy unit's m is fixed by theta, and the split is a function of the (unit, m)
        # sequence: one seen before split as that call did (its ranges are in ``seen``), so it is
        # not done again.
        starts, ends, works, share = units.start, units.end, units.work, min(theta, 1.0) * target
        heavy = [(i, min(cp, max(2, -((starts[i] - ends[i]) // L), math.ceil(works[i] / share - 1e-9))))
                 for i in units.heavy(theta * target, L)]
        if seen is not None:
            sequence = ("zigzag", tuple(heavy))
            if sequence in seen:
                return None
            seen.add(sequence)
    owned = ranks.owned
    for i, m in heavy:
        # Ranks picked by sorting (key, rank) tuples: a stable sort of range(cp) by key, without a
        # key function call per rank.
        if style == "need":
            n, w = units.end[i] - units.start[i], units.work[i]
            needs = sorted([(load[r] - target, -room[r], r) for r in range(cp)])
            m, covered = 0, 0.0
            while m < cp and (m < 2 or covered < w or m * L < n):
                covered += max(target - load[needs[m][2]], 0.0)
                m += 1
            chosen = sorted([r for _, _, r in needs[:m]], key=load.__getitem__)
        else:
            by_room = sorted([(-room[r], load[r], r) for r in range(cp)])
            chosen = sorted([r for _, _, r in by_room[:m]], key=load.__getitem__)
        halves = units.halves(i, m)
        for r, half in zip(chosen, halves):  # a loop, not any() over a generator: many short calls
            if room[r] < half[0]:
                break  # no room to split it: it goes whole, and step 3 cuts it where it lands
        else:
            split.add(i)
            for r, (size, head, head_work, tail, tail_work) in zip(chosen, halves):
                if head is not None:
                    owned[r].append(head)
                    load[r] += head_work
                if tail is not None:
                    owned[r].append(tail)
                    load[r] += tail_work
                room[r] -= size
    whole = [i for i in units.by_work if i not in split] if split else list(units.by_work)

    if seen is not None:
        key = tuple(tuple(o) for o in ranks.owned)
        if key in seen:
            return None
        seen.add(key)
    return ranks, whole


def pack(units: Units, ranks: "_Ranks", whole: Sequence[int]) -> Tuple[Owned, Owned]:
    """Steps 2-3 of ``split_and_pack`` after ``split_heavy`` (``ranks`` filled in place), one packing in
    Python (``pack_lockstep``: many at once)."""
    cp, L = len(ranks.room), units.tokens // len(ranks.room)
    target = max(units.total / cp, 1e-9)
    load, room = ranks.load, ranks.room
    # Step 2, two ways: whole units strictly where they fit (the rest cut in), or binned and streamed.
    strict = ranks.copy()
    _fill(strict, units, whole)
    # Step 2: a heap on the current key (ties by rank) instead of a scan of every rank per unit.
    bins: List[List[int]] = [[] for _ in range(cp)]
    tokens = [L - r for r in room]
    work = list(load)
    heap = [(max(work[r] / target, tokens[r] / L), r) for r in range(cp)]
    heapq.heapify(heap)
    lengths, works, replace = units.length, units.work, heapq.heapreplace
    for i in whole:
        r = heap[0][1]
        bins[r].append(i)
        t = tokens[r] = tokens[r] + lengths[i]
        x = work[r] = work[r] + works[i]
        x, t = x / target, t / L
        replace(heap, (t if t > x else x, r))  # max(x, t)
    # Within a bin, longest first (a stable sort: ties keep their by_work order).
    neg_len, ranges = units.neg_len.__getitem__, units.range
    ranks.cut_in([ranges[i] for b in bins for i in sorted(b, key=neg_len)])
    return ranks.owned, strict.owned


def _fill(ranks: "_Ranks", units: "Units", order: Sequence[int]) -> None:
    """Whole units in ``order`` to the least loaded rank that has room (ties by rank); the rest cut
    into the ranks' free tokens, least loaded first."""
    room, owned, load = ranks.room, ranks.owned, ranks.load
    # The ranks with room by (load, rank), kept sorted (not a heap): most units do not fit the least
    # loaded rank, and the first with room among the four least loaded is then a slice, not a sort.
    ranked = sorted((load[r], r) for r in range(len(room)) if room[r] > 0)
    rest = []
    ranges, lengths, works, insort = units.range, units.length, units.work, bisect.insort
    for i in order:
        n = lengths[i]
        for k, (_, r) in enumerate(ranked[:4]):
            if room[r] >= n:
                break
        else:
            rest.append(ranges[i])
            continue
        owned[r].append(ranges[i])
        room[r] -= n
        load[r] += works[i]
        del ranked[k]
        if room[r] > 0:
            insort(ranked, (load[r], r))
    ranks.cut_in(rest, order=sorted(range(len(room)), key=load.__getitem__))


def pack_lockstep(jobs: Sequence[Tuple[Units, "_Ranks", Sequence[int]]], cp: int) -> List[Tuple[Flat, Flat]]:
    """``pack`` of J packings at once (``split_heavy``'s results), each as (rank, a, b) arrays in the order
    ``pack``'s lists hold them: both greedy steps 2 walk the J packings' t-th whole units together as
    [J, cp] numpy arrays (one step per unit, not per (packing, unit)), the same float sums in the
    same order (bit-identical), and step 3's cuts are binary searches. A packing with fewer units
    steps through zeros, which change nothing."""
    J = len(jobs)
    S = max(len(whole) for _, _, whole in jobs)
    start, length = np.zeros((J, S), dtype=np.int64), np.zeros((J, S), dtype=np.int64)
    work, valid = np.zeros((J, S)), np.zeros((J, S), dtype=bool)
    for j, (u, _, whole) in enumerate(jobs):
        idx = np.array(whole, dtype=np.int64)
        u_start, u_length, u_work = u.arrays()
        start[j, :idx.size], length[j, :idx.size], work[j, :idx.size] = u_start[idx], u_length[idx], u_work[idx]
        valid[j, :idx.size] = True
    room0 = np.array([r.room for _, r, _ in jobs], dtype=np.int64).ravel()  # [J * cp]: flat rank j * cp + r
    load0 = np.array([r.load for _, r, _ in jobs], dtype=np.float64).ravel()
    L = np.array([u.tokens // cp for u, _, _ in jobs], dtype=np.int64)
    target = np.array([max(u.total / cp, 1e-9) for u, _, _ in jobs])
    jrow, base = np.arange(J), np.arange(J) * cp
    # Step 2 strictly (``_fill``): per unit, the first with room among the (up to) four least loaded
    # ranks with room, by (load, rank): a stable argsort of the loads, full ranks at inf. A rank with
    # room n >= 1 has room, so the four need no other test.
    room, load = room0.copy(), load0.copy()
    ranked = np.where(room > 0, load, np.inf)
    by_load = ranked.reshape(J, cp)  # a view
    lengths, works = length.T.copy(), work.T.copy()  # [S, J]: each step's row contiguous
    placed = np.empty((S, J), dtype=np.int64)  # flat rank, or -1: cut in afterwards
    for t in range(S):
        n = lengths[t]
        four = by_load.argsort(1, kind="stable")[:, :4]
        four += base[:, None]
        fits = room[four] >= n[:, None]
        k = fits.argmax(1)
        r = four[jrow, k]
        has = fits[jrow, k]
        left = room[r] - n * has
        room[r] = left
        x = load[r] + works[t] * has
        load[r] = x
        x[left == 0] = np.inf
        ranked[r] = x
        r[~has] = -1
        placed[t] = r
    # Step 2 streamed: per unit, the rank of the least max(work / share, tokens / L) (ties: the lower).
    tokens, streamed = np.repeat(L, cp) - room0, load0.copy()
    key = np.maximum(streamed / np.repeat(target, cp), tokens / np.repeat(L, cp))
    by_key = key.reshape(J, cp)  # a view
    binned = np.empty((S, J), dtype=np.int64)
    for t in range(S):
        r = by_key.argmin(1)
        r += base
        binned[t] = r
        x = tokens[r] + lengths[t]
        tokens[r] = x
        y = streamed[r] + works[t]
        streamed[r] = y
        key[r] = np.maximum(y / target, x / L)
    placed, binned = placed.T, binned.T
    # Step 3, streamed: each rank's bin longest first (ties in by_work order), ranks in order, cut into
    # their room; strictly: the units left over, cut into the room left, least loaded rank first.
    j_of, t_of = np.nonzero(valid)  # job-major
    s_a, s_n, s_bin = start[j_of, t_of], length[j_of, t_of], binned[j_of, t_of]
    order = np.argsort(s_bin * (int(s_n.max(initial=0)) + 1) - s_n, kind="stable")  # flat bins: job-major
    stream = _stream_cut(s_a[order], s_n[order], np.arange(J * cp), room0)
    left = placed[j_of, t_of] < 0
    rest = _stream_cut(s_a[left], s_n[left], (np.argsort(load.reshape(J, cp), axis=1, kind="stable")
                                              + base[:, None]).ravel(), room)
    # Per packing, step 1's ranges, then (strict) the units placed whole in order, then the cuts.
    per_rank = [spans for _, ranks, _ in jobs for spans in ranks.owned]
    ab = np.fromiter(chain.from_iterable(chain.from_iterable(per_rank)), dtype=np.int64).reshape(-1, 2)
    first = (repeat_arange(np.fromiter(map(len, per_rank), dtype=np.int64, count=len(per_rank))), ab[:, 0], ab[:, 1])
    whole_kept = ~left
    p_a = s_a[whole_kept]
    strict = _by_rank(J, cp, first, (placed[j_of, t_of][whole_kept], p_a, p_a + s_n[whole_kept]), rest)
    streamed_out = _by_rank(J, cp, first, stream)
    return [(streamed_out[j], strict[j]) for j in range(J)]


def _stream_cut(a: np.ndarray, n: np.ndarray, order: np.ndarray, room: np.ndarray
                ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_Ranks.cut_in`` of many packings at once: the ranges [a, a + n) (packing-major, each packing's
    tokens its ranks' room) laid end to end and cut into the flat ranks ``order`` (packing-major,
    each packing's ranks in its fill order) at their ``room``: (flat rank, a, b) per piece, in order."""
    cap = room[order]
    first = np.cumsum(cap) - cap  # each rank's first token in the stream of every packing's ranges
    end = np.cumsum(n)
    begin = end - n
    which, slot = pieces_np(begin, end, first)  # a full rank's equal start: the next rank's is found
    lo = np.maximum(begin[which], first[slot])
    hi = np.minimum(end[which], first[slot] + cap[slot])
    keep = hi > lo  # a full rank inside a range gets nothing
    which, slot, lo, hi = which[keep], slot[keep], lo[keep], hi[keep]
    shift = a[which] - begin[which]
    return order[slot], lo + shift, hi + shift


def _by_rank(J: int, cp: int, *parts: Tuple[np.ndarray, np.ndarray, np.ndarray]) -> List[Flat]:
    """Ranges (flat rank j * cp + r, a, b) from ``parts`` in turn, per packing j: (rank, a, b) by rank,
    each rank's in the order given."""
    rank, a, b = (np.concatenate(x) for x in zip(*parts))
    order = np.argsort(rank, kind="stable")
    rank, a, b = rank[order], a[order], b[order]
    cuts = np.searchsorted(rank, np.arange(J + 1) * cp).tolist()
    rank %= cp
    return [(rank[lo:hi], a[lo:hi], b[lo:hi]) for lo, hi in zip(cuts[:-1], cuts[1:])]
