"""Markdown summary of bench/results.jsonl with every target marked held / missed.

    python scripts/bench/summary.py [bench/results.jsonl] > bench/SUMMARY.md
"""

import json
import os
import statistics
import sys
from collections import defaultdict
from typing import Dict, List

HELD, MISSED = "**held**", "**MISSED**"
EXCHANGES = ("allgather", "halo", "a2a")
LAYOUTS = ("contiguous", "zigzag", "balanced")


def load(path: str) -> List[Dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _kib(n) -> str:
    return "-" if n is None else f"{n / 1024:.1f}"


def _mark(ok: bool) -> str:
    return HELD if ok else MISSED


def comm_tables(rows: List[Dict], out: List[str]) -> None:
    comm = [r for r in rows if r["suite"] == "comm"]
    if not comm:
        return
    idx = {(r["mix"], r["S"], r["cp"], r["layout"], r["exchange"]): r for r in comm}
    row_bytes = comm[0].get("kv_row_bytes")
    out.append("## Communication: K/V bytes per rank per layer (measured by the exchange)\n")
    out.append(f"Largest per-rank K/V bytes sent or received by one `blockdiag_cp_attention` call, "
               f"in KiB, at {row_bytes} bytes per K/V row (b=1, Hkv=1, D=8, fp32: scale by "
               f"b·Hkv·D·dtype/32 for a model); `lb` is that rank's lower bound (bytes of the "
               f"positions its queries need and it does not own). `halo*` = halo fell back to a2a "
               f"(a document straddles more than one boundary). The busiest rank can be a sender, so a "
               f"needed-only cell can exceed `lb` while every rank still receives exactly its own lower "
               f"bound (see the targets above).\n")
    for mix in sorted({r["mix"] for r in comm}, key=["short", "heavy_tail", "single"].index):
        out.append(f"### mix `{mix}`\n")
        out.append("| S | cp | layout | allgather | halo | a2a | lb | allgather / a2a |")
        out.append("|---:|---:|---|---:|---:|---:|---:|---:|")
        for S in sorted({r["S"] for r in comm}):
            for cp in sorted({r["cp"] for r in comm}):
                for layout in LAYOUTS:
                    cells = {e: idx.get((mix, S, cp, layout, e)) for e in EXCHANGES}
                    if not all(cells.values()):
                        continue
                    halo = cells["halo"]
                    halo_txt = _kib(halo["bytes_max"]) + ("*" if halo["exchange_resolved"] != "halo" else "")
                    a2a = cells["a2a"]["bytes_max"]
                    ratio = "∞" if a2a == 0 else f"{cells['allgather']['bytes_max'] / a2a:.1f}×"
                    out.append(f"| {S} | {cp} | {layout} | {_kib(cells['allgather']['bytes_max'])} | "
                               f"{halo_txt} | {_kib(a2a)} | {_kib(cells['a2a']['lower_bound_bytes'])} | {ratio} |")
        out.append("")


def comm_targets(rows: List[Dict], out: List[str]) -> None:
    comm = [r for r in rows if r["suite"] == "comm"]
    if not comm:
        return
    a2a = [r for r in comm if r["exchange"] == "a2a"]
    a2a_bad = [r for r in a2a if not r["recv_equals_lower_bound"]
               or sum(r["bytes_sent"]) != sum(r["lower_bound_per_rank"])]
    out.append(f"- a2a moves exactly the lower bound (every rank receives exactly its lower bound, "
               f"total sent = total needed): {_mark(not a2a_bad)}, held on {len(a2a) - len(a2a_bad)}/{len(a2a)} "
               f"configurations" + (f"; misses: {_configs(a2a_bad)}" if a2a_bad else "") + ".")
    halo = [r for r in comm if r["exchange"] == "halo"]
    pure = [r for r in halo if r["exchange_resolved"] == "halo"]
    halo_bad = [r for r in pure if not r["recv_equals_lower_bound"]]
    out.append(f"- halo equals the lower bound whenever every straddle comes from the previous shard: "
               f"{_mark(not halo_bad)}, held on {len(pure) - len(halo_bad)}/{len(pure)} configurations where "
               f"halo applied; it fell back to a2a on {len(halo) - len(pure)}/{len(halo)} "
               f"(by layout: {_count_by(halo, pure)}); fallbacks also move exactly the lower bound: "
               f"{_mark(all(r['recv_equals_lower_bound'] for r in halo))}.")
    idx = {(r["mix"], r["S"], r["cp"], r["layout"], r["exchange"]): r for r in comm}
    checks = []
    for r in comm:
        if r["mix"] == "short" and r["cp"] == 8 and r["exchange"] in ("halo", "a2a"):
            ag = idx[("short", r["S"], 8, r["layout"], "allgather")]["bytes_max"]
            ratio = float("inf") if r["bytes_max"] == 0 else ag / r["bytes_max"]
            checks.append((r, ratio))
    if checks:
        bad = [(r, x) for r, x in checks if x < 20]
        out.append(f"- short mix, cp=8: needed-only exchanges move >= 20× fewer bytes (bytes_max) than "
                   f"allgather: {_mark(not bad)}, held on {len(checks) - len(bad)}/{len(checks)}; ratios "
                   + ", ".join(f"S={r['S']} {r['layout']}/{r['exchange']} {x:.1f}×"
                               for r, x in sorted(checks, key=lambda c: (c[0]['S'], c[0]['layout'], c[0]['exchange'])))
                   + ".")


def _configs(rs) -> str:
    return ", ".join(f"{r['mix']}/S={r['S']}/cp={r['cp']}/{r['layout']}" for r in rs)


def _count_by(all_rows, kept) -> str:
    tot, fell = defaultdict(int), defaultdict(int)
    for r in all_rows:
        tot[r["layout"]] += 1
    kept_ids = {id(r) for r in kept}
    for r in all_rows:
        if id(r) not in kept_ids:
            fell[r["layout"]] += 1
    return ", ".join(f"{l} {fell[l]}/{tot[l]}" for l in LAYOUTS if tot[l])


def balance(rows: List[Dict], out: List[str]) -> None:
    bal = [r for r in rows if r["suite"] == "balance"]
    if not bal:
        return
    out.append("## Balance: max / mean causal work across ranks (ideal 1.0)\n")
    out.append("| mix | S | cp | contiguous | zigzag | balanced |")
    out.append("|---|---:|---:|---:|---:|---:|")
    idx = {(r["mix"], r["S"], r["cp"], r["layout"]): r["work_max_over_mean"] for r in bal}
    for mix in ("short", "heavy_tail", "single"):
        for S in sorted({r["S"] for r in bal}):
            for cp in sorted({r["cp"] for r in bal}):
                vals = [idx.get((mix, S, cp, l)) for l in LAYOUTS]
                if None in vals:
                    continue
                out.append(f"| {mix} | {S} | {cp} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    out.append("")
    for layout in LAYOUTS:
        vals = [r["work_max_over_mean"] for r in bal if r["layout"] == layout]
        out.append(f"- `{layout}`: max/mean from {min(vals):.3f} to {max(vals):.3f} "
                   f"(median {statistics.median(vals):.3f}) over {len(vals)} mix/S/cp points.")
    out.append("")


def balance_targets(rows: List[Dict], out: List[str]) -> None:
    bal = [r for r in rows if r["suite"] == "balance" and r["layout"] == "balanced"]
    if not bal:
        return
    bad = [r for r in bal if r["work_max_over_mean"] > 1.05]
    out.append(f"- `balanced` work max/mean <= 1.05 on every mix/S/cp: {_mark(not bad)}, held on "
               f"{len(bal) - len(bad)}/{len(bal)}" + (
                   "; misses: " + ", ".join(f"{r['mix']}/S={r['S']}/cp={r['cp']} "
                                            f"{r['work_max_over_mean']:.3f}" for r in bad) if bad else "") + ".")
    comm = {(r["mix"], r["S"], r["cp"], r["layout"], r["exchange"]): r
            for r in rows if r["suite"] == "comm"}
    if not comm:
        return
    checks = []
    for r in bal:
        b = comm.get((r["mix"], r["S"], r["cp"], "balanced", "a2a"))
        c = comm.get((r["mix"], r["S"], r["cp"], "contiguous", "halo"))
        if b and c:
            ratio = 1.0 if b["bytes_max"] == c["bytes_max"] else (
                float("inf") if c["bytes_max"] == 0 else b["bytes_max"] / c["bytes_max"])
            checks.append((r, ratio))
    bad = [(r, x) for r, x in checks if x > 1.2]
    out.append(f"- `balanced` (needed-only exchange) bytes_max within 1.2× of contiguous+halo: "
               f"{_mark(not bad)}, held on {len(checks) - len(bad)}/{len(checks)}" + (
                   "; misses: " + ", ".join(f"{r['mix']}/S={r['S']}/cp={r['cp']} {x:.2f}×"
                                            for r, x in bad) if bad else "") + ".")


def speed(rows: List[Dict], out: List[str]) -> None:
    sp = [r for r in rows if r["suite"] == "speed"]
    if not sp:
        return
    mem = {_key(r): r for r in rows if r["suite"] == "speed_memory"}
    out.append("## Speed and memory: one attention layer, forward + backward, CPU fp32\n")
    out.append("b=1, 8 heads, head dim 64, fp32; cp=2 on gloo (2 processes × 1 thread); the "
               "single-process contenders run on one process × 1 thread. Median of interleaved "
               "repetitions, slowest rank; peak = most tensor memory held during build + fwd + bwd "
               "above the inputs, per rank (max over ranks).\n")
    out.append("| mix | S | contender | layout | exchange | seconds | vs per_doc_ideal | peak MiB |")
    out.append("|---|---:|---|---|---|---:|---:|---:|")
    groups = defaultdict(list)
    for r in sp:
        groups[(r["mix"], r["S"])].append(r)
    for (mix, S), rs in sorted(groups.items(), key=lambda g: (g[0][1], ["short", "heavy_tail", "single"].index(g[0][0]))):
        ideal = next((r["seconds"] for r in rs if r["baseline"] == "per_doc_ideal"), None)
        for r in sorted(rs, key=lambda r: r["seconds"]):
            m = mem.get(_key(r))
            rel = "-" if not ideal else f"{r['seconds'] / ideal:.2f}×"
            name = r["baseline"] if r["baseline"] != "ours" else "ours (cp=2)"
            peak = "-" if not m else f"{m['peak_bytes'] / 2**20:.0f}"
            out.append(f"| {mix} | {S} | {name} | {r['layout']} | {r['exchange']} | {r['seconds']:.3f} | "
                       f"{rel} | {peak} |")
    out.append("")


def _key(r):
    return (r["mix"], r["S"], r["baseline"], r["layout"], r["exchange"])


def speed_targets(rows: List[Dict], out: List[str]) -> None:
    sp = [r for r in rows if r["suite"] == "speed"]
    if not sp:
        return
    groups = defaultdict(dict)
    for r in sp:
        groups[(r["mix"], r["S"])][(r["baseline"], r["layout"], r["exchange"])] = r["seconds"]
    checks = []
    for (mix, S), g in sorted(groups.items()):
        sp_ = g.get(("single_process", "-", "-"))
        ideal = g.get(("per_doc_ideal", "-", "-"))
        if sp_ and ideal:
            checks.append((mix, S, sp_ / ideal))
    bad = [c for c in checks if c[2] > 1.3]
    out.append(f"- our dense kernel on one process within 1.3× of the per-document ideal: "
               f"{_mark(not bad)}, held on {len(checks) - len(bad)}/{len(checks)}; ratios "
               + ", ".join(f"{m}/S={S} {x:.2f}×" for m, S, x in checks) + ".")
    g = groups.get(("short", 16384))
    if g and ("allgather_full_mask", "contiguous", "allgather") in g:
        fm = g[("allgather_full_mask", "contiguous", "allgather")]
        ours = {(k[1], k[2]): fm / v for k, v in g.items() if k[0] == "ours"}
        bad = {k: x for k, x in ours.items() if x < 5}
        out.append(f"- ours >= 5× faster than allgather_full_mask on the short mix at S=16384 (cp=2): "
                   f"{_mark(not bad)}, held on {len(ours) - len(bad)}/{len(ours)} layout/exchange pairs; "
                   f"speed-ups {min(ours.values()):.1f}× to {max(ours.values()):.1f}× "
                   f"(full mask {fm:.2f} s)" + (
                       "; misses: " + ", ".join(f"{l}/{e} {x:.1f}×" for (l, e), x in bad.items()) if bad else "") + ".")
    else:
        out.append("- ours >= 5× faster than allgather_full_mask on the short mix at S=16384: not measured "
                   "in this run.")


def memory_targets(rows: List[Dict], out: List[str]) -> None:
    mem = [r for r in rows if r["suite"] == "speed_memory" and r["mix"] == "short"]
    Ss = sorted({r["S"] for r in mem})
    if len(Ss) < 2:
        return
    lo, hi = Ss[0], Ss[-1]
    by = defaultdict(dict)
    for r in mem:
        by[(r["baseline"], r["layout"], r["exchange"])][r["S"]] = r["peak_bytes"]
    out.append(f"- memory, short mix, peak growth from S={lo} to S={hi} (S grows {hi / lo:.0f}×; a "
               f"local_len × S term grows {(hi / lo) ** 2:.0f}×):")
    ours_ok = True
    for key, v in sorted(by.items()):
        if lo in v and hi in v and v[lo] > 0:
            g = v[hi] / v[lo]
            if key[0] == "ours" and g > 1.5 * hi / lo:
                ours_ok = False
            out.append(f"  - {key[0]} {key[1]}/{key[2]}: {v[lo] / 2**20:.0f} -> {v[hi] / 2**20:.0f} MiB ({g:.1f}×)")
    out.append(f"  - no local_len × S term in ours (every ours configuration grows at most 1.5 × {hi / lo:.0f}×): "
               f"{_mark(ours_ok)}.")


def other(rows: List[Dict], out: List[str]) -> None:
    model = [r for r in rows if r["suite"] == "model"]
    if model:
        out.append("## Model: scripts/pretrain_gpt.py on its embedded default data (2 processes)\n")
        for r in model:
            if r.get("skipped"):
                out.append(f"- CP={r['cp']}: skipped: {r['reason']}")
            else:
                out.append(f"- CP={r['cp']} (DP={r['dp']}): {r['tokens_per_s']:.0f} tokens/s (median of "
                           f"steady log intervals; seq {r['S']}, backend {r['backend']}, exchange "
                           f"{r['exchange']}, layout {r['layout']})")
        out.append("")
    gpu = [r for r in rows if r["suite"] == "gpu"]
    if gpu:
        out.append("## GPU\n")
        skipped = [r for r in gpu if r.get("skipped")]
        for r in skipped:
            out.append(f"- skipped ({r['backend']}): {r['reason']}")
        done = [r for r in gpu if not r.get("skipped")]
        if done:
            out.append("\n| backend | mix | S | cp | layout | TFLOP/s (step) | of peak |")
            out.append("|---|---|---:|---:|---|---:|---:|")
            for r in done:
                out.append(f"| {r['backend']} | {r['mix']} | {r['S']} | {r['cp']} | {r['layout']} | "
                           f"{r['tflops_step']:.1f} | {100 * r['fraction_of_peak']:.1f}% |")
        out.append("")


def scale_section(rows: List[Dict], out: List[str]) -> None:
    sc = [r for r in rows if r["suite"] == "scale"]
    if not sc:
        return
    import json

    import scale

    bench_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
    out.append("## Scale (plan only, issues 10 and 19)\n")
    two_level_section(rows, out, bench_dir)
    latency_section(rows, out)
    worst_case_section(rows, out, bench_dir)
    out.append("### Issue 10's points (one link for the whole group)\n")
    out.append("Balanced at the issue's target points (NVLink: work max/mean <= 1.05 and modeled <= 1.2x "
               "ideal; IB: modeled <= 1.6x ideal; never worse than contiguous or zigzag). `bound` is "
               "prepare.modeled_lower_bound over the ideal.\n")
    round1_path = os.path.join(bench_dir, "scale_round1.json")
    round1 = {}
    if os.path.exists(round1_path):  # the first issue-10 engine (interval plan, first balanced search)
        round1 = {(r["S"], r["cp"], r["layout"], r["mix"], r["link"]): r for r in json.load(open(round1_path))}
    out.append("| S | cp | link | mix | max/mean | modeled/ideal | round 1 | bound/ideal | modeled/bound | "
               "end keys / share | candidate | <= peers | target |")
    out.append("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|---|---|")
    for t in scale.targets([r for r in rows if r.get("link") != "2lvl"]):
        r1 = round1.get((t["S"], t["cp"], "balanced", t["mix"], t["link"]))
        r1_mo = f"{r1['modeled_over_ideal']:.3f}" if r1 else "-"
        out.append(f"| {t['S']} | {t['cp']} | {t['link']} | {t['mix']} | {t['work_max_over_mean']:.3f} | "
                   f"{t['modeled_over_ideal']:.3f} | {r1_mo} | {t['bound_over_ideal']:.3f} | "
                   f"{t['modeled_over_bound']:.3f} | {t['end_keys_over_share']:.2f} | `{t['candidate']}` | "
                   f"{_mark(t['not_worse_than_peers'])} | "
                   f"{_mark(t['held'])} (<= {t['limit']}) |")
    out.append("")
    out.append("`end keys / share`: the K/V positions the holder of the longest document's last token must "
               "receive (all its earlier ones), times the cost model's pairs per position, over a rank's work "
               "share. Since issue 19 every link is priced by the larger of what a rank receives and sends (an "
               "owner whose rows many ranks need pays for sending them), so these rows are not comparable with "
               "the `round 1` column (receives only): one IB link for 16-64 ranks misses 1.6x where a document "
               "heavier than a rank's share must be split (ratio 0.65-1.04), and the two-level tables above "
               "show what the same points cost on 8-GPU nodes. At 32k / cp 8 (NVLink) there are 10-25 "
               "documents: the split document's pieces and the whole ones do not pack finer than 1.20-1.25. "
               "`candidate`: the balanced search's choice (balanced.py).\n")
    before_path = os.path.join(bench_dir, "scale_before.json")
    if os.path.exists(before_path):
        before = {(r["S"], r["cp"], r["layout"]): r for r in json.load(open(before_path))}
        out.append("Before -> round 1 -> now, lognormal mix, one rank's layout + plan on one core, modeled/ideal "
                   "over IB (before: the engine before issue 10, wall ms, bench/scale_before.json; round 1: the "
                   "first issue-10 engine, wall ms, bench/scale_round1.json; now: CPU ms, median of 3):\n")
        out.append("| S, cp | layout | plan ms before | round 1 | now | modeled/ideal before | round 1 | now |")
        out.append("|---|---|---:|---:|---:|---:|---:|---:|")
        for (S, cp, layout), b in sorted(before.items()):
            a = [r for r in sc if (r["S"], r["cp"], r["layout"], r["mix"], r["link"]) ==
                 (S, cp, layout, "lognormal", "ib")]
            if not a:
                continue
            a = a[0]
            r1 = round1.get((S, cp, layout, "lognormal", "ib"))
            r1_ms = f"{r1['plan_ms']:.0f}" if r1 else "-"
            r1_mo = f"{r1['modeled_over_ideal']:.2f}" if r1 else "-"
            out.append(f"| {S // 1024}k, {cp} | {layout} | {b['layout_ms'] + b['plan_ms']:.0f} | {r1_ms} | "
                       f"{1e3 * a['plan_seconds']:.1f} | {b['modeled_over_ideal_ib']:.2f} | {r1_mo} | "
                       f"{a['modeled_over_ideal']:.2f} |")
        out.append("")
    out.append("Plan ms (layout + plan, last rank, one core: CPU time of the planning thread, median of 3), "
               "worst over the three scale mixes and the topologies (nvlink, ib, 2lvl):\n")
    layouts = [l for l in ("contiguous", "zigzag", "balanced", "te_thd") if any(r["layout"] == l for r in sc)]
    out.append("| S | cp | " + " | ".join(layouts) + " |")
    out.append("|---:|---:|" + "---:|" * len(layouts))
    for S, cp in sorted({(r["S"], r["cp"]) for r in sc}):
        cells = []
        for l in layouts:
            v = [r["plan_seconds"] for r in sc if (r["S"], r["cp"], r["layout"]) == (S, cp, l)]
            cells.append(f"{1e3 * max(v):.1f}" if v else "-")
        out.append(f"| {S} | {cp} | " + " | ".join(cells) + " |")
    out.append("")




def _before(bench_dir: str) -> Dict:
    """bench/scale19_before.json: the engine before issue 19 (see bench/README.md), or {}."""
    import json

    path = os.path.join(bench_dir, "scale19_before.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def two_level_section(rows: List[Dict], out: List[str], bench_dir: str) -> None:
    import scale

    targets = scale.two_level_targets(rows)
    if not targets:
        return
    before = {(r["S"], r["cp"], r["mix"]): r for r in _before(bench_dir).get("modeled", [])}
    out.append("### Two levels (issue 19): 8 GPUs per node, NVLink inside, IB between\n")
    out.append("Balanced's modeled attention time over the ideal (cost.py, Hq 32, Hkv 8, D 128, bf16; sends "
               "and receives priced per link) at the target points, no overlap counted: target <= "
               f"{scale.TWO_LEVEL_LIMIT}x, <= {scale.FITS_LIMIT}x where every document fits a node's share "
               "(tokens and work). `before`: the engine before issue 19 (its balanced layout, planned for IB, "
               "with every rank fetching its own keys; bench/scale19_before.json) under the same model. "
               "`uniform IB`: every pair over IB (one level). `overlap`: the streamed op "
               "(`CostModel.overlapped`), backward refetching (and saving) the K/V; `exposed`: the busiest "
               "rank's communication left after overlap.\n")
    out.append("| S | cp | mix | fits a node | max/mean | 2lvl before | 2lvl now | uniform IB before | uniform IB now "
               "| 2lvl overlap (refetch / save) | exposed | uniform IB overlap | <= peers | candidate | target |")
    out.append("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
    for t in targets:
        b = before.get((t["S"], t["cp"], t["mix"]), {})
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        out.append(f"| {t['S']} | {t['cp']} | {t['mix']} | {'yes' if t['fits_a_node'] else 'no'} | "
                   f"{t['work_max_over_mean']:.3f} | {fmt(b.get('two_flat'))} | {t['modeled_over_ideal']:.3f} | "
                   f"{fmt(b.get('uib'))} | {fmt(t['uniform_ib'])} | {t['overlap_over_ideal']:.3f} / "
                   f"{fmt(t['overlap_save_over_ideal'])} | {100 * t['exposed_share']:.0f}% | "
                   f"{fmt(t['uniform_ib_overlap'])} | {_mark(t['not_worse_than_peers'])} | "
                   f"`{t['candidate'][:60]}` | {_mark(t['held'])} (<= {t['limit']}) |")
    out.append("")


def latency_section(rows: List[Dict], out: List[str]) -> None:
    lat = [r for r in rows if r["suite"] == "scale_latency"]
    if not lat:
        return
    pairs = sorted({(r["latency_us"], r["latency_inter_us"]) for r in lat})
    out.append("### Per-message latency (issue 19)\n")
    out.append("Balanced's modeled / ideal at the two-level points (no overlap; overlapped with refetch after the "
               "slash) when every transfer also pays a latency (intra-node / inter-node, microseconds), the "
               "layout searched under each model (`scripts/bench/scale.py::run_latency`).\n")
    out.append("| S | cp | mix | " + " | ".join(f"{a:g} / {b:g} us" for a, b in pairs) + " |")
    out.append("|---:|---:|---|" + "---:|" * len(pairs))
    for S, cp, mix in sorted({(r["S"], r["cp"], r["mix"]) for r in lat}):
        got = {(r["latency_us"], r["latency_inter_us"]): r for r in lat if (r["S"], r["cp"], r["mix"]) == (S, cp, mix)}
        cells = [f"{got[p]['modeled_over_ideal']:.3f} / {got[p]['overlap_over_ideal']:.3f}" if p in got else "-"
                 for p in pairs]
        out.append(f"| {S} | {cp} | {mix} | " + " | ".join(cells) + " |")
    out.append("")


def worst_case_section(rows: List[Dict], out: List[str], bench_dir: str) -> None:
    import scale

    wc = [r for r in rows if r["suite"] == "scale_worst"]
    if not wc:
        return
    n_mixes = len({r["mix"] for r in wc})
    before = _before(bench_dir)
    side = {}  # (S, cp, layout) -> (worst before, worst after) of the side-by-side run
    for r in before.get("plan_ms", []):
        key = (r["S"], r["cp"], r["layout"])
        b, a = side.get(key, (0.0, 0.0))
        side[key] = (max(b, r["before_ms"]), max(a, r["after_ms"]))
    out.append(f"### Worst case over {n_mixes} random mixes (issue 19)\n")
    out.append("Mixes: `megatron_ext.testing.mixes.worst_case_mix_params` (lognormal sigma 0.5-1.5 around 256-8k "
               "tokens, uniform, heavy-tailed with one document of S/8-S/2, one document). Plan: one rank's "
               "layout + plan (`prepare_plan`, last rank), CPU ms of the planning thread, median of 5 after one "
               "warm-up, worst over the mixes (and which); `worst min`: the worst over the mixes of each plan's "
               "minimum of those 5 (the same plan ran up to 2x apart on this shared host). `side by side`: the engine before issue 19 and "
               "the engine of that day measured alternately in one run (bench/scale19_before.json, "
               f"{before.get('measured', 'not measured')}; the machine is shared: compare within a run; the "
               "planner has been made faster since, so `then` is not this run's engine).\n")
    out.append("| S | cp | topology | layout | worst plan ms | mix | worst min ms | side by side: before | then "
               "| target |")
    out.append("|---:|---:|---|---|---:|---|---:|---:|---:|---|")
    for S, cp, link, limit in scale.SPEED_POINTS:
        for layout in scale.LAYOUTS + ("te_thd",):
            got = [r for r in wc if r["kind"] == "speed" and (r["S"], r["cp"], r["layout"]) == (S, cp, layout)]
            if not got:
                continue
            w = max(got, key=lambda r: r["plan_seconds"])
            b, a = side.get((S, cp, layout), (None, None))
            lows = [r["plan_min_seconds"] for r in got if "plan_min_seconds" in r]
            out.append(f"| {S} | {cp} | {link} | {layout} | {1e3 * w['plan_seconds']:.1f} | {w['mix']} | "
                       f"{f'{1e3 * max(lows):.1f}' if lows else '-'} | {'-' if b is None else f'{b:.1f}'} | {'-' if a is None else f'{a:.1f}'} | "
                       f"{_mark(1e3 * w['plan_seconds'] <= limit)} (<= {limit:.0f}) |")
    out.append("")
    out.append("Modeled / ideal over the same mixes (no overlap; overlap with refetch), worst and median over "
               "the mixes, per layout; `fits` = worst over the mixes whose every document fits a node:\n")
    out.append("| S | cp | topology | layout | worst | mix | median | worst fits | worst overlap |")
    out.append("|---:|---:|---|---|---:|---|---:|---:|---:|")
    for S, cp in scale.TWO_LEVEL_POINTS:
        for link in ("2lvl", "ib"):
            for layout in scale.LAYOUTS:
                got = [r for r in wc if r["kind"] == "modeled" and (r["S"], r["cp"], r["link"], r["layout"]) ==
                       (S, cp, link, layout)]
                if not got:
                    continue
                w = max(got, key=lambda r: r["modeled_over_ideal"])
                vals = sorted(r["modeled_over_ideal"] for r in got)
                fits = [r["modeled_over_ideal"] for r in got if r["fits_a_node"]]
                out.append(f"| {S} | {cp} | {link} | {layout} | {w['modeled_over_ideal']:.3f} | {w['mix']} | "
                           f"{vals[len(vals) // 2]:.3f} | {'-' if not fits else f'{max(fits):.3f}'} | "
                           f"{max(r['overlap_over_ideal'] for r in got):.3f} |")
    out.append("")


def dropin_section(rows: List[Dict], out: List[str]) -> None:
    dr = [r for r in rows if r["suite"] == "dropin"]
    if not dr:
        return
    r0 = dr[0]
    out.append(f"## Megatron's data paths: what the mask path and the q/k/v agreement cost "
               f"(S={r0['S']}, cp={r0['cp']}, {r0['mix']} mix, {r0['backend']}, {r0['exchange']})\n")
    out.append("| measure | median ms (slowest rank) | / one layer fwd+bwd | per |")
    out.append("|---|---:|---:|---|")
    per = {"mask_derive": "micro batch", "mask_state": "micro batch", "layer_fwd_bwd": "layer",
           "qkv_agreement": "layer forward call"}
    for r in dr:
        out.append(f"| {r['measure']} | {r['median_seconds'] * 1000:.1f} | {r['over_layer_fwd_bwd']:.3f} | "
                   f"{per.get(r['measure'], '')} |")
    out.append("")


def _mem_rows(rows, kernel="stub", engine="current"):
    return [r for r in rows if r["suite"] == "memory" and r["kernel"] == kernel and r.get("engine") == engine]


def cp_memory_targets(rows: List[Dict], out: List[str]) -> None:
    mem = [r for r in _mem_rows(rows) + _mem_rows(rows, "dense") if r["kv_backward"] == "refetch"]
    if not mem:
        return
    by = {(r["kernel"], r["mix"], r["S"], r["layout"], r["exchange"], r["cp"]): r for r in mem}
    ratios = [(k, by[k[:5] + (4,)]["peak_bytes"] / by[k[:5] + (2,)]["peak_bytes"])
              for k in by if k[5] == 2 and k[:5] + (4,) in by]
    bad = [(k, x) for k, x in ratios if x > 0.6]
    out.append(f"- memory, kv_backward=refetch: busiest rank's peak at cp=4 <= 0.6× its peak at cp=2: "
               f"{_mark(not bad)}, held on {len(ratios) - len(bad)}/{len(ratios)} (kernel, mix, S, layout, "
               f"exchange); ratios {min(x for _, x in ratios):.2f}–{max(x for _, x in ratios):.2f}"
               + ("; misses: " + ", ".join(f"{k[0]}/{k[1]}/S={k[2]}/{k[3]}/{k[4]} {x:.2f}" for k, x in bad)
                  if bad else "") + ".")
    held = [(r, r["held_bytes"] / r["local_bytes"]) for r in mem]
    bad = [(r, x) for r, x in held if x > 2]
    out.append(f"- memory, kv_backward=refetch: held between forward and backward <= 2× local q/k/v/out: "
               f"{_mark(not bad)}, held on {len(held) - len(bad)}/{len(held)}; at most "
               f"{max(x for _, x in held):.2f}× local.")


def cp_memory(rows: List[Dict], out: List[str]) -> None:
    mem = _mem_rows(rows) + _mem_rows(rows, "dense")
    if not mem:
        return
    out.append("## Memory per rank as cp grows: one attention layer, forward + backward, CPU fp32\n")
    out.append("b=1, 8 heads, head dim 64; busiest rank's peak tensor memory above the inputs during forward + "
               "backward, and what forward leaves for backward (output included), against the rank's own "
               "q/k/v/out (`local`). `stub`: the engine's buffers with a kernel that returns zeros of the real "
               "shapes; `dense`: the real kernel. Worst over layouts x exchanges; `scripts/bench/memory.py`.\n")
    out.append("| kernel | kv_backward | mix | S | peak MiB cp=2 / 4 / 8 | cp4/cp2 | cp8/cp4 | held / local (max) |")
    out.append("|---|---|---|---:|---|---:|---:|---:|")
    groups = defaultdict(list)
    for r in mem:
        groups[(r["kernel"], r["kv_backward"], r["mix"], r["S"])].append(r)
    for (kernel, mode, mix, S), rs in sorted(groups.items()):
        peak = {cp: max(r["peak_bytes"] for r in rs if r["cp"] == cp) for cp in sorted({r["cp"] for r in rs})}
        held = max(r["held_bytes"] / r["local_bytes"] for r in rs)
        fmt = " / ".join(f"{peak[cp] / 2**20:.0f}" for cp in sorted(peak))
        r42 = f"{peak[4] / peak[2]:.2f}" if 2 in peak and 4 in peak else "-"
        r84 = f"{peak[8] / peak[4]:.2f}" if 4 in peak and 8 in peak else "-"
        out.append(f"| {kernel} | {mode} | {mix} | {S} | {fmt} | {r42} | {r84} | {held:.2f} |")
    exposed = [r for r in mem if r.get("exposed_comm_fraction_busiest") is not None]
    if exposed:
        out.append("")
        out.append("Exposed communication (dense kernel, a timed iteration, cp = 2: one rank per core): the "
                   "share of a layer's forward + backward the busiest rank (most kernel time: it sets the "
                   "layer's time) spent waiting for K/V that compute did not hide, over layouts x exchanges: "
                   + ", ".join(f"{m} {mode} {min(x):.0%}–{max(x):.0%} (median {sorted(x)[len(x) // 2]:.0%})"
                               for (m, mode), x in sorted(_group_values(
                                   [r for r in exposed if r["cp"] == 2], ("mix", "kv_backward"),
                                   "exposed_comm_fraction_busiest").items())) + ".")
    before = [r for r in rows if r["suite"] == "memory" and r.get("engine", "current") != "current"]
    if before:
        out.append("")
        out.append("Before -> after (the same measurement on the engine before streaming, real dense kernel, "
                   "busiest rank's peak MiB, kv_backward=refetch after):\n")
        out.append("| mix | S | layout | exchange | cp | before | after |")
        out.append("|---|---:|---|---|---:|---:|---:|")
        after = {(r["mix"], r["S"], r["layout"], r["exchange"], r["cp"]): r for r in _mem_rows(rows, "dense")
                 if r["kv_backward"] == "refetch"}
        for r in sorted(before, key=lambda r: (r["mix"], r["S"], r["layout"], r["exchange"], r["cp"])):
            a = after.get((r["mix"], r["S"], r["layout"], r["exchange"], r["cp"]))
            now = "-" if a is None else f"{a['peak_bytes'] / 2**20:.0f}"
            out.append(f"| {r['mix']} | {r['S']} | {r['layout']} | {r['exchange']} | {r['cp']} | "
                       f"{r['peak_bytes'] / 2**20:.0f} | {now} |")
    out.append("")


def layer_ab_section(rows: List[Dict], out: List[str]) -> None:
    ab = [r for r in rows if r["suite"] == "layer_ab"]
    if not ab:
        return
    out.append("## One layer against an older engine (`scripts/bench/layer_ab.py`)\n")
    out.append(f"Forward + backward of one attention layer at cp=2, mix `{ab[0]['mix']}`, S={ab[0]['S']}, dense, "
               "fp32, 8 heads x 64; fresh processes per run, the two engines alternated; seconds are the "
               "median over rounds of each run's median (slowest rank).\n")
    out.append(f"| layout | exchange | {ab[0]['engine']} s | {ab[0]['other']} s | {ab[0]['other']} / "
               f"{ab[0]['engine']} per round |")
    out.append("|---|---|---:|---:|---|")
    for r in ab:
        out.append(f"| {r['layout']} | {r['exchange']} | {r['seconds']:.3f} | {r['seconds_other']:.3f} | "
                   + ", ".join(f"{x:.2f}" for x in r["ratio_other_over_this_per_round"]) + " |")
    out.append("")


def layer_ab_target(rows: List[Dict], out: List[str]) -> None:
    ab = [r for r in rows if r["suite"] == "layer_ab"]
    if not ab:
        return
    ratios = [r["seconds_other"] / r["seconds"] for r in ab]
    out.append(f"- one layer at cp=2 ({ab[0]['mix']}, S={ab[0]['S']}) no slower than {ab[0]['other']}: "
               f"{_mark(min(ratios) >= 1.0)}, {ab[0]['other']} / {ab[0]['engine']} {min(ratios):.2f}–"
               f"{max(ratios):.2f}× over the 9 layout x exchange pairs.")


def window_section(rows: List[Dict], out: List[str]) -> None:
    win = [r for r in rows if r["suite"] == "window"]
    if not win:
        return
    out.append("## Sliding windows: K/V moved per layer and work, plan only\n")
    out.append("Busiest rank's K/V received per layer by the needed-only exchanges (a2a = halo = the windowed "
               "lower bound: exactly the keys some query's window reaches on another rank) against the "
               "all-gather ring, in MiB at Llama-3-8B's K/V (4 KiB a row); work = attention pairs per rank, "
               "max / mean. `balanced` is laid out for the window it runs (the model's windows, "
               "`cost.WindowMix`). `scripts/bench/window.py`.\n")
    head = {(r["S"], r["cp"], r["mix"], r["layout"], r["window"]): r for r in win}
    keys = sorted({(S, cp, mix) for S, cp, mix, _, w in head if w == 4096 and mix in ("short", "long")})
    if keys:
        out.append("A 4k window, short and long documents: busiest rank's K/V per layer, MiB (no window -> 4k "
                   "window), against the all-gather ring:\n")
        out.append("| S | cp | mix | contiguous | zigzag | balanced | all-gather | balanced 4k / all-gather |")
        out.append("|---:|---:|---|---:|---:|---:|---:|---:|")
        for S, cp, mix in keys:
            cells, ag, ratio = [], "-", "-"
            for layout in ("contiguous", "zigzag", "balanced"):
                a, b = head.get((S, cp, mix, layout, None)), head.get((S, cp, mix, layout, 4096))
                cells.append("-" if a is None or b is None else
                             f"{a['needed_bytes_max'] / 2**20:.0f} -> {b['needed_bytes_max'] / 2**20:.1f}")
                if layout == "balanced" and b is not None:
                    ag = f"{b['allgather_bytes'] / 2**20:.0f}"
                    ratio = f"{b['needed_bytes_max'] / b['allgather_bytes']:.3f}"
            out.append(f"| {S} | {cp} | {mix} | " + " | ".join(cells) + f" | {ag} | {ratio} |")
        out.append("\nEvery layout, mix and window:\n")
    out.append("| S | cp | mix | layout | window | needed MiB | all-gather MiB | needed / all-gather | work max/mean |")
    out.append("|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for r in sorted(win, key=lambda r: (r["S"], r["cp"], r["mix"], r["layout"], r["window"] or 0)):
        out.append(f"| {r['S']} | {r['cp']} | {r['mix']} | {r['layout']} | {r['window'] or 'none'} | "
                   f"{r['needed_bytes_max'] / 2**20:.1f} | {r['allgather_bytes'] / 2**20:.0f} | "
                   f"{r['needed_bytes_max'] / r['allgather_bytes']:.3f} | {r['work_max_over_mean']:.3f} |")
    out.append("")


def _group_values(rows, keys, field):
    out = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r[field])
    return out


def render(rows: List[Dict]) -> str:
    out = ["# Benchmark summary", ""]
    meta = [r for r in rows if r["suite"] == "meta"]
    if meta:
        m = meta[-1]
        out.append(f"Generated by `scripts/bench/run_all.py` on {m.get('host', '?')} "
                   f"({m.get('cpus', '?')} CPUs, torch {m.get('torch', '?')}), {m.get('date', '?')}; "
                   f"suites {', '.join(m.get('suites', []))}; wall time {m.get('wall_seconds', 0):.0f} s"
                   + (" (quick)" if m.get("quick") else "") + "."
                   + (f" Engine at commit `{m['git_head'][:10]}`" if m.get("git_head") else "")
                   + (f" with uncommitted engine edits: {', '.join(m['engine_uncommitted'])}"
                      if m.get("engine_uncommitted") else "") + ("." if m.get("git_head") else "") + "\n")
    out.append("## Targets\n")
    comm_targets(rows, out)
    balance_targets(rows, out)
    speed_targets(rows, out)
    memory_targets(rows, out)
    cp_memory_targets(rows, out)
    layer_ab_target(rows, out)
    out.append("")
    comm_tables(rows, out)
    balance(rows, out)
    speed(rows, out)
    cp_memory(rows, out)
    layer_ab_section(rows, out)
    window_section(rows, out)
    other(rows, out)
    scale_section(rows, out)
    dropin_section(rows, out)
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    here = os.path.dirname(os.path.abspath(__file__))
    path = argv[0] if argv else os.path.join(here, "..", "..", "bench", "results.jsonl")
    sys.stdout.write(render(load(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
