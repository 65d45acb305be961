"""Who owns which global positions: contiguous, zigzag and document-balanced layouts.

A layout maps the padded sequence [0, P) onto ``cp`` ranks, every rank owning
exactly ``P / cp`` positions, each rank's positions sorted ascending (its local
order). Sorting keeps every document's local queries adjacent in local order,
which is what the plan's varlen segments rely on.
"""

import heapq
from dataclasses import dataclass
from typing import List

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


def _balanced_positions(doc_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """Equal tokens per rank, causal work as equal as possible, few documents split.

    1. Documents longer than half a rank's share are split zigzag-style (2m
       chunks, rank i of m takes chunks i and 2m-1-i) over the m ranks with the
       most room: the zigzag pairing equalises their work exactly.
    2. The remaining documents, largest work first, go whole to the rank with the
       least work that still has room (LPT scheduling).
    3. What does not fit whole is cut into contiguous pieces that fill the
       remaining room; padding fills last (it costs no work).
    """
    P = doc_ids.shape[-1]
    L = P // cp
    work = position_work(doc_ids).to(torch.float64)
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), work.cumsum(0)])

    def span_work(a: int, b: int) -> float:
        return float(cum[b] - cum[a])

    owned: List[List[range]] = [[] for _ in range(cp)]
    room = [L] * cp
    load = [0.0] * cp

    def give(rank: int, a: int, b: int) -> None:
        if b > a:
            owned[rank].append(range(a, b))
            room[rank] -= b - a
            load[rank] += span_work(a, b)

    segments = _segments(doc_ids)
    docs = [(a, b) for a, b, pad in segments if not pad]
    pads = [(a, b) for a, b, pad in segments if pad]
    large = sorted((d for d in docs if d[1] - d[0] > L // 2), key=lambda d: d[0] - d[1])
    small = sorted((d for d in docs if d[1] - d[0] <= L // 2),
                   key=lambda d: (-span_work(*d), d[0]))

    leftovers: List[tuple] = []
    for a, b in large:
        n = b - a
        m = min(cp, max(2, -(-n // L)))
        ranks = sorted(range(cp), key=lambda r: (-room[r], load[r]))[:m]
        if sum(room[r] for r in ranks) < n or any(room[r] < -(-n // m) for r in ranks):
            leftovers.append((a, b))
            continue
        bounds = [a + (n * j) // (2 * m) for j in range(2 * m + 1)]
        for i, rank in enumerate(sorted(ranks, key=lambda r: load[r])):
            give(rank, bounds[i], bounds[i + 1])
            give(rank, bounds[2 * m - 1 - i], bounds[2 * m - i])

    heap = [(load[r], r) for r in range(cp)]
    heapq.heapify(heap)
    for a, b in small:
        n = b - a
        skipped = []
        placed = False
        while heap:
            _, r = heapq.heappop(heap)
            if room[r] >= n:
                give(r, a, b)
                heapq.heappush(heap, (load[r], r))
                placed = True
                break
            skipped.append(r)
        for r in skipped:
            heapq.heappush(heap, (load[r], r))
        if not placed:
            leftovers.append((a, b))

    # Fill what is left: pieces of the remaining documents, then padding, into the
    # ranks with room, lowest load first (a document's later pieces carry more work).
    for a, b in sorted(leftovers) + pads:
        while a < b:
            r = min((r for r in range(cp) if room[r] > 0), key=lambda r: (load[r], -room[r]))
            take = min(room[r], b - a)
            give(r, a, a + take)
            a += take

    assert all(x == 0 for x in room), room
    rows = [torch.cat([torch.arange(rg.start, rg.stop) for rg in ranges]).sort().values
            for ranges in owned]
    return torch.stack(rows)
