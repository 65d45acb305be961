"""speed and speed_memory suites: one attention layer, forward + backward, side by side in one run.

At cp=2 on a gloo group (two processes, one thread each), b=1, 8 heads, head dim 64,
fp32, Megatron's sbhd layout. Contenders for each (mix, S):

- ``ours``: ``blockdiag_cp_attention`` with the dense kernel, every layout x exchange;
- ``allgather_full_mask``: the naive approach: contiguous shards, an all-gather of K/V
  (its own autograd Function: all-gather forward, reduce-scatter backward) and one SDPA
  per rank over all S keys with a full [local_len, S] bool mask;
- ``single_process``: our dense kernel on one process (a state on a group of size 1, cp=1);
- ``per_doc_ideal``: one process, one causal SDPA per document (``tensor.split`` slicing).

Timing: the configurations of one (mix, S) are interleaved (A B C A B C ...), every
timed iteration starts after a barrier, and its time is the slowest rank's wall time;
rows keep the median and every sample. The per-step host work (our plan, the naive
mask) is built once and reported separately as ``build_seconds``: it is shared by
every layer of a model.

Memory: one extra iteration per configuration (also the warm-up) runs under
``torch.profiler`` with ``profile_memory=True``; the peak of the running sum of the
CPU allocator's alloc/free events is the most tensor memory that step held on top of
what was live before it (the inputs). That iteration includes the per-step build
(plan or mask), so a persistent [local_len, S] mask would be counted.
"""

import statistics
import time
from typing import Dict, List, Optional

import torch

HEADS, HEAD_DIM = 8, 64
LAYOUTS = ("contiguous", "zigzag", "balanced")
EXCHANGES = ("allgather", "halo", "a2a")

# ---------------------------------------------------------------------------
# worker side (runs on every rank of a 2-process pool)
# ---------------------------------------------------------------------------

_CACHE: Dict = {}
_SELF_GROUPS: List = []


def setup_worker() -> int:
    """Once per pool: size-1 groups for the single-process contenders, warm the profiler."""
    import logging

    import torch.distributed as dist

    logging.getLogger("megatron_ext.blockdiag_cp").setLevel(logging.ERROR)
    from torch.profiler import ProfilerActivity, profile

    world = dist.get_world_size()
    _SELF_GROUPS[:] = [dist.new_group([r]) for r in range(world)]
    x = torch.ones(4)
    dist.all_reduce(x)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        torch.ones(8).sum()
    return dist.get_rank()


def _inputs(mix: str, S: int):
    key = ("inputs", mix, S)
    if key not in _CACHE:
        for k in [k for k in _CACHE if k[0] == "inputs" or k[0] == "prepared"]:
            del _CACHE[k]  # keep one (mix, S) group in memory
        from megatron_ext.testing.mixes import doc_lengths, make_doc_ids

        g = torch.Generator().manual_seed(S)
        t = [torch.randn(S, 1, HEADS, HEAD_DIM, generator=g) for _ in range(4)]  # q, k, v, dout
        _CACHE[key] = (make_doc_ids(mix, S), doc_lengths(mix, S), *t)
    return _CACHE[key]


class _GatherKV(torch.autograd.Function):
    """The naive baseline's own all-gather: flat all-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // world,) + tuple(grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def _full_mask(doc_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[len(positions), S] bool: same document and key <= query (global positions)."""
    S = doc_ids.numel()
    keys = torch.arange(S)
    return (doc_ids[positions].unsqueeze(1) == doc_ids.unsqueeze(0)) & (
        keys.unsqueeze(0) <= positions.unsqueeze(1))


def _prepare(cfg: Dict, rank: int):
    """Per-step host work of a configuration: (prepared object, seconds)."""
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    doc_ids, lengths, q, k, v, dout = _inputs(cfg["mix"], cfg["S"])
    t0 = time.perf_counter()
    base = cfg["baseline"]
    if base == "ours":
        prepared = bdcp.BlockDiagCPState.build(
            doc_ids, cp_group=dist.group.WORLD, layout=cfg["layout"], kv_exchange=cfg["exchange"],
            attn_backend="dense")
    elif base == "single_process":
        prepared = bdcp.BlockDiagCPState.build(
            doc_ids, cp_group=_SELF_GROUPS[rank], layout="contiguous", attn_backend="dense")
    elif base == "allgather_full_mask":
        world = dist.get_world_size()
        L = cfg["S"] // world
        prepared = _full_mask(doc_ids, torch.arange(rank * L, (rank + 1) * L))
    else:  # per_doc_ideal
        prepared = list(lengths)
    return prepared, time.perf_counter() - t0


def _step(cfg: Dict, prepared, rank: int) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    import megatron_ext.blockdiag_cp as bdcp

    doc_ids, lengths, q, k, v, dout = _inputs(cfg["mix"], cfg["S"])
    base = cfg["baseline"]
    if base in ("ours", "single_process"):
        state = prepared
        leaves = [state.shard(t).requires_grad_() for t in (q, k, v)]
        with bdcp.blockdiag_cp_step(state):
            out = bdcp.blockdiag_cp_attention(*leaves)
            out.backward(state.shard(dout))
    elif base == "allgather_full_mask":
        world = dist.get_world_size()
        L = cfg["S"] // world
        sl = slice(rank * L, (rank + 1) * L)
        ql, kl, vl = (t[sl].clone().requires_grad_() for t in (q, k, v))
        kv = _GatherKV.apply(torch.cat([kl, vl], dim=-1), dist.group.WORLD)  # [S, b, H, 2D]
        kf, vf = kv.split(HEAD_DIM, dim=-1)
        qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (ql, kf, vf))  # [b, H, s, D]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=prepared)
        out.permute(2, 0, 1, 3).backward(dout[sl])
    else:  # per_doc_ideal
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        qh, kh, vh = (t.permute(1, 2, 0, 3) for t in leaves)
        outs = [F.scaled_dot_product_attention(a, b, c, is_causal=True)
                for a, b, c in zip(qh.split(prepared, 2), kh.split(prepared, 2), vh.split(prepared, 2))]
        torch.cat(outs, dim=2).permute(2, 0, 1, 3).backward(dout)


def _single(cfg: Dict) -> bool:
    return cfg["baseline"] in ("single_process", "per_doc_ideal")


def speed_worker(cfg: Dict, mode: str) -> Optional[Dict]:
    """mode 'memory': build + one profiled iteration (also the warm-up); 'time': one timed iteration."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if _single(cfg) and rank != 0:
        return None
    key = ("prepared", tuple(sorted(cfg.items())))
    if mode == "memory":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            prepared, build_s = _prepare(cfg, rank)
            _step(cfg, prepared, rank)
        _CACHE[key] = (prepared, build_s)
        return {"peak_bytes": _peak_bytes(prof), "build_seconds": build_s}
    prepared, _ = _CACHE[key] if key in _CACHE else _prepare(cfg, rank)
    if not _single(cfg):
        dist.barrier()
    t0 = time.perf_counter()
    _step(cfg, prepared, rank)
    return {"seconds": time.perf_counter() - t0}


def _peak_bytes(prof) -> int:
    from memory import profiler_memory  # this folder's memory suite

    return profiler_memory(prof)[1]


# ---------------------------------------------------------------------------
# driver side
# ---------------------------------------------------------------------------


def configs_for(mix: str, S: int, full_mask: bool, ours=None) -> List[Dict]:
    ours = [(l, e) for l in LAYOUTS for e in EXCHANGES] if ours is None else ours
    cfgs = [{"baseline": "ours", "mix": mix, "S": S, "layout": l, "exchange": e} for l, e in ours]
    cfgs += [{"baseline": b, "mix": mix, "S": S, "layout": "-", "exchange": "-"}
             for b in ("single_process", "per_doc_ideal")]
    if full_mask:
        cfgs.append({"baseline": "allgather_full_mask", "mix": mix, "S": S,
                     "layout": "contiguous", "exchange": "allgather"})
    return cfgs


# (mix, S, run the full-mask baseline?) -- the full mask costs the same on every mix, and
# ~10 s per fwd+bwd per rank at S=16k, so it runs at 16k on the short mix only.
# heavy_tail at 16k (one 8k document) costs ~4 s per fwd+bwd per config on a loaded
# 2-core machine, too much for the 15-minute budget: heavy_tail runs at 4k and 8k.
DEFAULT_PLAN = [
    ("short", 4096, True), ("heavy_tail", 4096, True), ("single", 4096, True),
    ("short", 8192, True), ("heavy_tail", 8192, False),
    ("short", 16384, True),
]
# The full mask is 5-30x slower than everything else, so its ratio is insensitive to
# noise: it gets at most this many timed repetitions (the rest of the group gets reps).
FULL_MASK_MAX_REPS = 2
QUICK_PLAN = [("short", 4096, True)]


def _row_common(cfg: Dict, cp: int) -> Dict:
    backend = {"ours": "dense", "single_process": "dense", "allgather_full_mask": "sdpa_full_mask",
               "per_doc_ideal": "sdpa_per_doc"}[cfg["baseline"]]
    return {"mix": cfg["mix"], "S": cfg["S"], "cp": cp, "layout": cfg["layout"],
            "exchange": cfg["exchange"], "backend": backend, "baseline": cfg["baseline"],
            "dtype": "float32", "heads": HEADS, "head_dim": HEAD_DIM, "batch": 1}


def run(plan=None, reps: int = 3, log=print) -> List[Dict]:
    from megatron_ext.testing import WorkerPool

    plan = DEFAULT_PLAN if plan is None else plan
    rows: List[Dict] = []
    with WorkerPool(2, timeout=600.0) as pool:
        pool.run(setup_worker)
        for mix, S, full_mask in plan:
            t0 = time.perf_counter()
            cfgs = configs_for(mix, S, full_mask)
            mem = {}
            for cfg in cfgs:  # warm-up + memory, one configuration at a time
                mem[id(cfg)] = pool.run(speed_worker, cfg, "memory")
            times = {id(cfg): [] for cfg in cfgs}
            per_rank = {id(cfg): [] for cfg in cfgs}
            for rep in range(reps):  # interleaved: A B C ... A B C ...
                for cfg in cfgs:
                    if cfg["baseline"] == "allgather_full_mask" and rep >= FULL_MASK_MAX_REPS:
                        continue
                    res = [r for r in pool.run(speed_worker, cfg, "time") if r is not None]
                    per_rank[id(cfg)].append([r["seconds"] for r in res])
                    times[id(cfg)].append(max(r["seconds"] for r in res))
            for cfg in cfgs:
                cp = 1 if _single(cfg) else 2
                m = [r for r in mem[id(cfg)] if r is not None]
                common = _row_common(cfg, cp)
                rows.append({"suite": "speed", **common,
                             "seconds": statistics.median(times[id(cfg)]),
                             "seconds_all": times[id(cfg)], "per_rank_seconds": per_rank[id(cfg)],
                             "reps": len(times[id(cfg)]), "build_seconds": max(r["build_seconds"] for r in m)})
                rows.append({"suite": "speed_memory", **common,
                             "peak_bytes": max(r["peak_bytes"] for r in m),
                             "peak_bytes_per_rank": [r["peak_bytes"] for r in m],
                             "method": "torch.profiler profile_memory: peak of live CPU-allocator "
                                       "bytes during build+fwd+bwd above the bytes live before"})
            log(f"  speed {mix} S={S}: {len(cfgs)} configs x {reps} reps in "
                f"{time.perf_counter() - t0:.1f}s")
    return rows
