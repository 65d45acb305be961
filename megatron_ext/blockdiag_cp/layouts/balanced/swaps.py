"""Equal-length range swaps: a local search that unloads a layout's busiest rank.

Every rank owns the same number of tokens; swapping two ranges of one length
between two ranks keeps that, and moves work (and keys) between them:

    rank A (busiest)   ...[ x: n tokens ]......[ a1 ]...      A gives x to B
    rank B             ..[ b0 ]...[ y: n tokens ]......       B gives y to A

x is a prefix or a suffix of one of A's ranges, y of one of B's, and n the
shorter of the two ranges, so one of them moves whole (``halvings``: also every
power of two below it, so that two long ranges trade a part: a node layout of a
few long spans); A and B share a group (a node: a swap never moves keys' owners
across nodes). A round estimates every swap off A at once by the work it moves
(``RangeWork``, closed form; the keys taken as they were), scores each peer's
best estimate with the caller's scorer (keys included), and takes the best of
those if it lowers the busiest rank (or keeps it and lowers the second busiest:
ties move on). With at most ``score_all`` swaps off A, the scorer scores every
one instead: a swap that moves more work onto A can still lower it, by cutting a
document where fewer of its keys cross (the estimate would drop it). The search
ends when none helps or the caller's rounds run out; A is always the busiest
rank of the whole group, so the rank that sets the step's time is the one
worked on.

The balanced search runs it (``nodes``) on the two-level search's result, every
node scored by the search's own count (work + keys), and over the nodes of its
best node layouts, each node one rank of the node-level count.
"""

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ...intervals import expand_np
from .tuning import DEFAULT_TUNING

Owned = List[List[Tuple[int, int]]]  # per rank, the [a, b) ranges it owns
TOLERANCE = 1e-12  # relative: a swap must lower a score by more than rounding
# (candidates, the two ranks each one changed, the scores before them) -> [n, cp] per-rank scores in
# work units; (the start, None, None): score every rank. A scorer may score only what changed.
Scorer = Callable[[Sequence[Owned], Optional[Sequence[Tuple[int, int]]], Optional[np.ndarray]], np.ndarray]


class RangeWork:
    """Causal work of any range of positions, from document runs (one row, full attention).

    ``starts``, ``alpha``, ``beta``: per run on which no row changes document; positions p of a run
    weigh alpha * p + beta (``units.UnitTable``), so a run's prefix has a closed form.
    """

    def __init__(self, starts: np.ndarray, alpha: np.ndarray, beta: np.ndarray, P: int):
        self.starts, self.alpha, self.beta = starts.astype(np.int64), alpha.astype(np.float64), beta.astype(np.float64)
        ends = np.append(self.starts[1:], P)
        self.cum = np.concatenate([[0.0], np.cumsum(self._head(ends, np.arange(self.starts.size)))])

    def _head(self, x: np.ndarray, unit: np.ndarray) -> np.ndarray:
        s = self.starts[unit]
        return self.alpha[unit] * (x * (x - 1) - s * (s - 1)) / 2 + self.beta[unit] * (x - s)

    def before(self, x: np.ndarray) -> np.ndarray:
        """Work of positions [0, x)."""
        x = np.asarray(x, dtype=np.int64)
        unit = np.searchsorted(self.starts, x, side="right") - 1
        return self.cum[unit] + self._head(x, unit)

    def of(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.before(b) - self.before(a)


def merged_spans(spans: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """Sorted, touching ranges merged, empty ones dropped."""
    out: List[Tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return out


class RangeSwaps:
    """One layout's search (see the module docstring); the scorer counts in ``range_work``'s units.

    ``peers``: at most this many peers of the busiest rank a round scores (the best swap with each),
    best estimates first.
    """

    def __init__(self, owned: Owned, score: Scorer, range_work: RangeWork, group: int = 0,
                 halvings: bool = False, score_all: int = 0, max_pairs: int = 0,
                 peers: int = DEFAULT_TUNING.swap_peers):
        self.owned = [merged_spans(o) for o in owned]
        self.score, self.range_work = score, range_work
        self.group = group or len(self.owned)  # swaps stay inside groups of this many ranks (nodes)
        self.halvings, self.score_all, self.max_pairs, self.peers = halvings, score_all, max_pairs, peers
        self.total = score([self.owned], None, None)[0]  # [cp]
        self.done = len(self.owned) < 2
        self.swaps = 0

    def _options(self, A: int):
        """Every swap off rank A: arrays (B, index of A's range, of B's range, x start, y start, n)."""
        mine = self.owned[A]
        lo = A // self.group * self.group
        others = [(r, k, a, b) for r in range(lo, lo + self.group) if r != A for k, (a, b) in enumerate(self.owned[r])]
        if not mine or not others or 0 < self.max_pairs < len(mine) * len(others):
            return None
        ma = np.array([a for a, _ in mine], dtype=np.int64)
        mb = np.array([b for _, b in mine], dtype=np.int64)
        ob = np.array(others, dtype=np.int64)  # [m, 4]: rank, index, a, b
        i, j = (x.ravel() for x in np.meshgrid(np.arange(ma.size), np.arange(ob.shape[0]), indexing="ij"))
        n = np.minimum(mb[i] - ma[i], ob[j, 3] - ob[j, 2])
        if self.halvings:  # also 2^k < n (k >= 0) for every pair of ranges
            top = np.floor(np.log2(np.maximum(n - 1, 1))).astype(np.int64) + (n > 1)  # 2^k < n: k < top
            pair, k = expand_np(np.zeros_like(top), top + 1)  # k = 0 .. top per pair; k = top: n itself
            i, j, n = i[pair], j[pair], np.where(k == top[pair], n[pair], 1 << k)
        # x: A's prefix or suffix, y: B's prefix or suffix (one choice when a range moves whole).
        xs = np.concatenate([ma[i], mb[i] - n, ma[i], mb[i] - n])
        ys = np.concatenate([ob[j, 2], ob[j, 2], ob[j, 3] - n, ob[j, 3] - n])
        rep = lambda v: np.tile(v, 4)  # noqa: E731
        ii, jj, nn = rep(i), rep(j), rep(n)
        whole_x, whole_y = nn == mb[ii] - ma[ii], nn == ob[jj, 3] - ob[jj, 2]
        block = np.repeat(np.arange(4), i.size)
        keep = ~((whole_x & (block % 2 == 1)) | (whole_y & (block >= 2)))
        return ob[jj, 0][keep], ii[keep], ob[jj, 1][keep], xs[keep], ys[keep], nn[keep]

    def _apply(self, A: int, B: int, ia: int, ib: int, x: int, y: int, n: int) -> Owned:
        owned = list(self.owned)
        a0, a1 = self.owned[A][ia]
        b0, b1 = self.owned[B][ib]
        keep_a = [r for k, r in enumerate(self.owned[A]) if k != ia]
        keep_b = [r for k, r in enumerate(self.owned[B]) if k != ib]
        owned[A] = merged_spans(keep_a + [(a0, x), (x + n, a1), (y, y + n)])
        owned[B] = merged_spans(keep_b + [(b0, y), (y + n, b1), (x, x + n)])
        return owned

    def step(self) -> bool:
        """One round; False (and done) when no shortlisted swap lowers the busiest ranks."""
        if self.done:
            return False
        A = int(np.argmax(self.total))
        options = self._options(A)
        if options is None:
            self.done = True
            return False
        B, ia, ib, x, y, n = options
        if B.size <= self.score_all:
            order = np.arange(B.size)
        else:
            moved = self.range_work.of(y, y + n) - self.range_work.of(x, x + n)  # what A gains
            estimate = np.maximum(self.total[A] + moved, self.total[B] - moved)
            ranked = np.argsort(estimate, kind="stable")
            # Each peer's best swap (its first place in ``ranked``), the ``peers`` best of those.
            order = ranked[np.sort(np.unique(B[ranked], return_index=True)[1])[:self.peers]]
            order = order[estimate[order] < self.total[A]]
        if order.size == 0:
            self.done = True
            return False
        cands = [self._apply(A, int(B[k]), int(ia[k]), int(ib[k]), int(x[k]), int(y[k]), int(n[k])) for k in order]
        scores = self.score(cands, [(A, int(B[k])) for k in order], self.total)  # [k, cp]

        top = -np.sort(-scores, axis=1)[:, :2]  # [k, 2]: busiest, second busiest
        now = -np.sort(-self.total)[:2]
        best = int(np.lexsort((top[:, 1], top[:, 0]))[0])
        lower = top[best, 0] < now[0] * (1 - TOLERANCE)
        if not (lower or (top[best, 0] <= now[0] * (1 + TOLERANCE) and top[best, 1] < now[1] * (1 - TOLERANCE))):
            self.done = True
            return False
        self.owned, self.total = cands[best], scores[best]
        self.swaps += 1
        return True


__all__ = ["RangeSwaps", "RangeWork", "merged_spans"]
