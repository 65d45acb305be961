"""PNG plots of bench/results.jsonl (matplotlib, Agg backend).

    comm_bytes.png   bytes per exchange/layout against the lower bound (largest S)
    balance.png      work max/mean per layout, per mix, per cp (largest S)
    speed.png        fwd+bwd seconds of ours against the baselines, per (mix, S)
    memory.png       peak tensor memory vs S, ours against the baselines (short mix)
    memory_cp.png    busiest rank's peak memory vs cp, every layout x exchange, against local q/k/v/out
    scale.png        modeled / ideal attention time vs cp per layout (scale suite, largest S)
    exchange_choice.png  modeled ms per exchange per mix at 128k / cp 8 and 1M / cp 64 (exchange_choice suite)
    gpu_model.png    modeled H200 time / roofline per mix, layout and exchange, GQA, no window (gpu_model suite);
                     a tick: modeled / the busiest rank's own roofline
"""

import os
import sys
from collections import defaultdict
from typing import Dict, List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MIX_ORDER = ["short", "heavy_tail", "single"]
LAYOUTS = ("contiguous", "zigzag", "balanced")
EXCHANGES = ("allgather", "halo", "a2a")
COLORS = {"allgather": "#c44e52", "halo": "#55a868", "a2a": "#4c72b0", "lower bound": "#222222"}


def _mixes(rows):
    return [m for m in MIX_ORDER if any(r["mix"] == m for r in rows)]


_FLOOR_KIB = 0.03


def _bar(ax, x, nbytes, width, **kw):
    if nbytes == 0:
        ax.bar(x, 0, width, **kw)  # keeps the legend entry
        ax.text(x, _FLOOR_KIB * 1.15, "0", ha="center", fontsize=6)
    else:
        ax.bar(x, nbytes / 1024, width, **kw)


def plot_comm(rows: List[Dict], out_dir: str) -> str:
    comm = [r for r in rows if r["suite"] == "comm"]
    if not comm:
        return ""
    S = max(r["S"] for r in comm)
    comm = [r for r in comm if r["S"] == S]
    idx = {(r["mix"], r["cp"], r["layout"], r["exchange"]): r for r in comm}
    mixes, cps = _mixes(comm), sorted({r["cp"] for r in comm})
    fig, axes = plt.subplots(1, len(mixes), figsize=(6 * len(mixes), 4.5), squeeze=False)
    for ax, mix in zip(axes[0], mixes):
        labels, x = [], 0
        width = 0.8 / len(EXCHANGES)
        for cp in cps:
            for layout in LAYOUTS:
                if (mix, cp, layout, "a2a") not in idx:
                    continue
                for i, ex in enumerate(EXCHANGES):
                    r = idx.get((mix, cp, layout, ex))
                    if r:
                        hatch = "//" if ex == "halo" and r["exchange_resolved"] != "halo" else None
                        _bar(ax, x + (i - 1.5) * width, r["bytes_max"], width,
                             color=COLORS[ex], hatch=hatch, label=ex if x == 0 else None)
                lb = idx[(mix, cp, layout, "a2a")]["lower_bound_bytes"]
                _bar(ax, x + 1.5 * width, lb, width, color=COLORS["lower bound"],
                     label="lower bound" if x == 0 else None)
                labels.append(f"cp{cp}\n{layout[:6]}")
                x += 1
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylim(bottom=_FLOOR_KIB)
        ax.set_ylabel("largest per-rank K/V KiB per layer (0 drawn as '0')")
        ax.set_title(f"{mix}, S={S} (hatched halo = fell back to a2a)", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("K/V bytes moved per attention call, measured by the exchange "
                 f"({comm[0]['kv_row_bytes']} B per K/V row)")
    fig.tight_layout()
    path = os.path.join(out_dir, "comm_bytes.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_balance(rows: List[Dict], out_dir: str) -> str:
    bal = [r for r in rows if r["suite"] == "balance"]
    if not bal:
        return ""
    Ss = sorted({r["S"] for r in bal})
    mixes, cps = _mixes(bal), sorted({r["cp"] for r in bal})
    idx = {(r["mix"], r["S"], r["cp"], r["layout"]): r["work_max_over_mean"] for r in bal}
    fig, axes = plt.subplots(1, len(mixes), figsize=(6 * len(mixes), 4.2), squeeze=False)
    for ax, mix in zip(axes[0], mixes):
        for j, layout in enumerate(LAYOUTS):
            xs, ys = [], []
            for i, (S, cp) in enumerate((S, cp) for S in Ss for cp in cps):
                v = idx.get((mix, S, cp, layout))
                if v is not None:
                    xs.append(i + (j - 1) * 0.27)
                    ys.append(v)
            ax.bar(xs, ys, 0.27, label=layout)
        ticks = [f"{S // 1024}k\ncp{cp}" for S in Ss for cp in cps]
        ax.set_xticks(range(len(ticks)))
        ax.set_xticklabels(ticks, fontsize=6)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.05, color="k", lw=0.8, ls="--", label="target 1.05 (balanced)")
        ax.set_ylim(0.9, max(1.2, max(idx.values()) * 1.05))
        ax.set_title(mix)
        ax.set_ylabel("causal work max / mean across ranks")
        ax.legend(fontsize=7)
    fig.suptitle("Load balance per layout (ideal 1.0)")
    fig.tight_layout()
    path = os.path.join(out_dir, "balance.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(r) -> str:
    if r["baseline"] == "ours":
        return f"ours {r['layout'][:6]}/{r['exchange']}"
    return r["baseline"]


def plot_speed(rows: List[Dict], out_dir: str) -> str:
    sp = [r for r in rows if r["suite"] == "speed"]
    if not sp:
        return ""
    groups = defaultdict(list)
    for r in sp:
        groups[(r["mix"], r["S"])].append(r)
    keys = sorted(groups, key=lambda k: (k[1], MIX_ORDER.index(k[0])))
    fig, axes = plt.subplots(len(keys), 1, figsize=(11, 2.6 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        rs = groups[key]
        order = sorted(rs, key=lambda r: (r["baseline"] != "ours", r["layout"], r["exchange"]))
        colors = ["#4c72b0" if r["baseline"] == "ours" else
                  {"single_process": "#8172b2", "per_doc_ideal": "#55a868",
                   "allgather_full_mask": "#c44e52"}[r["baseline"]] for r in order]
        secs = [r["seconds"] for r in order]
        ax.barh(range(len(order)), secs, color=colors)
        for i, v in enumerate(secs):
            ax.text(v, i, f" {v:.2f}", va="center", fontsize=6)
        ax.set_xlim(0, max(secs) * 1.12)
        ax.set_yticks(range(len(order)))
        ax.set_yticklabels([_label(r) for r in order], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{key[0]}, S={key[1]}: fwd+bwd seconds (median, slowest rank; ours at cp=2)", fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, "speed.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(rows: List[Dict], out_dir: str) -> str:
    mem = [r for r in rows if r["suite"] == "speed_memory" and r["mix"] == "short"]
    if not mem:
        return ""
    series = defaultdict(dict)
    for r in mem:
        series[_label(r)][r["S"]] = r["peak_bytes"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for name, pts in sorted(series.items()):
        Ss = sorted(pts)
        style = dict(lw=2.2, marker="s") if not name.startswith("ours") else dict(lw=0.9, marker="o", alpha=0.8)
        ax.plot(Ss, [pts[s] / 2**20 for s in Ss], label=name, **style)
    Ss = sorted({r["S"] for r in mem})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(Ss)
    ax.set_xticklabels([str(s) for s in Ss])
    ax.set_xlabel("S (tokens)")
    ax.set_ylabel("peak tensor MiB per rank (build + fwd + bwd)")
    ax.set_title("Peak memory vs S, short mix (ours at cp=2)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path = os.path.join(out_dir, "memory.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cp_memory(rows: List[Dict], out_dir: str) -> str:
    mem = [r for r in rows if r["suite"] == "memory" and r.get("engine", "current") == "current"
           and r["kernel"] == "stub"]
    if not mem:
        return ""
    S = max(r["S"] for r in mem)
    mixes = sorted({r["mix"] for r in mem})
    modes = sorted({r["kv_backward"] for r in mem})
    fig, axes = plt.subplots(len(modes), len(mixes), figsize=(4.4 * len(mixes), 3.6 * len(modes)), squeeze=False)
    for i, mode in enumerate(modes):
        for j, mix in enumerate(mixes):
            ax = axes[i][j]
            series = defaultdict(dict)
            local = {}
            for r in mem:
                if (r["S"], r["mix"], r["kv_backward"]) == (S, mix, mode):
                    series[f"{r['layout']}/{r['exchange']}"][r["cp"]] = r["peak_bytes"] / 2**20
                    local[r["cp"]] = r["local_bytes"] / 2**20
            for name, pts in sorted(series.items()):
                cps = sorted(pts)
                ax.plot(cps, [pts[c] for c in cps], marker="o", lw=1, label=name)
            cps = sorted(local)
            ax.plot(cps, [local[c] for c in cps], "k--", lw=2, label="local q/k/v/out")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(cps)
            ax.set_xticklabels([str(c) for c in cps])
            ax.set_title(f"{mix}, S={S // 1024}k, kv_backward={mode}")
            ax.set_xlabel("cp")
            ax.set_ylabel("busiest rank's peak MiB")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    path = os.path.join(out_dir, "memory_cp.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


SCALE_LAYOUTS = ("contiguous", "zigzag", "balanced", "allgather", "te_thd")


def plot_scale(rows: List[Dict], out_dir: str) -> str:
    sc = [r for r in rows if r["suite"] == "scale"]
    if not sc:
        return ""
    S = max(r["S"] for r in sc)
    mixes = sorted({r["mix"] for r in sc})
    links = [l for l in ("nvlink", "ib", "2lvl") if any(r["link"] == l for r in sc)]
    fig, axes = plt.subplots(len(links), len(mixes), figsize=(4.2 * len(mixes), 3.4 * len(links)),
                             squeeze=False)
    for i, link in enumerate(links):
        for j, mix in enumerate(mixes):
            ax = axes[i][j]
            for layout in SCALE_LAYOUTS:
                pts = sorted((r["cp"], r["modeled_over_ideal"]) for r in sc
                             if (r["S"], r["mix"], r["link"], r["layout"]) == (S, mix, link, layout))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=layout)
            bound = sorted((r["cp"], r["modeled_over_ideal"] / r["modeled_over_bound"]) for r in sc
                           if (r["S"], r["mix"], r["link"], r["layout"]) == (S, mix, link, "balanced"))
            if bound:
                ax.plot([p[0] for p in bound], [p[1] for p in bound], "k--", label="lower bound")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{mix}, S={S // 1024}k, {link}")
            ax.set_xlabel("cp")
            ax.set_ylabel("modeled / ideal")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "scale.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


CHOICE_COLORS = {"allgather": "#c44e52", "a2a": "#4c72b0", "hierarchical": "#55a868", "ulysses": "#8172b2", "2d": "#dd8452"}


def plot_exchange_choice(rows: List[Dict], out_dir: str) -> str:
    if not any(r["suite"] == "exchange_choice" for r in rows):
        return ""
    from exchange_choice import EXCHANGES, choices

    recs = choices(rows)
    panels = []
    for r in recs:
        if (r["point"], r["model"]) not in panels:
            panels.append((r["point"], r["model"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4), squeeze=False)
    width = 0.8 / len(EXCHANGES)
    for ax, (point, model) in zip(axes[0], panels):
        got = [r for r in recs if (r["point"], r["model"]) == (point, model)]
        for i, r in enumerate(got):
            for j, ex in enumerate(EXCHANGES):
                x = i + (j - (len(EXCHANGES) - 1) / 2) * width
                c = r["by"].get(ex)
                if c is None:
                    continue
                if c.get("refused"):
                    ax.text(x, r["ideal_seconds"] * 1e3, "refused", rotation=90, ha="center", va="bottom", fontsize=6,
                            color=CHOICE_COLORS[ex])
                    continue
                ax.bar(x, c["modeled_seconds"] * 1e3, width, color=CHOICE_COLORS[ex],
                       label=(ex if ex != "2d" else "2d (best u, outer)") if i == 0 else None)
                ax.plot([x - width / 2, x + width / 2], [r["streamed"][ex] * 1e3] * 2, "k-", lw=1.2,
                        label="streamed" if i == 0 and j == 0 else None)
            ax.plot([i - 0.4, i + 0.4], [r["ideal_seconds"] * 1e3] * 2, "k:", lw=1,
                    label="ideal" if i == 0 else None)
        ax.set_xticks(range(len(got)))
        ax.set_xticklabels([r["mix"] for r in got], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("modeled ms per layer, forward + backward")
        ax.set_title(f"{point}, {model.replace('_', '-')}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=6)
    fig.suptitle("Modeled attention time per exchange (bars: no overlap; black tick: streamed; dotted: ideal)")
    fig.tight_layout()
    path = os.path.join(out_dir, "exchange_choice.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


GPU_MODEL_COLORS = {"a2a": "#4c72b0", "halo": "#55a868", "allgather": "#c44e52", "hierarchical": "#8172b2"}


def plot_gpu_model(rows: List[Dict], out_dir: str) -> str:
    got = [r for r in rows if r["suite"] == "gpu_model" and not r.get("refused") and r["model_key"] == "gqa"
           and not r["window"] and r.get("relayout", "none") == "none"]  # the batch's own layout
    if not got:
        return ""
    points = []
    for r in sorted(got, key=lambda r: (r["S"], r["cp"])):
        if r["point"] not in points:
            points.append(r["point"])
    fig, axes = plt.subplots(len(points), 1, figsize=(11, 3.6 * len(points)), squeeze=False)
    exchanges = [e for e in GPU_MODEL_COLORS if any(r["exchange"] == e for r in got)]
    width = 0.8 / len(exchanges)
    for ax, point in zip(axes[:, 0], points):
        here = [r for r in got if r["point"] == point]
        groups = []
        for r in here:
            if (r["mix"], r["layout"]) not in groups:
                groups.append((r["mix"], r["layout"]))
        for i, (mix, layout) in enumerate(groups):
            for j, ex in enumerate(exchanges):
                r = next((r for r in here if (r["mix"], r["layout"], r["exchange"]) == (mix, layout, ex)), None)
                if r is None:
                    continue
                x = i + (j - (len(exchanges) - 1) / 2) * width
                roof = r["roofline_fwd_s"] + r["roofline_bwd_s"]
                ax.bar(x, r["ratio"], width, color=GPU_MODEL_COLORS[ex], label=ex)  # legend: one per label
                ax.plot(x, (r["host_s_fwd"] + r["host_s_bwd"]) / roof, "k.", ms=4,
                        label="host (CPU, null kernel) / roofline" if (i, j) == (0, 0) else None)
                if r.get("host_dispatch_s_fwd") is not None:  # as a GPU's host issues it
                    issue = r["host_dispatch_s_fwd"] + r["host_dispatch_s_bwd"] + r["launch_s_fwd"] + r["launch_s_bwd"]
                    ax.plot(x, issue / roof, "x", color="0.35", ms=4, mew=1,
                            label="host (meta + 7.5 µs an op) / roofline")
                if r.get("own_roofline_fwd_s") is not None:  # the layout's imbalance left out
                    own = (r["modeled_s_fwd"] + r["modeled_s_bwd"]) / (r["own_roofline_fwd_s"] + r["own_roofline_bwd_s"])
                    ax.plot(x, own, "_", color="k", ms=7, mew=1.2, label="modeled / the busiest rank's own roofline")
        ax.axhline(1.2, color="k", ls=":", lw=1, label="1.2x roofline")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{m}\n{l}" for m, l in groups], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("modeled / roofline (fwd + bwd)")
        ax.set_title(f"{point}, Llama-3-8B attention, no window (modeled H200, busiest rank)", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        handles, labels = ax.get_legend_handles_labels()
        seen = {}
        for h, lab in zip(handles, labels):
            seen.setdefault(lab, h)
        ax.legend(seen.values(), seen.keys(), fontsize=6, ncol=3)
    fig.tight_layout()
    path = os.path.join(out_dir, "gpu_model.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(rows: List[Dict], out_dir: str) -> List[str]:
    return [p for p in (plot_comm(rows, out_dir), plot_balance(rows, out_dir),
                        plot_speed(rows, out_dir), plot_memory(rows, out_dir), plot_cp_memory(rows, out_dir),
                        plot_scale(rows, out_dir), plot_exchange_choice(rows, out_dir),
                        plot_gpu_model(rows, out_dir)) if p]


if __name__ == "__main__":
    from summary import load

    here = os.path.dirname(os.path.abspath(__file__))
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "..", "bench", "results.jsonl")
    print("\n".join(plot_all(load(path), os.path.dirname(os.path.abspath(path)))))
