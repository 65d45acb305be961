#!/usr/bin/env python3
"""GPU check of the block-diagonal CP engine's kernels: flash (and te if importable) vs dense, bf16.

Run from the repository root on a one-GPU machine (megatron-core, TransformerEngine and
flash-attn are NOT needed; torch's varlen_attn serves as "flash"):

    PYTHONPATH=. python3 scripts/gpu_check.py            # or: bash scripts/gpu_check.sh
    PYTHONPATH=. python3 scripts/gpu_check.py --dry-run  # CPU, fp32, tiny sizes, flash test double

Checks, each printed as one JSON line (and appended to $OUT/gpu_check.jsonl when OUT is set):
- env: versions, which flash implementation, whether te is importable, and that
  megatron_ext.blockdiag_cp imports without megatron.
- accuracy: every layout x exchange at cp=2 and cp=4, forward and backward, each backend in
  bf16 against an fp32 reference (same bf16-rounded inputs), max abs / rel error of out, dq, dk, dv.
- timing: one packed mix at a realistic size (32k tokens, 32 query heads, 8 KV heads, head dim
  128): each backend's kernel per rank for every layout at cp=1/2/4 (forward, forward+backward),
  plus the whole engine call at cp=1 with its error vs an fp32 dense run.
- te: not run (and said so) unless transformer_engine imports.

How cp ranks share one GPU: NCCL refuses two ranks on one device, so each check spawns cp
processes on cuda:0 joined by a gloo group, and sets MEGATRON_EXT_STAGE_COLLECTIVES_ON_CPU=1 so
the engine's K/V collectives run on CPU copies (gloo's send/recv, used by the halo exchange,
cannot take CUDA tensors). The exchange's speed is therefore not measured here; timing is of the
kernels on each rank's real segments, run one rank at a time in this process.
"""

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

BLOCK_MEGATRON_ENV = "GPU_CHECK_BLOCK_MEGATRON"


class _BlockMegatron:
    """Meta-path finder that makes megatron(-core) unimportable, as on the GPU machine."""

    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by gpu_check --block-megatron)")
        return None


def _block_megatron():
    os.environ[BLOCK_MEGATRON_ENV] = "1"  # inherited by the spawned ranks, which run this module too
    if not any(isinstance(f, _BlockMegatron) for f in sys.meta_path):
        sys.meta_path.insert(0, _BlockMegatron())


if os.environ.get(BLOCK_MEGATRON_ENV) == "1":
    _block_megatron()

LAYOUTS = ("contiguous", "zigzag", "balanced")
EXCHANGES = ("allgather", "halo", "a2a")
STAGE_ENV = "MEGATRON_EXT_STAGE_COLLECTIVES_ON_CPU"
APPROACH = ("cp ranks = cp processes on one device joined by a gloo group; K/V collectives staged "
            "through CPU (MEGATRON_EXT_STAGE_COLLECTIVES_ON_CPU=1) because NCCL refuses two ranks on "
            "one GPU and gloo's send/recv (halo) cannot take CUDA tensors; exchange speed is not "
            "measured; kernel timings run each rank's real segments one rank at a time")

# bf16 bounds on max|err| / max|ref| against the fp32 reference (fp32 dry run: much tighter).
TOL_BF16 = {"out": 2e-2, "dq": 5e-2, "dk": 5e-2, "dv": 5e-2}
TOL_FP32 = {"out": 1e-4, "dq": 1e-4, "dk": 1e-4, "dv": 1e-4}


def sizes(dry_run):
    if dry_run:
        return {"acc_cases": [("mix", 64, 1), ("rows2", 48, 2)], "acc_heads": (4, 2, 8),
                "time_S": 256, "time_heads": (4, 2, 16), "reps": 1, "warmup": 1}
    return {"acc_cases": [("mix", 4096, 1), ("rows2", 2048, 2)], "acc_heads": (8, 2, 128),
            "time_S": 32768, "time_heads": (32, 8, 128), "reps": 5, "warmup": 2}


# ---------------------------------------------------------------------------
# shared helpers (parent and workers)
# ---------------------------------------------------------------------------


def packed_mix(S, seed, min_len, max_len, pad_tail=0):
    """[S] doc ids: log-uniform document lengths, a few length-1 documents, a padded tail."""
    import torch

    g = torch.Generator().manual_seed(seed)
    runs, n, doc = [], 0, 1
    body = S - pad_tail
    while n < body:
        if float(torch.rand(1, generator=g)) < 0.08:
            length = 1
        else:
            u = float(torch.rand(1, generator=g))
            length = int(math.exp(math.log(min_len) + u * (math.log(max_len) - math.log(min_len))))
        length = max(1, min(length, body - n))
        runs.append(torch.full((length,), doc, dtype=torch.int64))
        n, doc = n + length, doc + 1
    runs.append(torch.zeros(pad_tail, dtype=torch.int64))
    return torch.cat(runs)


def case_doc_ids(name, S, b):
    import torch

    if b == 1:
        return packed_mix(S, 11, max(2, S // 64), max(4, S // 3), pad_tail=S // 50)
    return torch.stack([packed_mix(S, 12 + r, max(2, S // 32), max(4, S // 2), pad_tail=r * (S // 20))
                        for r in range(b)])


def setup_backends(dry_run):
    """Backends to check, after installing the CPU flash double in a dry run."""
    from megatron_ext.blockdiag_cp import kernels

    if dry_run:
        import flash_double

        kernels.KERNELS["flash"] = flash_double.flash_kernel_double
        real_static, real_call = kernels.static_availability, kernels.call_availability
        kernels.static_availability = lambda b, d: (True, "CPU flash test double") if b == "flash" \
            else real_static(b, d)
        kernels.call_availability = lambda b, q, p: (True, "CPU flash test double") if b == "flash" \
            else real_call(b, q, p)
    backends = ["flash", "dense"]
    if kernels.KERNEL_INSTALLED["te"]()[0]:
        backends.insert(0, "te")
    return backends


def device_and_dtype(dry_run):
    import torch

    if dry_run:
        return torch.device("cpu"), torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", 0), torch.bfloat16


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------
# accuracy (runs on every rank of a gloo pool)
# ---------------------------------------------------------------------------


def reference_fp32(q, k, v, doc_ids):
    """tests/reference.py's full-mask per-document causal attention, on q's device, in fp32."""
    import torch
    from reference import doc_mask

    S, b, hq, d = q.shape
    rep = hq // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    mask = doc_mask(doc_ids).to(q.device)  # [R, S, S]
    mask = mask.expand(b, S, S) if mask.shape[0] == 1 else mask
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * d ** -0.5
    probs = torch.softmax(scores.masked_fill(~mask.unsqueeze(1), float("-inf")), dim=-1)
    return torch.einsum("bhst,tbhd->sbhd", torch.nan_to_num(probs, nan=0.0), v)


def w_accuracy(dry_run):
    import torch
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    device, dtype = device_and_dtype(dry_run)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backends = setup_backends(dry_run)
    hq, hkv, d = sizes(dry_run)["acc_heads"]
    rows = []
    for case, S, b in sizes(dry_run)["acc_cases"]:
        doc_ids = case_doc_ids(case, S, b)
        g = torch.Generator().manual_seed(5)
        shapes = [(S, b, hq, d), (S, b, hkv, d), (S, b, hkv, d), (S, b, hq, d)]
        # Inputs rounded to the test dtype once; the fp32 reference sees the same values.
        q, k, v, w = (torch.randn(*s, generator=g).to(dtype).to(device) for s in shapes)
        ref_in = [t.float().requires_grad_() for t in (q, k, v)]
        ref = reference_fp32(*ref_in, doc_ids)
        (ref * w.float()).sum().backward()
        ref_t = {"out": ref.detach(), "dq": ref_in[0].grad, "dk": ref_in[1].grad, "dv": ref_in[2].grad}
        for layout in LAYOUTS:
            for exchange in EXCHANGES:
                for backend in backends:
                    row = {"case": case, "S": S, "b": b, "layout": layout, "exchange": exchange,
                           "backend": backend}
                    try:
                        state = bdcp.BlockDiagCPState.build(doc_ids, layout=layout, kv_exchange=exchange,
                                                            attn_backend=backend, device=device)
                        local = [state.shard(t).detach().requires_grad_() for t in (q, k, v)]
                        with bdcp.blockdiag_cp_step(state):
                            out = bdcp.blockdiag_cp_attention(*local)
                            (out.float() * state.shard(w).float()).sum().backward()
                        got = {"out": out, "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
                        row["err"], row["ref_max"] = {}, {}
                        for name, value in got.items():
                            expect = state.shard(ref_t[name])
                            row["err"][name] = float((value.detach().float() - expect).abs().max())
                            row["ref_max"][name] = float(expect.abs().max())
                        report = state.report()
                        row.update(resolved=report["attn_backend"], reason=report["attn_backend_reason"],
                                   exchange_resolved=report["kv_exchange"])
                    except Exception as exc:  # noqa: BLE001 - BlockDiagCPError is raised on every rank
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
                    rows.append(row)
        del ref, ref_in, ref_t
    dist.barrier()
    return rows


def run_accuracy(cp, dry_run, emit, deadline):
    from dist_pool import WorkerPool

    pool = WorkerPool(cp, env={STAGE_ENV: "1"})  # spawn hands the workers this sys.path
    try:
        per_rank = pool.run(w_accuracy, dry_run, timeout=max(30.0, min(240.0, deadline - time.time())))
    finally:
        pool.close()
    tol = TOL_FP32 if dry_run else TOL_BF16
    lines = []
    for i, row in enumerate(per_rank[0]):
        ranks = [rows[i] for rows in per_rank]
        line = {"check": "accuracy", "cp": cp, **{k: row[k] for k in ("case", "S", "b", "layout", "exchange",
                                                                    "backend")}}
        errors = [r["error"] for r in ranks if "error" in r]
        if errors:
            line.update(passed=False, error=errors[0])
        else:
            max_abs = {n: max(r["err"][n] for r in ranks) for n in tol}
            ref_max = {n: max(r["ref_max"][n] for r in ranks) for n in tol}
            max_rel = {n: max_abs[n] / max(ref_max[n], 1e-30) for n in tol}
            resolved = sorted({r["resolved"] for r in ranks})
            passed = resolved == [row["backend"]] and all(max_rel[n] < tol[n] for n in tol)
            line.update(resolved=resolved, exchange_resolved=sorted({r["exchange_resolved"] for r in ranks}),
                        max_abs=_round(max_abs), max_rel=_round(max_rel), tol=tol, passed=passed)
            if resolved != [row["backend"]]:
                line["reason"] = ranks[0]["reason"]
        lines.append(line)
    # Each backend's error relative to dense's on the same case/layout/exchange (dense = 1.0).
    dense = {(l["case"], l["layout"], l["exchange"]): l["max_rel"] for l in lines
             if l["backend"] == "dense" and "max_rel" in l}
    for line in lines:
        base = dense.get((line["case"], line["layout"], line["exchange"]))
        if base and "max_rel" in line and line["backend"] != "dense":
            line["err_ratio_vs_dense"] = _round({n: line["max_rel"][n] / max(base[n], 1e-30) for n in base})
        emit(line)
    return all(line["passed"] for line in lines)


def _round(d):
    return {k: float(f"{v:.3e}") for k, v in d.items()}


# ---------------------------------------------------------------------------
# timing (this process, one rank at a time)
# ---------------------------------------------------------------------------


def _timed(fn, reps, warmup, device):
    import torch

    for _ in range(warmup):
        fn()
    _sync(device)
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


def run_kernel_timing(dry_run, backends, emit, deadline):
    import torch

    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.blockdiag_cp.layout import build_layout, padded_length
    from megatron_ext.blockdiag_cp.plan import build_plan

    device, dtype = device_and_dtype(dry_run)
    cfg = sizes(dry_run)
    S, (hq, hkv, d) = cfg["time_S"], cfg["time_heads"]
    doc_ids = packed_mix(S, 21, max(2, S // 128), max(4, S // 4))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(S, h, d, generator=g).to(dtype).to(device) for h in (hq, hkv, hkv))
    scale = 1.0 / math.sqrt(d)
    docs = int((doc_ids.diff() != 0).sum()) + 1
    ok_all = True
    for cp in (1, 2, 4):
        for layout in (("contiguous",) if cp == 1 else LAYOUTS):
            ids = torch.nn.functional.pad(doc_ids.unsqueeze(0), (0, padded_length(S, layout, cp) - S))
            lay = build_layout(layout, ids, cp)
            pad = ids.shape[1] - S
            qp_, kp_, vp_ = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
            buf_index = lay.positions.reshape(-1).to(device)  # all-gather buffer: rank-major
            per_backend = {b: {"fwd_ms": [], "fwd_bwd_ms": []} for b in backends}
            diffs = []
            for rank in range(cp):
                if time.time() > deadline:
                    emit({"check": "timing", "cp": cp, "layout": layout, "passed": False,
                          "error": "skipped: out of time"})
                    return False
                plan = build_plan(ids, lay, rank)
                ks = plan.segments["allgather"]
                q_lens, k_lens = ks.lengths()
                seg = kernels.Segments(ks.cu_seqlens_q.to(device), ks.cu_seqlens_k.to(device),
                                       ks.max_seqlen_q, ks.max_seqlen_k, tuple(q_lens), tuple(k_lens))
                qr = qp_[lay.positions[rank].to(device)][ks.q_index.to(device)].contiguous()
                kr = kp_[buf_index][ks.k_index.to(device)].contiguous()
                vr = vp_[buf_index][ks.k_index.to(device)].contiguous()
                grad = torch.randn(qr.shape, generator=g).to(dtype).to(device)
                outs = {}
                for backend in backends:
                    fn = kernels.KERNELS[backend]
                    leaves = [t.detach().requires_grad_() for t in (qr, kr, vr)]

                    def fwd():
                        with torch.no_grad():
                            return fn(qr, kr, vr, seg, scale, 0.0)

                    def fwd_bwd():
                        out = fn(*leaves, seg, scale, 0.0)
                        out.backward(grad)

                    if qr.shape[0] == 0:
                        per_backend[backend]["fwd_ms"].append(0.0)
                        per_backend[backend]["fwd_bwd_ms"].append(0.0)
                        continue
                    outs[backend] = fwd().float()
                    per_backend[backend]["fwd_ms"].append(_timed(fwd, cfg["reps"], cfg["warmup"], device))
                    per_backend[backend]["fwd_bwd_ms"].append(
                        _timed(fwd_bwd, cfg["reps"], cfg["warmup"], device))
                if "dense" in outs and len(outs) > 1:
                    ref = outs["dense"]
                    diffs += [float((o - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                              for b, o in outs.items() if b != "dense"]
            pairs = [int(x) for x in build_plan(ids, lay, 0).work_per_rank]
            line = {"check": "timing", "cp": cp, "layout": layout, "S": S, "docs": docs,
                    "heads": [hq, hkv], "head_dim": d, "dtype": str(dtype).replace("torch.", ""),
                    "pairs_per_rank": pairs, "kernels": {}}
            for backend, t in per_backend.items():
                slowest = max(t["fwd_ms"])
                line["kernels"][backend] = {
                    "fwd_ms_per_rank": [round(x, 3) for x in t["fwd_ms"]],
                    "fwd_bwd_ms_per_rank": [round(x, 3) for x in t["fwd_bwd_ms"]],
                    "fwd_ms_max_rank": round(slowest, 3),
                    "fwd_bwd_ms_max_rank": round(max(t["fwd_bwd_ms"]), 3),
                    # 4 * pairs * heads * dim flops of the busiest rank over the slowest rank's time
                    "fwd_tflops_effective": round(4.0 * max(pairs) * hq * d / (slowest * 1e-3) / 1e12, 2)
                    if slowest > 0 else None}
            line["max_rel_diff_vs_dense"] = float(f"{max(diffs):.3e}") if diffs else None
            tol = (TOL_FP32 if dry_run else TOL_BF16)["out"]
            line["passed"] = all(x < 2 * tol for x in diffs)
            ok_all &= line["passed"]
            emit(line)
    return ok_all


def run_engine_timing(dry_run, backends, emit):
    """The whole engine call at cp=1 (no exchange) on the realistic mix; error vs fp32 dense."""
    import torch

    import megatron_ext.blockdiag_cp as bdcp

    device, dtype = device_and_dtype(dry_run)
    cfg = sizes(dry_run)
    S, (hq, hkv, d) = cfg["time_S"], cfg["time_heads"]
    doc_ids = packed_mix(S, 21, max(2, S // 128), max(4, S // 4))
    g = torch.Generator().manual_seed(4)
    q, k, v, w = (torch.randn(S, 1, h, d, generator=g).to(dtype).to(device) for h in (hq, hkv, hkv, hq))

    def step(state, tensors, weight):
        leaves = [t.detach().requires_grad_() for t in tensors]
        with bdcp.blockdiag_cp_step(state):
            out = bdcp.blockdiag_cp_attention(*leaves)
            (out.float() * weight.float()).sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    def build(backend):
        return bdcp.BlockDiagCPState.build(doc_ids, cp_group=None, attn_backend=backend, device=device)

    ref = step(build("dense"), [t.float() for t in (q, k, v)], w.float())  # fp32 dense: the reference
    ok_all = True
    for backend in backends:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        state = build(backend)
        got = step(state, (q, k, v), w)
        ms = _timed(lambda: step(state, (q, k, v), w), cfg["reps"], cfg["warmup"], device)
        names = ("out", "dq", "dk", "dv")
        tol = TOL_FP32 if dry_run else TOL_BF16
        max_rel = {n: float((a.float() - r).abs().max() / r.abs().max().clamp_min(1e-30))
                   for n, a, r in zip(names, got, ref)}
        report = state.report()
        line = {"check": "engine_cp1", "S": S, "heads": [hq, hkv], "head_dim": d, "backend": backend,
                "resolved": report["attn_backend"], "dtype": str(dtype).replace("torch.", ""),
                "fwd_bwd_ms": round(ms, 3), "max_rel_vs_fp32_dense": _round(max_rel),
                "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                if device.type == "cuda" else None}
        line["passed"] = report["attn_backend"] == backend and all(max_rel[n] < tol[n] for n in names)
        ok_all &= line["passed"]
        emit(line)
    return ok_all


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def _megatron_installed():
    try:
        return importlib.util.find_spec("megatron") is not None
    except ImportError:
        return False


def env_check(dry_run):
    before = {m for m in sys.modules if m == "megatron" or m.startswith("megatron.")}
    import torch

    import megatron_ext.blockdiag_cp  # noqa: F401 - the engine path must not need megatron
    from megatron_ext.blockdiag_cp import kernels

    pulled = sorted({m for m in sys.modules if m == "megatron" or m.startswith("megatron.")} - before)
    te_ok, te_reason = kernels.KERNEL_INSTALLED["te"]()
    line = {"check": "env", "dry_run": dry_run, "python": platform.python_version(),
            "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "flash_impl": kernels.flash_impl_name(), "te_importable": te_ok, "te_reason": te_reason,
            "megatron_core_installed": _megatron_installed(),
            "engine_imported_megatron": pulled, "approach": APPROACH}
    line["passed"] = not pulled and (dry_run or torch.cuda.is_available())
    return line


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, fp32, tiny sizes, the flash test double in place of the CUDA kernel")
    parser.add_argument("--out", default=None, help="JSONL path (default: $OUT/gpu_check.jsonl if OUT is set)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new checks after this")
    parser.add_argument("--skip", default="", help="comma list of: accuracy,timing,engine")
    parser.add_argument("--block-megatron", action="store_true",
                        help="make megatron unimportable first (as on a machine without megatron-core)")
    args = parser.parse_args(argv)
    if args.block_megatron:
        _block_megatron()
    t0 = time.time()
    deadline = t0 + args.budget_s
    out_path = args.out or (os.path.join(os.environ["OUT"], "gpu_check.jsonl") if os.environ.get("OUT") else None)
    if out_path:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        open(out_path, "w").close()
    skip = {s for s in args.skip.split(",") if s}

    def emit(line):
        line.setdefault("dry_run", args.dry_run)
        line["t_s"] = round(time.time() - t0, 1)
        text = json.dumps(line, sort_keys=False)
        print(text, flush=True)
        if out_path:
            with open(out_path, "a") as f:
                f.write(text + "\n")

    results = {}
    env = env_check(args.dry_run)
    emit(env)
    results["env"] = env["passed"]
    if not env["passed"]:
        emit({"check": "summary", "passed": False, "failed": ["env"], "wall_s": round(time.time() - t0, 1)})
        return 1
    backends = setup_backends(args.dry_run)
    if "te" not in backends:
        emit({"check": "te", "status": "not_run", "passed": True,
              "reason": f"transformer_engine not importable ({env['te_reason']}); te was NOT checked"})
    for name, fn in (("accuracy_cp2", lambda: run_accuracy(2, args.dry_run, emit, deadline)),
                     ("accuracy_cp4", lambda: run_accuracy(4, args.dry_run, emit, deadline)),
                     ("engine", lambda: run_engine_timing(args.dry_run, backends, emit)),
                     ("timing", lambda: run_kernel_timing(args.dry_run, backends, emit, deadline))):
        if name.split("_")[0] in skip:
            continue
        if time.time() > deadline:
            emit({"check": name, "passed": False, "error": "skipped: out of time budget"})
            results[name] = False
            continue
        try:
            results[name] = bool(fn())
        except Exception as exc:  # noqa: BLE001 - one failed check must not hide the others
            emit({"check": name, "passed": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"})
            results[name] = False
    failed = [k for k, ok in results.items() if not ok]
    emit({"check": "summary", "passed": not failed, "failed": failed, "backends": backends,
          "te_checked": "te" in backends, "wall_s": round(time.time() - t0, 1)})
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
