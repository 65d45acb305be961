"""Plan ahead and plan to look: the host half of ``BlockDiagCPState.build``, without a group.

``prepare_plan`` runs exactly the padding, layout and plan code one rank runs
in a real step, from the replicated doc ids alone (no process group, no
device), so a data loader or a background thread can build the next
micro-batch's plan while the current step runs; ``BlockDiagCPState.build(...,
prepared=)`` then only does the agreement all-reduce. ``plan_summary`` runs the
same code and reports what a layout costs: work balance, K/V positions per
rank for the needed-only and all-gather exchanges, and the cost model's
modeled / ideal / lower-bound time, without and with overlap (``layout_cost``).
"""

import math
import time
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from .cost import CostModel, WindowMix, default_cost_model, resolve_cost_model, resolve_windows
from .hierarchy import HierarchicalRoute, build_hierarchical_route, layout_traffic
from .intervals import RankRuns, document_runs, overlap_counts, pair_work, work_and_intervals
from .layouts import Layout, build_layout, padded_length
from .plan import CHUNK_KINDS, StepPlan, plan_with_tables
from .layouts.balanced import BalancedChoice, balanced_search
from . import state as knobs
from .state import normalize_kv_exchange, normalize_layout


@dataclass(frozen=True)
class PreparedPlan:
    """What one rank's build needs from the host: padded ids, layout and plan."""

    doc_ids: torch.Tensor  # [R, P] int64, padded
    seq_len: int  # S before padding
    cp: int
    rank: int
    layout: Layout
    plan: StepPlan
    cost_model: CostModel
    layout_seconds: float
    plan_seconds: float  # layout + plan (+ route), this rank's host time
    # The hierarchical exchange's route for ``ranks_per_node`` CP ranks per node (None: not planned
    # for it, or the exchange would fall back to a2a there: one node, one rank per node).
    route: Optional[HierarchicalRoute] = None
    ranks_per_node: int = 0
    # The model's sliding windows the layout was priced for, and the plans of its windowed layers.
    windows: WindowMix = WindowMix()
    window_plans: Optional[Dict[int, StepPlan]] = None
    window_routes: Optional[Dict[int, HierarchicalRoute]] = None  # the windowed layers' routes
    # Which candidate the layout is: balanced's chosen label (``BalancedChoice.label``), else the
    # layout's name.
    layout_choice: str = ""

    def matches(self, doc_ids: torch.Tensor, cp: int, rank: int, layout_name: str,
                cost_model: Optional[CostModel] = None, windows: Optional[WindowMix] = None) -> bool:
        """Planned for these [R, S] ids, this group size, rank and layout (and, for balanced, this
        cost model and these windows when given: they decide where the cuts fall)."""
        balanced = layout_name == "balanced"
        return (self.cp == cp and self.rank == rank and self.layout.name == layout_name
                and self.plan.window is None  # a windowed plan is for its windowed layers only
                and tuple(doc_ids.shape) == (self.doc_ids.shape[0], self.seq_len)
                and (cost_model is None or not balanced
                     or self.cost_model.agreement_key() == cost_model.agreement_key())
                and (windows is None or not balanced or self.windows == windows)
                and torch.equal(self.doc_ids[:, :self.seq_len], doc_ids))


def _as_rows(doc_ids) -> torch.Tensor:
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.is_floating_point() or doc_ids.dtype == torch.bool:
        raise ValueError(f"doc_ids must be an integer tensor of shape [S] or [b, S], got {doc_ids!r:.80}")
    if doc_ids.dim() not in (1, 2) or doc_ids.shape[-1] == 0:
        raise ValueError(f"doc_ids must have shape [S] or [b, S] with S > 0, got {tuple(doc_ids.shape)}")
    ids = doc_ids.detach().to("cpu", torch.int64)
    if int(ids.min()) < 0:  # one reduction, not a [b, S] mask
        raise ValueError(f"doc_ids must be >= 0 (0 = padding, documents 1-based); found {int(ids.min())}")
    return ids.unsqueeze(0) if ids.dim() == 1 else ids


def prepare_plan(doc_ids, cp: int, rank: int, layout: Optional[str] = None,
                 cost_model: Optional[CostModel] = None,
                 kinds: Sequence[str] = CHUNK_KINDS, window: Optional[int] = None,
                 kv_exchange: Optional[str] = None, ranks_per_node: Optional[int] = None,
                 windows=None) -> PreparedPlan:
    """Pad, lay out and plan one step for ``rank`` of ``cp`` (host only, no collective).

    ``windows``: the model's sliding windows (``cost.resolve_windows``: None, a window, a
    ``WindowMix`` or per-layer windows): ``balanced`` prices its candidates as that mix, and
    the plans of the windowed layers are made here too (``window_plans``), as the step would
    on its first windowed layer. ``window``: make ``plan`` itself for that window (work and
    needed K/V inside the windows only; such a plan describes, it is not used by a build).
    ``layout`` None: the configured knob (``configure_cp_varlen``); ``kinds``: the
    chunk kinds whose steps are built now (the others are built on first access).
    ``kv_exchange`` "hierarchical": also this rank's route through the nodes
    (``hierarchy.build_hierarchical_route``, which the build would otherwise make on the
    step's first layer), for ``ranks_per_node`` CP ranks per node
    (``parallel_state.cp_ranks_per_node()`` on the launch); counted in ``plan_seconds``.
    """
    if int(cp) < 1 or not 0 <= int(rank) < int(cp):
        raise ValueError(f"prepare_plan: need cp >= 1 and 0 <= rank < cp, got cp={cp}, rank={rank}")
    name = normalize_layout(knobs._CP_LAYOUT if layout is None else layout)
    mix = resolve_windows(windows)
    hierarchical = kv_exchange is not None and normalize_kv_exchange(kv_exchange) == "hierarchical" and cp > 1
    g = 0
    if hierarchical:
        if ranks_per_node is None or isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) \
                or ranks_per_node < 0:
            raise ValueError("prepare_plan: kv_exchange='hierarchical' needs ranks_per_node, the CP ranks per node "
                             f"(parallel_state.cp_ranks_per_node(); 0 when they form no equal node blocks), "
                             f"got {ranks_per_node!r}")
        g = ranks_per_node
    # The default prices the exchange asked for, as the build's does (hierarchical routes or not).
    cost = default_cost_model(kv_exchange=kv_exchange) if cost_model is None else resolve_cost_model(cost_model)
    ids = _as_rows(doc_ids)
    S = ids.shape[1]
    t0 = time.perf_counter()
    padded = torch.nn.functional.pad(ids, (0, padded_length(S, name, cp) - S))
    # The rows' document runs, once for the layout, every plan and every route.
    rows = [document_runs(padded[r]) for r in range(padded.shape[0])]
    lay, choice = _lay_out(name, padded, cp, cost, mix, rows)
    # What the search's exact pricing computed for this layout, which the plan and route reuse.
    chosen = choice.tables if choice is not None and window is None else None
    t1 = time.perf_counter()
    tables = {}  # window -> (needed intervals, their overlap counts): the plan's, reused by its route
    plan, *tables[window] = plan_with_tables(padded, lay, rank, kinds, window, rows,
                                             known=(chosen.work, chosen.intervals, chosen.counts) if chosen else None)
    window_plans = {}
    for w in mix.windows:
        if w != window:
            window_plans[w], *tables[w] = plan_with_tables(padded, lay, rank, kinds, w, rows)
    # As the build decides: routes only where the group is several whole nodes of several ranks.
    routed = hierarchical and 1 < g < cp and cp % g == 0
    routes = chosen.routes if chosen and chosen.ranks_per_node == g else None  # the search's, of this layout
    route = build_hierarchical_route(lay, padded, rank, g, routes=routes, window=window,
                                     intervals=tables[window][0], counts=tables[window][1]) if routed else None
    window_routes = {w: build_hierarchical_route(lay, padded, rank, g, window=w, intervals=tables[w][0],
                                                 counts=tables[w][1]) for w in window_plans} \
        if routed else None
    t2 = time.perf_counter()
    return PreparedPlan(padded, S, cp, rank, lay, plan, cost, t1 - t0, t2 - t0, route, g, mix, window_plans,
                        window_routes, choice.label if choice is not None else lay.name)


def _lay_out(name: str, padded: torch.Tensor, cp: int, cost: CostModel, mix: WindowMix, rows
             ) -> Tuple[Layout, Optional[BalancedChoice]]:
    """``build_layout``, and for balanced the search's choice with it (its tables: the plan's to reuse).

    Balanced's layout is built here from the search's result, as ``build_layout`` builds it from
    ``balanced_runs``: ``layout.BalancedLayout`` hands back the runs alone.
    """
    if name != "balanced" or cp == 1:
        return build_layout(name, padded, cp, cost_model=cost, windows=mix, doc_runs=rows), None
    P = padded.shape[-1]  # padded_length's: a multiple of the layout's granularity
    choice = balanced_search(padded, cp, cost, mix, rows)
    return Layout(name=name, cp=cp, padded_len=P, runs=RankRuns.build(cp, P, *choice.runs)), choice


def modeled_lower_bound(doc_ids: torch.Tensor, cp: int, local_len: int, cost_model: CostModel) -> float:
    """Seconds no layout with equal tokens per rank can beat under ``cost_model`` (one row of ids).

    The largest of: (1) the ideal, total work / cp; (2) the mean over ranks of
    work plus traffic, where a document of n > L positions is held by ranks whose
    k-th (by last position) needs at least n - k*L earlier keys; (3) per document,
    the rank holding its last position: owning a of its positions it does at
    least n + a(a-1)/2 pairs and receives n - a keys (or all n(n+1)/2 pairs when
    it owns the whole document).
    """
    ids = doc_ids.reshape(-1, doc_ids.shape[-1])[0]
    change = torch.ones(ids.numel(), dtype=torch.bool)
    change[1:] = ids[1:] != ids[:-1]
    starts = torch.nonzero(change).flatten()
    n = torch.cat([starts[1:], torch.tensor([ids.numel()])]) - starts
    n = n[ids[starts] > 0].double()
    tp, tq = cost_model.seconds_per_pair, cost_model.seconds_per_position
    if n.numel() == 0:
        return 0.0
    L = float(local_len)
    work = n * (n + 1) / 2
    ideal = float(work.sum()) / cp * tp
    m = torch.ceil(n / L)
    traffic = (m - 1) * n - L * m * (m - 1) / 2  # sum over k >= 1 of max(0, n - k L)
    mean = (float(work.sum()) * tp + float(traffic.sum()) * tq) / cp
    # (3): convex in a; the continuous minimum sits at a = tq / tp + 1/2.
    best_split = torch.full_like(n, math.inf)
    a_hi = torch.minimum(n - 1, torch.full_like(n, L))
    star = tq / tp + 0.5
    for a in (torch.floor(torch.full_like(n, star)), torch.ceil(torch.full_like(n, star)), a_hi,
              torch.ones_like(n)):
        a = torch.minimum(torch.clamp(a, min=1.0), a_hi)
        cost = (n + a * (a - 1) / 2) * tp + (n - a) * tq
        best_split = torch.where(a_hi >= 1, torch.minimum(best_split, cost), best_split)
    whole = torch.where(n <= L, work * tp, torch.full_like(n, math.inf))
    per_doc = torch.minimum(whole, best_split)
    return max(ideal, mean, float(per_doc.max()))


def layout_cost(doc_ids: torch.Tensor, layout: Layout, cost_model: CostModel, exchange: str = "needed",
                overlap: bool = True, kv_backward: str = "refetch", windows=None) -> dict:
    """What ``layout`` costs under ``cost_model`` (padded doc ids [R, P] or [P]; any process, no group).

    ``exchange``: "needed" (a2a / halo, or the hierarchical routes of a two-level
    hierarchical model) or "allgather" (a ring of full chunks). Returns per-rank
    work and traffic (``cost.Traffic``), the modeled seconds without overlap and,
    with ``overlap``, the streamed op's (``CostModel.overlapped``, ``kv_backward``
    "refetch" or "save") and the exposed share of its busiest rank. ``windows``
    (``cost.resolve_windows``): one layer on average over the model's window mix --
    seconds weighed by the shares of layers (each layer waits for its slowest rank);
    ``work`` / ``traffic`` / ``counts`` are then those of the mix's first share.
    """
    ids = doc_ids.reshape(-1, doc_ids.shape[-1])
    rows = [document_runs(ids[r]) for r in range(ids.shape[0])]
    runs = layout.runs
    cp = layout.cp
    out = {"modeled_seconds": 0.0, "ideal_seconds": 0.0}
    if overlap:
        out.update(overlap_seconds=0.0, exposed_seconds=0.0, exposed_share=0.0)
    for window, share in resolve_windows(windows).shares:
        work, dst, a, b = work_and_intervals(runs, rows, window)
        counts = overlap_counts(runs, dst, a, b)
        traffic = layout_traffic(runs, rows, cost_model, exchange, intervals=(dst, a, b), counts=counts)
        if "work" not in out:
            out.update(work=work, traffic=traffic, counts=counts)
        out["modeled_seconds"] += share * cost_model.modeled_seconds(work, traffic)
        out["ideal_seconds"] += share * cost_model.ideal_seconds(work)
        if overlap:
            chunks = counts if exchange == "needed" else torch.full((cp, cp), layout.local_len).fill_diagonal_(0)
            routed = exchange == "needed" and bool(cost_model.ranks_per_node) and cost_model.hierarchical
            o = cost_model.overlapped(pair_work(runs, rows, window), traffic, chunks, kv_backward=kv_backward,
                                      ring=exchange == "allgather", one_shot=routed)
            out["overlap_seconds"] += share * o.modeled_seconds
            out["exposed_seconds"] += share * o.exposed_seconds
    if overlap:
        out["exposed_share"] = out["exposed_seconds"] / out["overlap_seconds"] if out["overlap_seconds"] > 0 else 0.0
    return out


def plan_summary(doc_ids, cp: int, layout: Optional[str] = None,
                 cost_model: Optional[CostModel] = None, rank: Optional[int] = None,
                 window: Optional[int] = None, windows=None) -> dict:
    """What a layout costs for these doc ids at ``cp`` ranks: no process group, no device.

    Runs ``prepare_plan`` for ``rank`` (default: the last rank) with the
    needed-only exchange's steps, exactly as a real build does, and times it.
    Counts are per attention call of one layer with ``window`` (None: full
    attention); ``windows``, the model's mix (default: ``window`` on every layer),
    steers ``balanced`` and prices the seconds (one layer on average, ``layout_cost``).
    Seconds come from ``cost_model`` (default: ``cost.default_cost_model()``, NVLink
    without a process group).
    """
    cost = resolve_cost_model(cost_model)
    mix = resolve_windows(window if windows is None else windows)
    rank = cp - 1 if rank is None else rank
    prep = prepare_plan(doc_ids, cp, rank, layout=layout, cost_model=cost, kinds=("needed",), window=window,
                        windows=mix)
    plan, lay = prep.plan, prep.layout
    work = plan.work_per_rank.double()
    needed = plan.needed_remote
    allgather = torch.full((cp,), (cp - 1) * lay.local_len, dtype=torch.long)
    mean = float(work.mean())
    priced = layout_cost(prep.doc_ids, lay, cost, "needed", windows=mix)
    priced_allgather = layout_cost(prep.doc_ids, lay, cost, "allgather", windows=mix)
    modeled, modeled_allgather = priced["modeled_seconds"], priced_allgather["modeled_seconds"]
    ideal = priced["ideal_seconds"]
    bound = (modeled_lower_bound(prep.doc_ids, cp, lay.local_len, cost)
             if prep.doc_ids.shape[0] == 1 and mix.full_only else ideal)
    return {
        "layout": lay.name, "cp": cp, "rank": rank, "seq_len": prep.seq_len, "window": window,
        "layout_choice": prep.layout_choice,  # balanced's chosen candidate, else the layout's name
        "windows": mix.describe(),
        "padded_len": lay.padded_len, "local_len": lay.local_len,
        "positions": lay.positions,  # [cp, local_len] global padded positions per rank
        "work_per_rank": plan.work_per_rank.tolist(),
        "work_max_over_mean": float(work.max()) / mean if mean > 0 else 1.0,
        "needed_positions_per_rank": needed.tolist(),
        # cost.Traffic of the needed-only (or hierarchical) exchange, for the layers the counts describe
        "traffic": priced["traffic"] if mix.shares[0][0] == window else layout_cost(
            prep.doc_ids, lay, cost, "needed", overlap=False, windows=window)["traffic"],
        # the full ring, as the cost model prices allgather (the op posts only the hops some rank
        # further round attends: exchange.RingReach, the state's report)
        "allgather_positions_per_rank": allgather.tolist(),
        "halo_ok": plan.exchange.halo_ok,
        "cost_model": cost.name,
        "layout_seconds": prep.layout_seconds,
        "plan_seconds": prep.plan_seconds,
        "modeled_seconds": modeled,
        "modeled_allgather_seconds": modeled_allgather,
        "ideal_seconds": ideal,
        "lower_bound_seconds": bound,
        "modeled_over_ideal": modeled / ideal if ideal > 0 else 1.0,
        "modeled_over_bound": modeled / bound if bound > 0 else 1.0,
        "overlap_seconds": priced["overlap_seconds"],
        "overlap_over_ideal": priced["overlap_seconds"] / ideal if ideal > 0 else 1.0,
        "exposed_share": priced["exposed_share"],
        "overlap_allgather_seconds": priced_allgather["overlap_seconds"],
        "exposed_allgather_share": priced_allgather["exposed_share"],
        "traffic_allgather": priced_allgather["traffic"],
    }


__all__ = ["PreparedPlan", "prepare_plan", "plan_summary", "modeled_lower_bound", "layout_cost"]
