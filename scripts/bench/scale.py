"""scale suite: plan-only, no processes. What each layout costs at 32k-1M tokens and cp 8-64.

For every mix (scale_mixes.py), S, cp, layout and topology, ``plan_summary`` runs the
layout + plan code one rank (the last) runs in a real step, on one core
(``torch.set_num_threads(1)``), and reports work balance, the needed-only
exchange's busiest receiver, the host plan time, and the cost model's modeled
time over the ideal and over the lower bound (cost.py; default dims: Hq 32,
Hkv 8, D 128, bf16), without and with overlap (the streamed op, refetch in
backward; ``exposed_share``: the busiest rank's communication left after it).
Topologies (``link``): ``nvlink`` and ``ib`` (one link for the whole group) and
``2lvl`` (8 GPUs per node: NVLink inside, IB between, the hierarchical exchange),
the last only where the group spans nodes (cp > 8).

``run_worst_case`` adds the worst-case table: 24 random mixes (mixes.worst_case_mix_params:
lognormal sigma 0.5-1.5 around 256-8k tokens, uniform, heavy-tailed with one
document of S/8-S/2, one document), plan CPU ms of every layout at 128k / cp 8
(one node) and 1M / cp 64 (8 nodes), and balanced's modeled / ideal at the
two-level target points. ``plan_seconds`` is the planning thread's CPU time
(``time.thread_time``), median of ``PLAN_REPEATS`` runs of ``prepare_plan`` (on two
levels with the hierarchical exchange's route, planned ahead with the rest): the
machine is shared, and CPU time does not count the time other processes hold
the core (``plan_wall_seconds``: the wall time of the first run); the worst-case
table's rows take ``WORST_CASE_REPEATS`` runs and keep their minimum too
(``plan_min_seconds``). Peer rows:
``allgather`` (Llama-3 style, zigzag layout, every rank receives (cp-1) *
local_len) and ``te_thd`` (TransformerEngine's THD
per-document partition, documents padded at their end to 2*cp, with TE's p2p
ring traffic (cp-1) * local_len per rank).
"""

import gc
import statistics
import time
from typing import Dict, List

import torch

SEQ_LENS = (32768, 131072, 524288, 1048576)
CPS = (8, 16, 32, 64)
LAYOUTS = ("contiguous", "zigzag", "balanced")
LINKS = ("nvlink", "ib", "2lvl")
GPUS_PER_NODE = 8
PLAN_REPEATS = 3
# The worst-case table's plans: the median and the minimum of this many (the same plan's CPU time runs
# 1.5-2x apart on this shared host; the minimum is what the code costs, the median what a run saw).
WORST_CASE_REPEATS = 5
# One link for the whole group: the target points (S, cp, link).
TARGET_POINTS = ((32768, 8, "nvlink"), (131072, 8, "nvlink"), (131072, 16, "ib"),
                 (524288, 32, "ib"), (1048576, 64, "ib"))
# Two levels at 8 GPUs per node: the target points; <= 1.25x ideal, <= 1.1x where every document fits a node.
TWO_LEVEL_POINTS = ((131072, 16), (524288, 32), (1048576, 64))
TWO_LEVEL_LIMIT, FITS_LIMIT = 1.25, 1.1
# Planning-speed points (S, cp, link) and limits (CPU ms, one rank's layout + plan).
SPEED_POINTS = ((131072, 8, "nvlink", 10.0), (1048576, 64, "2lvl", 100.0))


def cost_model(link: str):
    from megatron_ext.blockdiag_cp.cost import CostModel

    return CostModel.two_level(GPUS_PER_NODE) if link == "2lvl" else CostModel.preset(link)


def fits_a_node(lengths, S: int, cp: int) -> bool:
    """Every document within one node's share: its tokens and its causal work."""
    nodes = max(1, cp // GPUS_PER_NODE)
    work = [n * (n + 1) / 2 for n in lengths]
    return max(lengths) <= S // nodes and max(work) <= sum(work) / nodes


def thd_padded(ids: torch.Tensor, cp: int) -> torch.Tensor:
    """Every document padded at its end to a multiple of 2*cp (THD's cu_seqlens_padded)."""
    change = torch.ones(ids.numel(), dtype=torch.bool)
    change[1:] = ids[1:] != ids[:-1]
    starts = torch.nonzero(change).flatten()
    lengths = torch.cat([starts[1:], torch.tensor([ids.numel()])]) - starts
    ext = (lengths + 2 * cp - 1) // (2 * cp) * (2 * cp)
    doc = torch.repeat_interleave(ids[starts], ext)
    within = torch.arange(int(ext.sum())) - torch.repeat_interleave(ext.cumsum(0) - ext, ext)
    return torch.where(within < torch.repeat_interleave(lengths, ext), doc, torch.zeros_like(doc))


def _plan_cpu_times(ids: torch.Tensor, cp: int, layout: str, cost, hierarchical: bool = False,
                    repeats: int = PLAN_REPEATS) -> List[float]:
    """CPU times of the planning thread over ``repeats`` prepare_plan runs (last rank).

    ``hierarchical``: the step runs the hierarchical exchange (the two-level rows), so its node
    route is planned ahead too and counted (``prepare_plan(kv_exchange="hierarchical")``).
    """
    from megatron_ext.blockdiag_cp import prepare_plan

    extra = dict(kv_exchange="hierarchical", ranks_per_node=GPUS_PER_NODE) if hierarchical else {}
    times = []
    for _ in range(repeats):
        # Earlier plans' garbage (the suite makes thousands of 1M-token plans) is collected before the
        # clock starts, not by whichever timed plan trips the collector; this plan's own is counted.
        gc.collect()
        t0 = time.thread_time()
        prepare_plan(ids, cp, cp - 1, layout=layout, cost_model=cost, kinds=("needed",), **extra)
        times.append(time.thread_time() - t0)
    return times


def _plan_cpu_seconds(ids: torch.Tensor, cp: int, layout: str, cost, hierarchical: bool = False) -> float:
    """Median of ``_plan_cpu_times``."""
    return statistics.median(_plan_cpu_times(ids, cp, layout, cost, hierarchical))


def _row(mix, S, cp, layout, link, exchange, summ, cost, allgather=False) -> Dict:
    key = "_allgather" if allgather else ""
    modeled = summ[f"modeled{key}_seconds"]
    overlap = summ[f"overlap{key}_seconds"]
    traffic = summ["traffic_allgather" if allgather else "traffic"]
    ideal = summ["ideal_seconds"]
    return {"suite": "scale", "mix": mix, "S": S, "cp": cp, "layout": layout, "link": link,
            "exchange": exchange, "backend": "-", "cost_model": cost.name,
            "work_max_over_mean": summ["work_max_over_mean"],
            "needed_max": int((traffic.intra_in + traffic.inter_in).max()),
            "inter_node_max": int(traffic.inter_in.max()),
            "plan_seconds": summ["plan_cpu_seconds"], "plan_wall_seconds": summ["plan_seconds"],
            "layout_seconds": summ["layout_seconds"],
            "modeled_over_ideal": modeled / ideal, "modeled_over_bound": modeled / summ["lower_bound_seconds"],
            "overlap_over_ideal": overlap / ideal,
            "exposed_share": summ["exposed_allgather_share" if allgather else "exposed_share"],
            "modeled_seconds": modeled, "ideal_seconds": ideal, "padded_len": summ["padded_len"]}


def _save_and_fits(ids, cp, layout, cost, mix, S) -> Dict:
    """The overlapped time with kv_backward="save" and whether every document fits a node."""
    from megatron_ext.blockdiag_cp import prepare_plan
    from megatron_ext.blockdiag_cp.prepare import layout_cost

    prep = prepare_plan(ids, cp, cp - 1, layout=layout, cost_model=cost, kinds=())
    priced = layout_cost(prep.doc_ids, prep.layout, cost, kv_backward="save")
    lengths = torch.unique_consecutive(ids, return_counts=True)[1].tolist()
    return {"overlap_save_over_ideal": priced["overlap_seconds"] / priced["ideal_seconds"],
            "fits_a_node": fits_a_node(lengths, S, cp)}


def run(seq_lens=SEQ_LENS, cps=CPS, mixes=None, log=print) -> List[Dict]:
    from megatron_ext.blockdiag_cp import plan_summary
    from scale_mixes import SCALE_MIXES, scale_doc_ids

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows: List[Dict] = []
    try:
        for mix in mixes or SCALE_MIXES:
            for S in seq_lens:
                ids = scale_doc_ids(mix, S)
                for cp in cps:
                    if S // cp < 512:
                        continue
                    t0 = time.perf_counter()
                    for link in LINKS:
                        if link == "2lvl" and cp <= GPUS_PER_NODE:
                            continue  # one node: the two-level model is the NVLink one
                        cost = cost_model(link)
                        exchange = "hier" if link == "2lvl" else "a2a"
                        for layout in LAYOUTS:
                            summ = plan_summary(ids, cp, layout=layout, cost_model=cost)
                            summ["plan_cpu_seconds"] = _plan_cpu_seconds(ids, cp, layout, cost, link == "2lvl")
                            rows.append(_row(mix, S, cp, layout, link, exchange, summ, cost))
                            rows[-1]["candidate"] = summ["layout_choice"]
                            if layout == "balanced" and link == "2lvl" and (S, cp) in TWO_LEVEL_POINTS:
                                rows[-1].update(_save_and_fits(ids, cp, layout, cost, mix, S))
                            if layout == "zigzag":
                                rows.append(_row(mix, S, cp, "allgather", link, "allgather", summ, cost, True))
                        thd_ids = thd_padded(ids, cp)
                        summ = plan_summary(thd_ids, cp, layout="thd", cost_model=cost)
                        summ["plan_cpu_seconds"] = _plan_cpu_seconds(thd_ids, cp, "thd", cost)
                        # TE's p2p ring moves every rank's K/V: priced as the all-gather (a ring).
                        rows.append(_row(mix, S, cp, "te_thd", link, "te_p2p", summ, cost, True))
                    log(f"  scale {mix} S={S} cp={cp}: {time.perf_counter() - t0:.1f}s")
    finally:
        torch.set_num_threads(threads)
    return rows


def targets(rows: List[Dict]) -> List[Dict]:
    """Balanced at each one-link target point and mix: held or missed, with numbers."""
    from megatron_ext.blockdiag_cp.cost import CostModel
    from scale_mixes import scale_doc_lengths

    out = []
    scale = [r for r in rows if r["suite"] == "scale"]
    for S, cp, link in TARGET_POINTS:
        for mix in sorted({r["mix"] for r in scale}):
            got = {r["layout"]: r for r in scale if (r["S"], r["cp"], r["link"], r["mix"]) == (S, cp, link, mix)}
            if "balanced" not in got:
                continue
            b = got["balanced"]
            limit = 1.2 if link == "nvlink" else 1.6
            ok = b["modeled_over_ideal"] <= limit
            if link == "nvlink":
                ok = ok and b["work_max_over_mean"] <= 1.05
            peers = min(got[x]["modeled_over_ideal"] for x in ("contiguous", "zigzag"))
            # Whoever holds the last token of the longest document receives its earlier keys:
            # that traffic alone, in rank work shares (total work / cp), before any compute.
            lengths = torch.tensor(scale_doc_lengths(mix, S), dtype=torch.float64)
            share = float((lengths * (lengths + 1) / 2).sum()) / cp
            q = CostModel.preset(link).positions_per_pair
            out.append({"S": S, "cp": cp, "link": link, "mix": mix, "limit": limit,
                        "work_max_over_mean": b["work_max_over_mean"],
                        "modeled_over_ideal": b["modeled_over_ideal"],
                        "modeled_over_bound": b["modeled_over_bound"],
                        "bound_over_ideal": b["modeled_over_ideal"] / b["modeled_over_bound"],
                        "not_worse_than_peers": b["modeled_over_ideal"] <= peers * (1 + 1e-9),
                        "end_keys_over_share": q * float(lengths.max() - 1) / share,
                        "candidate": b.get("candidate", "-"),
                        "held": ok})
    return out


def two_level_targets(rows: List[Dict]) -> List[Dict]:
    """Balanced at the two-level points on the scale mixes, against 1.25x (1.1x where every
    document fits a node), with the uniform-IB figure of the same layout search beside it."""
    scale = [r for r in rows if r["suite"] == "scale"]
    out = []
    for S, cp in TWO_LEVEL_POINTS:
        for mix in sorted({r["mix"] for r in scale}):
            got = {(r["layout"], r["link"]): r for r in scale if (r["S"], r["cp"], r["mix"]) == (S, cp, mix)}
            b = got.get(("balanced", "2lvl"))
            if b is None:
                continue
            limit = FITS_LIMIT if b.get("fits_a_node") else TWO_LEVEL_LIMIT
            peers = min(got[(x, "2lvl")]["modeled_over_ideal"] for x in ("contiguous", "zigzag"))
            uib = got.get(("balanced", "ib"))
            out.append({"S": S, "cp": cp, "mix": mix, "limit": limit, "fits_a_node": b.get("fits_a_node"),
                        "modeled_over_ideal": b["modeled_over_ideal"], "overlap_over_ideal": b["overlap_over_ideal"],
                        "overlap_save_over_ideal": b.get("overlap_save_over_ideal"),
                        "exposed_share": b["exposed_share"], "work_max_over_mean": b["work_max_over_mean"],
                        "uniform_ib": uib["modeled_over_ideal"] if uib else None,
                        "uniform_ib_overlap": uib["overlap_over_ideal"] if uib else None,
                        "peers": peers, "not_worse_than_peers": b["modeled_over_ideal"] <= peers * (1 + 1e-9),
                        "candidate": b.get("candidate", "-"), "held": b["modeled_over_ideal"] <= limit})
    return out


def run_worst_case(n_mixes: int = 24, speed_points=SPEED_POINTS, model_points=TWO_LEVEL_POINTS,
                   log=print) -> List[Dict]:
    """The worst-case table (see the module docstring): suite "scale_worst" rows, kind
    "speed" (plan CPU ms per layout) or "modeled" (modeled / ideal per layout and topology)."""
    from megatron_ext.blockdiag_cp import plan_summary
    from megatron_ext.testing.mixes import mix_name, worst_case_doc_ids, worst_case_doc_lengths, \
        worst_case_mix_params

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows: List[Dict] = []
    params = worst_case_mix_params(n_mixes)
    try:
        for S, cp, link, limit in speed_points:
            t0 = time.perf_counter()
            cost = cost_model(link)
            for p in params:
                ids = worst_case_doc_ids(p, S)
                for layout in LAYOUTS + ("te_thd",):
                    x, name = (thd_padded(ids, cp), "thd") if layout == "te_thd" else (ids, layout)
                    # Our layouts on two levels run the hierarchical exchange: its route is planned too.
                    # TE's THD rows model TE's p2p ring, which has none.
                    hier = link == "2lvl" and layout != "te_thd"
                    _plan_cpu_times(x, cp, name, cost, hier, 1)  # warm: the first plan of a shape pays lazy inits
                    times = _plan_cpu_times(x, cp, name, cost, hier, WORST_CASE_REPEATS)
                    rows.append({"suite": "scale_worst", "kind": "speed", "mix": mix_name(p), "S": S, "cp": cp,
                                 "link": link, "layout": layout, "exchange": "hier" if hier else "-",
                                 "backend": "-", "plan_seconds": statistics.median(times),
                                 "plan_min_seconds": min(times), "limit_ms": limit})
            log(f"  scale_worst speed S={S} cp={cp}: {time.perf_counter() - t0:.1f}s")
        for S, cp in model_points:
            t0 = time.perf_counter()
            for p in params:
                ids = worst_case_doc_ids(p, S)
                fits = fits_a_node(worst_case_doc_lengths(p, S), S, cp)
                for link in ("2lvl", "ib"):
                    cost = cost_model(link)
                    for layout in LAYOUTS:
                        summ = plan_summary(ids, cp, layout=layout, cost_model=cost)
                        ideal = summ["ideal_seconds"]
                        rows.append({"suite": "scale_worst", "kind": "modeled", "mix": mix_name(p), "S": S,
                                     "cp": cp, "link": link, "layout": layout, "exchange": "-", "backend": "-",
                                     "fits_a_node": fits, "work_max_over_mean": summ["work_max_over_mean"],
                                     "modeled_over_ideal": summ["modeled_seconds"] / ideal,
                                     "overlap_over_ideal": summ["overlap_seconds"] / ideal,
                                     "exposed_share": summ["exposed_share"],
                                     "candidate": summ["layout_choice"]})
            log(f"  scale_worst modeled S={S} cp={cp}: {time.perf_counter() - t0:.1f}s")
    finally:
        torch.set_num_threads(threads)
    return rows


# Per-message latency (intra-node, inter-node) in seconds: none, NCCL-like small-message figures, and a slow fabric.
LATENCIES = ((0.0, 0.0), (3e-6, 10e-6), (10e-6, 30e-6))


def run_latency(points=TWO_LEVEL_POINTS, latencies=LATENCIES, mixes=None, log=print) -> List[Dict]:
    """Suite "scale_latency": balanced's modeled / ideal at the two-level points with a per-message
    latency added to every transfer (``CostModel.two_level(latency=, latency_inter=)``); the layout is
    searched under each priced model, so the figure is what the planner achieves, not a re-pricing."""
    from megatron_ext.blockdiag_cp import plan_summary
    from megatron_ext.blockdiag_cp.cost import CostModel
    from scale_mixes import SCALE_MIXES, scale_doc_ids

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows: List[Dict] = []
    try:
        for S, cp in points:
            t0 = time.perf_counter()
            for mix in mixes or SCALE_MIXES:
                ids = scale_doc_ids(mix, S)
                for lat, lat_inter in latencies:
                    cost = CostModel.two_level(GPUS_PER_NODE, latency=lat, latency_inter=lat_inter)
                    summ = plan_summary(ids, cp, layout="balanced", cost_model=cost)
                    ideal = summ["ideal_seconds"]
                    rows.append({"suite": "scale_latency", "mix": mix, "S": S, "cp": cp, "layout": "balanced",
                                 "link": "2lvl", "exchange": "hier", "backend": "-", "cost_model": cost.name,
                                 "latency_us": 1e6 * lat, "latency_inter_us": 1e6 * lat_inter,
                                 "modeled_over_ideal": summ["modeled_seconds"] / ideal,
                                 "overlap_over_ideal": summ["overlap_seconds"] / ideal,
                                 "candidate": summ["layout_choice"]})
            log(f"  scale_latency S={S} cp={cp}: {time.perf_counter() - t0:.1f}s")
    finally:
        torch.set_num_threads(threads)
    return rows
