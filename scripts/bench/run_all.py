#!/usr/bin/env python3
"""Run the benchmark suites and write results.jsonl, PNG plots and SUMMARY.md.

    python scripts/bench/run_all.py                       # full CPU suite -> bench/
    python scripts/bench/run_all.py --quick               # smoke run -> bench/quick/
    python scripts/bench/run_all.py --suites comm,balance # a subset (rows of other suites kept)
    python scripts/bench/run_all.py --suites gpu          # CUDA only: TFLOP/s per backend
    python scripts/bench/run_all.py --suites gpu_check    # the GPU check (scripts/gpu_check.sh)

Suites: comm, balance (same runs: one engine call per config on a cp-process gloo
group), speed, speed_memory (same runs: cp=2 fwd+bwd timings against the baselines, one
profiled iteration each), memory (per-rank peak and held memory of one layer as cp grows,
cp 2-8, every layout x exchange x kv_backward; scripts/bench/memory.py),
model (scripts/pretrain_gpt.py tokens/s at CP=1 and CP=2), gpu (skipped without CUDA),
scale (plan only, no processes: layout + plan cost and modeled time at 32k-1M tokens, cp 8-64),
scale_latency (plan only: balanced at the two-level points with a per-message latency priced),
window (plan only: K/V bytes and work with and without a sliding window, 32k-128k at cp 8),
exchange_choice (plan only: bytes and modeled time of allgather, a2a, hierarchical and ulysses on the
scale mixes at 128k / cp 8 and 1M / cp 64),
gpu_model (the op's recorded op sequence with a null kernel, replayed on a modeled H200 roofline:
every case at 32k / cp 2 and 128k / cp 8; scripts/bench/gpu_model.py; and, as suite
gpu_model_loopback, the gpu_check loopback's ranks modeled beside what an H200 measured for them, and as
gpu_model_kv, cases replayed with kv_backward "auto" beside their refetch rows),
gpu_check (not in the default set; --dry-run runs it on CPU), dropin (not in the default set:
Megatron-mask document derivation and the per-call q/k/v agreement against one layer at
32k tokens, cp=4), torch_cp (not in the default set, about 10 minutes: one causal document at cp=2,
8k and 16k, fwd+bwd beside torch's own ring attention; scripts/bench/torch_cp.py), torch_cp_flex (not in
the default set, about 2 minutes: the short mix at cp=2, 8k and 16k, forward beside torch's flex-attention
context parallelism; scripts/bench/torch_cp_flex.py). One JSON object per
measurement; re-running some suites replaces only their rows. Exit status 1 when a
row says ``"passed": false`` (the checks of gpu_check).
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
for _p in (HERE, REPO_ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

ALL_SUITES = ("comm", "balance", "speed", "speed_memory", "memory", "model", "gpu", "scale", "scale_latency",
              "window", "exchange_choice", "gpu_model", "gpu_check", "dropin", "torch_cp", "torch_cp_flex")
DEFAULT_SUITES = ("comm", "balance", "speed", "speed_memory", "memory", "model", "gpu", "scale", "scale_latency",
                  "window", "exchange_choice", "gpu_model")  # gpu: a skipped row without CUDA


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small smoke run (about two minutes)")
    p.add_argument("--suites", default=",".join(DEFAULT_SUITES),
                   help=f"comma list of {', '.join(ALL_SUITES)} (default: all; gpu records a skipped row without CUDA)")
    p.add_argument("--out", default=None, help="output folder (default bench/, bench/quick/ with --quick)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per speed config (default 4, --quick 2)")
    p.add_argument("--comm-real-kernel", action="store_true",
                   help="run the real dense kernel in the comm suite too (slow at cp=8; bytes are equal)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--compare", action="append", default=[], metavar="ARCHIVE",
                   help="SUMMARY.md: put an archived run (bench/archive/*.jsonl) beside this one; repeatable")
    p.add_argument("--dry-run", action="store_true",
                   help="gpu_check: CPU, fp32, tiny sizes, the flash test double in place of the CUDA kernel")
    p.add_argument("--budget-s", type=float, default=420.0, help="gpu_check: start no check after this")
    p.add_argument("--skip", default="", help="gpu_check: comma list of matmul,accuracy,engine,timing")
    p.add_argument("--block-megatron", action="store_true",
                   help="gpu_check: make megatron unimportable first (as on a machine without megatron-core)")
    args = p.parse_args(argv)
    args.suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    unknown = sorted(set(args.suites) - set(ALL_SUITES))
    if unknown:
        p.error(f"unknown suite(s) {unknown}; choose from {', '.join(ALL_SUITES)}")
    if args.out is None:
        args.out = os.path.join(REPO_ROOT, "bench", "quick" if args.quick else "")
    args.out = os.path.abspath(args.out)
    return args


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _git(*args) -> str:
    """The engine under test is whatever is on disk: record the commit and local edits."""
    import subprocess

    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - no git: record nothing
        return ""


def _load(path: str):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # inherited by the worker processes
    import logging

    logging.getLogger("megatron_ext.blockdiag_cp").setLevel(logging.ERROR)
    import torch

    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    git_head = _git("rev-parse", "HEAD")
    engine_dirty = _git("status", "--porcelain", "megatron_ext").splitlines()
    rows, timings = [], {}
    suites = set(args.suites)

    if suites & {"comm", "balance"}:
        import comm_balance

        t0 = time.perf_counter()
        if args.quick:
            got = comm_balance.run(cps=(2, 4), seq_lens=(4096,), log=_log, real_kernel=args.comm_real_kernel)
        else:
            got = comm_balance.run(log=_log, real_kernel=args.comm_real_kernel)
        rows += [r for r in got if r["suite"] in suites]
        timings["comm+balance"] = time.perf_counter() - t0

    if suites & {"speed", "speed_memory"}:
        import speed

        t0 = time.perf_counter()
        plan = speed.QUICK_PLAN if args.quick else speed.DEFAULT_PLAN
        reps = args.reps or (2 if args.quick else 4)
        got = speed.run(plan=plan, reps=reps, log=_log)
        rows += [r for r in got if r["suite"] in suites]
        timings["speed+speed_memory"] = time.perf_counter() - t0

    if "memory" in suites:
        import memory

        t0 = time.perf_counter()
        rows += memory.run(memory.default_grid(args.quick), "current", log=_log)
        timings["memory"] = time.perf_counter() - t0

    if "model" in suites:
        import model

        t0 = time.perf_counter()
        rows += model.run(iters=6 if args.quick else 16, log_interval=2 if args.quick else 4, log=_log)
        timings["model"] = time.perf_counter() - t0

    if "scale" in suites:
        import scale

        t0 = time.perf_counter()
        if args.quick:
            rows += scale.run(seq_lens=(32768, 131072), cps=(8, 16), log=_log)
            rows += scale.run_worst_case(n_mixes=6, speed_points=((131072, 8, "nvlink", 10.0),),
                                         model_points=((131072, 16),), log=_log)
        else:
            rows += scale.run(log=_log)
            rows += scale.run_worst_case(log=_log)
        timings["scale"] = time.perf_counter() - t0

    if "scale_latency" in suites:
        import scale

        t0 = time.perf_counter()
        rows += scale.run_latency(points=((131072, 16),) if args.quick else scale.TWO_LEVEL_POINTS, log=_log)
        timings["scale_latency"] = time.perf_counter() - t0

    if "window" in suites:
        import window

        t0 = time.perf_counter()
        rows += window.run(points=((131072, 8),) if args.quick else window.POINTS, log=_log)
        timings["window"] = time.perf_counter() - t0

    if "exchange_choice" in suites:
        import exchange_choice

        t0 = time.perf_counter()
        rows += exchange_choice.run(log=_log)  # seconds: the same points with --quick
        timings["exchange_choice"] = time.perf_counter() - t0

    if "gpu_model" in suites:
        import gpu_model

        t0 = time.perf_counter()
        rows += gpu_model.run(gpu_model.QUICK_POINTS if args.quick else gpu_model.FULL_POINTS, log=_log)
        rows += gpu_model.loopback_rows(log=_log)  # seconds; suite gpu_model_loopback
        timings["gpu_model"] = time.perf_counter() - t0

    if "dropin" in suites:
        import dropin

        t0 = time.perf_counter()
        rows += dropin.run(seq_lens=(8192,) if args.quick else (32768,), log=_log)
        timings["dropin"] = time.perf_counter() - t0

    if "torch_cp" in suites:
        import torch_cp

        t0 = time.perf_counter()
        rows += torch_cp.run(sizes=(2048,) if args.quick else (8192, 16384), reps=args.reps or (2 if args.quick else 3),
                             rounds=1 if args.quick else 2, log=_log)
        timings["torch_cp"] = time.perf_counter() - t0

    if "torch_cp_flex" in suites:
        import torch_cp_flex

        t0 = time.perf_counter()
        rows += torch_cp_flex.run(sizes=(2048,) if args.quick else (8192, 16384), reps=args.reps or 3, log=_log)
        timings["torch_cp_flex"] = time.perf_counter() - t0

    if "gpu" in suites:
        import gpu

        t0 = time.perf_counter()
        rows += gpu.run(log=_log)
        timings["gpu"] = time.perf_counter() - t0

    if "gpu_check" in suites:
        import gpu_check

        t0 = time.perf_counter()
        rows += gpu_check.run(dry_run=args.dry_run, budget_s=args.budget_s, block_megatron=args.block_megatron,
                              skip={s for s in args.skip.split(",") if s}, log=_log)
        timings["gpu_check"] = time.perf_counter() - t0

    wall = time.perf_counter() - t_start
    meta = {"git_head": git_head, "engine_uncommitted": engine_dirty,
            "suite": "meta", "mix": "-", "S": None, "cp": None, "layout": "-", "exchange": "-",
            "backend": "-", "suites": sorted(suites), "quick": args.quick, "wall_seconds": wall,
            "suite_seconds": timings, "host": platform.node(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
    path = os.path.join(args.out, "results.jsonl")
    rerun = (suites | ({"scale_worst"} if "scale" in suites else set())  # the scale suite writes both
             | ({"gpu_model_loopback", "gpu_model_kv"} if "gpu_model" in suites else set()))  # and gpu_model these
    kept = [r for r in _load(path) if r.get("suite") not in rerun and r.get("suite") != "meta"]
    with open(path, "w") as f:
        for r in kept + rows + [meta]:
            f.write(json.dumps(r, sort_keys=False) + "\n")
    _log(f"wrote {len(rows)} rows ({len(kept)} kept from earlier runs) to {path} in {wall:.0f}s: "
         + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))

    all_rows = _load(path)
    if not args.no_plots:
        import plot

        for p in plot.plot_all(all_rows, args.out):
            _log(f"plot {p}")
    import summary

    with open(os.path.join(args.out, "SUMMARY.md"), "w") as f:
        f.write(summary.render(all_rows, [summary.Archive(a) for a in args.compare]))
    _log(f"summary {os.path.join(args.out, 'SUMMARY.md')}")
    failed = [r for r in rows if r.get("passed") is False]
    if failed:
        _log(f"{len(failed)} row(s) failed: " + ", ".join(sorted({f"{r['suite']}/{r.get('check', '?')}"
                                                               for r in failed})))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
