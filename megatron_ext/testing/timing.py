"""Timers and per-rank kernel timing for the benchmarks and the GPU check.

``median_ms`` times a callable with CUDA events on a GPU (wall clock on CPU): warm-up
calls first, then the median of ``reps``. ``matmul_tflops`` measures the device's
dense matmul rate in the same run, the peak a kernel's TFLOP/s is compared with.

``time_kernels`` runs the engine's kernels on the segments each CP rank gets for one
layout: the engine's own plan (layout, needed K/V, bottom-right causal varlen
segments) gives rank r its packed q [Nq, Hq, D] and delivered K/V [Nk, Hkv, D], and
every backend runs forward and forward+backward on the same random inputs. The ranks
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
class RankSegments:
    """One CP rank's varlen segments for a layout, ready for a kernel call on ``device``."""

    rank: int
    segments: object  # kernels.Segments on the device
    num_q: int  # packed query rows
    num_k: int  # packed K/V rows delivered to the kernel
    pairs: int  # useful query-key pairs (bottom-right causal within each document)


def rank_segments(doc_ids: torch.Tensor, layout: str, cp: int, device) -> List[RankSegments]:
    """Every rank's kernel segments for ``doc_ids`` ([S] or [R, S]) under ``layout`` at ``cp``."""
    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.blockdiag_cp.layout import build_layout, padded_length
    from megatron_ext.blockdiag_cp.plan import build_plan, segment_pairs

    ids = doc_ids if doc_ids.dim() == 2 else doc_ids.unsqueeze(0)  # [R, S]
    S = ids.shape[1]
    ids = torch.nn.functional.pad(ids, (0, padded_length(S, layout, cp) - S))
    lay = build_layout(layout, ids, cp)
    out = []
    for rank in range(cp):
        seg = build_plan(ids, lay, rank).segments["sparse"]
        q_lens, k_lens = seg.lengths()
        device_seg = kernels.Segments(seg.cu_seqlens_q.to(device), seg.cu_seqlens_k.to(device),
                                      seg.max_seqlen_q, seg.max_seqlen_k, tuple(q_lens), tuple(k_lens))
        pairs = int(segment_pairs(torch.tensor(q_lens, dtype=torch.long),
                                  torch.tensor(k_lens, dtype=torch.long)).sum()) if q_lens else 0
        out.append(RankSegments(rank, device_seg, sum(q_lens), sum(k_lens), pairs))
    return out


def time_kernels(doc_ids: torch.Tensor, layout: str, cp: int, backends: Sequence[str],
                 heads: Tuple[int, int, int], device, dtype: torch.dtype, reps: int = 5,
                 warmup: int = 2, seed: int = 3) -> Dict:
    """Per rank and backend: forward and forward+backward ms of the engine's kernel on that rank.

    heads = (Hq, Hkv, D). Returns {"pairs": [per rank], "backends": {backend: {"fwd_ms": [...],
    "fwd_bwd_ms": [...]}}, "max_rel_diff_vs_dense": float or None} -- the last compares each
    backend's forward output with dense's on the same inputs (when dense is among ``backends``).
    A rank without queries costs 0 ms (the engine makes no kernel call there).
    """
    from megatron_ext.blockdiag_cp import kernels

    hq, hkv, d = heads
    scale = kernels.default_softmax_scale(d)
    g = torch.Generator().manual_seed(seed)
    ranks = rank_segments(doc_ids, layout, cp, device)
    times = {b: {"fwd_ms": [], "fwd_bwd_ms": []} for b in backends}
    diffs = []
    for r in ranks:
        q, k, v = (torch.randn(n, h, d, generator=g).to(dtype).to(device)
                   for n, h in ((r.num_q, hq), (r.num_k, hkv), (r.num_k, hkv)))
        grad = torch.randn(q.shape, generator=g).to(dtype).to(device)
        outs = {}
        for backend in backends:
            if r.num_q == 0:
                times[backend]["fwd_ms"].append(0.0)
                times[backend]["fwd_bwd_ms"].append(0.0)
                continue
            ok, why = kernels.call_availability(backend, q, 0.0)
            if not ok:
                raise RuntimeError(f"{backend} cannot take this call: {why}")
            fn = kernels.kernel_for(backend)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]

            def fwd():
                with torch.no_grad():
                    return fn(q, k, v, r.segments, scale, 0.0)

            def fwd_bwd():
                fn(*leaves, r.segments, scale, 0.0).backward(grad)

            outs[backend] = fwd().float()
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
