"""Two-dimensional CP's layouts: the batch's cut at cp = u * r ranks, and the ring layout of its r groups.

    cp = 4 as u = 2 x r = 2 (CP rank c = j * u + i: Ulysses group j, place i), zigzag, P = 16:

    CP ranks (the batch's cut)   | 0 0 | 1 1 | 2 2 | 3 3 | 3 3 | 2 2 | 1 1 | 0 0 |   zigzag at 4
    Ulysses groups (ring layout) | 0 0   0 0 | 1 1   1 1 | 1 1   1 1 | 0 0   0 0 |   zigzag at 2

After the Ulysses all-to-all every rank of group j holds all of the group's positions on its
share of the heads, so the ring level runs the engine's exchange between the r groups with the
ring layout, whose rank j owns the union of group j's positions. For ``contiguous``, ``zigzag``
and ``thd`` that union is the same layout at r (``union_layout`` builds it; a test checks the
two agree), so the batch keeps megatron-core's / TE's cut at cp. ``balanced`` is searched at r,
where balance matters (inside a group every rank attends the group's positions), and each
group's positions are split into u equal consecutive pieces (``split_layout``).
"""

from typing import Optional, Tuple

import torch

from ..intervals import RankRuns
from .base import Layout


def union_layout(layout: Layout, ulysses_size: int) -> Layout:
    """The layout at cp / u whose rank j owns the positions of ranks [j * u, (j + 1) * u)."""
    runs = layout.runs
    return Layout(name=layout.name, cp=layout.cp // ulysses_size, padded_len=layout.padded_len,
                  runs=RankRuns.build(layout.cp // ulysses_size, layout.padded_len, runs.rank // ulysses_size,
                                      runs.start, runs.length),
                  cu_seqlens_padded=layout.cu_seqlens_padded)


def split_layout(layout: Layout, ulysses_size: int) -> Layout:
    """The layout at cp * u whose ranks [j * u, (j + 1) * u) own rank j's positions, u equal consecutive
    pieces in its (ascending) order."""
    cp = layout.cp * ulysses_size
    P = layout.padded_len
    positions = layout.positions.reshape(-1)  # [P] rank-major, ascending within a rank
    rank = torch.arange(P) // (P // cp)  # [P] the new owner of each row
    new_run = torch.ones(P, dtype=torch.bool)
    new_run[1:] = (positions[1:] != positions[:-1] + 1) | (rank[1:] != rank[:-1])
    first = new_run.nonzero().squeeze(1)  # [n] the row each run starts at
    length = torch.diff(first, append=torch.tensor([P]))
    return Layout(name=layout.name, cp=cp, padded_len=P,
                  runs=RankRuns.build(cp, P, rank[first], positions[first], length))


def two_dim_layouts(name: str, doc_ids: torch.Tensor, cp: int, ulysses_size: int, cost_model=None, windows=None,
                    cu_seqlens_padded: Optional[torch.Tensor] = None) -> Tuple[Layout, Layout]:
    """(the layout at cp: who holds which positions of the batch, the ring layout at cp / u).

    doc_ids: [R, P] padded to ``padded_length(S, name, cp)`` (a multiple of the layout's granularity
    at cp, so at cp / u too). ``cost_model`` and ``windows`` steer ``balanced`` at cp / u.
    """
    from . import build_layout

    r = cp // ulysses_size
    if name == "balanced":
        ring = build_layout(name, doc_ids, r, cost_model=cost_model, windows=windows)
        return split_layout(ring, ulysses_size), ring
    layout = build_layout(name, doc_ids, cp, cost_model=cost_model, windows=windows,
                          cu_seqlens_padded=cu_seqlens_padded)
    ring = build_layout(name, doc_ids, r, cu_seqlens_padded=layout.cu_seqlens_padded)
    return layout, ring


__all__ = ["union_layout", "split_layout", "two_dim_layouts"]
