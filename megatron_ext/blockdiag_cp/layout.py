"""Who owns which global positions: contiguous, zigzag and document-balanced layouts.

A layout maps the padded sequence [0, P) onto ``cp`` ranks, every rank owning
exactly ``P / cp`` positions, each rank's positions sorted ascending (its local
order). Sorting keeps every document's local queries adjacent in local order,
which is what the plan's varlen segments rely on.
"""

import itertools
import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from .state import normalize_layout


def layout_granularity(layout: str, cp: int) -> int:
    """The padded length must be a multiple of this (1 for a single rank: no padding)."""
    return 2 * cp if normalize_layout(layout) == "zigzag" and cp > 1 else cp


def padded_length(seq_len: int, layout: str, cp: int) -> int:
    g = layout_granularity(layout, cp)
    return max(g, -(-seq_len // g) * g)


@dataclass(frozen=True)
class Layout:
    name: str
    cp: int
    padded_len: int
    positions: torch.Tensor  # [cp, local_len] int64, each row ascending

    @property
    def local_len(self) -> int:
        return self.padded_len // self.cp

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


def build_layout(name: str, doc_ids: torch.Tensor, cp: int) -> Layout:
    """doc_ids: [b, P] int64 already padded to the layout's granularity."""
    name = normalize_layout(name)
    padded = doc_ids.shape[-1]
    assert padded % layout_granularity(name, cp) == 0, (padded, name, cp)
    if name == "contiguous" or cp == 1:
        positions = torch.arange(padded).view(cp, -1)
    elif name == "zigzag":
        positions = _zigzag_positions(padded, cp)
    else:
        positions = _balanced_positions(doc_ids, cp)
    return Layout(name=name, cp=cp, padded_len=padded, positions=positions)


def _zigzag_positions(padded: int, cp: int) -> torch.Tensor:
    # megatron-core's get_batch_on_this_cp_rank: 2*cp chunks, rank r owns r and 2*cp-1-r.
    chunks = torch.arange(padded).view(2 * cp, -1)
    return torch.stack([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


# ---------------------------------------------------------------------------
# Document-balanced layout
# ---------------------------------------------------------------------------


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


def _segments(doc_ids: torch.Tensor) -> List[tuple]:
    """Maximal runs [start, end) on which no row changes document, with padding flag."""
    rows = doc_ids.reshape(-1, doc_ids.shape[-1])
    change = torch.zeros(rows.shape[-1], dtype=torch.bool)
    change[0] = True
    change[1:] = (rows[:, 1:] != rows[:, :-1]).any(0)
    starts = torch.nonzero(change).flatten().tolist() + [rows.shape[-1]]
    padding = (rows == 0).all(0)
    return [(a, b, bool(padding[a])) for a, b in zip(starts[:-1], starts[1:])]


# Split thresholds tried by the balanced layout (fraction of a rank's work share a
# document may carry whole); the best candidate wins.
_SPLIT_THRESHOLDS = (1.0, 0.75, 0.5, 0.35, 0.25)
_BALANCE_GOAL = 1.05


def _balanced_positions(doc_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """Equal tokens per rank, causal work as equal as possible, few documents split.

    Tries a few split thresholds and keeps the candidate whose max/mean work is
    within the goal (or closest to it) with the least K/V traffic.
    """
    ids = doc_ids.reshape(-1, doc_ids.shape[-1])
    pos_work = position_work(ids)
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), pos_work.to(torch.float64).cumsum(0)]).tolist()
    segments = _segments(ids)
    starts = document_starts(ids)
    best = None
    for theta, by_need in itertools.product(_SPLIT_THRESHOLDS, (False, True)):
        positions = _balanced_candidate(cum, segments, cp, theta, by_need)
        work = pos_work[positions].sum(1).to(torch.float64)
        imbalance = float(work.max() / work.mean()) if float(work.mean()) > 0 else 1.0
        traffic = int(needed_remote_counts(ids, positions, starts).max())
        key = (max(imbalance, _BALANCE_GOAL), traffic)
        if best is None or key < best[0]:
            best = (key, positions)
    return best[1]


def _balanced_candidate(cum: List[float], segments: List[tuple], cp: int, theta: float,
                        by_need: bool) -> torch.Tensor:
    """One balanced assignment.

    1. A document whose tokens exceed a rank's share, or whose work exceeds
       ``theta`` of a rank's work share (``by_need``: of the work the neediest
       rank still misses), is split zigzag-style (2m chunks, rank i of m takes
       chunks i and 2m-1-i) over m ranks (``by_need``: the fewest neediest ranks
       whose missing work covers it): the pairing equalises its work exactly.
    2. The other documents (and padding runs), largest work first, go whole to
       the rank that keeps max(work / share, tokens / share) smallest; tokens may
       overflow a little here.
    3. The ranks' documents are laid end to end (largest first within a rank)
       and cut at exact multiples of the per-rank length, so only a few small
       documents straddle a boundary, as in the contiguous layout.
    """
    P = len(cum) - 1  # cum: prefix sums of per-position work, [P + 1]
    L = P // cp
    target = max(cum[-1] / cp, 1e-9)

    def span_work(a: int, b: int) -> float:
        return cum[b] - cum[a]

    owned: List[List[range]] = [[] for _ in range(cp)]
    room = [L] * cp
    load = [0.0] * cp

    def give(rank: int, a: int, b: int) -> None:
        if b > a:
            owned[rank].append(range(a, b))
            room[rank] -= b - a
            load[rank] += span_work(a, b)

    whole = []
    for a, b, pad in sorted(segments, key=lambda s: -span_work(s[0], s[1])):
        n, w = b - a, span_work(a, b)
        needs = sorted(range(cp), key=lambda r: (load[r] - target, -room[r]))  # most work missing first
        share = max(target - load[needs[0]], 0.0) if by_need else target
        if pad or (n <= L and w <= theta * share):
            whole.append((a, b))
            continue
        if by_need:  # the fewest ranks whose missing work covers it (at least two, enough room)
            m, covered = 0, 0.0
            while m < cp and (m < 2 or covered < w or m * L < n):
                covered += max(target - load[needs[m]], 0.0)
                m += 1
            ranks = sorted(needs[:m], key=lambda r: load[r])
        else:  # enough ranks that each carries at most theta of a share
            m = min(cp, max(2, -(-n // L), math.ceil(w / (theta * target) - 1e-9)))
            ranks = sorted(sorted(range(cp), key=lambda r: (-room[r], load[r]))[:m], key=lambda r: load[r])
        bounds = [a + (n * j) // (2 * m) for j in range(2 * m + 1)]
        pairs = [((bounds[i], bounds[i + 1]), (bounds[2 * m - 1 - i], bounds[2 * m - i]))
                 for i in range(m)]
        if any(room[r] < (h[1] - h[0]) + (t[1] - t[0]) for r, (h, t) in zip(ranks, pairs)):
            whole.append((a, b))  # no room to zigzag it: step 3 cuts it where it lands
            continue
        for rank, (head, tail) in zip(ranks, pairs):
            give(rank, *head)
            give(rank, *tail)

    bins: List[List[tuple]] = [[] for _ in range(cp)]
    tokens = [L - r for r in room]
    work = list(load)
    for a, b in whole:
        n, w = b - a, span_work(a, b)
        r = min(range(cp), key=lambda r: max((work[r] + w) / target, (tokens[r] + n) / L))
        bins[r].append((a, b))
        tokens[r] += n
        work[r] += w

    rank = 0
    for a, b in (d for docs in bins for d in sorted(docs, key=lambda d: d[0] - d[1])):
        while a < b:
            while room[rank] == 0:
                rank += 1
            take = min(room[rank], b - a)
            give(rank, a, a + take)
            a += take
    assert all(x == 0 for x in room), room
    rows = [torch.cat([torch.arange(rg.start, rg.stop) for rg in ranges]).sort().values
            for ranges in owned]
    return torch.stack(rows)


def needed_mask(doc_ids: torch.Tensor, starts: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[P] bool: positions whose K/V the given queries need (union over rows).

    ``positions`` ascending: a document's queries are adjacent, and the document
    needs [its start, its last query], one interval per document.
    """
    R, P = doc_ids.shape
    diff = torch.zeros(P + 1, dtype=torch.int32)
    for row in range(R):
        q = positions[doc_ids[row, positions] > 0]
        if q.numel() == 0:
            continue
        s = starts[row, q]
        last = torch.ones_like(q, dtype=torch.bool)
        last[:-1] = s[1:] != s[:-1]
        ones = torch.ones(int(last.sum()), dtype=torch.int32)
        diff.index_add_(0, s[last], ones)
        diff.index_add_(0, q[last] + 1, -ones)
    return diff.cumsum(0)[:P] > 0


def needed_remote_counts(doc_ids: torch.Tensor, positions: torch.Tensor,
                         starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[cp] K/V positions each rank's queries need and it does not own (the lower bound)."""
    ids = doc_ids.reshape(-1, doc_ids.shape[-1])
    starts = document_starts(ids) if starts is None else starts
    owner = torch.empty(ids.shape[-1], dtype=torch.long)
    owner[positions.reshape(-1)] = torch.arange(positions.shape[0]).repeat_interleave(positions.shape[1])
    return torch.stack([(needed_mask(ids, starts, positions[r]) & (owner != r)).sum()
                        for r in range(positions.shape[0])])
