"""scale suite: plan-only, no processes. What each layout costs at 32k-1M tokens and cp 8-64.

For every mix (scale_mixes.py), S, cp, layout and link, ``plan_summary`` runs the
layout + plan code one rank (the last) runs in a real step, on one core
(``torch.set_num_threads(1)``), and reports work balance, the needed-only
exchange's busiest receiver, the host plan time, and the cost model's modeled
time over the ideal and over the lower bound (cost.py; default dims: Hq 32,
Hkv 8, D 128, bf16). ``plan_seconds`` is the planning thread's CPU time
(``time.thread_time``), median of ``PLAN_REPEATS`` runs of ``prepare_plan``: the
machine is shared, and CPU time does not count the time other processes hold
the core (``plan_wall_seconds``: the wall time of the first run). Peer rows:
``allgather`` (Llama-3 style, zigzag layout, every rank receives (cp-1) *
local_len) and ``te_thd`` (TransformerEngine's THD
per-document partition, documents padded at their end to 2*cp, with TE's p2p
ring traffic (cp-1) * local_len per rank).
"""

import statistics
import time
from typing import Dict, List

import torch

SEQ_LENS = (32768, 131072, 524288, 1048576)
CPS = (8, 16, 32, 64)
LAYOUTS = ("contiguous", "zigzag", "balanced")
LINKS = ("nvlink", "ib")
PLAN_REPEATS = 3
# The target points: (S, cp, link).
TARGET_POINTS = ((32768, 8, "nvlink"), (131072, 8, "nvlink"), (131072, 16, "ib"),
                 (524288, 32, "ib"), (1048576, 64, "ib"))


def _thd_padded(ids: torch.Tensor, cp: int) -> torch.Tensor:
    """Every document padded at its end to a multiple of 2*cp (THD's cu_seqlens_padded)."""
    change = torch.ones(ids.numel(), dtype=torch.bool)
    change[1:] = ids[1:] != ids[:-1]
    starts = torch.nonzero(change).flatten()
    lengths = torch.cat([starts[1:], torch.tensor([ids.numel()])]) - starts
    ext = (lengths + 2 * cp - 1) // (2 * cp) * (2 * cp)
    doc = torch.repeat_interleave(ids[starts], ext)
    within = torch.arange(int(ext.sum())) - torch.repeat_interleave(ext.cumsum(0) - ext, ext)
    return torch.where(within < torch.repeat_interleave(lengths, ext), doc, torch.zeros_like(doc))


def _plan_cpu_seconds(ids: torch.Tensor, cp: int, layout: str, cost) -> float:
    """Median CPU time of the planning thread over PLAN_REPEATS prepare_plan runs (last rank)."""
    from megatron_ext.blockdiag_cp import prepare_plan

    times = []
    for _ in range(PLAN_REPEATS):
        t0 = time.thread_time()
        prepare_plan(ids, cp, cp - 1, layout=layout, cost_model=cost, kinds=("needed",))
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def _row(mix, S, cp, layout, link, exchange, summ, needed, cost) -> Dict:
    work = torch.tensor(summ["work_per_rank"], dtype=torch.float64)
    need = torch.tensor(needed, dtype=torch.float64)
    modeled = cost.modeled_seconds(work, need)
    ideal = cost.ideal_seconds(work)
    return {"suite": "scale", "mix": mix, "S": S, "cp": cp, "layout": layout, "link": link,
            "exchange": exchange, "backend": "-",
            "work_max_over_mean": summ["work_max_over_mean"], "needed_max": int(max(needed)),
            "plan_seconds": summ["plan_cpu_seconds"], "plan_wall_seconds": summ["plan_seconds"],
            "layout_seconds": summ["layout_seconds"],
            "modeled_over_ideal": modeled / ideal, "modeled_over_bound": modeled / summ["lower_bound_seconds"],
            "modeled_seconds": modeled, "ideal_seconds": ideal, "padded_len": summ["padded_len"]}


def run(seq_lens=SEQ_LENS, cps=CPS, mixes=None, log=print) -> List[Dict]:
    from megatron_ext.blockdiag_cp import balanced, plan_summary
    from megatron_ext.blockdiag_cp.cost import CostModel
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
                        cost = CostModel.preset(link)
                        for layout in LAYOUTS:
                            summ = plan_summary(ids, cp, layout=layout, cost_model=cost)
                            choice = balanced.LAST_CHOICE[0] if layout == "balanced" else layout
                            summ["plan_cpu_seconds"] = _plan_cpu_seconds(ids, cp, layout, cost)
                            rows.append(_row(mix, S, cp, layout, link, "a2a", summ,
                                             summ["needed_positions_per_rank"], cost))
                            rows[-1]["candidate"] = choice
                            if layout == "zigzag":
                                rows.append(_row(mix, S, cp, "allgather", link, "allgather", summ,
                                                 summ["allgather_positions_per_rank"], cost))
                        thd_ids = _thd_padded(ids, cp)
                        summ = plan_summary(thd_ids, cp, layout="thd", cost_model=cost)
                        summ["plan_cpu_seconds"] = _plan_cpu_seconds(thd_ids, cp, "thd", cost)
                        rows.append(_row(mix, S, cp, "te_thd", link, "te_p2p", summ,
                                         summ["allgather_positions_per_rank"], cost))
                    log(f"  scale {mix} S={S} cp={cp}: {time.perf_counter() - t0:.1f}s")
    finally:
        torch.set_num_threads(threads)
    return rows


def targets(rows: List[Dict]) -> List[Dict]:
    """The issue's targets for balanced at each target point and mix: held or missed, with numbers."""
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
