"""What a layout is: who owns which global positions of the padded sequence, as runs.

A layout maps the padded sequence [0, P) onto ``cp`` ranks, every rank owning
exactly ``P / cp`` positions, each rank's positions sorted ascending (its local
order). Sorting keeps every document's local queries adjacent in local order,
which is what the plan's varlen segments rely on.

A strategy (``LayoutStrategy``, one subclass per layout) draws ranges, not
positions: the layout keeps them as runs (``intervals.RankRuns``: a handful per
rank for contiguous, zigzag and balanced, two per document for thd) and builds
the [cp, P / cp] positions only when asked (``Layout.positions``; one rank's:
``Layout.rank_positions``).
"""

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional, Tuple

import torch

from ..cost import CostModel, WindowMix
from ..intervals import RankRuns

RunSpec = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rank, start, length) of owned ranges


@dataclass(frozen=True)
class Layout:
    """Who owns what, as runs (``intervals.RankRuns``); positions are built only when asked."""

    name: str
    cp: int
    padded_len: int
    runs: RankRuns
    # thd at cp > 1: the padded document boundaries its chunks cut, [n + 1] int64 ascending (empty
    # extents dropped); the THD plan's closed forms read them (None for the other layouts).
    cu_seqlens_padded: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

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


class LayoutStrategy:
    """One way of cutting [0, P) into cp equal shares (subclasses draw theirs)."""

    name = ""

    @staticmethod
    def granularity(cp: int) -> int:
        return cp

    def runs(self, doc_ids: torch.Tensor, cp: int, cost_model: Optional[CostModel],
             windows: Optional[WindowMix] = None, doc_runs=None) -> RunSpec:
        """(rank, start, length) of the ranges each rank owns (any order; touching ones merge).

        ``windows``: the model's sliding windows; only a cost-aware layout (balanced) reads them,
        and ``doc_runs``, the rows' ``intervals.document_runs`` (None: it finds them)."""
        raise NotImplementedError


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


__all__ = ["Layout", "LayoutStrategy", "RunSpec", "position_work", "document_starts"]
