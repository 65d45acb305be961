"""memory suite: per-rank memory of one attention layer, forward + backward, as cp grows.

For each mix (one long document, short documents, lognormal with a heavy tail), S,
cp (2, 4, 8), layout x exchange and ``kv_backward`` mode, every rank of a gloo group
builds the step (outside the measurement), then runs one attention layer:

- ``peak_bytes``: the most tensor memory the layer's forward + backward held on top
  of what was live before it (the inputs), from ``torch.profiler``'s CPU-allocator
  events (forward and backward profiled separately: peak = max(forward's peak, held +
  backward's peak));
- ``held_bytes``: what forward left allocated for backward (its output included);
- ``local_bytes``: this rank's own q, k, v and output, the yardstick (O(S / cp)).

Two kernels: ``stub`` (forward returns zeros and a zero lse, backward zero gradients,
each of the real shape) measures the engine's own buffers over the whole grid in
seconds; ``dense`` (the real kernel) runs where two cores allow, and its timed second
iteration reports how much of the layer's time each rank spent waiting for K/V
(``exposed_comm_fraction``: the waits compute did not hide, over forward + backward).

The script takes only the public API (``BlockDiagCPState.build``, ``blockdiag_cp_attention``),
so ``--engine-path`` can point it at another checkout of the engine (a before/after
comparison in one run).
"""

import argparse
import inspect
import json
import os
import sys
import time
from typing import Dict, List

import torch

LAYOUTS = ("contiguous", "zigzag", "balanced")
EXCHANGES = ("allgather", "halo", "a2a")
MIXES = ("single", "short", "heavy_tail")


def profiler_memory(prof):
    """(net, peak) bytes of the CPU allocator's events in a ``torch.profiler`` run with profile_memory:
    what the run left allocated, and the most it held at once, both above what was live before it.

    Here, not in megatron_ext.testing: this suite also measures other checkouts of the engine.
    """
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return int(cur), int(peak)


def _stub():
    from megatron_ext.blockdiag_cp.kernels import Kernel

    def forward(q, k, v, seg, scale, dropout_p=0.0, seed=0):
        return q.new_zeros(q.shape[:2] + v.shape[2:]), q.new_zeros(q.shape[:2]), None

    def backward(dout, q, k, v, out, lse, aux, seg, scale, dropout_p=0.0):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    return Kernel(forward, backward)


def memory_worker(cfg: Dict) -> Dict:
    """On every rank: build (not measured), profile forward, profile backward, then a timed pass."""
    import contextlib
    import logging

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing.mixes import make_doc_ids

    logging.getLogger("megatron_ext.blockdiag_cp").setLevel(logging.ERROR)
    kwargs = dict(layout=cfg["layout"], kv_exchange=cfg["exchange"], attn_backend="dense")
    if "kv_backward" in inspect.signature(bdcp.BlockDiagCPState.build).parameters:
        kwargs["kv_backward"] = cfg["kv_backward"]
    state = bdcp.BlockDiagCPState.build(make_doc_ids(cfg["mix"], cfg["S"]), **kwargs)
    L, h, d = state.local_len, cfg["heads"], cfg["head_dim"]
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(L, 1, h, d, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(L, 1, h, d, generator=g)
    hook = contextlib.nullcontext()
    if cfg["kernel"] == "stub":
        from megatron_ext.testing import override_kernel

        hook = override_kernel("dense", _stub())

    def layer(profiled: bool):
        with hook, bdcp.blockdiag_cp_step(state):
            t0 = time.perf_counter()
            if profiled:
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as fwd:
                    out = bdcp.blockdiag_cp_attention(q, k, v)
            else:
                out = bdcp.blockdiag_cp_attention(q, k, v)
            t1 = time.perf_counter()
            if profiled:
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as bwd:
                    out.backward(dout)
            else:
                out.backward(dout)
            t2 = time.perf_counter()
        for t in (q, k, v):
            t.grad = None
        if not profiled:
            return t1 - t0, t2 - t1
        held, fwd_peak = profiler_memory(fwd)
        _, bwd_peak = profiler_memory(bwd)
        return held, max(fwd_peak, held + bwd_peak)

    dist.barrier()
    held, peak = layer(True)
    result = {"held_bytes": held, "peak_bytes": peak, "local_bytes": 4 * L * h * d * 4,
              "kv_backward": state.report().get("kv_backward", "n/a")}  # n/a: an engine before the knob
    if cfg["kernel"] == "dense" and cfg.get("timed", True):
        dist.barrier()
        fwd_s, bwd_s = layer(False)
        from megatron_ext.blockdiag_cp.exchange import resolve_waits

        stats = resolve_waits(state.comm_stats)  # CUDA-event waits read back after the step
        waits = stats.get("wait_seconds", 0.0) + stats.get("backward_wait_seconds", 0.0)
        compute = stats.get("compute_seconds", 0.0) + stats.get("backward_compute_seconds", 0.0)
        result.update(forward_seconds=fwd_s, backward_seconds=bwd_s, wait_seconds=waits, compute_seconds=compute,
                      exposed_comm_fraction=waits / (fwd_s + bwd_s) if "wait_seconds" in stats else None)
    return result


def configs(mixes, seq_lens, cps, kernel, modes, layouts=LAYOUTS, exchanges=EXCHANGES, heads=8, head_dim=64):
    for mix in mixes:
        for S in seq_lens:
            for cp in cps:
                for layout in layouts:
                    for exchange in exchanges:
                        for mode in modes:
                            yield dict(mix=mix, S=S, cp=cp, layout=layout, exchange=exchange, kv_backward=mode,
                                       kernel=kernel, heads=heads, head_dim=head_dim)


def _config_key(cfg: Dict) -> tuple:
    return tuple(cfg[k] for k in ("mix", "S", "cp", "layout", "exchange", "kv_backward", "kernel", "heads",
                                  "head_dim"))


# Fresh ranks every few configs: a rank's resident memory only grows over configs (allocator caches,
# profiler buffers), and eight ranks at S = 64k outgrew the 24 GiB machine.
POOL_RECYCLE_CONFIGS = 9


def run(grid: List[Dict], engine: str, log=print, out_path=None) -> List[Dict]:
    """Every config of ``grid``; with ``out_path``, each row is appended as it lands and configs
    already there for this engine are skipped (a run stopped half-way resumes)."""
    from megatron_ext.testing import WorkerPool

    rows, pools = [], {}
    if out_path and os.path.exists(out_path):
        with open(out_path) as f:
            done = {_config_key({**r, "kv_backward": r["kv_backward_requested"]}) for r in map(json.loads, f)
                    if r.get("engine") == engine}
        grid = [cfg for cfg in grid if _config_key(cfg) not in done]
    grid = sorted(grid, key=lambda cfg: cfg["cp"])  # stable: one pool per cp size, spawned once
    used = 0
    try:
        for cfg in grid:
            cp = cfg["cp"]
            if cp not in pools or used >= POOL_RECYCLE_CONFIGS:
                for other in list(pools):
                    pools.pop(other).close()  # one pool alive: cp=8 is eight processes on two cores
                pools[cp], used = WorkerPool(cp, timeout=1800.0), 0
            used += 1
            t0 = time.perf_counter()
            per_rank = pools[cp].run(memory_worker, cfg)
            busiest = max(range(cp), key=lambda r: per_rank[r]["peak_bytes"])
            row = {"suite": "memory", "engine": engine, **cfg, "exchange_requested": cfg["exchange"],
                   "kv_backward_requested": cfg["kv_backward"], "kv_backward": per_rank[0]["kv_backward"],
                   "peak_bytes": per_rank[busiest]["peak_bytes"],
                   "held_bytes": max(r["held_bytes"] for r in per_rank),
                   "local_bytes": per_rank[0]["local_bytes"],
                   "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
                   "held_bytes_per_rank": [r["held_bytes"] for r in per_rank],
                   "method": "torch.profiler profile_memory: CPU-allocator bytes above those live before "
                             "forward; peak = max(forward peak, held + backward peak); busiest rank"}
            if "forward_seconds" in per_rank[0]:
                row["layer_seconds"] = max(r["forward_seconds"] + r["backward_seconds"] for r in per_rank)
                fractions = [r["exposed_comm_fraction"] for r in per_rank]
                row["exposed_comm_fraction_per_rank"] = fractions
                row["exposed_comm_fraction"] = None if None in fractions else max(fractions)
                # The busiest rank (most kernel time) sets the layer's time: its waits are the exchange
                # compute did not hide; a lighter rank's waits are mostly the busiest one's compute.
                critical = max(range(cp), key=lambda r: per_rank[r].get("compute_seconds", 0.0))
                row["exposed_comm_fraction_busiest"] = fractions[critical]
            rows.append(row)
            if out_path:
                with open(out_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
            log(f"  memory {engine} {cfg['kernel']} {cfg['mix']} S={cfg['S']} cp={cp} {cfg['layout']}/"
                f"{cfg['exchange']}/{row['kv_backward']}: peak {row['peak_bytes'] / 2**20:.0f} MiB, held "
                f"{row['held_bytes'] / 2**20:.1f} MiB, local {row['local_bytes'] / 2**20:.1f} MiB "
                f"({time.perf_counter() - t0:.1f}s)")
    finally:
        for pool in pools.values():
            pool.close()
    return rows


def default_grid(quick: bool = False) -> List[Dict]:
    """The engine's buffers over the whole grid (stub kernel), the real kernel at S = 16k."""
    if quick:
        return (list(configs(("single",), (16384,), (2, 4), "stub", ("refetch",)))
                + list(configs(("single",), (16384,), (2, 4), "dense", ("refetch",), layouts=("zigzag",),
                               exchanges=("a2a",))))
    # refetch (the O(S / cp) mode the targets are about) over the whole grid; save at the longest S.
    grid = list(configs(MIXES, (16384, 65536), (2, 4, 8), "stub", ("refetch",)))
    grid += list(configs(MIXES, (65536,), (2, 4, 8), "stub", ("save",)))
    grid += list(configs(("single", "short"), (16384,), (2, 4, 8), "dense", ("refetch",)))
    return grid


def exposed_grid() -> List[Dict]:
    """The exposed exchange at cp = 2 (one rank per core: waits are the exchange, not a shared core)."""
    return list(configs(("single", "short"), (16384,), (2,), "dense", ("refetch", "save")))


def before_after_grid() -> List[Dict]:
    """The grid to measure on another engine too: one document and the short mix, S = 16k, real kernel."""
    return list(configs(("single", "short"), (16384,), (2, 4, 8), "dense", ("refetch",)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine-path", default=None,
                   help="import megatron_ext from this checkout instead (e.g. a worktree of an older commit)")
    p.add_argument("--engine-label", default="current")
    p.add_argument("--grid", choices=("default", "quick", "before_after", "exposed"), default="before_after")
    p.add_argument("--out", required=True, help="JSON lines file to append rows to")
    args = p.parse_args(argv)
    if args.engine_path:
        sys.path.insert(0, os.path.abspath(args.engine_path))
        os.environ["PYTHONPATH"] = os.path.abspath(args.engine_path) + os.pathsep + os.environ.get("PYTHONPATH", "")
    grid = {"default": default_grid, "quick": lambda: default_grid(True), "before_after": before_after_grid,
            "exposed": exposed_grid}[args.grid]()
    run(grid, args.engine_label, out_path=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
