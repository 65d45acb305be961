"""exchange_choice suite: plan only, no processes. Which exchange moves less and is modeled faster, per mix.

At 128k tokens / cp 8 (one node, NVLink) and 1M tokens / cp 64 (8 nodes x 8 GPUs, NVLink inside
a node, IB between), on the scale suite's mixes (``scale_mixes.py``, seed 0) and one document of
S (``single``), for each exchange: the busiest rank's bytes moved per layer forward and the cost
model's modeled time of one layer forward + backward (``megatron_ext/blockdiag_cp/cost.py``).

- ``allgather``: the zigzag layout, every rank's K/V to every rank (``plan_summary``'s all-gather
  pricing, as the scale suite's ``allgather`` rows; across nodes a ring whose every hop is IB).
- ``a2a`` (needed-only) and, at the two-level point, ``hierarchical``: the ``balanced`` layout
  (searched under that exchange's cost model) and ``zigzag``; bytes from the plan's counts
  (``plan_summary``'s ``traffic``, the positions each rank receives and sends) x the K/V row bytes
  (2 * Hkv * D * dtype), as the scale suite reads them.
- ``ulysses``: any layout; per rank per layer forward the two all-to-alls move (cp - 1) / cp of its
  local q, k and v (K/V heads repeated r = cp / gcd(Hkv, cp) times) and out, whatever the
  documents (``cost_options.ulysses_forward_bytes``, the engine's own per-tensor count; tests/bench/
  test_bench_exchange_choice.py checks it against ``report()["bytes_sent"]``). Modeled time
  (``ulysses_seconds``): every rank attends every document on Hq / cp heads, so compute is the
  ideal, total causal pairs / cp x ``seconds_per_pair``; the all-to-alls are priced on the cost
  model's links, the backward mirroring the forward: with g ranks per node (g = cp on one node)
  a tensor of T bytes sends T (g - 1) / cp over NVLink and T (cp - g) / cp over IB, so

      modeled = pairs / cp * seconds_per_pair + 2 * (B_nvlink / 400e9 + B_ib / 50e9)

  (``CostModel.comm_seconds`` on those bytes in K/V-row units), with nothing overlapped; streamed, as
  the engine moves them, a group of heads at a time (``cost_options.pipelined_seconds``): all but the
  first group's move in and the last one's move home hidden behind the attention, as far as it lasts.
- ``2d`` (two-dimensional CP, ``cost_options.price_option``): ulysses over u consecutive ranks inside
  a node, then a2a or hierarchical between the r = cp / u groups, for every u dividing cp and the 8
  GPUs per node with 1 < u < cp (128k / cp 8: u 2, 4; 1M / cp 64: u 2, 4, 8; hierarchical where a
  node holds several groups), on both layouts at r:

      modeled = 2 * B_u / 400e9 + plan_summary(ids, r, layout, CostModel(Hq / u, Hkv * rep / u))

  B_u = (u - 1) / u of the local q, k (repeated u / gcd(Hkv, u) times), v and out; the outer
  cost model's links: NVLink on one node, two levels with G / u groups per node, IB when u = 8.
  Rows carry ``option`` ("2d u4 x r2 a2a"), ``ulysses_size``, ``outer_exchange``; ``choices``
  compares the best of them with the 1-D exchanges.

Llama-3-8B attention (32 query heads, 8 K/V heads, head dim 128, bf16) at both points. Ulysses needs
cp to divide the query heads: at cp 64 the 8B is refused (a row with ``refused``), so the 1M / cp 64
point is priced a second time with Llama-3-70B attention (64 query heads, 8 K/V heads, head dim
128), where ulysses runs with every K/V head repeated 8 times. Every time is modeled (cost.py's
constants above), none measured.
"""

import time
from typing import Dict, List, Optional, Tuple

import torch

# The ulysses pricing is the library's (one place for the bench, the planner and a per-step chooser).
from megatron_ext.blockdiag_cp.cost_options import (  # noqa: F401 - re-exported for the bench's tests
    head_groups_for, pipelined_seconds, price_option, ulysses_forward_bytes, ulysses_link_bytes, ulysses_seconds)

GPUS_PER_NODE = 8
# model -> (Hq, Hkv, head dim, dtype bytes)
MODELS = {"llama3_8b": (32, 8, 128, 2), "llama3_70b": (64, 8, 128, 2)}
# (label, S, cp, link, models): link "nvlink" = one node, "2lvl" = GPUS_PER_NODE per node, NVLink + IB.
POINTS = (("128k / cp 8", 131072, 8, "nvlink", ("llama3_8b",)),
          ("1M / cp 64", 1048576, 64, "2lvl", ("llama3_8b", "llama3_70b")))
MIXES = ("short", "lognormal", "heavy", "single")
LAYOUTS = ("balanced", "zigzag")
EXCHANGES = ("allgather", "a2a", "hierarchical", "ulysses", "2d")  # "2d": the best 2-D option of the point


def doc_ids(mix: str, S: int) -> torch.Tensor:
    """The scale suite's mix (seed 0), or ``single``: one document of S tokens."""
    from scale_mixes import scale_doc_ids

    return torch.ones(S, dtype=torch.long) if mix == "single" else scale_doc_ids(mix, S)


def cost_model(link: str, dims, hierarchical: bool = True):
    from megatron_ext.blockdiag_cp.cost import CostModel

    hq, hkv, d, nbytes = dims
    if link == "2lvl":
        return CostModel.two_level(GPUS_PER_NODE, hq, hkv, d, nbytes, hierarchical=hierarchical)
    return CostModel.preset(link, hq, hkv, d, nbytes)


def _busiest(traffic) -> Tuple[int, int, int]:
    """(max over ranks of max(received, sent), of received, of max(inter-node received, sent)) positions."""
    recv = traffic.intra_in + traffic.inter_in
    sent = traffic.intra_out + traffic.inter_out
    return (int(torch.maximum(recv, sent).max()), int(recv.max()),
            int(torch.maximum(traffic.inter_in, traffic.inter_out).max()))


def _row(base: Dict, exchange: str, layout: str, cost, positions: Tuple[int, int, int], row_bytes: int,
         modeled: float, overlap: Optional[float], ideal: float, **extra) -> Dict:
    both, recv, inter = positions
    return {**base, "exchange": exchange, "layout": layout, "cost_model": cost.name,
            "bytes_max": both * row_bytes, "bytes_received_max": recv * row_bytes,
            "inter_node_bytes_max": inter * row_bytes, "modeled_seconds": modeled,
            "overlap_seconds": overlap, "ideal_seconds": ideal, "modeled_over_ideal": modeled / ideal, **extra}


def run(points=POINTS, mixes=MIXES, log=print) -> List[Dict]:
    from megatron_ext.blockdiag_cp import plan_summary
    from megatron_ext.blockdiag_cp.layouts import padded_length

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows: List[Dict] = []
    try:
        for label, S, cp, link, models in points:
            for model in models:
                hq, hkv, d, nbytes = dims = MODELS[model]
                row_bytes = 2 * hkv * d * nbytes
                t0 = time.perf_counter()
                for mix in mixes:
                    ids = doc_ids(mix, S)
                    lengths = torch.unique_consecutive(ids, return_counts=True)[1].double()
                    pairs = float((lengths * (lengths + 1) / 2).sum())
                    base = {"suite": "exchange_choice", "point": label, "mix": mix, "S": S, "cp": cp, "link": link,
                            "model": model, "heads": hq, "kv_heads": hkv, "head_dim": d, "dtype_bytes": nbytes,
                            "backend": "-", "row_bytes": row_bytes, "documents": int(lengths.numel()),
                            "longest": int(lengths.max())}
                    needed = (("a2a", False), ("hierarchical", True)) if link == "2lvl" else (("a2a", False),)
                    for exchange, hier in needed:
                        cost = cost_model(link, dims, hier)
                        for layout in LAYOUTS:
                            t = time.thread_time()
                            s = plan_summary(ids, cp, layout=layout, cost_model=cost)
                            rows.append(_row(base, exchange, layout, cost, _busiest(s["traffic"]), row_bytes,
                                             s["modeled_seconds"], s["overlap_seconds"], s["ideal_seconds"],
                                             work_max_over_mean=s["work_max_over_mean"],
                                             candidate=s["layout_choice"], summary_cpu_seconds=time.thread_time() - t))
                            if layout == "zigzag" and not hier:
                                rows.append(_row(base, "allgather", "zigzag", cost,
                                                 _busiest(s["traffic_allgather"]), row_bytes,
                                                 s["modeled_allgather_seconds"], s["overlap_allgather_seconds"],
                                                 s["ideal_seconds"], work_max_over_mean=s["work_max_over_mean"]))
                    cost = cost_model(link, dims)
                    local_len = padded_length(S, "zigzag", cp) // cp
                    moved, repeats, refused = ulysses_forward_bytes(local_len, 1, hq, hkv, d, d, nbytes, cp)
                    if refused:
                        rows.append({**base, "exchange": "ulysses", "layout": "any", "cost_model": cost.name,
                                     "refused": refused})
                        rows += two_d_rows(base, ids, cp, dims, link)
                        continue
                    intra, inter = ulysses_link_bytes(local_len, hq, hkv, d, nbytes, cp, repeats,
                                                      GPUS_PER_NODE if link == "2lvl" else 0)
                    modeled, ideal, comm = ulysses_seconds(cost, pairs, cp, intra, inter, row_bytes)
                    streamed = pipelined_seconds(ideal, comm, head_groups_for(hq // cp, hkv * repeats // cp, False))
                    rows.append(_row(base, "ulysses", "any", cost, (0, 0, 0), row_bytes, modeled, streamed, ideal,
                                     bytes_max=moved, bytes_received_max=moved, inter_node_bytes_max=round(inter),
                                     kv_head_repeats=repeats, comm_seconds=comm, work_max_over_mean=1.0))
                    rows += two_d_rows(base, ids, cp, dims, link)
                log(f"  exchange_choice {label} {model}: {time.perf_counter() - t0:.1f}s")
    finally:
        torch.set_num_threads(threads)
    return rows


def two_d_rows(base: Dict, ids: torch.Tensor, cp: int, dims, link: str) -> List[Dict]:
    """2-D CP rows (``cost_options.price_option``): every ulysses size u with 1 < u < cp dividing cp
    and the GPUs per node, outer a2a (and hierarchical where the outer level spans nodes with several
    groups per node), each on LAYOUTS; ``exchange`` "2d", ``option`` e.g. "2d u4 x r2 a2a"."""
    from megatron_ext.blockdiag_cp.cost_options import default_options

    G = GPUS_PER_NODE if link == "2lvl" else cp
    rows, cache = [], {}
    for exchange, u in default_options(cp, G):
        if not 1 < u < cp:
            continue
        for layout in LAYOUTS:
            t = time.thread_time()
            o = price_option(ids, cp, layout, exchange, u, dims, G, "nvlink", cache)
            row = {**base, "exchange": "2d", "option": o.name, "outer_exchange": exchange, "ulysses_size": u,
                   "layout": o.layout, "cost_model": f"2d u{u}"}
            if o.refused:
                rows.append({**row, "refused": o.refused})
                continue
            # The suite compares exchanges on cost.py's terms (pairs and bytes), which the 1-D rows are
            # priced on; the planned price's merges (``merge_seconds``) stay out of it here.
            modeled, overlap = o.modeled_seconds - o.merge_seconds, o.overlap_seconds - o.merge_seconds
            rows.append({**row, "bytes_max": o.bytes_max, "bytes_received_max": o.bytes_max,
                         "inter_node_bytes_max": o.inter_node_bytes_max, "modeled_seconds": modeled,
                         "overlap_seconds": overlap, "ideal_seconds": o.ideal_seconds,
                         "modeled_over_ideal": modeled / o.ideal_seconds, "merge_seconds": o.merge_seconds,
                         "summary_cpu_seconds": time.thread_time() - t})
    return rows


TIE = 0.01  # exchanges modeled within 1% of the least are named with it


def _picks(timed: Dict[str, float], names: Optional[Dict[str, str]] = None) -> str:
    """The exchange of least time, and any within TIE of it ("a2a = hierarchical"); ``names``: how
    to print one (the 2-D column as its option, "2d u8 x r8 a2a")."""
    if not timed:
        return "-"
    best = min(timed.values())
    names = names or {}
    return " = ".join(names.get(ex, ex) for ex in EXCHANGES if ex in timed and timed[ex] <= best * (1 + TIE))


def choices(rows: List[Dict]) -> List[Dict]:
    """Per point, model and mix (in run order): each exchange's row of least modeled time over its
    layouts (``by``; a refused exchange: its reason; "2d": over every 2-D option, its ``option`` naming u,
    r and the outer exchange), its least streamed time (``streamed``), and the
    exchanges of least time without overlap (``pick``) and with the streamed op (``pick_streamed``),
    ties within TIE named together."""
    ours = [r for r in rows if r["suite"] == "exchange_choice"]
    keys: List[Tuple] = []
    for r in ours:
        if (r["S"], r["model"], r["mix"]) not in keys:
            keys.append((r["S"], r["model"], r["mix"]))
    out = []
    for S, model, mix in keys:
        got = [r for r in ours if (r["S"], r["model"], r["mix"]) == (S, model, mix)]
        rec = {"point": got[0]["point"], "S": S, "cp": got[0]["cp"], "model": model, "mix": mix,
               "documents": got[0]["documents"], "longest": got[0]["longest"], "ideal_seconds": None,
               "by": {}, "streamed": {}}
        for ex in EXCHANGES:
            cands = [r for r in got if r["exchange"] == ex and not r.get("refused")]
            if cands:
                rec["by"][ex] = min(cands, key=lambda r: r["modeled_seconds"])
                streamed = min(cands, key=lambda r: r["overlap_seconds"])
                rec["streamed"][ex] = streamed["overlap_seconds"]
                if ex == "2d":
                    rec["streamed_option"] = streamed["option"]
                rec["ideal_seconds"] = rec["by"][ex]["ideal_seconds"]
            elif any(r["exchange"] == ex for r in got):
                rec["by"][ex] = {"refused": next(r["refused"] for r in got if r["exchange"] == ex)}
        rec["pick"] = _picks({ex: r["modeled_seconds"] for ex, r in rec["by"].items() if "modeled_seconds" in r},
                             {"2d": rec["by"].get("2d", {}).get("option", "2d")})
        rec["pick_streamed"] = _picks(rec["streamed"], {"2d": rec.get("streamed_option", "2d")})
        out.append(rec)
    return out
