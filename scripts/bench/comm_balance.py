"""comm and balance suites: K/V bytes counted by the exchange itself, and causal work balance.

For every mix, S, cp, layout and exchange, the real engine runs on a real gloo group
of cp processes with tiny heads (b=1, Hq=Hkv=1, D=8, fp32: a K/V row is 64 bytes), one
``blockdiag_cp_attention`` forward call per configuration; each rank then reads
``state.report()``: ``bytes_sent`` / ``bytes_received`` are what the exchange measured
on the tensors it moved, ``lower_bound_bytes`` the K/V bytes of exactly the positions
that rank's queries need and it does not own, ``work_max_over_mean`` the layout's causal
balance. Bytes scale linearly with b * Hkv * D * dtype size: the ratios hold for any model.
"""

import time
from typing import Dict, List

import torch

LAYOUTS = ("contiguous", "zigzag", "balanced")
EXCHANGES = ("allgather", "halo", "a2a")
HEAD_DIM = 8


def _no_kernel_forward(q, k, v, seg, softmax_scale, dropout_p=0.0, seed=0):
    """Stands in for the attention kernel: the transfers run and count their bytes regardless."""
    return q.new_zeros(q.shape[:2] + v.shape[2:]), q.new_zeros(q.shape[:2]), None


def _no_kernel():
    from megatron_ext.blockdiag_cp.kernels import Kernel

    return Kernel(_no_kernel_forward, None)  # the bench runs forward only


def measure_worker(mix: str, S: int, layouts=LAYOUTS, exchanges=EXCHANGES,
                   real_kernel: bool = False) -> Dict:
    """Runs on every rank of the pool: one forward call per (layout, exchange).

    With ``real_kernel=False`` the dense kernel is swapped for a stub through the
    engine's kernel hook (``megatron_ext.testing.override_kernel``): everything up to the kernel (build,
    consensus, plan, the exchange and its byte counters, segment indexing) is the
    real code, only the O(local_len x doc) attention arithmetic is skipped, which
    at cp=8 on two cores would cost minutes and changes no byte.
    """
    import logging

    import contextlib

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing import override_kernel
    from megatron_ext.testing.mixes import make_doc_ids

    # halo -> a2a fallbacks are recorded in the rows (exchange_resolved / exchange_reason)
    logging.getLogger("megatron_ext.blockdiag_cp").setLevel(logging.ERROR)

    doc_ids = make_doc_ids(mix, S)
    out = {}
    with contextlib.nullcontext() if real_kernel else override_kernel("dense", _no_kernel()):
        _measure(bdcp, doc_ids, layouts, exchanges, out)
    return out


def _measure(bdcp, doc_ids, layouts, exchanges, out) -> None:
    for layout in layouts:
        for exchange in exchanges:
            t0 = time.perf_counter()
            state = bdcp.BlockDiagCPState.build(doc_ids, layout=layout, kv_exchange=exchange,
                                                attn_backend="dense")
            t1 = time.perf_counter()
            g = torch.Generator().manual_seed(state.rank)
            q, k, v = (torch.randn(state.local_len, 1, 1, HEAD_DIM, generator=g) for _ in range(3))
            with torch.no_grad(), bdcp.blockdiag_cp_step(state):
                bdcp.blockdiag_cp_attention(q, k, v)
            rep = state.report()
            rep["plan_seconds"] = t1 - t0
            rep["attn_seconds"] = time.perf_counter() - t1
            out[(layout, exchange)] = rep


def _rows_for(mix: str, S: int, cp: int, per_rank: List[Dict]) -> List[Dict]:
    rows = []
    keys = sorted(per_rank[0])
    for layout, exchange in keys:
        reps = [r[(layout, exchange)] for r in per_rank]
        sent = [int(r["bytes_sent"]) for r in reps]
        recv = [int(r["bytes_received"]) for r in reps]
        lower = [int(r["lower_bound_bytes"]) for r in reps]
        moved = [max(s, r) for s, r in zip(sent, recv)]
        worst = max(range(cp), key=lambda i: (moved[i], lower[i]))
        r0 = reps[0]
        rows.append({
            "suite": "comm", "mix": mix, "S": S, "cp": cp, "layout": layout,
            "exchange": exchange, "backend": "dense",
            "exchange_resolved": r0["kv_exchange"], "exchange_reason": r0["kv_exchange_reason"],
            "bytes_max": moved[worst], "lower_bound_bytes": lower[worst],
            "lower_bound_max": max(lower),
            "bytes_sent": sent, "bytes_received": recv, "lower_bound_per_rank": lower,
            "kv_row_bytes": r0["kv_row_bytes"], "local_len": r0["local_len"],
            "padded_len": r0["padded_len"],
            "recv_equals_lower_bound": recv == lower,
            "plan_seconds_max": max(r["plan_seconds"] for r in reps),
        })
    for layout in sorted({k[0] for k in keys}):
        r0 = per_rank[0][next(k for k in keys if k[0] == layout)]
        work = [int(w) for w in r0["work_per_rank"]]
        rows.append({
            "suite": "balance", "mix": mix, "S": S, "cp": cp, "layout": layout,
            "exchange": "-", "backend": "dense",
            "work_max_over_mean": float(r0["work_max_over_mean"]), "ideal": 1.0,
            "work_per_rank": work,
        })
    return rows


def run(cps=(2, 4, 8), seq_lens=(4096, 8192, 16384, 32768), mixes=("short", "heavy_tail", "single"),
        log=print, real_kernel: bool = False) -> List[Dict]:
    from megatron_ext.testing import WorkerPool

    rows = []
    for cp in cps:
        t0 = time.perf_counter()
        with WorkerPool(cp, timeout=600.0) as pool:
            for mix in mixes:
                for S in seq_lens:
                    t1 = time.perf_counter()
                    per_rank = pool.run(measure_worker, mix, S, LAYOUTS, EXCHANGES, real_kernel)
                    rows += _rows_for(mix, S, cp, per_rank)
                    log(f"  comm/balance cp={cp} {mix} S={S}: {time.perf_counter() - t1:.1f}s")
        log(f"comm/balance cp={cp} done in {time.perf_counter() - t0:.1f}s")
    return rows
