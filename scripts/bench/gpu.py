"""GPU hook (``--suites gpu``): TFLOP/s of useful attention work per backend, bf16, cp=2 and 4.

Not run on CPU machines: without CUDA it returns one skipped row that says why.
Meant to be run by scripts/gpu_check.sh on a CUDA machine (one H200 is enough):

    python scripts/bench/run_all.py --suites gpu

What it measures. The machine this is written for has ONE GPU, and NCCL refuses two
ranks on one device, so the CP ranks' kernels run one after another on that GPU: for
each rank the engine's own plan (``build_plan``: layout, needed K/V, bottom-right
causal varlen segments) gives that rank's packed q [Nq, Hq, D] and delivered K/V
[Nk, Hkv, D], and the chosen kernel (te / flash / dense from
``megatron_ext.blockdiag_cp.kernels``) runs forward + backward on them, timed with
CUDA events (median of ``reps`` after warm-up). A step's attention time is the
slowest rank's time; the K/V exchange is not timed here (it needs cp GPUs).

Useful work counts only the query-key pairs the documents need (causal within each
document): forward 4 * pairs * Hq * D FLOP, forward+backward 3.5x that (the usual
flash-attention convention: backward ~2.5x forward). ``tflops`` is per rank; the
step figure divides the total useful work by (cp x slowest rank time). Compared with
the H200's ~989 TFLOP/s dense bf16 peak.

Set BENCH_GPU_ON_CPU=1 to exercise this code path on CPU (dense, fp32, small S): a
smoke test of the hook, not a measurement.
"""

import os
import statistics
import time
from typing import Dict, List

import torch

H200_BF16_PEAK_TFLOPS = 989.0
BACKENDS = ("te", "flash", "dense")
LAYOUTS = ("contiguous", "zigzag", "balanced")


def _skipped(reason: str, **extra) -> Dict:
    return {"suite": "gpu", "mix": extra.pop("mix", "-"), "S": extra.pop("S", None),
            "cp": extra.pop("cp", None), "layout": extra.pop("layout", "-"), "exchange": "-",
            "backend": extra.pop("backend", "-"), "skipped": True, "reason": reason, **extra}


def _time_fn(fn, device, reps: int) -> float:
    for _ in range(2):
        fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def run(cps=(2, 4), seq_lens=(16384, 32768), mixes=("short", "heavy_tail", "single"),
        heads=32, kv_heads=8, head_dim=128, reps=5, log=print) -> List[Dict]:
    on_cpu = os.environ.get("BENCH_GPU_ON_CPU") == "1"
    if not torch.cuda.is_available() and not on_cpu:
        reason = "CUDA is not available on this machine; run `python scripts/bench/run_all.py " \
                 "--suites gpu` on a GPU machine (scripts/gpu_check.sh)"
        log(f"  gpu: skipped: {reason}")
        return [_skipped(reason)]
    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.blockdiag_cp.layout import build_layout, padded_length
    from megatron_ext.blockdiag_cp.plan import build_plan, segment_pairs

    from mixes import make_doc_ids

    device = torch.device("cpu" if on_cpu else "cuda")
    dtype = torch.float32 if on_cpu else torch.bfloat16
    backends = ("dense",) if on_cpu else BACKENDS
    scale = kernels.default_softmax_scale(head_dim)
    rows: List[Dict] = []
    for backend in backends:
        ok, reason = kernels.static_availability(backend, device)
        if not ok:
            rows.append(_skipped(f"{backend}: {reason}", backend=backend))
            log(f"  gpu {backend}: skipped: {reason}")
            continue
        for mix in mixes:
            for S in seq_lens:
                for cp in cps:
                    for layout in LAYOUTS:
                        ids = make_doc_ids(mix, S)
                        P = padded_length(S, layout, cp)
                        ids = torch.nn.functional.pad(ids, (0, P - S)).unsqueeze(0)
                        lay = build_layout(layout, ids, cp)
                        per_rank_s, per_rank_pairs = [], []
                        for rank in range(cp):
                            seg = build_plan(ids, lay, rank).segments["sparse"]
                            q_lens, k_lens = seg.lengths()
                            nq, nk = int(seg.cu_seqlens_q[-1]), int(seg.cu_seqlens_k[-1])
                            dseg = kernels.Segments(seg.cu_seqlens_q.to(device),
                                                    seg.cu_seqlens_k.to(device), seg.max_seqlen_q,
                                                    seg.max_seqlen_k, tuple(q_lens), tuple(k_lens))
                            g = torch.Generator(device=device).manual_seed(rank)
                            q = torch.randn(nq, heads, head_dim, generator=g, device=device, dtype=dtype)
                            k = torch.randn(nk, kv_heads, head_dim, generator=g, device=device, dtype=dtype)
                            v = torch.randn(nk, kv_heads, head_dim, generator=g, device=device, dtype=dtype)
                            dout = torch.randn_like(q)
                            ok, why = kernels.call_availability(backend, q, 0.0)
                            if not ok:
                                raise RuntimeError(f"{backend}: {why}")
                            leaves = [t.requires_grad_() for t in (q, k, v)]
                            fn = kernels.KERNELS[backend]

                            def step():
                                out = fn(*leaves, dseg, scale, 0.0)
                                torch.autograd.grad(out, leaves, dout)

                            per_rank_s.append(_time_fn(step, device, reps))
                            pairs = segment_pairs(torch.tensor(q_lens), torch.tensor(k_lens))
                            per_rank_pairs.append(int(pairs.sum()))
                        fwd_flop = [4.0 * p * heads * head_dim for p in per_rank_pairs]
                        tflops = [3.5 * f / s / 1e12 for f, s in zip(fwd_flop, per_rank_s)]
                        step_tflops = 3.5 * sum(fwd_flop) / (cp * max(per_rank_s)) / 1e12
                        rows.append({
                            "suite": "gpu", "mix": mix, "S": S, "cp": cp, "layout": layout,
                            "exchange": "-", "backend": backend, "dtype": str(dtype).replace("torch.", ""),
                            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                            "seconds": max(per_rank_s), "per_rank_seconds": per_rank_s,
                            "useful_pairs_per_rank": per_rank_pairs, "tflops_per_rank": tflops,
                            "tflops_step": step_tflops, "peak_tflops": H200_BF16_PEAK_TFLOPS,
                            "fraction_of_peak": step_tflops / H200_BF16_PEAK_TFLOPS,
                            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                            "note": "kernels of the cp ranks run one after another on one device; "
                                    "exchange not timed"})
                        log(f"  gpu {backend} {mix} S={S} cp={cp} {layout}: "
                            f"{step_tflops:.1f} TFLOP/s (slowest rank {max(per_rank_s) * 1e3:.1f} ms)")
    return rows
