"""gpu suite (``--suites gpu``): TFLOP/s of useful attention work per backend, bf16, cp=2 and 4.

Not run on CPU machines: without CUDA it returns one skipped row that says why. On a
CUDA machine (one H200 is enough):

    python scripts/bench/run_all.py --suites gpu

What it measures: for each mix, S, cp and layout, ``megatron_ext.testing.timing.time_kernels``
runs each rank's real kernel segments (the engine's own plan) forward + backward, the
ranks one after another on the one GPU (the K/V exchange is not timed: it needs cp
GPUs). A step's attention time is the slowest rank's; ``tflops_step`` divides the total
useful work (query-key pairs causal within each document) by (cp x slowest rank time).
It is compared with the bf16 matmul rate measured on the same device in the same run
(``peak_tflops``) and with the H200's ~989 TFLOP/s data-sheet figure.

Set BENCH_GPU_ON_CPU=1 to exercise this code path on CPU (dense, fp32, small S): a
smoke test of the suite, not a measurement. The prepared GPU check (parity, engine
overhead, timing at 32k tokens) is the ``gpu_check`` suite (scripts/bench/gpu_check.py).
"""

import os
from typing import Dict, List

import torch

H200_BF16_SPEC_TFLOPS = 989.0
BACKENDS = ("te", "flash", "dense")
LAYOUTS = ("contiguous", "zigzag", "balanced")


def _skipped(reason: str, **extra) -> Dict:
    return {"suite": "gpu", "mix": extra.pop("mix", "-"), "S": extra.pop("S", None),
            "cp": extra.pop("cp", None), "layout": extra.pop("layout", "-"), "exchange": "-",
            "backend": extra.pop("backend", "-"), "skipped": True, "reason": reason, **extra}


def run(cps=(2, 4), seq_lens=(16384, 32768), mixes=("short", "heavy_tail", "single"),
        heads=32, kv_heads=8, head_dim=128, reps=5, log=print) -> List[Dict]:
    on_cpu = os.environ.get("BENCH_GPU_ON_CPU") == "1"
    if not torch.cuda.is_available() and not on_cpu:
        reason = "CUDA is not available on this machine; run `python scripts/bench/run_all.py " \
                 "--suites gpu` on a GPU machine (scripts/gpu_check.sh runs the gpu_check suite)"
        log(f"  gpu: skipped: {reason}")
        return [_skipped(reason)]
    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.testing.mixes import make_doc_ids
    from megatron_ext.testing.timing import matmul_tflops, time_kernels, useful_tflops

    device = torch.device("cpu" if on_cpu else "cuda")
    dtype = torch.float32 if on_cpu else torch.bfloat16
    backends = ("dense",) if on_cpu else BACKENDS
    peak = matmul_tflops(device, dtype, n=1024 if on_cpu else 8192)["tflops"]
    log(f"  gpu: measured {str(dtype).replace('torch.', '')} matmul peak {peak:.1f} TFLOP/s")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
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
                        timed = time_kernels(make_doc_ids(mix, S), layout, cp, (backend,),
                                             (heads, kv_heads, head_dim), device, dtype, reps=reps)
                        per_rank_s = [ms / 1e3 for ms in timed["backends"][backend]["fwd_bwd_ms"]]
                        pairs = timed["pairs"]
                        tflops = [useful_tflops(p, heads, head_dim, s * 1e3) for p, s in zip(pairs, per_rank_s)]
                        step_tflops = useful_tflops(sum(pairs), heads, head_dim, cp * max(per_rank_s) * 1e3)
                        rows.append({
                            "suite": "gpu", "mix": mix, "S": S, "cp": cp, "layout": layout,
                            "exchange": "-", "backend": backend, "dtype": str(dtype).replace("torch.", ""),
                            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                            "seconds": max(per_rank_s), "per_rank_seconds": per_rank_s,
                            "useful_pairs_per_rank": pairs, "tflops_per_rank": tflops,
                            "tflops_step": step_tflops, "peak_tflops": peak,
                            "peak_tflops_spec": H200_BF16_SPEC_TFLOPS,
                            "fraction_of_peak": step_tflops / peak, "device": device_name,
                            "note": "kernels of the cp ranks run one after another on one device; "
                                    "exchange not timed; peak = bf16 matmul measured in this run"})
                        log(f"  gpu {backend} {mix} S={S} cp={cp} {layout}: "
                            f"{step_tflops:.1f} TFLOP/s (slowest rank {max(per_rank_s) * 1e3:.1f} ms)")
    return rows
