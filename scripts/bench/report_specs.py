"""What each benchmark suite puts in bench/SUMMARY.md: its targets (the claim, the configurations it
is judged on, the figures printed with it) and its tables (how a record is read from the rows of
bench/results.jsonl, the columns, the columns an archived run can fill). summary.py renders them.
"""

import statistics
from collections import defaultdict
from typing import Dict

from report import Check, Column, Compare, Suite, Table, Target, Text, mark, misses

LAYOUTS = ("contiguous", "zigzag", "balanced")
EXCHANGES = ("allgather", "halo", "a2a")
MIXES = ("short", "heavy_tail", "single")  # the mixes of the process suites, in table order
MiB = 2**20


def fmt(spec: str, suffix: str = "", scale: float = 1.0):
    """A cell formatter: ``-`` for a missing value, else ``format(scale * v, spec) + suffix``."""
    return lambda v: "-" if v is None else format(scale * v, spec) + suffix


def suite(*names):
    return lambda rows: [r for r in rows if r["suite"] in names]


def _ratio(num: float, den: float) -> float:
    return float("inf") if den == 0 else num / den


def _config(r: Dict) -> str:
    return f"{r['mix']}/S={r['S']}/cp={r['cp']}"


# --- comm -------------------------------------------------------------------------------------


def _comm_index(rows):
    return {(r["mix"], r["S"], r["cp"], r["layout"], r["exchange"]): r for r in rows if r["suite"] == "comm"}


def _a2a_exact(rows):
    return [Check(f"{_config(r)}/{r['layout']}", r["recv_equals_lower_bound"]
                  and sum(r["bytes_sent"]) == sum(r["lower_bound_per_rank"]))
            for r in rows if r["suite"] == "comm" and r["exchange"] == "a2a"]


def _halo_rows(rows):
    return [r for r in rows if r["suite"] == "comm" and r["exchange"] == "halo"]


def _halo_exact(rows):
    return [Check(f"{_config(r)}/{r['layout']}", r["recv_equals_lower_bound"])
            for r in _halo_rows(rows) if r["exchange_resolved"] == "halo"]


def _halo_fallbacks(checks, rows):
    halo = _halo_rows(rows)
    fell = [r for r in halo if r["exchange_resolved"] != "halo"]
    by_layout = ", ".join(f"{l} {sum(r['layout'] == l for r in fell)}/{sum(r['layout'] == l for r in halo)}"
                          for l in LAYOUTS if any(r["layout"] == l for r in halo))
    text = (f"it fell back to a2a on {len(fell)}/{len(halo)} (by layout: {by_layout}); fallbacks also move "
            f"exactly the lower bound: {mark(all(r['recv_equals_lower_bound'] for r in halo))}")
    return "; ".join(x for x in (misses(checks), text) if x)


def _needed_only_vs_allgather(rows):
    """Against a full all-gather: (cp - 1) local shards each way, what TE's p2p ring moves (our ring posts
    only the hops some rank further round attends, so its own row is less)."""
    got = [r for r in rows if r["suite"] == "comm" and r["mix"] == "short" and r["cp"] == 8
           and r["exchange"] in ("halo", "a2a")]
    got.sort(key=lambda r: (r["S"], r["layout"], r["exchange"]))
    checks = []
    for r in got:
        full = (r["cp"] - 1) * r["local_len"] * r["kv_row_bytes"]
        x = _ratio(full, r["bytes_max"])
        checks.append(Check(f"S={r['S']} {r['layout']}/{r['exchange']}", x >= 20, x))
    return checks


def _listed(spec: str, suffix: str = "×", word: str = "ratios"):
    return lambda checks, rows: f"{word} " + ", ".join(f"{c.label} {c.value:{spec}}{suffix}" for c in checks)


def _kib(n):
    return "-" if n is None else f"{n / 1024:.1f}"


def _comm_records(rows):
    idx = _comm_index(rows)
    comm = [r for r in rows if r["suite"] == "comm"]
    out = []
    for mix in sorted({r["mix"] for r in comm}, key=MIXES.index):
        for S in sorted({r["S"] for r in comm}):
            for cp in sorted({r["cp"] for r in comm}):
                for layout in LAYOUTS:
                    cells = {e: idx.get((mix, S, cp, layout, e)) for e in EXCHANGES}
                    if all(cells.values()):
                        out.append({"mix": mix, "S": S, "cp": cp, "layout": layout,
                                    **{e: cells[e]["bytes_max"] for e in EXCHANGES},
                                    "halo_fell_back": cells["halo"]["exchange_resolved"] != "halo",
                                    "lb": cells["a2a"]["lower_bound_bytes"]})
    return out


def _comm_note(records):
    return ("Largest per-rank K/V bytes sent or received by one `blockdiag_cp_attention` call, in KiB, at "
            f"{records[0]['row_bytes']} bytes per K/V row (b=1, Hkv=1, D=8, fp32: scale by b·Hkv·D·dtype/32 "
            "for a model); `lb` is that rank's lower bound (bytes of the positions its queries need and it "
            "does not own). `halo*` = halo fell back to a2a (a document straddles more than one boundary). "
            "The busiest rank can be a sender, so a needed-only cell can exceed `lb` while every rank still "
            "receives exactly its own lower bound (see the targets above).")


def _with_row_bytes(records_fn):
    def records(rows):
        comm = [r for r in rows if r["suite"] == "comm"]
        return [{**rec, "row_bytes": comm[0].get("kv_row_bytes")} for rec in records_fn(rows)]
    return records


COMM = Suite(
    "comm", suite("comm"),
    targets=(
        Target("a2a moves exactly the lower bound (every rank receives exactly its lower bound, total sent = "
               "total needed)", _a2a_exact, unit="configurations"),
        Target("halo equals the lower bound whenever every straddle comes from the previous shard",
               _halo_exact, _halo_fallbacks, unit="configurations where halo applied"),
        Target("short mix, cp=8: needed-only exchanges move >= 20× fewer bytes (bytes_max) than a full all-gather "
               "((cp − 1) local shards each way)",
               _needed_only_vs_allgather, _listed(".1f")),
    ),
    tables=(
        Table("Communication: K/V bytes per rank per layer (measured by the exchange)",
              _with_row_bytes(_comm_records), note=_comm_note, split="mix", split_title="mix `{}`",
              columns=(Column("S", "S"), Column("cp", "cp"), Text("layout", "layout"),
                       Column("allgather", "allgather", _kib),
                       Column("halo", lambda r: _kib(r["halo"]) + ("*" if r["halo_fell_back"] else ""), str),
                       Column("a2a", "a2a", _kib), Column("lb", "lb", _kib),
                       Column("allgather / a2a", lambda r: "∞" if r["a2a"] == 0 else
                              f"{r['allgather'] / r['a2a']:.1f}×", str))),
    ),
)


# --- balance ----------------------------------------------------------------------------------


def _balanced_work(rows):
    return [Check(_config(r), r["work_max_over_mean"] <= 1.05, r["work_max_over_mean"])
            for r in rows if r["suite"] == "balance" and r["layout"] == "balanced"]


def _balanced_bytes(rows):
    comm = _comm_index(rows)
    checks = []
    for r in rows:
        if r["suite"] != "balance" or r["layout"] != "balanced":
            continue
        b = comm.get((r["mix"], r["S"], r["cp"], "balanced", "a2a"))
        c = comm.get((r["mix"], r["S"], r["cp"], "contiguous", "halo"))
        if b and c:
            x = 1.0 if b["bytes_max"] == c["bytes_max"] else _ratio(b["bytes_max"], c["bytes_max"])
            checks.append(Check(_config(r), x <= 1.2, x))
    return checks


def _balance_records(rows):
    bal = [r for r in rows if r["suite"] == "balance"]
    idx = {(r["mix"], r["S"], r["cp"], r["layout"]): r["work_max_over_mean"] for r in bal}
    out = []
    for mix in MIXES:
        for S in sorted({r["S"] for r in bal}):
            for cp in sorted({r["cp"] for r in bal}):
                vals = {l: idx.get((mix, S, cp, l)) for l in LAYOUTS}
                if None not in vals.values():
                    out.append({"mix": mix, "S": S, "cp": cp, **vals})
    return out


def _balance_spread(rows):
    bal = [r for r in rows if r["suite"] == "balance"]
    out = []
    for layout in LAYOUTS:
        vals = [r["work_max_over_mean"] for r in bal if r["layout"] == layout]
        if vals:
            out.append({"layout": f"`{layout}`", "min": min(vals), "median": statistics.median(vals),
                        "max": max(vals), "points": len(vals)})
    return out


BALANCE = Suite(
    "balance", suite("balance"),
    targets=(
        Target("`balanced` work max/mean <= 1.05 on every mix/S/cp", _balanced_work,
               lambda checks, rows: misses(checks, ".3f")),
        Target("`balanced` (needed-only exchange) bytes_max within 1.2× of contiguous+halo", _balanced_bytes,
               lambda checks, rows: misses([Check(c.label, c.ok, f"{c.value:.2f}×") for c in checks])),
    ),
    tables=(
        Table("Balance: max / mean causal work across ranks (ideal 1.0)", _balance_records,
              columns=(Text("mix", "mix"), Column("S", "S"), Column("cp", "cp"))
              + tuple(Column(l, l, ".3f") for l in LAYOUTS)),
        Table("Balance per layout over every mix/S/cp point", _balance_spread, level=3,
              columns=(Text("layout", "layout"), Column("min", "min", ".3f"),
                       Column("median", "median", ".3f"), Column("max", "max", ".3f"),
                       Column("points", "points"))),
    ),
)


# --- speed and speed_memory -------------------------------------------------------------------


def _speed_key(r):
    return (r["mix"], r["S"], r["baseline"], r["layout"], r["exchange"])


def _speed_groups(rows):
    groups = defaultdict(dict)
    for r in rows:
        if r["suite"] == "speed":
            groups[(r["mix"], r["S"])][(r["baseline"], r["layout"], r["exchange"])] = r["seconds"]
    return groups


def _dense_vs_ideal(rows):
    checks = []
    for (mix, S), g in sorted(_speed_groups(rows).items()):
        one, ideal = g.get(("single_process", "-", "-")), g.get(("per_doc_ideal", "-", "-"))
        if one and ideal:
            checks.append(Check(f"{mix}/S={S}", one / ideal <= 1.3, one / ideal))
    return checks


FULL_MASK = ("allgather_full_mask", "contiguous", "allgather")


def _ours_vs_full_mask(rows):
    g = _speed_groups(rows).get(("short", 16384), {})
    if FULL_MASK not in g:
        return []
    return [Check(f"{k[1]}/{k[2]}", g[FULL_MASK] / v >= 5, g[FULL_MASK] / v) for k, v in g.items() if k[0] == "ours"]


def _speedups(checks, rows):
    fm = _speed_groups(rows)[("short", 16384)][FULL_MASK]
    vals = [c.value for c in checks]
    text = f"speed-ups {min(vals):.1f}× to {max(vals):.1f}× (full mask {fm:.2f} s)"
    bad = [c for c in checks if not c.ok]
    return text + ("; misses: " + ", ".join(f"{c.label} {c.value:.1f}×" for c in bad) if bad else "")


def _speed_records(rows):
    mem = {_speed_key(r): r for r in rows if r["suite"] == "speed_memory"}
    groups = defaultdict(list)
    for r in rows:
        if r["suite"] == "speed":
            groups[(r["mix"], r["S"])].append(r)
    out = []
    for (mix, S), rs in sorted(groups.items(), key=lambda g: (g[0][1], MIXES.index(g[0][0]))):
        ideal = next((r["seconds"] for r in rs if r["baseline"] == "per_doc_ideal"), None)
        for r in sorted(rs, key=lambda r: r["seconds"]):
            m = mem.get(_speed_key(r))
            out.append({**r, "contender": r["baseline"] if r["baseline"] != "ours" else "ours (cp=2)",
                        "vs_ideal": r["seconds"] / ideal if ideal else None,
                        "peak": m["peak_bytes"] if m else None})
    return out


def _growth(rows):
    """Short mix: peak bytes per (contender, layout, exchange) at the smallest and largest S."""
    mem = [r for r in rows if r["suite"] == "speed_memory" and r["mix"] == "short"]
    Ss = sorted({r["S"] for r in mem})
    if len(Ss) < 2:
        return None, None, []
    lo, hi = Ss[0], Ss[-1]
    by = defaultdict(dict)
    for r in mem:
        by[(r["baseline"], r["layout"], r["exchange"])][r["S"]] = r["peak_bytes"]
    out = [{"contender": k[0], "config": f"{k[1]}/{k[2]}", "lo": v[lo], "hi": v[hi], "growth": v[hi] / v[lo]}
           for k, v in sorted(by.items()) if lo in v and hi in v and v[lo] > 0]
    return lo, hi, out


def _no_s_term(rows):
    lo, hi, got = _growth(rows)
    return [Check(f"{g['contender']} {g['config']}", g["growth"] <= 1.5 * hi / lo, g["growth"])
            for g in got if g["contender"] == "ours"]


def _no_s_term_claim(rows):
    lo, hi, _ = _growth(rows)
    return (f"memory, short mix, no local_len × S term in ours: from S={lo} to S={hi} (S grows {hi / lo:.0f}×; a "
            f"local_len × S term grows {(hi / lo) ** 2:.0f}×) every ours configuration's peak grows at most "
            f"1.5 × {hi / lo:.0f}×")


def _growth_columns(records):
    lo, hi = records[0]["S_lo"], records[0]["S_hi"]
    return (Text("contender", "contender"), Text("layout/exchange", "config"),
            Column(f"peak MiB S={lo}", "lo", fmt(".0f", scale=1 / MiB)),
            Column(f"peak MiB S={hi}", "hi", fmt(".0f", scale=1 / MiB)), Column("growth", "growth", fmt(".1f", "×")))


def _growth_records(rows):
    lo, hi, got = _growth(rows)
    return [{**g, "S_lo": lo, "S_hi": hi} for g in got]


SPEED = Suite(
    "speed", suite("speed", "speed_memory"),
    targets=(
        Target("our dense kernel on one process within 1.3× of the per-document ideal", _dense_vs_ideal,
               _listed(".2f")),
        Target("ours >= 5× faster than allgather_full_mask on the short mix at S=16384 (cp=2)", _ours_vs_full_mask,
               _speedups, unit="layout/exchange pairs"),
        Target(_no_s_term_claim, _no_s_term, unit="configurations"),
    ),
    tables=(
        Table("Speed and memory: one attention layer, forward + backward, CPU fp32", _speed_records,
              note="b=1, 8 heads, head dim 64, fp32; cp=2 on gloo (2 processes × 1 thread); the single-process "
                   "contenders run on one process × 1 thread. Median of interleaved repetitions, slowest rank; "
                   "peak = most tensor memory held during build + fwd + bwd above the inputs, per rank (max over "
                   "ranks).",
              columns=(Text("mix", "mix"), Column("S", "S"),
                       Text("contender", "contender"), Text("layout", "layout"),
                       Text("exchange", "exchange"), Column("seconds", "seconds", ".3f"),
                       Column("vs per_doc_ideal", "vs_ideal", fmt(".2f", "×")),
                       Column("peak MiB", "peak", fmt(".0f", scale=1 / MiB)))),
        Table("Peak memory as S grows, short mix", _growth_records, level=3, columns=_growth_columns),
    ),
)


# --- memory (per rank as cp grows) ------------------------------------------------------------


def _mem_rows(rows, kernel="stub", engine="current"):
    return [r for r in rows if r["suite"] == "memory" and r["kernel"] == kernel and r.get("engine") == engine]


def _refetch_rows(rows):
    return [r for r in _mem_rows(rows) + _mem_rows(rows, "dense") if r["kv_backward"] == "refetch"]


def _cp4_over_cp2(rows):
    by = {(r["kernel"], r["mix"], r["S"], r["layout"], r["exchange"], r["cp"]): r for r in _refetch_rows(rows)}
    checks = []
    for k in by:
        if k[5] == 2 and k[:5] + (4,) in by:
            x = by[k[:5] + (4,)]["peak_bytes"] / by[k]["peak_bytes"]
            checks.append(Check(f"{k[0]}/{k[1]}/S={k[2]}/{k[3]}/{k[4]}", x <= 0.6, x))
    return checks


def _range(spec: str, suffix: str = ""):
    def figures(checks, rows):
        vals = [c.value for c in checks]
        return f"ratios {min(vals):{spec}}–{max(vals):{spec}}{suffix}" + (
            "; " + misses(checks, spec) if not all(c.ok for c in checks) else "")
    return figures


def _held_over_local(rows):
    return [Check(f"{r['kernel']}/{r['mix']}/S={r['S']}/{r['layout']}/{r['exchange']}/cp={r['cp']}",
                  r["held_bytes"] / r["local_bytes"] <= 2, r["held_bytes"] / r["local_bytes"])
            for r in _refetch_rows(rows)]


def _cp_memory_records(rows):
    groups = defaultdict(list)
    for r in _mem_rows(rows) + _mem_rows(rows, "dense"):
        groups[(r["kernel"], r["kv_backward"], r["mix"], r["S"])].append(r)
    out = []
    for (kernel, mode, mix, S), rs in sorted(groups.items()):
        peak = {cp: max(r["peak_bytes"] for r in rs if r["cp"] == cp) for cp in sorted({r["cp"] for r in rs})}
        out.append({"kernel": kernel, "kv_backward": mode, "mix": mix, "S": S,
                    "peaks": " / ".join(f"{peak[cp] / MiB:.0f}" for cp in sorted(peak)),
                    "cp4_cp2": peak[4] / peak[2] if 2 in peak and 4 in peak else None,
                    "cp8_cp4": peak[8] / peak[4] if 4 in peak and 8 in peak else None,
                    "held": max(r["held_bytes"] / r["local_bytes"] for r in rs)})
    return out


def _exposed_records(rows):
    vals = defaultdict(list)
    for r in _mem_rows(rows) + _mem_rows(rows, "dense"):
        if r.get("exposed_comm_fraction_busiest") is not None and r["cp"] == 2:
            vals[(r["mix"], r["kv_backward"])].append(r["exposed_comm_fraction_busiest"])
    return [{"mix": m, "kv_backward": mode, "min": min(x), "median": sorted(x)[len(x) // 2], "max": max(x)}
            for (m, mode), x in sorted(vals.items())]


def _other_engine_records(rows):
    now = {(r["mix"], r["S"], r["layout"], r["exchange"], r["cp"]): r for r in _mem_rows(rows, "dense")
           if r["kv_backward"] == "refetch"}
    other = [r for r in rows if r["suite"] == "memory" and r.get("engine", "current") != "current"]
    out = []
    for r in sorted(other, key=lambda r: (r["engine"], r["mix"], r["S"], r["layout"], r["exchange"], r["cp"])):
        a = now.get((r["mix"], r["S"], r["layout"], r["exchange"], r["cp"]))
        out.append({**r, "current": a["peak_bytes"] if a else None})
    return out


MEMORY = Suite(
    "memory", suite("memory"),
    targets=(
        Target("memory, kv_backward=refetch: busiest rank's peak at cp=4 <= 0.6× its peak at cp=2", _cp4_over_cp2,
               _range(".2f"), unit="(kernel, mix, S, layout, exchange)"),
        Target("memory, kv_backward=refetch: held between forward and backward <= 2× local q/k/v/out",
               _held_over_local,
               lambda checks, rows: f"at most {max(c.value for c in checks):.2f}× local"
               + ("; " + misses(checks, ".2f") if not all(c.ok for c in checks) else "")),
    ),
    tables=(
        Table("Memory per rank as cp grows: one attention layer, forward + backward, CPU fp32", _cp_memory_records,
              note="b=1, 8 heads, head dim 64; busiest rank's peak tensor memory above the inputs during forward + "
                   "backward, and what forward leaves for backward (output included), against the rank's own "
                   "q/k/v/out (`local`). `stub`: the engine's buffers with a kernel that returns zeros of the real "
                   "shapes; `dense`: the real kernel. Worst over layouts x exchanges; `scripts/bench/memory.py`.",
              columns=(Text("kernel", "kernel"), Text("kv_backward", "kv_backward"),
                       Text("mix", "mix"), Column("S", "S"),
                       Text("peak MiB cp=2 / 4 / 8", "peaks"),
                       Column("cp4/cp2", "cp4_cp2", fmt(".2f")), Column("cp8/cp4", "cp8_cp4", fmt(".2f")),
                       Column("held / local (max)", "held", ".2f"))),
        Table("Exposed communication", _exposed_records, level=3,
              note="Dense kernel, a timed iteration, cp = 2 (one rank per core): the share of a layer's forward + "
                   "backward the busiest rank (most kernel time: it sets the layer's time) spent waiting for K/V "
                   "that compute did not hide, over layouts x exchanges.",
              columns=(Text("mix", "mix"), Text("kv_backward", "kv_backward"),
                       Column("min", "min", ".0%"), Column("median", "median", ".0%"), Column("max", "max", ".0%"))),
        Table("The same measurement on another engine", _other_engine_records, level=3,
              note="Real dense kernel, busiest rank's peak MiB; the current engine with kv_backward=refetch.",
              split="engine", split_title="engine `{}`",
              columns=(Text("mix", "mix"), Column("S", "S"), Text("layout", "layout"),
                       Text("exchange", "exchange"), Column("cp", "cp"),
                       Column("that engine", "peak_bytes", fmt(".0f", scale=1 / MiB)),
                       Column("current", "current", fmt(".0f", scale=1 / MiB)))),
    ),
)


# --- layer_ab ---------------------------------------------------------------------------------


def _layer_ab_checks(rows):
    return [Check(f"{r['layout']}/{r['exchange']}", r["seconds_other"] / r["seconds"] >= 1.0,
                  r["seconds_other"] / r["seconds"]) for r in rows if r["suite"] == "layer_ab"]


def _layer_ab_claim(rows):
    ab = [r for r in rows if r["suite"] == "layer_ab"]
    return f"one layer at cp=2 ({ab[0]['mix']}, S={ab[0]['S']}) no slower than {ab[0]['other']}"


def _layer_ab_figures(checks, rows):
    ab = next(r for r in rows if r["suite"] == "layer_ab")
    vals = [c.value for c in checks]
    return f"{ab['other']} / {ab['engine']} {min(vals):.2f}–{max(vals):.2f}×"


def _layer_ab_columns(records):
    r0 = records[0]
    return (Text("layout", "layout"), Text("exchange", "exchange"),
            Column(f"{r0['engine']} s", "seconds", ".3f"), Column(f"{r0['other']} s", "seconds_other", ".3f"),
            Text(f"{r0['other']} / {r0['engine']} per round", "ratio_other_over_this_per_round",
                   lambda v: ", ".join(f"{x:.2f}" for x in v)))


LAYER_AB = Suite(
    "layer_ab", suite("layer_ab"),
    targets=(Target(_layer_ab_claim, _layer_ab_checks, _layer_ab_figures, unit="layout x exchange pairs"),),
    tables=(
        Table("One layer against another engine (`scripts/bench/layer_ab.py`)", suite("layer_ab"),
              note=lambda rs: f"Forward + backward of one attention layer at cp=2, mix `{rs[0]['mix']}`, "
                              f"S={rs[0]['S']}, dense, fp32, 8 heads x 64; fresh processes per run, the two "
                              "engines alternated; seconds are the median over rounds of each run's median "
                              "(slowest rank).",
              columns=_layer_ab_columns),
    ),
)


# --- torch_cp ---------------------------------------------------------------------------------


_OURS_BESIDE_TORCH = (Column("ours s", "seconds", ".3f"), Column("torch s", "seconds_torch", ".3f"),
                      Column("ours / torch", "ratio_ours_over_torch", ".2f"))


def _ours_no_slower(name, case):
    """Ours no slower than torch per row of suite ``name``, labelled S and ``case`` (its row field)."""
    return lambda rows: [Check(f"S={r['S']} {r[case]}", r["seconds"] <= r["seconds_torch"], r["ratio_ours_over_torch"])
                         for r in rows if r["suite"] == name]


def _torch_cp_agree(rows):
    return [Check(f"S={r['S']} {r['exchange']}", max(r["max_rel_diff"].values()) <= 1e-4,
                  max(r["max_rel_diff"].values()))
            for r in rows if r["suite"] == "torch_cp" and r.get("max_rel_diff")]


TORCH_CP = Suite(
    "torch_cp", suite("torch_cp"),
    targets=(Target("one causal document at cp=2 (fp32, 8 heads x 64, fwd+bwd): ours no slower than torch's ring "
                    "attention (head-tail balanced; a2a vs its alltoall rotater, allgather vs its allgather)",
                    _ours_no_slower("torch_cp", "exchange"), _listed(".2f", word="ours / torch"), unit="S x exchange"),
             Target("ours and torch's ring give the same output and dQ/dK/dV (max |diff| / max |value| <= 1e-4)",
                    _torch_cp_agree, _listed(".1e", suffix="", word="max rel diff"), unit="S x exchange")),
    tables=(
        Table("Ours beside torch's context parallelism (`scripts/bench/torch_cp.py`)", suite("torch_cp"),
              note=lambda rs: ("One causal document, cp=2, fp32, b=1, 8 heads x 64, forward + backward, gloo, one "
                               "thread per rank. Ours: zigzag, dense backend. Torch"
                               + (f" {rs[0]['torch_version']}" if rs[0].get("torch_version") else "")
                               + ": `_templated_ring_attention` (+ backward) with "
                               "head-tail load balancing and the CPU flash kernel, called directly because the "
                               "public `context_parallel` does not run on CPU (" + str(rs[0].get("public_api")) +
                               "). One fresh process pair per round runs both, alternated per iteration; seconds "
                               "are the median over rounds of each round's median (slowest rank). `rel diff`: "
                               "largest of out/dQ/dK/dV max |ours - torch| / max |torch|."),
              columns=(Column("S", "S"), Text("exchange", "exchange"), Text("torch rotate", "torch_rotate"),
                       *_OURS_BESIDE_TORCH,
                       Text("per round", lambda r: ", ".join(f"{a / b:.2f}" for a, b in
                                                            zip(r["seconds_rounds"], r["seconds_torch_rounds"])),
                            str),
                       Column("rel diff", lambda r: max(r["max_rel_diff"].values()) if r.get("max_rel_diff")
                              else None, fmt(".1e")))),
    ),
)


def _torch_cp_flex_agree(rows):
    return [Check(f"S={r['S']} {r['layout']}", r["max_rel_diff"] <= 1e-4, r["max_rel_diff"])
            for r in rows if r["suite"] == "torch_cp_flex"]


TORCH_CP_FLEX = Suite(
    "torch_cp_flex", suite("torch_cp_flex"),
    targets=(Target("short mix at cp=2 (fp32, 8 heads x 64, forward): ours no slower than torch's flex-attention "
                    "context parallelism (per-document head-tail, compiled flex kernel)",
                    _ours_no_slower("torch_cp_flex", "layout"), _listed(".2f", word="ours / torch"),
                    unit="S x layout"),
             Target("ours and torch's flex CP give the same output (max |diff| / max |value| <= 1e-4)",
                    _torch_cp_flex_agree, _listed(".1e", suffix="", word="max rel diff"), unit="S x layout")),
    tables=(
        Table("Ours beside torch's flex-attention context parallelism (`scripts/bench/torch_cp_flex.py`)",
              suite("torch_cp_flex"),
              note=lambda rs: ("The short mix (every document cut to a multiple of 4 tokens), cp=2, fp32, b=1, 8 "
                               "heads x 64, forward only (flex attention has no backward on CPU: "
                               + str(rs[0].get("torch_backward")) + "), gloo, one thread per rank. Ours: a2a, "
                               "dense backend. Torch" + (f" {rs[0]['torch_version']}" if rs[0].get("torch_version")
                                                         else "")
                               + ": `_ContextParallel(FLEX)` around `torch.compile(flex_attention)` (K and V "
                               "all-gathered), `_PerDocumentHeadTailLoadBalancer`, `_create_cp_block_mask`. Both "
                               "alternate per iteration after a warm-up (flex compiles on its first call: `torch "
                               "1st s`); seconds are the median (slowest rank). `rel diff`: max |ours - torch| / "
                               "max |torch| of the output at global positions."),
              columns=(Column("S", "S"), Column("docs", "docs"), Text("layout", "layout"), *_OURS_BESIDE_TORCH,
                       Column("torch 1st s", "torch_first_call_s", ".1f"),
                       Column("rel diff", "max_rel_diff", fmt(".1e")))),
    ),
)


# --- window -----------------------------------------------------------------------------------


def _window_4k_records(rows):
    head = {(r["S"], r["cp"], r["mix"], r["layout"], r["window"]): r for r in rows if r["suite"] == "window"}
    out = []
    for S, cp, mix in sorted({(S, cp, mix) for S, cp, mix, _, w in head if w == 4096 and mix in ("short", "long")}):
        rec = {"S": S, "cp": cp, "mix": mix, "allgather": None, "ratio": None}
        for layout in LAYOUTS:
            a, b = head.get((S, cp, mix, layout, None)), head.get((S, cp, mix, layout, 4096))
            rec[layout] = ("-" if a is None or b is None else
                           f"{a['needed_bytes_max'] / MiB:.0f} -> {b['needed_bytes_max'] / MiB:.1f}")
            if layout == "balanced" and b is not None:
                rec["allgather"] = b["allgather_bytes"]
                rec["ratio"] = b["needed_bytes_max"] / b["allgather_bytes"]
        out.append(rec)
    return out


def _window_records(rows):
    win = [r for r in rows if r["suite"] == "window"]
    return [{**r, "ratio": r["needed_bytes_max"] / r["allgather_bytes"]}
            for r in sorted(win, key=lambda r: (r["S"], r["cp"], r["mix"], r["layout"], r["window"] or 0))]


WINDOW = Suite(
    "window", suite("window"),
    tables=(
        Table("Sliding windows: K/V moved per layer and work, plan only", _window_4k_records,
              note="Busiest rank's K/V received per layer by the needed-only exchanges (a2a = halo = the windowed "
                   "lower bound: exactly the keys some query's window reaches on another rank) against the "
                   "all-gather ring, in MiB at Llama-3-8B's K/V (4 KiB a row); work = attention pairs per rank, "
                   "max / mean. `balanced` is laid out for the window it runs (the model's windows, "
                   "`cost.WindowMix`). `scripts/bench/window.py`. A 4k window, short and long documents: busiest "
                   "rank's K/V per layer, MiB (no window -> 4k window), against the all-gather ring:",
              columns=(Column("S", "S"), Column("cp", "cp"), Text("mix", "mix"))
              + tuple(Column(l, l, str) for l in LAYOUTS)
              + (Column("all-gather", "allgather", fmt(".0f", scale=1 / MiB)),
                 Column("balanced 4k / all-gather", "ratio", fmt(".3f")))),
        Table("Every layout, mix and window", _window_records, level=3,
              columns=(Column("S", "S"), Column("cp", "cp"), Text("mix", "mix"),
                       Text("layout", "layout"),
                       Column("window", "window", lambda w: str(w or "none")),
                       Column("needed MiB", "needed_bytes_max", fmt(".1f", scale=1 / MiB)),
                       Column("all-gather MiB", "allgather_bytes", fmt(".0f", scale=1 / MiB)),
                       Column("needed / all-gather", "ratio", ".3f"),
                       Column("work max/mean", "work_max_over_mean", ".3f"))),
    ),
)


# --- model and gpu ----------------------------------------------------------------------------

MODEL = Suite(
    "model", suite("model"),
    tables=(
        Table("Model: scripts/pretrain_gpt.py on its embedded default data (2 processes)", suite("model"),
              note="Tokens/s: median of the steady log intervals.",
              columns=(Column("CP", "cp"), Column("DP", "dp"),
                       Column("tokens/s", lambda r: f"skipped: {r['reason']}" if r.get("skipped")
                              else f"{r['tokens_per_s']:.0f}", str),
                       Column("seq", "S"), Text("backend", "backend"),
                       Text("exchange", "exchange"), Text("layout", "layout"))),
    ),
)


def _gpu_note(rows):
    return "\n".join(f"- skipped ({r['backend']}): {r['reason']}" for r in rows if r.get("skipped"))


GPU = Suite(
    "gpu", suite("gpu"),
    tables=(
        Table("GPU", lambda rows: [r for r in rows if r["suite"] == "gpu" and r.get("skipped")],
              note=lambda rs: _gpu_note(rs), columns=()),
        Table("GPU: TFLOP/s per backend",
              lambda rows: [r for r in rows if r["suite"] == "gpu" and not r.get("skipped")],
              columns=(Text("backend", "backend"), Text("mix", "mix"),
                       Column("S", "S"), Column("cp", "cp"), Text("layout", "layout"),
                       Column("TFLOP/s (step)", "tflops_step", ".1f"),
                       Column("of peak", "fraction_of_peak", fmt(".1f", "%", 100)))),
    ),
)


# --- scale (plan only) ------------------------------------------------------------------------


def _scale():
    import scale  # torch and the engine: only where a scale table is rendered

    return scale


def _target_cell(r):
    return f"{mark(r['held'])} (<= {r['limit']})"


BALANCED_SCALE = {"suite": "scale", "layout": "balanced"}


def _two_level_note(records):
    s = _scale()
    return ("8 GPUs per node, NVLink inside, IB between. Balanced's modeled attention time over the ideal (cost.py, "
            "Hq 32, Hkv 8, D 128, bf16; sends and receives priced per link) at the target points, no overlap "
            f"counted: target <= {s.TWO_LEVEL_LIMIT}x, <= {s.FITS_LIMIT}x where every document fits a node's share "
            "(tokens and work). `uniform IB`: every pair over IB (one level). `overlap`: the streamed op "
            "(`CostModel.overlapped`), backward refetching (and saving) the K/V; `exposed`: the busiest rank's "
            "communication left after overlap.")


def _latency_records(rows):
    lat = [r for r in rows if r["suite"] == "scale_latency"]
    out = []
    for S, cp, mix in sorted({(r["S"], r["cp"], r["mix"]) for r in lat}):
        got = {(r["latency_us"], r["latency_inter_us"]): r for r in lat if (r["S"], r["cp"], r["mix"]) == (S, cp, mix)}
        out.append({"S": S, "cp": cp, "mix": mix, "by_latency": got})
    return out


def _latency_columns(records):
    pairs = sorted({p for r in records for p in r["by_latency"]})
    cell = lambda p: lambda r: (f"{r['by_latency'][p]['modeled_over_ideal']:.3f} / "  # noqa: E731
                                f"{r['by_latency'][p]['overlap_over_ideal']:.3f}" if p in r["by_latency"] else "-")
    return (Column("S", "S"), Column("cp", "cp"), Text("mix", "mix")) + tuple(
        Column(f"{a:g} / {b:g} us", cell(p), str) for p in pairs for a, b in [p])


def _worst_speed_records(rows):
    s = _scale()
    wc = [r for r in rows if r["suite"] == "scale_worst" and r["kind"] == "speed"]
    out = []
    for S, cp, link, limit in s.SPEED_POINTS:
        for layout in s.LAYOUTS + ("te_thd",):
            got = [r for r in wc if (r["S"], r["cp"], r["layout"]) == (S, cp, layout)]
            if got:
                w = max(got, key=lambda r: r["plan_seconds"])
                lows = [r["plan_min_seconds"] for r in got if "plan_min_seconds" in r]
                out.append({"S": S, "cp": cp, "link": link, "layout": layout, "plan_seconds": w["plan_seconds"],
                            "mix": w["mix"], "worst_min": max(lows) if lows else None, "limit": limit,
                            "target": f"{mark(1e3 * w['plan_seconds'] <= limit)} (<= {limit:.0f})"})
    return out


def _worst_note(records):
    return (f"Over {records[0]['n_mixes']} random mixes (`megatron_ext.testing.mixes.worst_case_mix_params`: "
            "lognormal sigma 0.5-1.5 around 256-8k tokens, uniform, heavy-tailed with one document of S/8-S/2, one "
            "document). Plan: one rank's layout + plan (`prepare_plan`, last rank), CPU ms of the planning thread, "
            "median of 5 after one warm-up, worst over the mixes (and which); `worst min`: the worst over the mixes "
            "of each plan's minimum of those 5 (on a shared host the same plan's times spread). An archived run's "
            "timings come from another run on that host: compare its columns with each other, not with this run's.")


def _worst_records_mixes(rows):
    recs = _worst_speed_records(rows)
    mixes = {r["mix"] for r in rows if r["suite"] == "scale_worst"}
    return [{**r, "n_mixes": len(mixes)} for r in recs]


def _worst_modeled_records(rows):
    s = _scale()
    wc = [r for r in rows if r["suite"] == "scale_worst" and r["kind"] == "modeled"]
    out = []
    for S, cp in s.TWO_LEVEL_POINTS:
        for link in ("2lvl", "ib"):
            for layout in s.LAYOUTS:
                got = [r for r in wc if (r["S"], r["cp"], r["link"], r["layout"]) == (S, cp, link, layout)]
                if got:
                    w = max(got, key=lambda r: r["modeled_over_ideal"])
                    vals = sorted(r["modeled_over_ideal"] for r in got)
                    fits = [r["modeled_over_ideal"] for r in got if r["fits_a_node"]]
                    out.append({"S": S, "cp": cp, "link": link, "layout": layout, "worst": w["modeled_over_ideal"],
                                "mix": w["mix"], "median": vals[len(vals) // 2], "fits": max(fits) if fits else None,
                                "overlap": max(r["overlap_over_ideal"] for r in got)})
    return out


def _lognormal_ib_records(rows):
    return sorted(({**r, "point": f"{r['S'] // 1024}k, {r['cp']}"} for r in rows
                   if r["suite"] == "scale" and r["mix"] == "lognormal" and r["link"] == "ib"
                   and r["layout"] in LAYOUTS), key=lambda r: (r["S"], r["cp"], r["layout"]))


def _plan_ms_records(rows):
    sc = [r for r in rows if r["suite"] == "scale"]
    out = []
    for S, cp in sorted({(r["S"], r["cp"]) for r in sc}):
        rec = {"S": S, "cp": cp}
        for l in ("contiguous", "zigzag", "balanced", "te_thd"):
            v = [r["plan_seconds"] for r in sc if (r["S"], r["cp"], r["layout"]) == (S, cp, l)]
            rec[l] = max(v) if v else None
        out.append(rec)
    return out


def _plan_ms_columns(records):
    layouts = [l for l in ("contiguous", "zigzag", "balanced", "te_thd") if any(r[l] is not None for r in records)]
    return (Column("S", "S"), Column("cp", "cp")) + tuple(Column(l, l, fmt(".1f", scale=1e3)) for l in layouts)


def _two_level_checks(rows):
    return [Check(f"S={t['S']}/cp={t['cp']}/{t['mix']}", t["held"], t["modeled_over_ideal"])
            for t in _scale().two_level_targets(rows)]


def _one_link_targets(rows):
    return _scale().targets([r for r in rows if r.get("link") != "2lvl"])


def _one_link_checks(rows):
    return [Check(f"{t['link']} S={t['S']}/cp={t['cp']}/{t['mix']}", t["held"], t["modeled_over_ideal"])
            for t in _one_link_targets(rows)]


def _peer_checks(rows):
    return [Check(f"{t.get('link', '2lvl')} S={t['S']}/cp={t['cp']}/{t['mix']}", t["not_worse_than_peers"])
            for t in _scale().two_level_targets(rows) + _one_link_targets(rows)]


def _plan_time_checks(rows):
    return [Check(f"S={r['S']}/cp={r['cp']}/{r['layout']}", 1e3 * r["plan_seconds"] <= r["limit"],
                  1e3 * r["plan_seconds"]) for r in _worst_speed_records(rows)]


f3 = fmt(".3f")
SCALE = Suite(
    "scale", suite("scale", "scale_worst", "scale_latency"),
    targets=(
        Target(lambda rows: f"two levels (8-GPU nodes): balanced modeled / ideal <= {_scale().TWO_LEVEL_LIMIT}, "
                            f"<= {_scale().FITS_LIMIT} where every document fits a node",
               _two_level_checks, lambda checks, rows: misses(checks, ".3f"), unit="points"),
        Target("one link for the whole group: balanced work max/mean <= 1.05 and modeled / ideal <= 1.2 on NVLink, "
               "modeled / ideal <= 1.6 on IB", _one_link_checks, lambda checks, rows: misses(checks, ".3f"),
               unit="points"),
        Target("balanced's modeled time never worse than contiguous's or zigzag's at the target points", _peer_checks,
               unit="points"),
        Target(lambda rows: "plan time, worst over the random mixes: " + ", ".join(
                   f"<= {limit:g} ms at {S // 1024}k / cp {cp}" for S, cp, _, limit in _scale().SPEED_POINTS),
               _plan_time_checks, lambda checks, rows: misses(checks, ".1f"), unit="layouts x points"),
    ),
    tables=(
        Table("Scale (plan only): balanced on two levels, 8 GPUs per node",
              lambda rows: _scale().two_level_targets(rows), note=_two_level_note,
              columns=(Column("S", "S"), Column("cp", "cp"), Text("mix", "mix"),
                       Text("fits a node", "fits_a_node", lambda v: "yes" if v else "no"),
                       Column("max/mean", "work_max_over_mean", ".3f"), Column("2lvl", "modeled_over_ideal", ".3f"),
                       Column("uniform IB", "uniform_ib", f3),
                       Column("2lvl overlap (refetch / save)",
                              lambda r: f"{r['overlap_over_ideal']:.3f} / {f3(r['overlap_save_over_ideal'])}", str),
                       Column("exposed", "exposed_share", ".0%"),
                       Column("uniform IB overlap", "uniform_ib_overlap", f3),
                       Text("<= peers", "not_worse_than_peers", mark),
                       Text("candidate", lambda r: f"`{r['candidate'][:60]}`", str),
                       Text("target", _target_cell, str)),
              compare=(Compare("2lvl", "2lvl", "modeled_over_ideal", ("S", "cp", "mix"),
                               {**BALANCED_SCALE, "link": "2lvl"}, f3),
                       Compare("uniform IB", "uniform IB", "modeled_over_ideal", ("S", "cp", "mix"),
                               {**BALANCED_SCALE, "link": "ib"}, f3))),
        Table("Per-message latency", _latency_records, level=3, columns=_latency_columns,
              note="Balanced's modeled / ideal at the two-level points (no overlap; overlapped with refetch after the "
                   "slash) when every transfer also pays a latency (intra-node / inter-node, microseconds), the "
                   "layout searched under each model (`scripts/bench/scale.py::run_latency`)."),
        Table("Planning time, worst case over random mixes", _worst_records_mixes, level=3, note=_worst_note,
              columns=(Column("S", "S"), Column("cp", "cp"), Text("topology", "link"),
                       Text("layout", "layout"),
                       Column("worst plan ms", "plan_seconds", fmt(".1f", scale=1e3)),
                       Text("mix", "mix"),
                       Column("worst min ms", "worst_min", fmt(".1f", scale=1e3)),
                       Text("target", "target", str)),
              compare=(Compare("target", "worst plan ms", "plan_seconds", ("S", "cp", "layout"),
                               {"suite": "scale_worst", "kind": "speed"}, fmt(".1f", scale=1e3)),)),
        Table("Modeled / ideal, worst case over the same mixes", _worst_modeled_records, level=3,
              note="No overlap; overlap with refetch; worst and median over the mixes, per layout; `fits` = worst over "
                   "the mixes whose every document fits a node.",
              columns=(Column("S", "S"), Column("cp", "cp"), Text("topology", "link"),
                       Text("layout", "layout"), Column("worst", "worst", ".3f"),
                       Text("mix", "mix"), Column("median", "median", ".3f"),
                       Column("worst fits", "fits", f3), Column("worst overlap", "overlap", ".3f"))),
        Table("One link for the whole group: balanced at the target points",
              _one_link_targets, level=3,
              note="NVLink: work max/mean <= 1.05 and modeled <= 1.2x ideal; IB: modeled <= 1.6x ideal; never worse "
                   "than contiguous or zigzag. `bound` is prepare.modeled_lower_bound over the ideal. `end keys / "
                   "share`: the K/V positions the holder of the longest document's last token must receive (all its "
                   "earlier ones), times the cost model's pairs per position, over a rank's work share. "
                   "Every link is priced by the larger of what a rank receives and sends. `candidate`: the balanced "
                   "search's choice.",
              columns=(Column("S", "S"), Column("cp", "cp"), Text("link", "link"),
                       Text("mix", "mix"), Column("max/mean", "work_max_over_mean", ".3f"),
                       Column("modeled/ideal", "modeled_over_ideal", ".3f"),
                       Column("bound/ideal", "bound_over_ideal", ".3f"),
                       Column("modeled/bound", "modeled_over_bound", ".3f"),
                       Column("end keys / share", "end_keys_over_share", ".2f"),
                       Text("candidate", lambda r: f"`{r['candidate']}`", str),
                       Text("<= peers", "not_worse_than_peers", mark),
                       Text("target", _target_cell, str)),
              compare=(Compare("modeled/ideal", "modeled/ideal", "modeled_over_ideal", ("S", "cp", "mix", "link"),
                               BALANCED_SCALE, f3),)),
        Table("Lognormal mix over IB, one rank's layout + plan", _lognormal_ib_records, level=3, compare_only=True,
              note="Plan ms: CPU time of the planning thread, median of 3, for the current run; an archived run gives "
                   "what its meta row says it measured.",
              columns=(Text("S, cp", "point"), Text("layout", "layout"),
                       Column("plan ms", "plan_seconds", fmt(".1f", scale=1e3)),
                       Column("modeled/ideal", "modeled_over_ideal", ".2f")),
              compare=(Compare("plan ms", "plan ms", "plan_seconds", ("S", "cp", "layout"),
                               {"suite": "scale", "mix": "lognormal", "link": "ib"}, fmt(".0f", scale=1e3)),
                       Compare("modeled/ideal", "modeled/ideal", "modeled_over_ideal", ("S", "cp", "layout"),
                               {"suite": "scale", "mix": "lognormal", "link": "ib"}, fmt(".2f")))),
        Table("Plan ms per layout", _plan_ms_records, level=3, columns=_plan_ms_columns,
              note="Layout + plan, last rank, one core: CPU time of the planning thread, median of 3, worst over the "
                   "three scale mixes and the topologies (nvlink, ib, 2lvl)."),
    ),
)


# --- exchange_choice (plan only) --------------------------------------------------------------


def _exchange_choice():
    import exchange_choice  # torch and the engine: only where its table is rendered

    return exchange_choice


def _choice_records(rows):
    return _exchange_choice().choices(rows)


def _choice_cell(field, spec, scale=1.0):
    def cell(r, ex):
        got = r["by"].get(ex)
        if got is None:
            return "-"
        if got.get("refused"):
            return "refused"
        return format(scale * (got[field] if field != "streamed" else r["streamed"][ex]), spec)
    return cell


def _choice_columns(records):
    exchanges = [e for e in _exchange_choice().EXCHANGES if any(e in r["by"] for r in records)]
    mib, ms = _choice_cell("bytes_max", ".1f", 1 / MiB), _choice_cell("modeled_seconds", ".2f", 1e3)
    streamed = _choice_cell("streamed", ".2f", 1e3)
    return ((Text("point", "point"), Text("model", "model"), Text("mix", "mix"), Column("longest doc", "longest"))
            + tuple(Column(f"{e} MiB", lambda r, e=e: mib(r, e), str) for e in exchanges)
            + (Column("ideal ms", "ideal_seconds", fmt(".2f", scale=1e3)),)
            + tuple(Column(f"{e} ms", lambda r, e=e: ms(r, e), str) for e in exchanges)
            + ((Text("2d option", lambda r: r["by"].get("2d", {}).get("option", "-")),)
               if "2d" in exchanges else ())
            + (Text("least", "pick"),)
            + tuple(Column(f"{e} streamed", lambda r, e=e: streamed(r, e), str) for e in exchanges)
            + (Text("least streamed", "pick_streamed"),))


def _choice_note(records):
    refused = sorted({f"{r['model']} at cp {r['cp']}" for r in records
                      for got in r["by"].values() if got.get("refused")})
    return ("Per layer, the busiest rank: MiB it moves in forward (the larger of sent and received) and the cost "
            "model's time of forward + backward (`cost.py`: H200 bf16 attention at 500e12 FLOP/s, NVLink 400e9 B/s "
            "per GPU, IB 50e9 B/s per GPU; 128k / cp 8 on one NVLink node, 1M / cp 64 on 8 nodes of 8). `ms`: no "
            "overlap; `streamed`: the needed-only and all-gather exchanges streamed behind compute "
            "(`CostModel.overlapped`, backward refetching), ulysses' all-to-alls a group of heads at a time as the "
            "engine moves them (`cost_options.pipelined_seconds`: all but the first group's move in and the last "
            "one's move home hidden behind the attention, as far as it lasts). a2a / hierarchical: the better of the balanced "
            "and zigzag layouts (every row in the next table); all-gather: zigzag. Ulysses: (cp - 1) / cp of the "
            "local q, k and v (K/V heads repeated to split over cp) and out, its compute the ideal (total pairs / "
            "cp), the all-to-alls priced on NVLink inside a node and IB for the (cp - 8) / cp of each tensor that "
            "leaves it. 2d: two-dimensional CP, ulysses over u ranks inside a node and the K/V exchange between the "
            "r = cp / u groups (`cost_options.price_option`: (u - 1) / u of the local q, k, v and out on NVLink, "
            "plus the layout at r priced with Hq / u and Hkv * repeats / u heads per rank over the outer level's "
            "links), the best over u (every u dividing cp and 8, 1 < u < cp), outer a2a or hierarchical and the "
            "two layouts; `2d option` names it (streamed: the outer exchange streamed, the all-to-alls by head groups). "
            "`least`: the exchange of least time (others within 1% named with it)."
            + (f" Ulysses is refused for {', '.join(refused)}: cp must divide the query heads." if refused else "")
            + " `scripts/bench/exchange_choice.py`.")


def _choice_rows(rows):
    return [{**r, "bytes_mib": r.get("bytes_max", 0) / MiB} for r in rows if r["suite"] == "exchange_choice"]


EXCHANGE_CHOICE = Suite(
    "exchange_choice", suite("exchange_choice"),
    tables=(
        Table("Which exchange: bytes and modeled time per layer (plan only)", _choice_records,
              note=_choice_note, columns=_choice_columns),
        Table("Every exchange and layout", _choice_rows, level=3,
              columns=(Text("point", "point"), Text("model", "model"), Text("mix", "mix"),
                       Text("exchange", lambda r: r.get("option", r["exchange"])), Text("layout", "layout"),
                       Column("MiB", lambda r: None if r.get("refused") else r["bytes_mib"], fmt(".1f")),
                       Column("received MiB", "bytes_received_max", fmt(".1f", scale=1 / MiB)),
                       Column("across nodes MiB", "inter_node_bytes_max", fmt(".1f", scale=1 / MiB)),
                       Column("ms", "modeled_seconds", fmt(".2f", scale=1e3)),
                       Column("streamed ms", "overlap_seconds", fmt(".2f", scale=1e3)),
                       Column("/ ideal", "modeled_over_ideal", fmt(".3f")),
                       Column("work max/mean", "work_max_over_mean", fmt(".3f")),
                       Text("refused", lambda r: r.get("refused", "").split(";")[0], str))),
    ),
)


# --- gpu_model (recorded op sequence, modeled H200) ---------------------------------------------


def _gpu_model_rows(rows):
    return [r for r in rows if r["suite"] == "gpu_model" and not r.get("refused")]


def _gm_label(r):
    window = f"/w{r['window']}" if r["window"] else ""
    relaid = "/relaid" if r.get("relayout", "none") != "none" else ""
    return f"{r['point']}/{r['mix']}/{r['layout']}{relaid}/{r['exchange']}{window}/{r['model_key']}"


def _gm_within_roofline(rows, suffix="", ratio="ratio"):
    """modeled <= 1.2x roofline per needed-only case phase; ``suffix``: "_measured_kernel" for the
    calls priced on the measured kernel (rows without them are left out); ``ratio`` "own_ratio": over
    the busiest rank's own roofline."""
    return [Check(f"{_gm_label(r)}/{phase}", r[key] <= 1.2, r[key])
            for r in _gpu_model_rows(rows) if r["exchange"] in ("a2a", "halo", "hierarchical")
            for phase in ("fwd", "bwd") for key in [f"{ratio}_{phase}{suffix}"] if key in r or not suffix]


def _gm_measured_kernel(rows):
    r = next((r for r in _gpu_model_rows(rows) if "measured_kernel_tflops" in r), None)
    return "" if r is None else (f"{r['measured_kernel_tflops']:.0f} TFLOP/s forward, backward "
                                 f"{r['measured_backward_factor']:.2f}x")


def _gm_host_under_gpu(rows):
    # The ulysses and relaid rows (model "gqa_heads") run the model's 32 query heads on the CPU, 8x the
    # elements of the other rows' run dims, so their host time holds that much more CPU arithmetic: left out.
    return [Check(f"{_gm_label(r)}/{phase}", r[f"host_s_{phase}"] <= r[f"modeled_s_{phase}"],
                  r[f"host_s_{phase}"] / r[f"modeled_s_{phase}"])
            for r in _gpu_model_rows(rows) if r["ideal_fwd_s"] >= 1e-3 and r["model_key"] != "gqa_heads"
            for phase in ("fwd", "bwd")]


def _gm_dispatch_under_gpu(rows):
    # What a GPU's host spends issuing the call: the meta run's thread time (the op's Python, torch's
    # dispatch and shape functions, no CPU arithmetic) plus the model's launch term (7.5 µs a launching op,
    # kernel call and posted batch), which counts each op's dispatch a second time. Every row with the
    # figure (hierarchical has none), the ulysses and relaid rows included: on meta their 32 heads cost nothing.
    return [Check(f"{_gm_label(r)}/{phase}", value <= 1.0, value)
            for r in _gpu_model_rows(rows) if r["ideal_fwd_s"] >= 1e-3 and r.get("host_dispatch_s_fwd") is not None
            for phase in ("fwd", "bwd")
            for value in [(r[f"host_dispatch_s_{phase}"] + r[f"launch_s_{phase}"]) / r[f"modeled_s_{phase}"]]]


def _gm_no_later_syncs(rows):
    return [Check(_gm_label(r), r["syncs_max_fwd"] + r["syncs_max_bwd"] == 0) for r in _gpu_model_rows(rows)]


def _gm_worst(checks, rows):
    bad = [c for c in checks if not c.ok]
    worst = max(checks, key=lambda c: c.value) if checks else None
    return (f"{len(bad)} miss; worst {worst.label} {worst.value:.2f}×" if worst and worst.value is not None
            else misses(checks))


def _gm_records(rows):
    return sorted(_gpu_model_rows(rows) + [r for r in rows if r["suite"] == "gpu_model" and r.get("refused")],
                  key=lambda r: (-r["cp"], r["model_key"], r["window"], r["mix"], r["layout"],
                                 r.get("relayout", "none") != "none", r["exchange"]))


_MS = fmt(".2f", scale=1e3)


def _gm_own_ratio(r):
    if r.get("own_roofline_fwd_s") is None:
        return "-"
    return f"{(r['modeled_s_fwd'] + r['modeled_s_bwd']) / (r['own_roofline_fwd_s'] + r['own_roofline_bwd_s']):.2f}"


def _gm_pair(a, b, spec=".0f", scale=1.0):
    return lambda r: "-" if r.get(a) is None else f"{scale * r[a]:{spec}} / {scale * r[b]:{spec}}"


GPU_MODEL = Suite(
    "gpu_model", suite("gpu_model"),
    targets=(
        Target("gpu_model: no host sync in a layer call after a step's first (every rank)", _gm_no_later_syncs,
               unit="cases"),
        Target("gpu_model: modeled GPU time <= 1.2x the layout's roofline with a needed-only exchange "
               "(a2a, halo, hierarchical), forward and backward, busiest rank", _gm_within_roofline,
               _gm_worst, unit="case phases"),
        Target(lambda rows: "gpu_model, on the kernel an H200 measured (torch's flash in "
               f"bench/gpu_check_h200.jsonl: {_gm_measured_kernel(rows)}): modeled GPU time <= 1.2x that "
               "roofline with a needed-only exchange, forward and backward (the same calls repriced; the line "
               "above prices them on the constants of bench/README.md)",
               lambda rows: _gm_within_roofline(rows, "_measured_kernel"),
               _gm_worst, unit="case phases"),
        Target("gpu_model, what the op adds to its layout: modeled GPU time <= 1.2x the busiest rank's own "
               "roofline (max(the most pairs the layout hands one rank at the kernel rate, the needed K/V at link "
               "rate)) with a needed-only exchange, forward and backward: the line above with the layout's "
               "imbalance left out", lambda rows: _gm_within_roofline(rows, ratio="own_ratio"),
               _gm_worst, unit="case phases"),
        Target("gpu_model: host time with a null kernel <= modeled GPU time where the ideal is >= 1 ms "
               "(the slowest rank, each rank alone on the CPU; hierarchical: every rank at once on the shared "
               "cores; the ulysses and relaid rows apart: their CPU runs the model's 32 heads)",
               _gm_host_under_gpu, _gm_worst, unit="case phases"),
        Target("gpu_model: host time as a GPU's host spends it <= modeled GPU time where the ideal is >= 1 ms: "
               "the steady call on meta tensors (the op's Python and torch's dispatch, no CPU arithmetic; the "
               "slowest rank, each rank alone) plus the model's 7.5 µs a launching op, kernel call and posted "
               "batch (hierarchical has no meta figure; the ulysses and relaid rows are in)",
               _gm_dispatch_under_gpu, _gm_worst, unit="case phases"),
    ),
    tables=(
        Table("Recorded op sequence on a modeled H200 (gpu_model: every GPU time modeled)", _gm_records,
              split="point", split_title="{}",
              note="Busiest rank, a steady layer call (the 2nd of a step), forward / backward. Counts recorded "
                   "by `OpCounter(log=True)` on CPU (gloo, null kernel, small head dims, bf16), replayed at the "
                   "model's dims on the H200 constants of bench/README.md (7.5 µs host per launching op, "
                   "450e12 FLOP/s varlen forward, 2.5x for backward, 3.3e12 B/s HBM, NVLink 400e9 / IB 50e9 "
                   "B/s). `host ms`: thread CPU time the CPU measured for the call with the null kernel (the "
                   "slowest rank, each rank alone as rank r of torch's fake process group, the less disturbed "
                   "of its steady calls; hierarchical: every rank at once on the shared cores); `host ms "
                   "(meta)`: the same steady call on meta tensors (the op's Python and torch's dispatch, without "
                   "the CPU running the ops; none for hierarchical). "
                   "`ideal`: the documents' attention FLOPs / cp at the kernel rate; `roofline`: max(ideal, "
                   "busiest rank's needed K/V bytes at link rate); `ratio`: modeled / roofline, forward + "
                   "backward; `rank work`: the most attention FLOPs the layout hands one rank, at the kernel "
                   "rate; `own ratio`: modeled / max(rank work, the same link term), forward + backward (what "
                   "the op adds to its layout); `ratio, H200 kernel`: forward / backward, the same calls and roofline priced with "
                   "the kernel an H200 measured (bench/README.md). hierarchical: 2 nodes of cp / 2 (IB across). "
                   "`scripts/bench/gpu_model.py`.",
              columns=(Text("mix", "mix"), Text("layout", "layout"),
                       Text("relayout", lambda r: r.get("relayout", "none")), Text("exchange", "exchange"),
                       Column("window", "window"), Text("model", "model_key"),
                       Column("calls", _gm_pair("kernel_calls_fwd", "kernel_calls_bwd"), str),
                       Column("ops", _gm_pair("launching_fwd", "launching_bwd"), str),
                       Column("syncs", _gm_pair("syncs_fwd", "syncs_bwd"), str),
                       Column("1st-call syncs", "first_call_syncs"),
                       Column("transfers", _gm_pair("transfers_fwd", "transfers_bwd"), str),
                       Column("modeled ms", _gm_pair("modeled_s_fwd", "modeled_s_bwd", ".2f", 1e3), str),
                       Column("host ms (CPU)", _gm_pair("host_s_fwd", "host_s_bwd", ".1f", 1e3), str),
                       Column("host ms (meta)", _gm_pair("host_dispatch_s_fwd", "host_dispatch_s_bwd", ".1f", 1e3),
                              str),
                       Column("ideal ms", _gm_pair("ideal_fwd_s", "ideal_bwd_s", ".2f", 1e3), str),
                       Column("roofline ms", _gm_pair("roofline_fwd_s", "roofline_bwd_s", ".2f", 1e3), str),
                       Column("ratio", "ratio", fmt(".2f")),
                       Column("rank work ms", _gm_pair("rank_work_fwd_s", "rank_work_bwd_s", ".2f", 1e3), str),
                       Column("own ratio", _gm_own_ratio, str),
                       Column("ratio, H200 kernel", _gm_pair("ratio_fwd_measured_kernel", "ratio_bwd_measured_kernel",
                                                              ".2f"), str),
                       Text("refused", lambda r: (r.get("refused") or "")[:80], str))),
    ),
)


def _gml_h200_pair(key):
    return lambda r: "-" if r.get(key) is None else f"{r[key][0]} / {r[key][1]}"


GPU_MODEL_LOOPBACK = Suite(
    "gpu_model_loopback", suite("gpu_model_loopback"),
    tables=(
        Table("The model beside an H200: one rank of cp 8, chunks handed over on the device",
              suite("gpu_model_loopback"),  # written in gpu_model.LOOPBACK_CASES' order
              note="The gpu_check loopback's cases (`testing.loopback`: rank r's real plan in one process, its "
                   "chunks handed over, so no link; 128k tokens, the gpu_model suite's documents, a2a, "
                   "`kv_backward` auto, Llama-3-8B attention 32 / 8 / 128, bf16), a step's steady second layer "
                   "call, forward + backward. `modeled`: its op sequence recorded on CPU (dense path, null "
                   "kernel) and priced with the link free, on the constants of bench/README.md and on the "
                   "kernel an H200 measured; `H200`: what the loopback measured on an H200 "
                   "(bench/gpu_check_h200.jsonl, torch's flash ops; `-`: no steady-call row there). Calls and "
                   "ops: forward / backward; the H200 ran the flash path, whose ops around the kernel differ "
                   "from the dense path's. `kernel ms`: the kernel calls alone (modeled: their priced time; "
                   "H200: CUDA events around each call, in a third layer call of the step); `tiles / pairs`: "
                   "the query-key pairs of every 128 x 64 tile a forward call touches over the pairs it "
                   "attends (`segment_tiles`; the model prices pairs). `scripts/bench/gpu_model.py` "
                   "(`loopback_rows`). `relayout` balanced: the rows attended in the balanced layout, timing only "
                   "(the fake group moves no rows). An H200 row searched under another cost model than the "
                   "model's (a balanced cut) is not joined.",
              columns=(Text("mix", "mix"), Text("layout", "layout"), Column("rank", "rank"),
                       Text("relayout", lambda r: r.get("relayout", "none")),
                       Text("kv_backward", "kv_backward"),
                       Column("calls", _gm_pair("kernel_calls_fwd", "kernel_calls_bwd"), str),
                       Column("H200 calls", _gml_h200_pair("h200_kernel_calls"), str),
                       Column("ops", _gm_pair("launching_fwd", "launching_bwd"), str),
                       Column("H200 ops", _gml_h200_pair("h200_launching"), str),
                       Column("modeled ms", "device_ms", fmt(".2f")),
                       Column("modeled ms, H200 kernel", "device_ms_measured_kernel", fmt(".2f")),
                       Column("H200 ms", "h200_fwd_bwd_ms", fmt(".2f")),
                       Column("H200 / modeled (H200 kernel)", "h200_over_modeled", fmt(".2f")),
                       Column("modeled kernel ms, H200 kernel", "kernel_ms_measured_kernel", fmt(".2f")),
                       Column("H200 kernel ms", "h200_kernel_ms", fmt(".2f")),
                       Column("tiles / pairs", "tiles_over_pairs", fmt(".2f")),
                       Column("modeled host ms", lambda r: (r["host_s_fwd"] + r["host_s_bwd"]) * 1e3, fmt(".2f")),
                       Column("H200 host ms", "h200_host_ms", fmt(".2f")))),
    ),
)


def _gm_key(r):
    return (r["point"], r["mix"], r["layout"], r["exchange"], r["window"], r["model_key"], r.get("relayout", "none"))


def _gm_kv_records(rows):
    """The gpu_model_kv rows, each with its refetch row's modeled backward (``refetch_bwd_s``)."""
    refetch = {_gm_key(r): r for r in _gpu_model_rows(rows)}
    got = []
    for r in rows:
        if r["suite"] == "gpu_model_kv" and not r.get("refused"):
            twin = refetch.get(_gm_key(r))
            got.append({**r, "refetch_bwd_s": None if twin is None else twin["modeled_s_bwd"]})
    return sorted(got, key=lambda r: (-r["cp"], r["model_key"], r["mix"], r["layout"], r["exchange"]))


GPU_MODEL_KV = Suite(
    "gpu_model_kv", suite("gpu_model_kv"),
    tables=(
        Table("Backward as kv_backward's default resolves it (gpu_model_kv: every GPU time modeled)", _gm_kv_records,
              note="The gpu_model replay (the same recording, null kernel and H200 constants) of cases built with "
                   "`kv_backward=\"auto\"`, the knob's default, and `thd` at 128k / cp 8 built with `save` "
                   "(auto refetches there; `save` takes the band mode's groups of pieces): `kv_backward` is "
                   "what it resolved to (`save`: "
                   "backward reads the K/V forward received and fetches nothing; then it takes the received "
                   "chunks first and the own keys last, while the last gradient travels home: "
                   "`BlockDiagCPState.backward_own_last`). `refetch bwd ms`: the same case's backward in the "
                   "gpu_model table (built with `refetch`). Busiest rank, a steady layer call; `ratio`: modeled / "
                   "roofline, forward + backward; `own ratio`: over the busiest rank's own roofline.",
              columns=(Text("point", "point"), Text("mix", "mix"), Text("layout", "layout"),
                       Text("exchange", "exchange"), Text("model", "model_key"),
                       Text("kv_backward", lambda r: r.get("kv_backward_resolved") or "-"),
                       Column("calls", _gm_pair("kernel_calls_fwd", "kernel_calls_bwd"), str),
                       Column("ops", _gm_pair("launching_fwd", "launching_bwd"), str),
                       Column("transfers", _gm_pair("transfers_fwd", "transfers_bwd"), str),
                       Column("modeled ms", _gm_pair("modeled_s_fwd", "modeled_s_bwd", ".2f", 1e3), str),
                       Column("refetch bwd ms", "refetch_bwd_s", fmt(".2f", scale=1e3)),
                       Column("host ms (CPU)", _gm_pair("host_s_fwd", "host_s_bwd", ".1f", 1e3), str),
                       Column("host ms (meta)", _gm_pair("host_dispatch_s_fwd", "host_dispatch_s_bwd", ".1f", 1e3),
                              str),
                       Column("roofline ms", _gm_pair("roofline_fwd_s", "roofline_bwd_s", ".2f", 1e3), str),
                       Column("ratio", "ratio", fmt(".2f")),
                       Column("own ratio", _gm_own_ratio, str))),
    ),
)


# --- dropin -----------------------------------------------------------------------------------

DROPIN_PER = {"mask_derive": "micro batch", "mask_state": "micro batch", "layer_fwd_bwd": "layer",
              "qkv_agreement": "layer forward call"}


def _dropin_title(rows):
    r0 = next(r for r in rows if r["suite"] == "dropin")
    return (f"Megatron's data paths: what the mask path and the q/k/v agreement cost (S={r0['S']}, cp={r0['cp']}, "
            f"{r0['mix']} mix, {r0['backend']}, {r0['exchange']})")


DROPIN = Suite(
    "dropin", suite("dropin"),
    tables=(
        Table(_dropin_title, suite("dropin"),
              columns=(Text("measure", "measure"),
                       Column("median ms (slowest rank)", "median_seconds", fmt(".1f", scale=1e3)),
                       Column("/ one layer fwd+bwd", "over_layer_fwd_bwd", ".3f"),
                       Text("per", lambda r: DROPIN_PER.get(r["measure"], ""), str))),
    ),
)

# The order of SUMMARY.md: targets of every suite first, then each suite's tables.
SUITES = (COMM, BALANCE, SPEED, MEMORY, LAYER_AB, TORCH_CP, TORCH_CP_FLEX, WINDOW, MODEL, GPU, SCALE, EXCHANGE_CHOICE, GPU_MODEL,
          GPU_MODEL_KV, GPU_MODEL_LOOPBACK, DROPIN)
