"""What a layout is: who owns which global positions of the padded sequence, as runs.

A layout maps the padded sequence [0, P) onto ``cp`` ranks, every rank owning
exactly ``P / cp`` positions, each rank's positions sorted ascending (its local
order). Sorting keeps every document's local queries adjacent in local order,
which is what the plan's varlen segments rely on.

A strategy (``LayoutStrategy``, one subclass per layout) draws ranges, not
positions: the layout keeps them as runs (``intervals.RankRuns``: a handful per
rank for contiguous, zigzag and balanced, two per document for thd) and builds
the [cp, P / cp] positions only when asked (``Layout.positions``; one rank's:
``Layout.rank_positions``). It also gives the plan its tables (``plan_tables``):
``LayoutTables``, interval arithmetic over the runs, unless the layout has closed
forms of them.
"""

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional, Sequence, Tuple

import torch

from ..cost import CostModel, WindowMix
from ..intervals import DocRuns, RankRuns, flat_ranges, overlap_counts, owned_ranges, work_intervals_and_docs

RunSpec = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rank, start, length) of owned ranges


def owner_of(positions: torch.Tensor) -> torch.Tensor:
    """[P] the rank owning each global position, from [cp, P / cp] the positions each rank owns."""
    cp, local_len = positions.shape
    owner = torch.empty(positions.numel(), dtype=torch.long)
    owner[positions.reshape(-1)] = torch.arange(cp).repeat_interleave(local_len)
    return owner


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
        return owner_of(self.positions)

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

    def plan_tables(self, layout: Layout, doc_ids: torch.Tensor, rows: Sequence[DocRuns],
                    window: Optional[int]) -> "LayoutTables":
        """The plan's global tables of ``layout`` (one of this strategy's) for padded doc ids [R, P], their
        rows' ``intervals.document_runs`` and a sliding window (None: whole documents)."""
        return LayoutTables(layout, rows, window)


class LayoutTables:
    """What the plan (``plan.plan_with_tables``) asks of a layout: who needs what, who owns it, who sends it.

    Interval arithmetic over the layout's runs and the documents' runs (``intervals``), for any layout;
    a layout with closed forms of these tables overrides them (``thd.THDTables``). Intervals [a, b) are
    needed K/V ranges: each starts at its document's start and ends inside it.
    """

    def __init__(self, layout: Layout, rows: Sequence[DocRuns], window: Optional[int]):
        self.runs, self.rows, self.window = layout.runs, rows, window

    def work_and_intervals(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(work [cp], dst, a, b, doc): every rank's query-key pairs and the intervals it needs, sorted by
        (dst, a), each with its document run (``intervals.work_intervals_and_docs``)."""
        return work_intervals_and_docs(self.runs, self.rows, self.window)

    def exchange_counts(self, dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, known=None
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(counts, overlap): counts[src, dst] [cp, cp], the positions src owns inside dst's intervals, and
        the same tensor where it is their ``intervals.overlap_counts`` (what a hierarchical route reuses),
        else None. ``known``: those overlap counts, when the caller already has them."""
        counts = overlap_counts(self.runs, dst, a, b) if known is None else known
        return counts, counts

    def send_ranges(self, src: int, a: torch.Tensor, b: torch.Tensor, doc: Optional[torch.Tensor]
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(lo, hi) [n]: the flat index range of src's positions in each [a, b) (``intervals.flat_ranges``);
        ``doc``: each interval's document run (None: not at hand)."""
        # Intervals of one row start at their documents' starts: where they outnumber the documents
        # (cp per document), lo is read off one search per document.
        many = doc is not None and a.numel() > 2 * self.rows[0][0].numel()
        return flat_ranges(self.runs, a, b, src, (self.rows[0][0], doc) if many else None)

    def owned_ranges(self, a: torch.Tensor, b: torch.Tensor, skip: int
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lo, hi) [cp, n] and (src, start, length) of every source's positions in each [a, b), none of
        ``skip`` (``intervals.owned_ranges``)."""
        return owned_ranges(self.runs, a, b, skip)


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


__all__ = ["Layout", "LayoutStrategy", "LayoutTables", "RunSpec", "position_work", "document_starts"]
