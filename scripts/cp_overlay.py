#!/usr/bin/env python3
"""Show that context parallelism changes nothing: the same training at CP = 1 and CP = 2.

Runs scripts/pretrain_gpt.py twice on the same data, seed and global batch, in fp32:
- CP = 1: one process (TP 1 x CP 1 x DP 1), the whole 2048-token sequence on one rank;
- CP = 2: two processes (TP 1 x CP 2 x DP 1), each rank holding half of every sequence
  and exchanging K/V with the other.
Both see the same micro batches in the same order (DP = 1 and global batch 1 in both),
so any difference in the losses is the CP engine's. It writes the two loss curves
and their relative difference per iteration as ``docs/cp_overlay.png`` and the
numbers as ``docs/cp_overlay.json``, and exits 1 if any iteration differs by more
than ``--tolerance`` (relative).

    python scripts/cp_overlay.py --control -- --lr 1e-3 --min-lr 1e-4   # docs/cp_overlay.png
    python scripts/cp_overlay.py --train-iters 6 --out-dir /tmp/o -- --num-layers 2 ...
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "pretrain_gpt.py"


def run_training(cp: int, train_iters: int, run_dir: pathlib.Path, extra_args, threads=None) -> dict:
    """One pretrain_gpt.py run with `cp` processes (CP = cp, DP = 1); its losses by iteration."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={cp}", str(SCRIPT), "--context-parallel-size", str(cp),
           "--fp32", "--train-iters", str(train_iters), "--run-dir", str(run_dir), "--no-plot",
           *extra_args]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}
    env.setdefault("PYTHONPATH", str(REPO_ROOT))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.time()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(REPO_ROOT))
    if res.returncode != 0:
        sys.stderr.write(res.stdout[-4000:] + res.stderr[-4000:])
        raise SystemExit(f"cp_overlay: the CP={cp} run failed with exit code {res.returncode}")
    with open(run_dir / "losses.json") as f:
        data = json.load(f)
    print(f"cp_overlay: CP={cp} ({cp} process{'es' if cp > 1 else ''}): {train_iters} iterations "
          f"in {time.time() - t0:.0f} s")
    return dict(zip(data["iteration"], data["loss"]))


def plot(path: pathlib.Path, iterations, loss_cp1, loss_cp2, rel, tolerance, title,
         control=None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    top.plot(iterations, loss_cp1, lw=2.5, alpha=0.6, label="CP = 1 (1 process)")
    top.plot(iterations, loss_cp2, lw=1.0, ls="--", color="black", label="CP = 2 (2 processes)")
    top.set_ylabel("lm loss")
    top.set_title(title, fontsize=9)
    top.legend()
    top.grid(alpha=0.3)
    floor = 1e-9  # identical losses would vanish on the log axis
    bottom.semilogy(iterations, [max(r, floor) for r in rel], lw=1.0, marker=".", ms=3,
                    label="CP=2 vs CP=1")
    if control is not None:
        bottom.semilogy(iterations, [max(r, floor) for r in control], lw=1.0, color="grey",
                        alpha=0.8, label="control: CP=1, 1 vs 2 threads")
    bottom.axhline(tolerance, color="red", lw=1, ls=":", label=f"tolerance {tolerance:g}")
    bottom.set_ylabel("|CP2 - CP1| / CP1")
    bottom.set_xlabel("iteration")
    bottom.legend()
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-iters", type=int, default=100)
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="largest relative loss difference allowed at any iteration")
    parser.add_argument("--out-dir", type=pathlib.Path, default=REPO_ROOT / "docs",
                        help="where cp_overlay.png and cp_overlay.json go")
    parser.add_argument("--work-dir", type=pathlib.Path, default=None,
                        help="where the two runs write their losses (default runs/cp_overlay)")
    parser.add_argument("--control", action="store_true",
                        help="also run CP=1 with one thread: the fp32 noise floor of the same "
                             "training when only the reduction order changes")
    parser.add_argument("pretrain_args", nargs="*",
                        help="further pretrain_gpt.py flags for both runs (after --)")
    args = parser.parse_args(argv)
    work = args.work_dir or REPO_ROOT / "runs" / "cp_overlay"
    args.out_dir.mkdir(parents=True, exist_ok=True)

    loss_cp1 = run_training(1, args.train_iters, work / "cp1", args.pretrain_args)
    loss_cp2 = run_training(2, args.train_iters, work / "cp2", args.pretrain_args)
    control = None
    if args.control:  # CP=1 above ran with 2 threads (torchrun leaves OMP_NUM_THREADS unset)
        loss_ctl = run_training(1, args.train_iters, work / "cp1_1thread", args.pretrain_args,
                                threads=1)
        control = [abs(loss_ctl[i] - loss_cp1[i]) / abs(loss_cp1[i]) for i in sorted(loss_cp1)]
    iterations = sorted(loss_cp1)
    if sorted(loss_cp2) != iterations or len(iterations) != args.train_iters:
        raise SystemExit(f"cp_overlay: the runs logged different iterations: "
                         f"{len(loss_cp1)} vs {len(loss_cp2)}")
    rel = [abs(loss_cp2[i] - loss_cp1[i]) / abs(loss_cp1[i]) for i in iterations]
    worst = max(range(len(rel)), key=rel.__getitem__)
    model = "the make-train model (4 layers, hidden 256, seq 2048)"
    if args.pretrain_args:
        model += ",\n" + " ".join(args.pretrain_args)
    summary = {
        "setup": "CP=1 on 1 process vs CP=2 on 2 processes; DP=1, global batch 1, fp32, "
                 "same data, seed and flags",
        "pretrain_args": args.pretrain_args, "train_iters": args.train_iters,
        "tolerance": args.tolerance, "max_rel_diff": rel[worst],
        "max_rel_diff_iteration": iterations[worst],
        "first_loss": loss_cp1[iterations[0]], "last_loss_cp1": loss_cp1[iterations[-1]],
        "last_loss_cp2": loss_cp2[iterations[-1]],
        "control_max_rel_diff": max(control) if control else None,
        "iterations": iterations, "loss_cp1": [loss_cp1[i] for i in iterations],
        "loss_cp2": [loss_cp2[i] for i in iterations], "rel_diff": rel,
        "control_rel_diff": control,
    }
    with open(args.out_dir / "cp_overlay.json", "w") as f:
        json.dump(summary, f, indent=1)
    plot(args.out_dir / "cp_overlay.png", iterations, summary["loss_cp1"], summary["loss_cp2"],
         rel, args.tolerance,
         f"Same training at CP=1 and CP=2, fp32 ({args.train_iters} iterations)\n{model}",
         control)
    ok = rel[worst] <= args.tolerance
    print(f"cp_overlay: max |CP2 - CP1| / CP1 = {rel[worst]:.3e} at iteration {iterations[worst]} "
          f"({'within' if ok else 'ABOVE'} {args.tolerance:g}); loss {summary['first_loss']:.4f} -> "
          f"{summary['last_loss_cp1']:.4f} (CP=1) / {summary['last_loss_cp2']:.4f} (CP=2); "
          f"plot {args.out_dir / 'cp_overlay.png'}")
    if control:
        print(f"cp_overlay: control (CP=1, 1 vs 2 threads): max relative difference {max(control):.3e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
