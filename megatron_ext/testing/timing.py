"""Timers and per-rank kernel timing for the benchmarks and the GPU check.

``median_ms`` times a callable with CUDA events on a GPU (wall clock on CPU): warm-up
calls first, then the median of ``reps``. ``matmul_tflops`` measures the device's
dense matmul rate in the same run, the peak a kernel's TFLOP/s is compared with.

``time_kernels`` runs the engine's kernel calls each CP rank makes (every round) for one
layout: the engine's own streamed plan (layout, chunks, full and causal varlen
calls) gives rank r its calls' shapes, and every backend runs each call forward and
forward+backward (with the lse) on the same random inputs. The ranks
run one after another in this process (one GPU takes one rank at a time; NCCL refuses
two ranks on one device), so the K/V exchange is not in these times; a step's
attention time is the slowest rank's.

Useful work counts only the query-key pairs the documents need (causal within each
document): forward 4 * pairs * Hq * D FLOP, forward+backward 3.5x that (the usual
flash-attention convention: backward ~2.5x forward).
"""

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch

FWD_BWD_FLOP_FACTOR = 3.5


def sync(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device, reps: int = 5, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls after ``warmup`` calls."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def matmul_tflops(device, dtype: torch.dtype, n: int = 8192, reps: int = 10) -> Dict:
    """Measured dense matmul rate: [n, n] @ [n, n] in ``dtype``, 2 n^3 FLOP per call."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(dtype).to(device) for _ in range(2))
    ms = median_ms(lambda: torch.matmul(a, b), device, reps=reps, warmup=3)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "ms": ms,
            "tflops": 2.0 * n ** 3 / (ms * 1e-3) / 1e12}


@dataclass(frozen=True)
class RankCalls:
    """One CP rank's streamed kernel calls (every round) for a layout, ready on ``device``."""

    rank: int
    calls: List  # [(kernels.Segments, num_q, num_k)] over every round, own chunk first
    pairs: int  # useful query-key pairs (causal within each document)


def rank_calls(doc_ids: torch.Tensor, layout: str, cp: int, device) -> List[RankCalls]:
    """Every rank's kernel calls for ``doc_ids`` ([S] or [R, S]) under ``layout`` at ``cp``."""
    from megatron_ext.blockdiag_cp.layouts import build_layout, padded_length
    from megatron_ext.blockdiag_cp.plan import build_plan
    from megatron_ext.blockdiag_cp.step_tables import DeviceCall

    ids = doc_ids if doc_ids.dim() == 2 else doc_ids.unsqueeze(0)  # [R, S]
    S = ids.shape[1]
    ids = torch.nn.functional.pad(ids, (0, padded_length(S, layout, cp) - S))
    lay = build_layout(layout, ids, cp)
    out = []
    for rank in range(cp):
        stream = build_plan(ids, lay, rank, kinds=("needed",)).stream["needed"]
        calls = [(DeviceCall.of(c, 0, 0, device).seg, sum(c.q_lens), sum(c.k_lens))
                 for step in stream.steps for c in step.calls]
        out.append(RankCalls(rank, calls, sum(step.pairs for step in stream.steps)))
    return out


def time_kernels(doc_ids: torch.Tensor, layout: str, cp: int, backends: Sequence[str],
                 heads: Tuple[int, int, int], device, dtype: torch.dtype, reps: int = 5,
                 warmup: int = 2, seed: int = 3) -> Dict:
    """Per rank and backend: forward and forward+backward ms of the engine's kernel calls on that rank.

    heads = (Hq, Hkv, D). Every call of every round of the rank's streamed plan runs on
    random inputs of its shape (the merging of partial outputs is not timed). Returns
    {"pairs": [per rank], "backends": {backend: {"fwd_ms": [...], "fwd_bwd_ms": [...]}},
    "max_rel_diff_vs_dense": float or None} -- the last compares each backend's forward
    output with dense's on the same inputs (when dense is among ``backends``). A rank
    without queries costs 0 ms (the engine makes no kernel call there).
    """
    from megatron_ext.blockdiag_cp import kernels

    hq, hkv, d = heads
    scale = kernels.default_softmax_scale(d)
    g = torch.Generator().manual_seed(seed)
    ranks = rank_calls(doc_ids, layout, cp, device)
    times = {b: {"fwd_ms": [], "fwd_bwd_ms": []} for b in backends}
    diffs = []
    for r in ranks:
        inputs = [tuple(torch.randn(n, h, d, generator=g).to(dtype).to(device)
                        for n, h in ((nq, hq), (nk, hkv), (nk, hkv), (nq, hq)))
                  for _, nq, nk in r.calls]  # q, k, v, dout per call
        outs = {}
        for backend in backends:
            if not r.calls:
                times[backend]["fwd_ms"].append(0.0)
                times[backend]["fwd_bwd_ms"].append(0.0)
                continue
            ok, why = kernels.call_availability(backend, inputs[0][0], 0.0, hkv)
            if not ok:
                raise RuntimeError(f"{backend} cannot take this call: {why}")
            kernel = kernels.kernel_for(backend)

            def fwd():
                return [kernel.forward(q, k, v, seg, scale, 0.0) for (seg, _, _), (q, k, v, _) in
                        zip(r.calls, inputs)]

            def fwd_bwd():
                for (seg, _, _), (q, k, v, do), (o, lse, aux) in zip(r.calls, inputs, fwd()):
                    kernel.backward(do, q, k, v, o, lse, aux, seg, scale, 0.0)

            outs[backend] = torch.cat([o.float().flatten() for o, _, _ in fwd()])
            times[backend]["fwd_ms"].append(median_ms(fwd, device, reps, warmup))
            times[backend]["fwd_bwd_ms"].append(median_ms(fwd_bwd, device, reps, warmup))
        if "dense" in outs:
            ref = outs["dense"]
            diffs += [float((o - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                      for b, o in outs.items() if b != "dense"]
    return {"pairs": [r.pairs for r in ranks], "backends": times,
            "max_rel_diff_vs_dense": max(diffs) if diffs else None}


def useful_tflops(pairs: int, heads: int, head_dim: int, ms: float, fwd_bwd: bool = True) -> float:
    """TFLOP/s of ``pairs`` useful query-key pairs done in ``ms`` milliseconds."""
    if ms <= 0:
        return 0.0
    flop = 4.0 * pairs * heads * head_dim * (FWD_BWD_FLOP_FACTOR if fwd_bwd else 1.0)
    return flop / (ms * 1e-3) / 1e12
