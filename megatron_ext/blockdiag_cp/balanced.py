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
  carry an expensive tail are filled with short documents (tried only where the
  longest split document's keys cost a quarter of a rank's share).

Choice: the least modeled time, except that a candidate within BALANCE_GOAL
(work max/mean) wins if it costs at most BALANCE_PRICE more and is no worse
than contiguous or zigzag: at a few thousand tokens per rank the model calls
balancing dearer than the keys it moves, and an unbalanced attention also
idles the token-balanced rest of the layer, which the model leaves out.

Work of a run [x, y) inside a unit (a range on which no row changes document)
is alpha * sum(p) + beta * (y - x) over p in [x, y): alpha real rows, beta the
sum over them of 1 - document start. One row: alpha = 1, beta = 1 - start.
"""

import heapq
import math
from itertools import chain
from typing import List, Optional, Sequence, Tuple

import torch

from .cost import CostModel
from .intervals import RankRuns, clip, document_runs, needed_remote

RunSpec = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rank, start, length) of owned ranges
Owned = List[List[Tuple[int, int]]]  # per rank, the [a, b) ranges it owns

BALANCE_GOAL = 1.05
# Split thresholds (fraction of a rank's work share a document may carry whole).
SPLIT_THRESHOLDS = (math.inf, 1.0, 0.75, 0.5, 0.35, 0.25)
# Equal-cost chunks over many ranks (small thresholds) cost the most to build and next to never win.
CHUNKS_MIN_THRESHOLD = 1.0
# Carving trades work balance for fewer received keys: only tried when receiving the longest split
# unit's keys costs at least this fraction of a rank's work share (below, zigzag pairs do as well).
CARVE_MIN_TRAFFIC = 0.25
# Carve budgets, in multiples of the ideal per-rank work.
CARVE_BUDGETS = (1.05, 1.15, 1.3, 1.5, 1.75, 2.1)
# ... and the filler density they reserve, in multiples of the light units' mean work per token.
CARVE_FILLERS = (0.5,)
# ... then around the best budget, these fillers too.
CARVE_REFINE = (1.0, 0.0)
# Candidates whose modeled time is within this fraction of the best count as ties, broken by work
# balance (the rest of the layer is token-balanced; imbalance is a preference, not a cost here).
TIE = 0.005
# Work balance within BALANCE_GOAL is worth this much modeled time: attention imbalance also idles the
# token-balanced rest of the layer on the other ranks, which the attention-only model does not see.
BALANCE_PRICE = 0.2
LAST_CHOICE: List[str] = []  # the label of the last candidate chosen (benchmarks and tests read it)


class _Units:
    """What the candidates place: ranges on which no row changes document, with their work
    coefficients (Python lists); runs of consecutive tiny documents are bundled into one
    unit of at most L / 32 tokens (never split, so the search loops over fewer units)."""

    def __init__(self, ids: torch.Tensor, cp: int):
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
        self.total = float(work.sum())
        self.start, self.end = [], []
        self.alpha, self.beta, self.work, self.bundle = [], [], [], []
        cap = max(1, P // cp // 32)
        for a, b, al, be, w in zip(starts.tolist(), ends.tolist(), alpha.tolist(), beta.tolist(), work.tolist()):
            tiny = al > 0 and b - a <= cap
            if tiny and self.bundle and self.bundle[-1] and self.end[-1] == a and b - self.start[-1] <= cap:
                self.end[-1] = b
                self.work[-1] += w
                continue
            self.start.append(a)
            self.end.append(b)
            self.alpha.append(al)
            self.beta.append(be)
            self.work.append(w)
            self.bundle.append(tiny)
        self.by_work = sorted(range(len(self.start)), key=lambda i: -self.work[i])

    def light(self, i: int, limit: float, L: int) -> bool:
        """Placed whole: padding, a bundle, or at most L tokens and ``limit`` work."""
        return self.alpha[i] == 0 or self.bundle[i] or (self.end[i] - self.start[i] <= L and self.work[i] <= limit)

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
    units = _Units(ids, cp)
    P = units.P
    L = P // cp
    q = cost_model.positions_per_pair
    candidates: List[Tuple[str, Owned]] = [("contiguous", [[(r * L, (r + 1) * L)] for r in range(cp)])]
    if P % (2 * cp) == 0:
        half = P // (2 * cp)
        candidates.append(("zigzag", [[(r * half, (r + 1) * half), ((2 * cp - 1 - r) * half, (2 * cp - r) * half)]
                                      for r in range(cp)]))
    n_peers = len(candidates)  # contiguous (and zigzag): the result is never worse than these
    target = units.total / cp
    heavy = [i for i in units.by_work if not units.light(i, min(SPLIT_THRESHOLDS) * target, L)]
    if heavy:
        seen = set()  # step-1 splits already packed
        for theta in SPLIT_THRESHOLDS:
            for style in ("zigzag", "chunks", "need"):
                if style == "chunks" and theta < CHUNKS_MIN_THRESHOLD:
                    continue
                packed = _split_and_pack(units, cp, theta, style, q, seen)
                if packed is not None:
                    candidates += [(f"{style}@{theta}", packed[0]), (f"{style}@{theta}/strict", packed[1])]
        if q * max(units.end[i] - units.start[i] for i in heavy) >= CARVE_MIN_TRAFFIC * target:
            candidates += _carve_candidates(units, cp, q, target)
    else:  # nothing worth splitting: one packing
        stream, strict = _split_and_pack(units, cp, math.inf, "zigzag", q)
        candidates += [("pack", stream), ("pack/strict", strict)]

    n_cand, group_t, a_t, b_t = _flatten([owned for _, owned in candidates], cp)
    if len(units.rows) == 1:
        work, need = _batched_cost(units, cp, n_cand, group_t, a_t, b_t)  # [n_candidates, cp]
    else:
        counted = [needed_remote(RankRuns.build(cp, P, *_runs_of(c, cp, group_t, a_t, b_t)), units.rows)
                   for c in range(len(candidates))]
        work, need = (torch.stack(x) for x in zip(*counted))
    modeled = (work.double() + q * need.double()).max(1).values
    imbalance = work.double().max(1).values / max(target, 1e-9)
    # The least modeled time among candidates within BALANCE_GOAL whose modeled time is at most
    # BALANCE_PRICE above the best and no worse than contiguous or zigzag (candidates 0 and 1);
    # if none, the least modeled time (near-ties: the best balance).
    inf = torch.full_like(modeled, math.inf)
    limit = torch.minimum(modeled.min() * (1 + BALANCE_PRICE), modeled[:n_peers].min())
    goal = (imbalance <= BALANCE_GOAL + 1e-12) & (modeled <= limit)
    if bool(goal.any()):
        best = int(torch.argmin(torch.where(goal, modeled, inf)))
    else:
        near = modeled <= modeled.min() * (1 + TIE)
        best = int(torch.argmin(torch.where(near, imbalance, inf)))
    LAST_CHOICE[:] = [candidates[best][0]]
    return _runs_of(best, cp, group_t, a_t, b_t)


def _carve_candidates(units: "_Units", cp: int, q: float, target: float) -> List[Tuple[str, Owned]]:
    """Carve at every budget (half the light filler reserved), then the best budget with other reserves."""
    filler = _light_density(units, cp)
    f0 = CARVE_FILLERS[0]
    carved = [(f"carve@{mult}/{f0}", _carve(units, cp, q, mult * target, f0 * filler)) for mult in CARVE_BUDGETS]
    best_mult = CARVE_BUDGETS[0]
    if len(units.rows) == 1:
        work, need = _batched_cost(units, cp, *_flatten([o for _, o in carved], cp))
        best_mult = CARVE_BUDGETS[int(torch.argmin((work.double() + q * need.double()).max(1).values))]
    return carved + [(f"carve@{best_mult}/{f}", _carve(units, cp, q, best_mult * target, f * filler))
                     for f in CARVE_REFINE]


def _light_density(units: "_Units", cp: int) -> float:
    """Mean work per token of the units a rank can hold whole (the filler of carved ranks)."""
    L, share = units.P // cp, units.total / cp
    light = [i for i in range(len(units.start)) if units.light(i, share, L)]
    tokens = sum(units.end[i] - units.start[i] for i in light)
    return sum(units.work[i] for i in light) / tokens if tokens else 0.0


def _flatten(owned_lists: Sequence[Owned], cp: int) -> Tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every candidate's ranges as flat tensors, candidate-major: (count, candidate * cp + rank, a, b)."""
    per_rank = [spans for owned in owned_lists for spans in owned]
    group = torch.repeat_interleave(torch.arange(len(per_rank)), torch.tensor([len(x) for x in per_rank]))
    a, b = torch.tensor(list(chain.from_iterable(chain.from_iterable(per_rank))), dtype=torch.long).view(-1, 2).t()
    return len(owned_lists), group, a.contiguous(), b.contiguous()


def _runs_of(c: int, cp: int, group: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> RunSpec:
    lo, hi = torch.searchsorted(group, torch.tensor([c * cp, (c + 1) * cp])).tolist()
    return group[lo:hi] - c * cp, a[lo:hi], b[lo:hi] - a[lo:hi]


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

    def copy(self) -> "_Ranks":
        other = _Ranks(len(self.room), 0)
        other.owned = [list(o) for o in self.owned]
        other.room, other.load = list(self.room), list(self.load)
        return other

    def give(self, rank: int, a: int, b: int, cost: float) -> None:
        if b > a:
            self.owned[rank].append((a, b))
            self.room[rank] -= b - a
            self.load[rank] += cost

    def cut_in(self, spans: Sequence[Tuple[int, int]], order: Optional[Sequence[int]] = None) -> None:
        """Fill the ranks' free tokens (ranks in ``order``) with these ranges, cutting where one is full."""
        order = list(range(len(self.room))) if order is None else list(order)
        k = 0
        for a, b in spans:
            while a < b:
                while self.room[order[k]] == 0:
                    k += 1
                take = min(self.room[order[k]], b - a)
                self.give(order[k], a, a + take, 0.0)
                a += take
        assert all(x == 0 for x in self.room), self.room


def _split_and_pack(units: _Units, cp: int, theta: float, style: str, q: float,
                    seen: Optional[set] = None) -> Optional[Tuple[Owned, Owned]]:
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
    Also returned: 2-3 done strictly (each unit whole to the least loaded rank
    it fits in; those that fit nowhere cut into the least loaded free tokens).
    None when step 1 split exactly as a call with the same ``seen`` set did.
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
        if units.light(i, theta * share, L):
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

    if seen is not None:
        key = tuple(tuple(o) for o in ranks.owned)
        if key in seen:
            return None
        seen.add(key)
    # Step 2, two ways: whole units strictly where they fit (the rest cut in), or binned and streamed.
    strict = ranks.copy()
    _fill(strict, units, whole, key=lambda r: strict.load[r])
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
    return ranks.owned, strict.owned


def _fill(ranks: "_Ranks", units: "_Units", order: Sequence[int], key, cut_in_key_order: bool = True) -> None:
    """Whole units in ``order`` to the rank with the smallest ``key`` that has room; the rest cut in
    (into the ranks by ``key``, or in rank order)."""
    room = ranks.room
    heap = [(key(r), r) for r in range(len(room)) if room[r] > 0]
    heapq.heapify(heap)
    rest = []
    for i in order:
        n = units.end[i] - units.start[i]
        stash, placed = [], False
        while heap and len(stash) < 4:
            _, r = heapq.heappop(heap)
            if room[r] >= n:
                ranks.give(r, units.start[i], units.end[i], units.work[i])
                if room[r] > 0:
                    heapq.heappush(heap, (key(r), r))
                placed = True
                break
            stash.append(r)
        for r in stash:
            heapq.heappush(heap, (key(r), r))
        if not placed:
            rest.append((units.start[i], units.end[i]))
    if cut_in_key_order:
        ranks.cut_in(rest, order=sorted(range(len(room)), key=key))
    else:
        ranks.cut_in(rest)


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


def _carve(units: _Units, cp: int, q: float, budget: float, filler: float) -> Owned:
    """Heavy units cut from their end under a per-rank budget; light ones filled by density.

    ``filler``: the work per token the light units will add to a rank's free
    tokens, so a tail leaves room in the budget for what fills its rank. A rank
    that already holds a later piece of the unit needs its earlier keys anyway:
    another piece there saves q per token instead of costing q per key.
    """
    L = units.P // cp
    share = units.total / cp
    ranks = _Ranks(cp, L)
    load, room = ranks.load, ranks.room
    light = []
    for i in units.by_work:
        a, b = units.start[i], units.end[i]
        if units.light(i, share, L):
            light.append(i)
            continue
        # Owning a head position p (relative) costs its work, receiving it costs q: heads pay below q.
        head_limit = a + int(q / max(units.alpha[i], 1.0))
        holds = [False] * cp  # holds a later piece of this unit (and so needs everything before it)
        h, e = a, b
        while h < e:
            r = max((r for r in range(cp) if room[r] > 0), key=lambda r: budget - load[r] - filler * room[r])
            spare = budget - load[r] - filler * room[r]
            if holds[r]:
                # [x, e) saves its keys: span(x, e) - (q + filler) * (e - x) <= spare
                x_low = max(h, e - room[r])
                x = _tail_start(units, i, x_low, e, spare + (q + filler) * e, q + filler)
                if x is None:  # over budget anyway: all its room (each token saves a key)
                    x = x_low
                ranks.give(r, x, e, units.span(i, x, e) - q * (e - x))
                e = x
                continue
            whole = units.span(i, h, e) + q * (h - a)
            if e - h <= room[r] and whole - filler * (e - h) <= spare:
                ranks.give(r, h, e, whole)
                break
            k = max(0, min(head_limit - h, room[r] // 2, e - h - 1))
            head = units.span(i, h, h + k)
            x_low = max(h + k, e - (room[r] - k))
            # tail [x, e): span + q * (x - a - k) - filler * (k + e - x) <= spare - head
            limit = spare - head + q * (a + k) + filler * (k + e)
            x = _tail_start(units, i, x_low, e, limit, q + filler)
            if x is None:  # nothing fits the budget: a thin slice, the least bad choice
                x = max(x_low, e - max(1, (room[r] - k) // 4))
            if k:
                ranks.give(r, h, h + k, head)
            ranks.give(r, x, e, units.span(i, x, e) + q * (x - a - k))
            holds[r] = True
            h, e = h + k, x
    # Light units, densest first, to the rank with the most spare budget per free token.
    light.sort(key=lambda i: units.start[i] - units.end[i])
    _fill(ranks, units, light, key=lambda r: -(budget - load[r]) / room[r], cut_in_key_order=False)
    return ranks.owned


def _tail_start(units: _Units, i: int, x_low: int, e: int, limit: float, slope: float) -> Optional[int]:
    """Smallest x in [x_low, e) with span(i, x, e) + slope * x <= limit, or None.

    Concave in x (work falls as x grows, the linear term rises): once under the
    limit past its peak it stays there, so a bisection finds the edge.
    """
    def cost(x: int) -> float:
        return units.span(i, x, e) + slope * x

    if x_low >= e:
        return None
    if cost(x_low) <= limit:
        return x_low
    if cost(e - 1) > limit:
        return None
    lo, hi = x_low, e - 1  # cost(lo) > limit >= cost(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost(mid) <= limit:
            hi = mid
        else:
            lo = mid
    return hi


__all__ = ["balanced_runs", "BALANCE_GOAL", "SPLIT_THRESHOLDS", "CARVE_BUDGETS"]
