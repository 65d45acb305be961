"""Who owns which global positions: one small strategy class per layout.

A layout maps the padded sequence [0, P) onto ``cp`` ranks, every rank owning
exactly ``P / cp`` positions, each rank's positions sorted ascending (its local
order). Sorting keeps every document's local queries adjacent in local order,
which is what the plan's varlen segments rely on.

``build_layout(name, doc_ids, cp)`` picks the strategy by (normalized) name;
every strategy is a pure function of the padded doc ids, so every rank computes
the same layout without communication.
"""

import heapq
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Tuple

import torch

from .cost import CostModel, resolve_cost_model
from .intervals import RankRuns, document_runs, needed_remote
from .state import normalize_layout


RunSpec = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rank, start, length) of owned ranges


def layout_granularity(layout: str, cp: int) -> int:
    """The padded length must be a multiple of this (1 for a single rank: no padding)."""
    return LAYOUT_STRATEGIES[normalize_layout(layout)].granularity(cp)


def padded_length(seq_len: int, layout: str, cp: int) -> int:
    g = layout_granularity(layout, cp)
    return max(g, -(-seq_len // g) * g)


@dataclass(frozen=True)
class Layout:
    """Who owns what, as runs (``intervals.RankRuns``); positions are built only when asked."""

    name: str
    cp: int
    padded_len: int
    runs: RankRuns

    @property
    def local_len(self) -> int:
        return self.padded_len // self.cp

    @cached_property
    def positions(self) -> torch.Tensor:
        """[cp, local_len] int64, each row ascending."""
        return self.runs.positions()

    def rank_positions(self, rank: int) -> torch.Tensor:
        """[local_len] the global positions ``rank`` owns, ascending (without building the others)."""
        if "positions" in self.__dict__:
            return self.positions[rank]
        return self.runs.positions(rank)

    def owner(self) -> torch.Tensor:
        """[P] rank that owns each global position."""
        owner = torch.empty(self.padded_len, dtype=torch.long)
        owner[self.positions.reshape(-1)] = torch.arange(self.cp).repeat_interleave(self.local_len)
        return owner

    def local_index(self) -> torch.Tensor:
        """[P] index of each global position inside its owner's local order."""
        index = torch.empty(self.padded_len, dtype=torch.long)
        index[self.positions.reshape(-1)] = torch.arange(self.local_len).repeat(self.cp)
        return index


def build_layout(name: str, doc_ids: torch.Tensor, cp: int,
                 cost_model: Optional[CostModel] = None) -> Layout:
    """doc_ids: [b, P] int64 already padded to the layout's granularity.

    ``cost_model`` only steers ``balanced`` (default: ``cost.default_cost_model()``).
    """
    name = normalize_layout(name)
    strategy = LAYOUT_STRATEGIES[name]
    ids = doc_ids.reshape(-1, doc_ids.shape[-1])
    padded = ids.shape[-1]
    if padded % strategy.granularity(cp) != 0:
        raise ValueError(f"layout {name!r} at cp={cp} needs a padded length that is a multiple of "
                         f"{strategy.granularity(cp)}, got {padded}; pad with padded_length()")
    if cp == 1:
        rank, start, length = [0], [0], [padded]
    else:
        rank, start, length = strategy.runs(ids, cp, cost_model)
    return Layout(name=name, cp=cp, padded_len=padded, runs=RankRuns.build(cp, padded, rank, start, length))


class LayoutStrategy:
    """One way of cutting [0, P) into cp equal shares (subclasses draw theirs)."""

    name = ""

    @staticmethod
    def granularity(cp: int) -> int:
        return cp

    def runs(self, doc_ids: torch.Tensor, cp: int, cost_model: Optional[CostModel]) -> RunSpec:
        """(rank, start, length) of the ranges each rank owns (any order; touching ones merge)."""
        raise NotImplementedError


class ContiguousLayout(LayoutStrategy):
    """Rank r owns the r-th contiguous block.

    cp = 4, P = 16:   | 0 0 0 0 | 1 1 1 1 | 2 2 2 2 | 3 3 3 3 |

    Causal work grows towards the end: the last rank does the most.
    """

    name = "contiguous"

    def runs(self, doc_ids, cp, cost_model):
        L = doc_ids.shape[-1] // cp
        return torch.arange(cp), torch.arange(cp) * L, torch.full((cp,), L)


class ZigzagLayout(LayoutStrategy):
    """megatron-core's get_batch_on_this_cp_rank: 2*cp chunks, rank r owns r and 2*cp-1-r.

    cp = 4, P = 16:   | 0 0 | 1 1 | 2 2 | 3 3 | 3 3 | 2 2 | 1 1 | 0 0 |

    Balanced for one causal document; blind to document boundaries.
    """

    name = "zigzag"

    @staticmethod
    def granularity(cp: int) -> int:
        return 2 * cp if cp > 1 else cp

    def runs(self, doc_ids, cp, cost_model):
        half = doc_ids.shape[-1] // (2 * cp)
        rank = torch.arange(cp)
        chunk = torch.stack([rank, 2 * cp - 1 - rank], 1)  # [cp, 2]
        return rank.repeat_interleave(2), chunk.reshape(-1) * half, torch.full((2 * cp,), half)


class THDLayout(LayoutStrategy):
    """TransformerEngine's THD DualChunkSwap partition, per document.

    Every padded document of length Lp (a multiple of 2*cp) is cut into 2*cp
    chunks of Lp / (2*cp); rank r owns chunks r and 2*cp-1-r of every document,
    documents in order. cp = 2, documents A (8 positions) and B (8):

        A: | 0 0 | 1 1 | 1 1 | 0 0 |   B: | 0 0 | 1 1 | 1 1 | 0 0 |
        rank 0: A0 A1 A6 A7 B0 B1 B6 B7   (= thd_partitioned_indices([0, 8, 16], 16, 2, 0))

    A document's padded extent runs from its first token to the next document's
    first token: THD pads every document at its end. One row of doc ids only.
    """

    name = "thd"

    @staticmethod
    def granularity(cp: int) -> int:
        return 2 * cp if cp > 1 else cp

    def runs(self, doc_ids, cp, cost_model):
        if doc_ids.shape[0] != 1:
            raise ValueError(f"layout 'thd' takes one row of doc ids (THD packs the batch into one "
                             f"sequence), got {doc_ids.shape[0]} rows; pass doc_ids of shape [S] or "
                             f"use another layout for per-row documents")
        cu = thd_padded_cu_seqlens(doc_ids[0], cp)
        chunk = cu.diff() // (2 * cp)  # [n]
        rank = torch.arange(cp)
        which = torch.stack([rank, 2 * cp - 1 - rank], 1)  # [cp, 2]: chunks r and 2cp-1-r
        start = cu[:-1].view(1, -1, 1) + which.view(cp, 1, 2) * chunk.view(1, -1, 1)  # [cp, n, 2]
        length = chunk.view(1, -1, 1).expand_as(start)
        return rank.view(cp, 1, 1).expand_as(start).reshape(-1), start.reshape(-1), length.reshape(-1)


def thd_padded_cu_seqlens(doc_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """[n + 1] padded document boundaries from one row of doc ids, checked for THD at cp.

    A boundary sits at every start of a nonzero run (and at 0): padding after a
    document belongs to that document's padded extent.
    """
    P = doc_ids.numel()
    new = torch.zeros(P, dtype=torch.bool)
    new[0] = True
    new[1:] = (doc_ids[1:] != doc_ids[:-1]) & (doc_ids[1:] > 0)
    cu = torch.cat([torch.nonzero(new).flatten(), torch.tensor([P])])
    extent = cu.diff()
    bad = torch.nonzero(extent % (2 * cp)).flatten()
    if bad.numel():
        i = int(bad[0])
        doc = int(doc_ids[int(cu[i])])
        raise ValueError(
            f"layout 'thd' at cp={cp}: document {doc} (positions {int(cu[i])}..{int(cu[i + 1]) - 1}) "
            f"has padded extent {int(extent[i])}, not a multiple of 2*cp = {2 * cp}; pad every "
            f"document at its end to a multiple of {2 * cp} (THD's cu_seqlens_padded), or use "
            f"another layout")
    return cu


def thd_partitioned_indices(cu_seqlens_padded, total_tokens: int, cp: int, rank: int) -> torch.Tensor:
    """Global token indices of ``rank``'s share, as TE's ``thd_get_partitioned_indices``.

    cu_seqlens_padded: [n + 1] padded document boundaries, each a multiple of 2*cp.
    Returns [total_tokens / cp] int64: for every document, its chunks ``rank`` and
    ``2*cp - 1 - rank`` of 2*cp equal chunks. Pure torch, any device.
    """
    cu = torch.as_tensor(cu_seqlens_padded).reshape(-1).to(torch.int64)
    if cu.numel() < 2 or int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
        raise ValueError(f"cu_seqlens_padded must start at 0 and not decrease, got {cu.tolist()}")
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"thd_partitioned_indices: need cp >= 1 and 0 <= rank < cp, got cp={cp}, rank={rank}")
    if bool((cu % (2 * cp)).any()):
        raise ValueError(f"cu_seqlens_padded {cu.tolist()} must be multiples of 2*cp = {2 * cp} "
                         "(pad every document to a multiple of 2*cp)")
    if total_tokens % cp:
        raise ValueError(f"total_tokens {total_tokens} must be a multiple of cp = {cp}")
    local = cu // cp  # [n + 1] boundaries in one rank's share
    token = torch.arange(total_tokens // cp, device=cu.device)
    # TE's binary search: the last document whose local start <= token (tokens past the end stay in it).
    seq = torch.searchsorted(local[1:], token, right=True).clamp(max=cu.numel() - 2)
    half = (local[seq + 1] - local[seq]) // 2
    index = token - local[seq]
    chunk = torch.where(index < half, torch.full_like(index, rank), torch.full_like(index, 2 * cp - 1 - rank))
    return index + local[seq] * cp + half * (chunk - (index >= half).long())


def position_work(doc_ids: torch.Tensor) -> torch.Tensor:
    """[P] causal work of each query position (keys it attends), summed over rows."""
    doc_ids = doc_ids.reshape(-1, doc_ids.shape[-1])
    P = doc_ids.shape[-1]
    pos = torch.arange(P).expand_as(doc_ids)
    starts = document_starts(doc_ids)
    work = torch.where(doc_ids > 0, pos - starts + 1, torch.zeros_like(pos))
    return work.sum(0)


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """[b, P] global start position of the document each position belongs to."""
    P = doc_ids.shape[-1]
    new_doc = torch.ones_like(doc_ids, dtype=torch.bool)
    new_doc[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    pos = torch.arange(P).expand_as(doc_ids)
    marked = torch.where(new_doc, pos, torch.zeros_like(pos))
    return torch.cummax(marked, dim=-1).values


# ---------------------------------------------------------------------------
# Cost-aware document-balanced layout
# ---------------------------------------------------------------------------


class BalancedLayout(LayoutStrategy):
    """Equal tokens per rank; documents kept whole where that is cheap, split where it pays.

    cp = 4, documents A (long) b c d e f (short):

        A A A A A A A A b b c d d e f f
        rank 0: A A .. A A (head + tail of A) | rank 1: A A .. A A (middle of A) | ...
        ranks 2, 3: b c d / e f (whole, packed by work)

    A document heavier than a rank can carry is split over a few ranks (zigzag
    pairs, which equalise its work, or contiguous chunks sized so that each
    chunk's compute plus the earlier keys it must receive costs the same); the
    others go whole to the least loaded rank; the ranks' documents are laid end
    to end and cut at exact multiples of the local length. A vectorized search
    over a few split thresholds and styles (and the contiguous and zigzag
    layouts themselves) keeps the candidate with the smallest modeled time
    (``cost.CostModel``: busiest rank's compute plus its K/V traffic), preferring
    work max/mean within ``BALANCE_GOAL``, so it is never worse than either.
    """

    name = "balanced"

    def runs(self, doc_ids, cp, cost_model):
        return balanced_runs(doc_ids, cp, resolve_cost_model(cost_model))


# Split thresholds (fraction of a rank's work share a document may carry whole).
_SPLIT_THRESHOLDS = (math.inf, 2.0, 1.0, 0.75, 0.5, 0.35, 0.25)
BALANCE_GOAL = 1.05
# Work beyond the goal weighs this much extra in the search key: the rest of the layer is
# token-balanced, so attention imbalance is a preference even where the model calls it cheap.
_IMBALANCE_WEIGHT = 2.0


class _Docs:
    """Runs on which no row changes document (units the balanced layout places), with work sums."""

    def __init__(self, ids: torch.Tensor):
        P = ids.shape[-1]
        change = torch.zeros(P, dtype=torch.bool)
        change[0] = True
        change[1:] = (ids[:, 1:] != ids[:, :-1]).any(0)
        self.starts = torch.nonzero(change).flatten()
        self.ends = torch.cat([self.starts[1:], torch.tensor([P])])
        self.padding = (ids[:, self.starts] == 0).all(0)
        self.pos_work = position_work(ids)
        self.cum = torch.cat([torch.zeros(1, dtype=torch.float64), self.pos_work.double().cumsum(0)])
        self.P = P


def _span_work(cum: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return cum[b] - cum[a]


def range_cost(docs: _Docs, rank: torch.Tensor, a: torch.Tensor, b: torch.Tensor, cp: int
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(work [cp], needed remote [cp]) of a layout given as ranges (rank, [a, b)); one row of ids.

    Cuts every range at document boundaries; a rank's pieces of one document need
    [document start, end of its last piece) minus what it owns.
    """
    rs, re = docs.starts, docs.ends
    n_docs = rs.numel()
    work = torch.zeros(cp, dtype=torch.float64).index_add_(0, rank, _span_work(docs.cum, a, b))
    first = torch.searchsorted(rs, a, right=True) - 1
    last = torch.searchsorted(rs, b - 1, right=True) - 1
    cnt = last - first + 1
    rep = torch.repeat_interleave(torch.arange(a.numel()), cnt)
    k = first[rep] + torch.arange(rep.numel()) - torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt, cnt)
    pa = torch.maximum(a[rep], rs[k])
    pb = torch.minimum(b[rep], re[k])
    keep = ~docs.padding[k]
    key = rank[rep][keep] * n_docs + k[keep]
    reach = torch.zeros(cp * n_docs, dtype=torch.long).scatter_reduce_(0, key, pb[keep], "amax")
    own = torch.zeros(cp * n_docs, dtype=torch.long).index_add_(0, key, (pb - pa)[keep])
    touched = reach > 0
    need = torch.where(touched, reach - rs.repeat(cp) - own, torch.zeros_like(reach))
    return work, need.view(cp, n_docs).sum(1)


def _owned_to_runs(owned: List[List[Tuple[int, int]]]) -> RunSpec:
    rank = torch.tensor([r for r, spans in enumerate(owned) for _ in spans], dtype=torch.long)
    start = torch.tensor([s[0] for spans in owned for s in spans], dtype=torch.long)
    end = torch.tensor([s[1] for spans in owned for s in spans], dtype=torch.long)
    return rank, start, end - start


def balanced_runs(ids: torch.Tensor, cp: int, cost_model: CostModel) -> RunSpec:
    docs = _Docs(ids)
    P = docs.P
    L = P // cp
    t_pair, t_pos = cost_model.seconds_per_pair, cost_model.seconds_per_position
    candidates = [("contiguous", [[(r * L, (r + 1) * L)] for r in range(cp)])]
    half = P // (2 * cp) if P % (2 * cp) == 0 else 0
    if half:
        candidates.append(("zigzag", [[(r * half, (r + 1) * half),
                                       ((2 * cp - 1 - r) * half, (2 * cp - r) * half)] for r in range(cp)]))
    seg = list(zip(docs.starts.tolist(), docs.ends.tolist(), docs.padding.tolist()))
    cum = docs.cum.tolist()
    seen = set()
    for theta in _SPLIT_THRESHOLDS:
        for style in ("zigzag", "chunks", "need"):
            owned = _balanced_candidate(cum, seg, cp, theta, style, t_pos / t_pair)
            key = tuple(tuple(sorted(o)) for o in owned)
            if key not in seen:
                seen.add(key)
                candidates.append((f"{style}@{theta}", owned))

    best = None
    total = float(docs.cum[-1])
    rows = [document_runs(row) for row in ids]
    for label, owned in candidates:
        spec = _owned_to_runs(owned)
        if ids.shape[0] == 1:
            work, need = range_cost(docs, *spec[:2], spec[1] + spec[2], cp)
        else:
            work, need = needed_remote(RankRuns.build(cp, P, *spec), rows)
        modeled = float((work.double() * t_pair + need.double() * t_pos).max())
        imbalance = float(work.max()) / (total / cp) if total > 0 else 1.0
        score = modeled * (1 + _IMBALANCE_WEIGHT * max(0.0, imbalance - BALANCE_GOAL))
        if best is None or score < best[0]:
            best = (score, label, spec)
    return best[2]


def _balanced_candidate(cum: List[float], segments: List[tuple], cp: int, theta: float,
                        style: str, pos_cost: float) -> List[List[Tuple[int, int]]]:
    """One balanced assignment as ranges per rank.

    1. A document whose tokens exceed a rank's share, or whose work exceeds
       ``theta`` of a rank's work share, is split over m ranks: ``zigzag`` (2m
       chunks, rank i of m takes chunks i and 2m-1-i: equal work), ``chunks``
       (m contiguous chunks, each costing the same compute plus received keys at
       ``pos_cost`` pairs per position), or ``need`` (zigzag over the fewest
       neediest ranks whose missing work covers it).
    2. The other documents (and padding runs), largest work first, go whole to
       the rank that keeps max(work / share, tokens / share) smallest.
    3. The ranks' documents are laid end to end (largest first within a rank)
       and cut at exact multiples of the per-rank length.
    """
    P = len(cum) - 1
    L = P // cp
    target = max(cum[-1] / cp, 1e-9)
    owned: List[List[Tuple[int, int]]] = [[] for _ in range(cp)]
    room = [L] * cp
    load = [0.0] * cp

    def give(rank: int, a: int, b: int) -> None:
        if b > a:
            owned[rank].append((a, b))
            room[rank] -= b - a
            load[rank] += cum[b] - cum[a]

    whole = []
    by_work = sorted(segments, key=lambda s: cum[s[0]] - cum[s[1]])
    for a, b, pad in by_work:
        n, w = b - a, cum[b] - cum[a]
        share = max(target - min(load), 0.0) if style == "need" else target
        if pad or (n <= L and w <= theta * share):
            whole.append((a, b))
            continue
        if style == "need":
            needs = sorted(range(cp), key=lambda r: (load[r] - target, -room[r]))
            m, covered = 0, 0.0
            while m < cp and (m < 2 or covered < w or m * L < n):
                covered += max(target - load[needs[m]], 0.0)
                m += 1
            ranks = sorted(needs[:m], key=lambda r: load[r])
        else:
            m = min(cp, max(2, -(-n // L), math.ceil(w / (min(theta, 1.0) * target) - 1e-9)))
            ranks = sorted(sorted(range(cp), key=lambda r: (-room[r], load[r]))[:m], key=lambda r: load[r])
        if style == "chunks":
            pieces = _cost_chunks(cum, a, b, m, pos_cost)
            # The most expensive-to-feed chunks (the last ones) go to the least loaded ranks.
            plan = list(zip(ranks, reversed(pieces or [])))
            if not plan or len(plan) < len(pieces) or any(room[r] < t - h for r, (h, t) in plan):
                whole.append((a, b))
                continue
            for rank, (h, t) in plan:
                give(rank, h, t)
            continue
        bounds = [a + (n * j) // (2 * m) for j in range(2 * m + 1)]
        pairs = [((bounds[i], bounds[i + 1]), (bounds[2 * m - 1 - i], bounds[2 * m - i])) for i in range(m)]
        if any(room[r] < (h[1] - h[0]) + (t[1] - t[0]) for r, (h, t) in zip(ranks, pairs)):
            whole.append((a, b))  # no room to split it: step 3 cuts it where it lands
            continue
        for rank, (head, tail) in zip(ranks, pairs):
            give(rank, *head)
            give(rank, *tail)

    # Step 2: a heap on the current key (ties by rank) instead of a scan of every rank per document.
    bins: List[List[Tuple[int, int]]] = [[] for _ in range(cp)]
    tokens = [L - r for r in room]
    work = list(load)
    heap = [(max(work[r] / target, tokens[r] / L), r) for r in range(cp)]
    heapq.heapify(heap)
    for a, b in whole:
        _, r = heapq.heappop(heap)
        bins[r].append((a, b))
        tokens[r] += b - a
        work[r] += cum[b] - cum[a]
        heapq.heappush(heap, (max(work[r] / target, tokens[r] / L), r))

    rank = 0
    for a, b in (d for docs in bins for d in sorted(docs, key=lambda d: d[0] - d[1])):
        while a < b:
            while room[rank] == 0:
                rank += 1
            take = min(room[rank], b - a)
            give(rank, a, a + take)
            a += take
    assert all(x == 0 for x in room), room
    return owned


def _cost_chunks(cum: List[float], a: int, b: int, m: int, pos_cost: float) -> Optional[List[Tuple[int, int]]]:
    """m contiguous chunks of [a, b) whose work + pos_cost * (chunk start - a) is equal (bisection)."""
    cum_t = torch.tensor(cum[a:b + 1], dtype=torch.float64) - cum[a]

    def cut(budget: float) -> List[int]:
        bounds, x = [a], a
        for _ in range(m):
            if x >= b:
                break
            # largest y with work(x, y) + pos_cost * (x - a) <= budget, at least one token
            limit = cum_t[x - a] + budget - pos_cost * (x - a)
            y = a + int(torch.searchsorted(cum_t, limit.reshape(1), right=True)) - 1
            y = min(max(y, x + 1), b)
            bounds.append(y)
            x = y
        return bounds

    lo, hi = 0.0, float(cum_t[-1]) + pos_cost * (b - a)
    for _ in range(40):
        mid = (lo + hi) / 2
        if cut(mid)[-1] >= b:
            hi = mid
        else:
            lo = mid
    bounds = cut(hi)
    if bounds[-1] < b:
        return None
    return [(h, t) for h, t in zip(bounds[:-1], bounds[1:]) if t > h]

LAYOUT_STRATEGIES: Dict[str, LayoutStrategy] = {
    s.name: s for s in (ContiguousLayout(), ZigzagLayout(), BalancedLayout(), THDLayout())}

__all__ = ["Layout", "LayoutStrategy", "ContiguousLayout", "ZigzagLayout", "BalancedLayout", "THDLayout",
           "LAYOUT_STRATEGIES", "build_layout", "padded_length", "layout_granularity", "document_starts",
           "position_work", "thd_partitioned_indices", "thd_padded_cu_seqlens",
           "BALANCE_GOAL"]
