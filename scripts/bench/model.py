"""model row: tokens/s of scripts/pretrain_gpt.py at CP=1 and CP=2 on its embedded default data.

Runs the script with torchrun (two processes on this machine, so CP=1 means DP=2 and
CP=2 means DP=1: the same hardware either way) for a few iterations and parses its
per-interval log line ``... | tokens/s: N | ...``; the first interval (warm-up, first
plan, allocator growth) is dropped and the median of the rest is kept. When the script
is missing or fails, the row is recorded as skipped with the reason instead.
"""

import os
import re
import statistics
import subprocess
import sys
import time
from typing import Dict, List

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO_ROOT, "scripts", "pretrain_gpt.py")
NPROC = 2

_TOKENS = re.compile(r"tokens/s:\s*([0-9.]+)")
_SUMMARY = re.compile(r"tokens_per_s=([0-9.]+)")
_SEQ = re.compile(r"\bseq (\d+)")
_CP_LINE = re.compile(r"cp attention: backend (\S+) -> (\S+) .*exchange (\S+) -> (\S+) .*layout (\S+)")


def _row(cp: int, **extra) -> Dict:
    return {"suite": "model", "mix": "stdlib_default", "S": extra.pop("S", None), "cp": cp,
            "layout": extra.pop("layout", "-"), "exchange": extra.pop("exchange", "-"),
            "backend": extra.pop("backend", "-"), "baseline": "pretrain_gpt", **extra}


def run_one(cp: int, iters: int, log_interval: int, timeout: float, extra_args=()) -> Dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={NPROC}", SCRIPT, "--train-iters", str(iters),
           "--log-interval", str(log_interval), "--context-parallel-size", str(cp), "--no-plot",
           *extra_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return _row(cp, skipped=True, reason=f"pretrain_gpt.py did not finish within {timeout:.0f}s")
    wall = time.perf_counter() - t0
    text = proc.stdout + "\n" + proc.stderr
    rates = [float(x) for x in _TOKENS.findall(text)]
    if proc.returncode != 0 or not rates:
        lines = [ln for ln in text.splitlines() if ln.strip() and "Traceback" not in ln]
        why = next((ln.strip() for ln in reversed(lines) if "Error" in ln), None)
        why = why or (lines[-1].strip() if lines else "no output")
        return _row(cp, skipped=True, reason=f"pretrain_gpt.py exit {proc.returncode}: {why}"[:500],
                    wall_seconds=wall)
    steady = rates[1:] or rates
    seq = _SEQ.search(text)
    cp_line = _CP_LINE.search(text)
    summary = _SUMMARY.search(text)
    extra = {}
    if cp_line:
        extra = {"backend": cp_line.group(2), "exchange": cp_line.group(4).rstrip(","),
                 "layout": cp_line.group(5)}
    return _row(cp, S=int(seq.group(1)) if seq else None, tokens_per_s=statistics.median(steady),
                tokens_per_s_intervals=rates, tokens_per_s_whole_run=float(summary.group(1)) if summary else None,
                iters=iters, world=NPROC, dp=NPROC // cp, wall_seconds=wall, **extra)


def run(cps=(1, 2), iters: int = 16, log_interval: int = 4, timeout: float = 420.0,
        log=print) -> List[Dict]:
    if not os.path.exists(SCRIPT):
        return [_row(cp, skipped=True, reason=f"{SCRIPT} does not exist") for cp in cps]
    rows = []
    for cp in cps:
        row = run_one(cp, iters, log_interval, timeout)
        if row.get("skipped"):
            log(f"  model cp={cp}: skipped: {row['reason']}")
        else:
            log(f"  model cp={cp}: {row['tokens_per_s']:.0f} tokens/s ({row['wall_seconds']:.0f}s)")
        rows.append(row)
    return rows
