"""The balanced layout's strategy class: the search (``search``) behind the ``LayoutStrategy`` face."""

from ...cost import resolve_cost_model
from ..base import LayoutStrategy
from .search import balanced_runs


class BalancedLayout(LayoutStrategy):
    """Equal tokens per rank; documents kept whole where that is cheap, split where it pays.

    cp = 4, documents A (long) b c d e f (short):

        A A A A A A A A b b c d d e f f
        rank 0: A A .. A A (head + tail of A) | rank 1: A A .. A A (middle of A) | ...
        ranks 2, 3: b c d / e f (whole, packed by work)

    A document heavier than a rank can carry is split over a few ranks (zigzag
    pairs, which equalise its work; contiguous chunks of equal compute plus
    received keys; or tails carved from its end under a per-rank budget, thin
    where every key is far from its start); the others go whole where they keep
    the ranks balanced. A search over a few such candidates (and the contiguous
    and zigzag layouts themselves) keeps the one with the smallest modeled time
    (``cost.CostModel``: busiest rank's compute plus its K/V traffic), so it is
    never worse than either (``search.balanced_search``).
    """

    name = "balanced"

    def runs(self, doc_ids, cp, cost_model, windows=None, doc_runs=None):
        return balanced_runs(doc_ids, cp, resolve_cost_model(cost_model), windows, doc_runs)
