"""One search: every candidate laying a set of spans out over cp ranks, scored, and the choice rules."""

import bisect
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..base import RunSpec
from .packing import pack, pack_lockstep, split_heavy
from .traffic import NodeExchange, score_many
from .tuning import BalancedTuning
from .units import Owned, Spans, Units, UnitTable


class Candidates:
    """A search's candidates, flattened (``flatten_np``), with their modeled cost and work balance
    (numpy: a handful of small reductions, where torch's dispatch per op cost more)."""

    def __init__(self, labels, n_cand, group, a, b, cp, modeled, imbalance, n_peers, tuning: BalancedTuning):
        self.labels, self.n_cand, self.group, self.a, self.b, self.cp = labels, n_cand, group, a, b, cp
        self.modeled, self.imbalance, self.n_peers, self.tuning = modeled, imbalance, n_peers, tuning

    def choose(self) -> int:
        return choose(self.modeled, self.imbalance, self.n_peers, self.tuning)

    def cheapest(self) -> int:
        """The least modeled cost, near-ties (``tuning.tie``) broken by work balance."""
        near = self.modeled <= self.modeled.min() * (1 + self.tuning.tie)
        return int(np.argmin(np.where(near, self.imbalance, math.inf)))

    def order(self) -> List[int]:
        """Candidates best first: the cheapest, then by modeled cost."""
        best = self.cheapest()
        rest = [c for c in np.argsort(self.modeled, kind="stable").tolist() if c != best]
        return [best] + rest

    def runs(self, c: int) -> RunSpec:
        return tuple(torch.from_numpy(x) for x in self._runs_np(c))

    def _runs_np(self, c: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo, hi = np.searchsorted(self.group, [c * self.cp, (c + 1) * self.cp]).tolist()
        return self.group[lo:hi] - c * self.cp, self.a[lo:hi], self.b[lo:hi] - self.a[lo:hi]

    def owned(self, c: int) -> Owned:
        rank, start, length = self._runs_np(c)
        out: Owned = [[] for _ in range(self.cp)]
        for r, s, n in zip(rank.tolist(), start.tolist(), length.tolist()):
            out[r].append((s, s + n))
        return out


def choose(modeled: np.ndarray, imbalance: np.ndarray, n_peers: int, tuning: BalancedTuning) -> int:
    """The least modeled time among candidates within ``tuning.balance_goal`` whose modeled time is at
    most ``tuning.balance_price`` above the best and no worse than the peers (the first ``n_peers``: contiguous and
    zigzag); if none, the least modeled time (near-ties no worse than the peers: the best balance)."""
    peers = float(modeled[:n_peers].min())
    limit = min(float(modeled.min()) * (1 + tuning.balance_price), peers)
    goal = (imbalance <= tuning.balance_goal + 1e-12) & (modeled <= limit)
    if goal.any():
        return int(np.argmin(np.where(goal, modeled, math.inf)))
    # Near-ties, but never worse than a peer: a better balance does not buy modeled time.
    near = (modeled <= modeled.min() * (1 + tuning.tie)) & (modeled <= peers)
    return int(np.argmin(np.where(near, imbalance, math.inf)))


def find_candidates(table: UnitTable, spans: Spans, cp: int, q: float, tuning: BalancedTuning, bundle: int = 0,
                    thresholds: Optional[Sequence[float]] = None) -> Candidates:
    """Every candidate laying ``spans`` out over ``cp`` ranks, scored by work + q * max(in, out).

    ``bundle``: the most tokens a bundle of tiny documents holds (default: ``tuning.bundle_fraction``
    of a rank's share); ``thresholds``: the zigzag splits' (default: ``tuning.split_thresholds``).
    """
    return find_candidates_many(table, [spans], cp, q, tuning, bundle, thresholds)[0]


def find_candidates_many(table: UnitTable, many: Sequence[Spans], cp: int, q: float, tuning: BalancedTuning,
                         bundle: int = 0, thresholds: Optional[Sequence[float]] = None,
                         exchange: Optional[NodeExchange] = None) -> List[Candidates]:
    """``find_candidates`` for several independent span sets (a group's nodes), each over its own ``cp``
    ranks; all candidates are scored together (one batched count instead of one per span set).
    ``exchange``: span set n is node n of that node layout, its ranks' IB time is scored too."""
    thresholds = tuning.split_thresholds if thresholds is None else thresholds
    units = [Units(table, spans, cp, bundle, tuning.bundle_fraction) for spans in many]
    cands, n_peers = [], []
    jobs = []  # (search, label, units, ranks after step 1, units left whole) per packing
    for spans, u in zip(many, units):
        L = u.tokens // cp
        c: List[Tuple[str, Owned]] = [("contiguous", _cut(spans, [(r * L, (r + 1) * L) for r in range(cp)]))]
        if L % 2 == 0:
            half = L // 2
            c.append(("zigzag", _cut(spans, [(r * half, (r + 1) * half) for r in range(cp)],
                                     [((2 * cp - 1 - r) * half, (2 * cp - r) * half) for r in range(cp)])))
        n_peers.append(len(c))  # contiguous (and zigzag): the result is never worse than these
        if exchange is not None and L % 2 == 0:
            half = L // 2
            c.append(("striped", _cut(spans, [(r * half, (r + 1) * half) for r in range(cp)],
                                      [((cp + r) * half, (cp + r + 1) * half) for r in range(cp)])))
        target = u.total / cp
        k = len(cands)
        if u.heavy(min(thresholds) * target, L):
            seen = set()  # step-1 splits already packed
            splits = [(f"{style}@{theta}", split_heavy(u, cp, theta, style, seen))
                      for style, ts in (("zigzag", thresholds), ("need", tuning.need_thresholds)) for theta in ts]
            jobs += [(k, label, u, *split) for label, split in splits if split is not None]
        else:  # nothing worth splitting: one packing
            jobs.append((k, "pack", u, *split_heavy(u, cp, math.inf, "zigzag")))
        cands.append(c)
    # Steps 2-3 of every packing: in lockstep when there are many (a group's nodes at every threshold).
    if sum(len(whole) for *_, whole in jobs) >= tuning.lockstep_width * max(len(whole) for *_, whole in jobs):
        packed = pack_lockstep([(u, ranks, whole) for _, _, u, ranks, whole in jobs], cp)
    else:
        packed = [pack(u, ranks, whole) for _, _, u, ranks, whole in jobs]
    for (k, label, *_), (stream, strict) in zip(jobs, packed):
        cands[k] += [(label, stream), (f"{label}/strict", strict)]
    costs = score_many(units[0], cp, q, cands, exchange)
    return [Candidates([label for label, _ in c], *cost[2], cp, cost[0], cost[1], n, tuning)
            for c, cost, n in zip(cands, costs, n_peers)]


def _cut(spans: Spans, *parts: Sequence[Tuple[int, int]]) -> Owned:
    """Per rank, the global ranges of offsets [x, y) into the concatenation of ``spans`` (one list of
    offset ranges per argument, rank-indexed)."""
    starts = [0]
    for a, b in spans:
        starts.append(starts[-1] + b - a)
    owned: Owned = [[] for _ in range(len(parts[0]))]
    for per_rank in parts:
        for r, (x, y) in enumerate(per_rank):
            k = max(0, bisect.bisect_right(starts, x) - 1)
            while x < y:
                a, b = spans[k]
                take = min(y, starts[k + 1]) - x
                if take > 0:
                    owned[r].append((a + x - starts[k], a + x - starts[k] + take))
                    x += take
                k += 1
    return owned
