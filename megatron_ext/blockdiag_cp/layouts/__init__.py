"""The layouts: who owns which global positions of the padded sequence, one strategy class per layout.

- ``base``: ``Layout`` (who owns what, as runs) and ``LayoutStrategy`` (what every layout implements);
- ``contiguous``, ``zigzag``: megatron-core's cuts, blind to documents;
- ``thd``: TransformerEngine's per-document DualChunkSwap, and the closed forms of its plan tables;
- ``balanced/``: the cost-aware balanced layout's search, split by job, and its strategy class.

``build_layout(name, doc_ids, cp)`` picks the strategy by (normalized) name;
every strategy is a pure function of the padded doc ids (``thd``: or of the
padded document boundaries a THD batch was cut by, ``cu_seqlens_padded``), so
every rank computes the same layout without communication.
"""

from typing import Dict, Optional

import torch

from ..cost import CostModel, resolve_windows
from ..intervals import RankRuns
from ..state import normalize_layout
from .balanced import BalancedLayout
from .base import Layout, LayoutStrategy, LayoutTables, RunSpec, document_starts, position_work
from .contiguous import ContiguousLayout
from .thd import THDLayout, thd_boundaries, thd_partitioned_indices
from .zigzag import ZigzagLayout

LAYOUT_STRATEGIES: Dict[str, LayoutStrategy] = {
    s.name: s for s in (ContiguousLayout(), ZigzagLayout(), BalancedLayout(), THDLayout())}


def layout_granularity(layout: str, cp: int) -> int:
    """The padded length must be a multiple of this (1 for a single rank: no padding)."""
    return LAYOUT_STRATEGIES[normalize_layout(layout)].granularity(cp)


def padded_length(seq_len: int, layout: str, cp: int) -> int:
    g = layout_granularity(layout, cp)
    return max(g, -(-seq_len // g) * g)


def build_layout(name: str, doc_ids: torch.Tensor, cp: int,
                 cost_model: Optional[CostModel] = None, windows=None, doc_runs=None,
                 cu_seqlens_padded=None) -> Layout:
    """doc_ids: [b, P] int64 already padded to the layout's granularity.

    ``cost_model`` and ``windows`` (the model's sliding windows, ``cost.resolve_windows``: None,
    a window, a ``WindowMix`` or per-layer windows) only steer ``balanced`` (default cost model:
    ``cost.default_cost_model()``). ``doc_runs``: ``intervals.document_runs`` of every row, when the
    caller has them (a cost-aware layout reads them). ``cu_seqlens_padded`` (``thd`` only): the
    padded document boundaries [n + 1] the batch was cut by (a THD batch's ``cu_seqlens_q_padded``);
    the chunks follow them, empty documents' padding included. None: boundaries from the doc ids
    (``thd_padded_cu_seqlens``).
    """
    windows = resolve_windows(windows)
    name = normalize_layout(name)
    strategy = LAYOUT_STRATEGIES[name]
    ids = doc_ids.reshape(-1, doc_ids.shape[-1])
    padded = ids.shape[-1]
    if cu_seqlens_padded is not None and name != "thd":
        raise ValueError(f"cu_seqlens_padded cuts the 'thd' layout only, not {name!r}; drop it or use "
                         f"layout 'thd'")
    if padded % strategy.granularity(cp) != 0:
        raise ValueError(f"layout {name!r} at cp={cp} needs a padded length that is a multiple of "
                         f"{strategy.granularity(cp)}, got {padded}; pad with padded_length()")
    cu = None
    if cp == 1:
        rank, start, length = [0], [0], [padded]
    elif name == "thd":
        cu = thd_boundaries(ids, cp, doc_runs, cu_seqlens_padded)
        rank, start, length = strategy.chunk_runs(cu.numpy(), cp)
    else:
        rank, start, length = strategy.runs(ids, cp, cost_model, windows, doc_runs=doc_runs)
    return Layout(name=name, cp=cp, padded_len=padded, runs=RankRuns.build(cp, padded, rank, start, length),
                  cu_seqlens_padded=cu)


__all__ = ["Layout", "LayoutStrategy", "LayoutTables", "RunSpec", "ContiguousLayout", "ZigzagLayout", "BalancedLayout",
           "THDLayout", "LAYOUT_STRATEGIES", "build_layout", "padded_length", "layout_granularity", "document_starts",
           "position_work", "thd_partitioned_indices"]
