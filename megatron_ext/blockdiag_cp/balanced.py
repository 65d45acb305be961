"""The cost-aware balanced layout: equal tokens per rank, the smallest modeled time we can find.

Every candidate is built from document runs alone (no per-position arrays) and
scored exactly: its runs go through the plan's own counting
(``intervals.needed_remote``), and the modeled time is the busiest rank's
causal pairs plus ``CostModel.positions_per_pair`` times the K/V positions it
receives. Candidates:

- ``contiguous`` and ``zigzag`` themselves, so the result is never worse than either;
- split-and-pack: documents heavier than ``theta`` of a rank's work share are
  split over a few ranks (``zigzag`` pairs, which equalise their work;
  ``chunks``, contiguous pieces of equal compute plus received keys; ``need``,
  zigzag pairs over the least loaded ranks), the rest packed whole by work and
  tokens, the ranks' documents laid end to end and cut at multiples of the
  local length;
- carve: for a per-rank budget B (a multiple of the ideal), each heavy document
  is cut from its end: the rank with the most spare budget takes the longest
  tail [x, end) whose compute plus the x earlier keys it must receive fits B
  (tails are thin near the end of a long document, where every key is far from
  its start), together with a few head tokens of the document where owning
  them is cheaper than receiving them; the light documents then go densest
  first to the rank with the most spare budget per free token, so ranks that
  carry an expensive tail are filled with short documents.

Work of a run [x, y) inside a unit (a range on which no row changes document)
is alpha * sum(p) + beta * (y - x) over p in [x, y): alpha real rows, beta the
sum over them of 1 - document start. One row: alpha = 1, beta = 1 - start.
"""

import heapq
import math
from typing import List, Optional, Sequence, Tuple

import torch

from .cost import CostModel
from .intervals import RankRuns, clip, document_runs, needed_remote

RunSpec = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rank, start, length) of owned ranges
Owned = List[List[Tuple[int, int]]]  # per rank, the [a, b) ranges it owns

BALANCE_GOAL = 1.05
# Split thresholds (fraction of a rank's work share a document may carry whole).
SPLIT_THRESHOLDS = (math.inf, 2.0, 1.0, 0.75, 0.5, 0.35, 0.25)
# Carve budgets, in multiples of the ideal per-rank work.
CARVE_BUDGETS = (1.05, 1.15, 1.3, 1.5, 1.75, 2.1)
# Work beyond the balance goal weighs this much extra in the choice: the rest of the layer is
# token-balanced, so attention imbalance is a (mild) preference even where traffic is cheaper.
IMBALANCE_WEIGHT = 0.5
LAST_CHOICE: List[str] = []  # the label of the last candidate chosen (benchmarks and tests read it)


class _Units:
    """Ranges on which no row changes document, with their work coefficients (Python lists)."""

    def __init__(self, ids: torch.Tensor):
        R, P = ids.shape
        self.rows = [document_runs(row) for row in ids]
        if R == 1:
            starts, ends, doc = self.rows[0]
            real = (doc > 0).double()
            alpha, beta = real, real * (1 - starts).double()
        else:
            starts = torch.unique(torch.cat([r[0] for r in self.rows]))
            ends = torch.cat([starts[1:], torch.tensor([P])])
            alpha = torch.zeros(starts.numel(), dtype=torch.float64)
            beta = torch.zeros_like(alpha)
            for row_starts, _, row_doc in self.rows:
                which = torch.searchsorted(row_starts, starts, right=True) - 1
                real = (row_doc[which] > 0).double()
                alpha += real
                beta += real * (1 - row_starts[which]).double()
        n = ends - starts
        sum_p = (starts + ends - 1).double() * n.double() / 2
        work = alpha * sum_p + beta * n.double()
        self.P = P
        self.start, self.end = starts.tolist(), ends.tolist()
        self.alpha, self.beta, self.work = alpha.tolist(), beta.tolist(), work.tolist()
        self.total = float(work.sum())
        self.by_work = sorted(range(len(self.start)), key=lambda i: -self.work[i])

    def span(self, i: int, x: int, y: int) -> float:
        """Work of positions [x, y) of unit i."""
        return self.alpha[i] * (y * (y - 1) - x * (x - 1)) / 2 + self.beta[i] * (y - x)

    def reach(self, i: int, x: int, budget: float) -> int:
        """Largest y with span(i, x, y) <= budget (at least x): the quadratic's root, checked once."""
        a2, b1 = self.alpha[i] / 2, self.beta[i] - self.alpha[i] / 2
        c = -(budget + a2 * x * x + b1 * x)  # a2 y^2 + b1 y + c <= 0
        if a2 <= 0:
            return self.end[i] if b1 <= 0 else max(x, int(math.floor(-c / b1)))
        y = int((-b1 + math.sqrt(max(b1 * b1 - 4 * a2 * c, 0.0))) / (2 * a2))
        if y > x and self.span(i, x, y) > budget:  # float rounding: one step is enough
            y -= 1
        return max(y, x)


def balanced_runs(ids: torch.Tensor, cp: int, cost_model: CostModel) -> RunSpec:
    """ids: [R, P] padded doc ids. The best candidate's runs (see the module docstring)."""
    units = _Units(ids)
    P = units.P
    L = P // cp
    q = cost_model.positions_per_pair
    candidates: List[Tuple[str, Owned]] = [("contiguous", [[(r * L, (r + 1) * L)] for r in range(cp)])]
    if P % (2 * cp) == 0:
        half = P // (2 * cp)
        candidates.append(("zigzag", [[(r * half, (r + 1) * half), ((2 * cp - 1 - r) * half, (2 * cp - r) * half)]
                                      for r in range(cp)]))
    target = units.total / cp
    heavy = [i for i in units.by_work if units.alpha[i] > 0
             and (units.end[i] - units.start[i] > L or units.work[i] > min(SPLIT_THRESHOLDS) * target)]
    if heavy:
        seen = set()
        for theta in SPLIT_THRESHOLDS:
            for style in ("zigzag", "chunks", "need"):
                if style != "need":  # fixed by which units split and over how many ranks: skip repeats
                    key = (style,) + tuple(_split_width(units, i, cp, theta, target) for i in heavy)
                    if key in seen:
                        continue
                    seen.add(key)
                candidates.append((f"{style}@{theta}", _split_and_pack(units, cp, theta, style, q)))
        for mult in CARVE_BUDGETS:
            candidates.append((f"carve@{mult}", _carve(units, cp, q, mult * target)))
    else:  # nothing worth splitting: one packing
        candidates.append(("pack", _split_and_pack(units, cp, math.inf, "zigzag", q)))

    # Every candidate's ranges as flat tensors, candidate-major.
    group = [c * cp + r for c, (_, owned) in enumerate(candidates) for r, spans in enumerate(owned) for _ in spans]
    spans = [span for _, owned in candidates for o in owned for span in o]
    group_t = torch.tensor(group, dtype=torch.long)
    a_t, b_t = torch.tensor(spans, dtype=torch.long).view(-1, 2).t().contiguous()
    if len(units.rows) == 1:
        work, need = _batched_cost(units, cp, len(candidates), group_t, a_t, b_t)  # [n_candidates, cp]
    else:
        counted = [needed_remote(RankRuns.build(cp, P, *_runs_of(c, cp, group_t, a_t, b_t)), units.rows)
                   for c in range(len(candidates))]
        work, need = (torch.stack(x) for x in zip(*counted))
    modeled = (work.double() + q * need.double()).max(1).values
    imbalance = work.double().max(1).values / target if target > 0 else torch.ones(len(candidates))
    score = modeled * (1 + IMBALANCE_WEIGHT * (imbalance - BALANCE_GOAL).clamp(min=0))
    best = int(torch.argmin(score))  # first of equals: contiguous, then zigzag, then the rest
    LAST_CHOICE[:] = [candidates[best][0]]
    return _runs_of(best, cp, group_t, a_t, b_t)


def _runs_of(c: int, cp: int, group: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> RunSpec:
    lo, hi = torch.searchsorted(group, torch.tensor([c * cp, (c + 1) * cp])).tolist()
    return group[lo:hi] - c * cp, a[lo:hi], b[lo:hi] - a[lo:hi]


def _split_width(units: "_Units", i: int, cp: int, theta: float, target: float) -> int:
    """Over how many ranks ``_split_and_pack`` splits unit i at ``theta`` (0: kept whole)."""
    n, w = units.end[i] - units.start[i], units.work[i]
    if n <= units.P // cp and w <= theta * target:
        return 0
    return min(cp, max(2, -(-n // (units.P // cp)), math.ceil(w / (min(theta, 1.0) * max(target, 1e-9)) - 1e-9)))


def _batched_cost(units: "_Units", cp: int, n_cand: int, group: torch.Tensor, a: torch.Tensor, b: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(work, needed) [n_candidates, cp] of every candidate at once; one row of doc ids.

    ``group`` = candidate * cp + rank of every range [a, b). A rank's pieces of
    one document need [document start, end of its last piece) minus what it
    owns: the plan's count (``intervals.needed_remote``), batched.
    """
    d_start, d_end, d_id = units.rows[0]
    which, doc, pa, pb = clip(a, b, d_start, d_end)
    real = d_id[doc] > 0
    which, doc, pa, pb = which[real], doc[real], pa[real], pb[real]
    g, s = group[which], d_start[doc]
    work = torch.zeros(n_cand * cp, dtype=torch.long).index_add_(0, g, (pa + pb - 2 * s + 1) * (pb - pa) // 2)
    key, inverse = torch.unique(g * d_start.numel() + doc, return_inverse=True)
    reach = torch.zeros(key.numel(), dtype=torch.long).scatter_reduce_(0, inverse, pb, "amax")
    own = torch.zeros(key.numel(), dtype=torch.long).index_add_(0, inverse, pb - pa)
    start = d_start[key % d_start.numel()]
    need = torch.zeros(n_cand * cp, dtype=torch.long).index_add_(0, key // d_start.numel(), reach - start - own)
    return work.view(n_cand, cp), need.view(n_cand, cp)


class _Ranks:
    """Per-rank owned ranges, free tokens and load (work + q * needed keys) while building."""

    def __init__(self, cp: int, L: int):
        self.owned: Owned = [[] for _ in range(cp)]
        self.room = [L] * cp
        self.load = [0.0] * cp

    def give(self, rank: int, a: int, b: int, cost: float) -> None:
        if b > a:
            self.owned[rank].append((a, b))
            self.room[rank] -= b - a
            self.load[rank] += cost

    def cut_in(self, spans: Sequence[Tuple[int, int]]) -> None:
        """Fill every rank's free tokens with these ranges in order, cutting where a rank is full."""
        rank = 0
        for a, b in spans:
            while a < b:
                while self.room[rank] == 0:
                    rank += 1
                take = min(self.room[rank], b - a)
                self.give(rank, a, a + take, 0.0)
                a += take
        assert all(x == 0 for x in self.room), self.room


def _split_and_pack(units: _Units, cp: int, theta: float, style: str, q: float) -> Owned:
    """Split heavy documents by ``style``, pack the rest whole, cut at multiples of L.

    1. A unit whose tokens exceed a rank's share, or whose work exceeds ``theta``
       of a rank's work share, is split over m ranks (``zigzag``: 2m chunks,
       rank i of m takes chunks i and 2m-1-i; ``chunks``: m contiguous chunks of
       equal compute plus received keys at q pairs per key; ``need``: zigzag over
       the fewest least loaded ranks whose missing work covers it).
    2. The other units, largest work first, go whole to the rank that keeps
       max(work / share, tokens / L) smallest.
    3. The ranks' units are laid end to end (largest first within a rank) and
       cut at exact multiples of L.
    """
    L = units.P // cp
    target = max(units.total / cp, 1e-9)
    ranks = _Ranks(cp, L)
    load, room = ranks.load, ranks.room
    whole = []
    for i in units.by_work:
        a, b, w = units.start[i], units.end[i], units.work[i]
        n = b - a
        share = max(target - min(load), 0.0) if style == "need" else target
        if units.alpha[i] == 0 or (n <= L and w <= theta * share):
            whole.append(i)
            continue
        if style == "need":
            needs = sorted(range(cp), key=lambda r: (load[r] - target, -room[r]))
            m, covered = 0, 0.0
            while m < cp and (m < 2 or covered < w or m * L < n):
                covered += max(target - load[needs[m]], 0.0)
                m += 1
            chosen = sorted(needs[:m], key=lambda r: load[r])
        else:
            m = min(cp, max(2, -(-n // L), math.ceil(w / (min(theta, 1.0) * target) - 1e-9)))
            chosen = sorted(sorted(range(cp), key=lambda r: (-room[r], load[r]))[:m], key=lambda r: load[r])
        if style == "chunks":
            pieces = _cost_chunks(units, i, m, q)
            # The most expensive-to-feed chunks (the last ones) go to the least loaded ranks.
            plan = list(zip(chosen, reversed(pieces or [])))
            if not plan or len(plan) < len(pieces) or any(room[r] < t - h for r, (h, t) in plan):
                whole.append(i)
                continue
            for rank, (h, t) in plan:
                ranks.give(rank, h, t, units.span(i, h, t))
            continue
        bounds = [a + (n * j) // (2 * m) for j in range(2 * m + 1)]
        pairs = [((bounds[k], bounds[k + 1]), (bounds[2 * m - 1 - k], bounds[2 * m - k])) for k in range(m)]
        if any(room[r] < (h[1] - h[0]) + (t[1] - t[0]) for r, (h, t) in zip(chosen, pairs)):
            whole.append(i)  # no room to split it: step 3 cuts it where it lands
            continue
        for rank, (head, tail) in zip(chosen, pairs):
            ranks.give(rank, *head, units.span(i, *head))
            ranks.give(rank, *tail, units.span(i, *tail))

    # Step 2: a heap on the current key (ties by rank) instead of a scan of every rank per unit.
    bins: List[List[int]] = [[] for _ in range(cp)]
    tokens = [L - r for r in room]
    work = list(load)
    heap = [(max(work[r] / target, tokens[r] / L), r) for r in range(cp)]
    heapq.heapify(heap)
    for i in whole:
        _, r = heapq.heappop(heap)
        bins[r].append(i)
        tokens[r] += units.end[i] - units.start[i]
        work[r] += units.work[i]
        heapq.heappush(heap, (max(work[r] / target, tokens[r] / L), r))
    ranks.cut_in((units.start[i], units.end[i]) for b in bins
                 for i in sorted(b, key=lambda i: units.start[i] - units.end[i]))
    return ranks.owned


def _cost_chunks(units: _Units, i: int, m: int, q: float) -> Optional[List[Tuple[int, int]]]:
    """m contiguous chunks of unit i whose work + q * (chunk start - unit start) is equal (bisection)."""
    a, b = units.start[i], units.end[i]

    def cut(budget: float) -> List[int]:
        bounds, x = [a], a
        for _ in range(m):
            if x >= b:
                break
            y = min(max(units.reach(i, x, budget - q * (x - a)), x + 1), b)
            bounds.append(y)
            x = y
        return bounds

    lo, hi = 0.0, units.work[i] + q * (b - a)
    for _ in range(20):  # budget to 1e-6 of its range: far below one token's work
        mid = (lo + hi) / 2
        if cut(mid)[-1] >= b:
            hi = mid
        else:
            lo = mid
    bounds = cut(hi)
    if bounds[-1] < b:
        return None
    return [(h, t) for h, t in zip(bounds[:-1], bounds[1:]) if t > h]


def _carve(units: _Units, cp: int, q: float, budget: float) -> Owned:
    """Heavy units cut from their end under a per-rank budget; light ones filled by density."""
    L = units.P // cp
    share = units.total / cp
    ranks = _Ranks(cp, L)
    load, room = ranks.load, ranks.room
    light = []
    for i in units.by_work:
        a, b, w = units.start[i], units.end[i], units.work[i]
        if units.alpha[i] == 0 or (b - a <= L and w <= share):
            light.append(i)
            continue
        # Owning a head position p (relative) costs its work, receiving it costs q: heads pay below q.
        head_limit = a + int(q / max(units.alpha[i], 1.0))
        h, e = a, b
        while h < e:
            r = max((r for r in range(cp) if room[r] > 0), key=lambda r: budget - load[r])
            spare = budget - load[r]
            if e - h <= room[r] and units.span(i, h, e) + q * (h - a) <= spare:
                ranks.give(r, h, e, units.span(i, h, e) + q * (h - a))
                break
            k = max(0, min(head_limit - h, room[r] // 2, e - h - 1))
            head = units.span(i, h, h + k)
            x_low = max(h + k, e - (room[r] - k))
            x = _tail_start(units, i, x_low, e, spare - head + q * k, q, a)
            if x is None:  # nothing fits the budget: a thin slice, the least bad choice
                x = max(x_low, e - max(1, (room[r] - k) // 8))
            cost = head + units.span(i, x, e) + q * (x - a - k)
            if k:
                ranks.give(r, h, h + k, 0.0)
            ranks.give(r, x, e, cost)
            h, e = h + k, x
    # Light units, densest first, to the rank with the most spare budget per free token.
    light.sort(key=lambda i: units.start[i] - units.end[i])
    heap = [(-(budget - load[r]) / room[r], r) for r in range(cp) if room[r] > 0]
    heapq.heapify(heap)
    rest = []
    for i in light:
        n = units.end[i] - units.start[i]
        stash, placed = [], False
        while heap and len(stash) < 4:
            _, r = heapq.heappop(heap)
            if room[r] >= n:
                ranks.give(r, units.start[i], units.end[i], units.work[i])
                if room[r] > 0:
                    heapq.heappush(heap, (-(budget - load[r]) / room[r], r))
                placed = True
                break
            stash.append(r)
        for r in stash:
            heapq.heappush(heap, (-(budget - load[r]) / room[r], r))
        if not placed:
            rest.append((units.start[i], units.end[i]))
    ranks.cut_in(rest)
    return ranks.owned


def _tail_start(units: _Units, i: int, x_low: int, e: int, spare: float, q: float, a: int) -> Optional[int]:
    """Smallest x in [x_low, e) with span(i, x, e) + q * (x - a) <= spare, or None.

    The cost is concave in x (work falls, received keys grow): once it dips
    under the budget past its peak it stays there, so a bisection finds the edge.
    """
    def cost(x: int) -> float:
        return units.span(i, x, e) + q * (x - a)

    if x_low >= e:
        return None
    if cost(x_low) <= spare:
        return x_low
    if cost(e - 1) > spare:
        return None
    lo, hi = x_low, e - 1  # cost(lo) > spare >= cost(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost(mid) <= spare:
            hi = mid
        else:
            lo = mid
    return hi


__all__ = ["balanced_runs", "BALANCE_GOAL", "SPLIT_THRESHOLDS", "CARVE_BUDGETS"]
