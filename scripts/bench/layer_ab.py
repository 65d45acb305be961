"""layer_ab: one attention layer, forward + backward, this engine against another checkout, A B A B.

    python scripts/bench/layer_ab.py --other /path/to/older/checkout --label-other before \\
        --out bench/results.jsonl

Each run is a fresh pair of gloo processes (cp = 2, one thread each) importing the engine
of one checkout (``--engine``, default this one; ``--other``), running every layout x
exchange on one mix (dense kernel, fp32, 8 heads x 64, b = 1) for ``--reps`` timed
iterations after a warm-up; an iteration's time is the slowest rank's. The two engines
alternate ``--rounds`` times, so drift of a shared machine hits both alike; rows keep every
round's median and the ratio other / this per round.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
LAYOUTS = ("contiguous", "zigzag", "balanced")
EXCHANGES = ("allgather", "halo", "a2a")


def _worker(rank, port, engine, mix, S, reps, queue):
    import logging

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing.mixes import make_doc_ids

    assert os.path.abspath(bdcp.__file__).startswith(engine), (bdcp.__file__, engine)
    logging.getLogger("megatron_ext.blockdiag_cp").setLevel(logging.ERROR)
    ids = make_doc_ids(mix, S)
    out = {}
    for layout in LAYOUTS:
        for exchange in EXCHANGES:
            state = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange=exchange, attn_backend="dense")
            g = torch.Generator().manual_seed(rank)
            q, k, v = (torch.randn(state.local_len, 1, 8, 64, generator=g).requires_grad_() for _ in range(3))
            dout = torch.randn(state.local_len, 1, 8, 64, generator=g)
            times = []
            for it in range(reps + 1):  # the first is the warm-up
                dist.barrier()
                t0 = time.perf_counter()
                with bdcp.blockdiag_cp_step(state):
                    bdcp.blockdiag_cp_attention(q, k, v).backward(dout)
                t = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if it:
                    times.append(float(t))
            out[f"{layout}/{exchange}"] = statistics.median(times)
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def one_run(engine: str, mix: str, S: int, reps: int) -> dict:
    """In a subprocess whose sys.path starts at ``engine``: {layout/exchange: median seconds}."""
    code = (f"import sys; sys.path.insert(0, {engine!r}); sys.path.insert(1, {HERE!r}); import layer_ab; "
            f"layer_ab._spawn({engine!r}, {mix!r}, {S}, {reps})")
    env = dict(os.environ, PYTHONPATH=engine)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"layer_ab run with {engine} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _spawn(engine, mix, S, reps):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, engine, mix, S, reps, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
    print(json.dumps(result))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", default=REPO)
    p.add_argument("--other", required=True)
    p.add_argument("--label", default="current")
    p.add_argument("--label-other", default="other")
    p.add_argument("--mix", default="short")
    p.add_argument("--S", type=int, default=16384)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    engines = {args.label: os.path.abspath(args.engine), args.label_other: os.path.abspath(args.other)}
    runs = {label: [] for label in engines}
    for r in range(args.rounds):
        for label, engine in engines.items():
            runs[label].append(one_run(engine, args.mix, args.S, args.reps))
            print(f"round {r} {label}: " + ", ".join(f"{k} {v:.2f}s" for k, v in runs[label][-1].items()),
                  flush=True)
    rows = []
    for key in runs[args.label][0]:
        layout, exchange = key.split("/")
        mine = [run[key] for run in runs[args.label]]
        other = [run[key] for run in runs[args.label_other]]
        rows.append({"suite": "layer_ab", "mix": args.mix, "S": args.S, "cp": 2, "layout": layout,
                     "exchange": exchange, "backend": "dense", "engine": args.label, "other": args.label_other,
                     "seconds": statistics.median(mine), "seconds_other": statistics.median(other),
                     "seconds_all": mine, "seconds_other_all": other,
                     "ratio_other_over_this_per_round": [o / m for o, m in zip(other, mine)],
                     "method": "fresh processes per run, engines alternated, median of rounds of medians"})
    from summary import append

    append(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
