"""Interval arithmetic over document runs: what each rank needs, without per-rank masks.

A document is a run [start, end) of equal nonzero ids in one row of doc ids. A
rank's queries in a document need that document's keys [start, last query], one
interval per (rank, document): nothing else. The exchange counts are overlaps of
those intervals with every rank's owned positions, counted by binary search on
the sorted positions (rank-major keys ``rank * (P + 1) + position`` are globally
sorted because each rank's row is ascending). Every step is a handful of
vectorized passes over ``P`` positions or over the (few thousand) intervals,
never ``cp`` passes over ``P``.
"""

from typing import Tuple

import torch


def rank_keys(positions: torch.Tensor, padded_len: int) -> torch.Tensor:
    """[cp * L] globally sorted keys rank * (P + 1) + position."""
    cp, L = positions.shape
    offset = torch.arange(cp).repeat_interleave(L) * (padded_len + 1)
    return positions.reshape(-1) + offset


def needed_intervals(doc_ids: torch.Tensor, starts: torch.Tensor,
                     positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dst, a, b): disjoint [a, b) each rank's queries need (own positions included).

    Sorted by (dst, a); the union over rows of [document start, last query + 1).
    doc_ids, starts: [R, P]; positions: [cp, L] each row ascending.
    """
    R, P = doc_ids.shape
    cp, L = positions.shape
    flat = positions.reshape(-1)
    rank_of = torch.arange(cp).repeat_interleave(L)
    dst_parts, a_parts, b_parts = [], [], []
    for row in range(R):
        real = doc_ids[row, flat] > 0
        q, r = flat[real], rank_of[real]
        if q.numel() == 0:
            continue
        s = starts[row, q]
        # A rank's queries of one document are adjacent (rows ascending): a group ends where
        # the document start or the rank changes.
        last = torch.ones_like(q, dtype=torch.bool)
        last[:-1] = (s[1:] != s[:-1]) | (r[1:] != r[:-1])
        dst_parts.append(r[last])
        a_parts.append(s[last])
        b_parts.append(q[last] + 1)
    if not dst_parts:
        empty = torch.empty(0, dtype=torch.long)
        return empty, empty, empty
    dst, a, b = torch.cat(dst_parts), torch.cat(a_parts), torch.cat(b_parts)
    if R == 1:
        return dst, a, b  # distinct documents of one row: already disjoint and sorted
    key_a = dst * (P + 1) + a
    order = torch.argsort(key_a)
    key_a, key_b, dst = key_a[order], (dst * (P + 1) + b)[order], dst[order]
    reach = torch.cummax(key_b, 0).values
    new = torch.ones_like(key_a, dtype=torch.bool)
    new[1:] = key_a[1:] > reach[:-1]
    first = torch.nonzero(new).flatten()
    last = torch.cat([first[1:] - 1, torch.tensor([key_a.numel() - 1])])
    dst = dst[first]
    return dst, key_a[first] - dst * (P + 1), reach[last] - dst * (P + 1)


def overlap_counts(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, keys: torch.Tensor,
                   cp: int, padded_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """counts[src, dst] (zero diagonal) and lo [n, cp]: first flat index of src's positions >= a."""
    src = torch.arange(cp)
    base = src * (padded_len + 1)  # [cp]
    lo = torch.searchsorted(keys, base + a.unsqueeze(1))  # [n, cp]
    hi = torch.searchsorted(keys, base + b.unsqueeze(1))
    n = hi - lo
    n[torch.arange(dst.numel()), dst] = 0
    counts = torch.zeros(cp * cp, dtype=torch.long)
    counts.index_add_(0, (src.unsqueeze(0) * cp + dst.unsqueeze(1)).reshape(-1), n.reshape(-1))
    return counts.view(cp, cp), lo, hi


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(s, s + n) for each (s, n)."""
    total = int(lengths.sum()) if lengths.numel() else 0
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - offsets, lengths, output_size=total) + torch.arange(total)
