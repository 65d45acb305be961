"""gpu_check suite (``--suites gpu_check``): the prepared GPU check of the engine's kernels, bf16.

Run on a one-GPU machine through its one prepared command (megatron-core,
TransformerEngine and flash-attn are NOT needed; torch's varlen_attn serves as "flash"):

    bash scripts/gpu_check.sh            # = run_all.py --suites gpu_check --out $OUT ...
    bash scripts/gpu_check.sh --dry-run  # CPU, fp32, tiny sizes, the flash test double

Checks, each one row (printed as a JSON line as it lands, and in results.jsonl):
- env: versions, which flash implementation, whether te is importable, and that
  megatron_ext.blockdiag_cp imports without megatron.
- matmul_peak: the device's bf16 matmul TFLOP/s measured in this run (the H200's data
  sheet says ~989); timing rows give their fraction of it.
- accuracy: every layout x exchange at cp=2 and cp=4, forward and backward, each backend in
  bf16 against an fp32 reference (same bf16-rounded inputs), max abs / rel error of out, dq, dk, dv;
  a ``variants`` case adds a sliding window (512), a learnable attention sink and MLA head dims
  (q/k 192, v 128), which flash / te must take (or fall back, which fails the check).
- flash_calls: cp 4, the variants case (window, sink, MLA) per layout with a2a: every flash call's
  out / lse and dq / dk / dv against the dense kernel on the same tensors, so a call the library reads
  differently from the engine (a window edge, a stride, the lse of a query with no key) is named with
  its segments, shapes and strides, not only seen in the layer's error.
- engine_cp1: the whole engine call (forward + backward) at cp=1 on a realistic pack
  (32k tokens, 32 query heads, 8 KV heads, head dim 128), its error vs an fp32 dense run,
  and the engine's overhead: the fraction of its time not spent in the kernel itself.
- timing: on the same pack, each backend's kernel calls per rank (every streamed step) for
  every layout at cp=1/2/4 (forward, forward+backward), effective TFLOP/s of the busiest rank.
- memory: one long document (32k tokens, the same heads), cp = 2 and 4 ranks sharing the GPU,
  kv_backward=refetch, every layout x exchange with the first checked backend: each rank's
  peak CUDA memory added by one layer's forward + backward (``max_memory_allocated`` above
  what was allocated before), the busiest rank's peak at cp=4 against cp=2 (target <= 0.6x),
  and what forward leaves for backward against the local q/k/v/out.
- loopback_cp8: one rank of cp = 8 in one process (``megatron_ext.testing.loopback``: rank r's real
  plan, its chunks handed over on the device, torch's fake process group for the agreements) on
  128k tokens with the timing heads and the gpu_model suite's documents (``gpu_model.LOOPBACK_CASES``: one
  long document and the short mix on zigzag, ranks 0 and 7; the short mix on thd, ranks 0 and 7;
  the heavy-tailed one on balanced, ranks 0 and 3; the thd pack again with relayout "balanced",
  ranks 0 and 7, timing only), a2a: kernel calls, launching ops and syncs per
  layer call, forward + backward wall ms (CUDA-synchronized) and the host's own ms issuing it, of a
  step's steady second layer call (the one gpu_model prices) and of its first, and the kernel calls'
  own ms (CUDA events around each) in a third.
- te: not run (and said so) unless transformer_engine imports.

How cp ranks share one GPU: NCCL refuses two ranks on one device, so each accuracy check
spawns cp processes on cuda:0 joined by a gloo group, and sets
MEGATRON_EXT_STAGE_COLLECTIVES_ON_CPU=1 so the engine's K/V collectives run on CPU copies
(gloo's send/recv, used by the halo exchange, cannot take CUDA tensors). The exchange's
speed is therefore not measured here; timing is of the kernels on each rank's real
segments, one rank at a time in this process (megatron_ext.testing.timing).
"""

import contextlib
import json
import platform
import time

from megatron_ext.testing.isolation import block_megatron_if_asked

block_megatron_if_asked()  # the ranks of a --block-megatron run import this module too

LAYOUTS = ("contiguous", "zigzag", "balanced")
EXCHANGES = ("allgather", "halo", "a2a")
STAGE_ENV = "MEGATRON_EXT_STAGE_COLLECTIVES_ON_CPU"
H200_BF16_SPEC_TFLOPS = 989.0
APPROACH = ("cp ranks = cp processes on one device joined by a gloo group; K/V collectives staged "
            "through CPU (MEGATRON_EXT_STAGE_COLLECTIVES_ON_CPU=1) because NCCL refuses two ranks on "
            "one GPU and gloo's send/recv (halo) cannot take CUDA tensors; exchange speed is not "
            "measured; kernel timings run each rank's real segments one rank at a time")

# bf16 bounds on max|err| / max|ref| against the fp32 reference (fp32 dry run: much tighter).
TOL_BF16 = {"out": 2e-2, "dq": 5e-2, "dk": 5e-2, "dv": 5e-2}
TOL_FP32 = {"out": 1e-4, "dq": 1e-4, "dk": 1e-4, "dv": 1e-4}


def sizes(dry_run):
    if dry_run:
        return {"acc_cases": [("mix", 64, 1), ("rows2", 48, 2), ("variants", 64, 1)], "acc_heads": (4, 2, 8),
                "variants": {"window": 9, "sink": True, "heads": (4, 4, 12, 8)},
                "time_S": 256, "time_heads": (4, 2, 16), "reps": 1, "warmup": 1, "matmul_n": 256}
    return {"acc_cases": [("mix", 4096, 1), ("rows2", 2048, 2), ("variants", 4096, 1)], "acc_heads": (8, 2, 128),
            # sliding window + learnable sink + MLA head dims (DeepSeek-V3's 192 / 128)
            "variants": {"window": 512, "sink": True, "heads": (8, 8, 192, 128)},
            "time_S": 32768, "time_heads": (32, 8, 128), "reps": 5, "warmup": 2, "matmul_n": 8192}


def w_memory(dry_run, backend):
    """On every rank sharing the device: one long document, peak memory of one layer per layout x exchange."""
    import torch
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    device, dtype = device_and_dtype(dry_run)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    S, (hq, hkv, d) = sizes(dry_run)["time_S"], sizes(dry_run)["time_heads"]
    rows = []
    # The dry run takes two pairs (the code path); the real run every layout x exchange.
    pairs = ([("zigzag", "a2a"), ("contiguous", "allgather")] if dry_run
             else [(lay, ex) for lay in LAYOUTS for ex in EXCHANGES])
    with check_backends(dry_run):
        for layout, exchange in pairs:
            state = bdcp.BlockDiagCPState.build(torch.ones(S, dtype=torch.long), layout=layout,
                                                kv_exchange=exchange, attn_backend=backend, device=device,
                                                kv_backward="refetch")
            L = state.local_len
            g = torch.Generator().manual_seed(dist.get_rank())
            q, k, v, w = (torch.randn(L, 1, h, d, generator=g).to(dtype).to(device).requires_grad_(i < 3)
                          for i, h in enumerate((hq, hkv, hkv, hq)))
            row = {"layout": layout, "exchange": exchange, "local_bytes": sum(
                t.numel() * t.element_size() for t in (q, k, v, w))}
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            with bdcp.blockdiag_cp_step(state):
                out = bdcp.blockdiag_cp_attention(q, k, v)
                if device.type == "cuda":
                    row["held_bytes"] = torch.cuda.memory_allocated(device) - before
                out.backward(w)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
            from megatron_ext.blockdiag_cp.exchange import resolve_waits

            stats = resolve_waits(state.comm_stats)  # CUDA-event waits read back after the step
            row["exposed_comm_fraction"] = round(
                (stats["wait_seconds"] + stats["backward_wait_seconds"])
                / max(1e-9, stats["forward_seconds"] + stats["backward_seconds"]), 4)
            rows.append(row)
            del out, q, k, v, w
    dist.barrier()
    return rows


def run_memory(dry_run, backends, emit, deadline):
    """cp = 2 and 4 on one long document: does the busiest rank's peak shrink with cp?"""
    from megatron_ext.testing import WorkerPool

    backend = backends[0]
    peaks = {}
    for cp in (2, 4):
        if time.time() > deadline:
            emit({"check": "memory", "cp": cp, "passed": False, "error": "skipped: out of time"})
            return False
        pool = WorkerPool(cp, env={STAGE_ENV: "1"})
        try:
            per_rank = pool.run(w_memory, dry_run, backend, timeout=max(30.0, min(240.0, deadline - time.time())))
        finally:
            pool.close()
        for i, row in enumerate(per_rank[0]):
            ranks = [rows[i] for rows in per_rank]
            line = {"check": "memory", "cp": cp, "backend": backend, "layout": row["layout"],
                    "exchange": row["exchange"], "S": sizes(dry_run)["time_S"], "doc": "one document",
                    "kv_backward": "refetch", "local_mib": round(row["local_bytes"] / 2**20, 1),
                    "exposed_comm_fraction_per_rank": [r["exposed_comm_fraction"] for r in ranks]}
            if "peak_bytes" in row:
                peak = max(r["peak_bytes"] for r in ranks)
                peaks[(cp, row["layout"], row["exchange"])] = peak
                line.update(peak_mib_per_rank=[round(r["peak_bytes"] / 2**20, 1) for r in ranks],
                            held_mib_per_rank=[round(r["held_bytes"] / 2**20, 1) for r in ranks],
                            peak_mib_busiest=round(peak / 2**20, 1))
            line["passed"] = True
            emit(line)
    ratios = {k[1:]: peaks[(4,) + k[1:]] / peaks[k] for k in peaks if k[0] == 2 and (4,) + k[1:] in peaks}
    summary = {"check": "memory_cp4_over_cp2", "backend": backend, "target": 0.6,
               "ratios": {f"{l}/{e}": round(x, 3) for (l, e), x in ratios.items()}}
    summary["passed"] = all(x <= 0.6 for x in ratios.values()) if ratios else dry_run
    emit(summary)
    return summary["passed"]


def case_doc_ids(S, b):
    import torch

    from megatron_ext.testing.mixes import packed_mix

    if b == 1:
        return packed_mix(S, 11, max(2, S // 64), max(4, S // 3), pad_tail=S // 50)
    return torch.stack([packed_mix(S, 12 + r, max(2, S // 32), max(4, S // 2), pad_tail=r * (S // 20))
                        for r in range(b)])


def timing_doc_ids(S):
    from megatron_ext.testing.mixes import packed_mix

    return packed_mix(S, 21, max(2, S // 128), max(4, S // 4))


@contextlib.contextmanager
def check_backends(dry_run):
    """Yields the backends to check; a dry run puts a CPU double of torch's flash ops behind "flash"
    (the engine's own flash forward/backward code runs, over plain-torch math)."""
    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.testing import override_availability, override_libraries
    from megatron_ext.testing.doubles import fake_torch_flash_ops

    with contextlib.ExitStack() as stack:
        if dry_run:
            stack.enter_context(override_libraries({
                "flash_attn": None, "torch.ops.aten.flash": fake_torch_flash_ops(),
                "torch.nn.attention.varlen": object()}))
            stack.enter_context(override_availability("flash", True, "CPU flash test double",
                                                      any_call=True))
        backends = ["flash", "dense"]
        if kernels.installed("te")[0]:
            backends.insert(0, "te")
        yield backends


def device_and_dtype(dry_run):
    import torch

    if dry_run:
        return torch.device("cpu"), torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", 0), torch.bfloat16


def _round(d):
    return {k: float(f"{v:.3e}") for k, v in d.items()}


def _sig(x):
    return float(f"{x:.4g}")


def _max_rel(got, ref):
    return float((got.detach().float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------
# accuracy (runs on every rank of a gloo pool)
# ---------------------------------------------------------------------------


def w_accuracy(dry_run):
    import torch
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing import reference_attention

    device, dtype = device_and_dtype(dry_run)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows = []
    with check_backends(dry_run) as backends:
        for case, S, b in sizes(dry_run)["acc_cases"]:
            doc_ids = case_doc_ids(S, b)
            g = torch.Generator().manual_seed(5)
            variant = sizes(dry_run)["variants"] if case == "variants" else {}
            hq, hkv, dk, dv = variant.get("heads", sizes(dry_run)["acc_heads"] + (sizes(dry_run)["acc_heads"][2],))
            shapes = [(S, b, hq, dk), (S, b, hkv, dk), (S, b, hkv, dv), (S, b, hq, dv)]
            # Inputs rounded to the test dtype once; the fp32 reference sees the same values.
            q, k, v, w = (torch.randn(*s, generator=g).to(dtype).to(device) for s in shapes)
            window = variant.get("window")
            sink = torch.randn(hq, generator=g).to(device) if variant.get("sink") else None
            ref_in = [t.float().requires_grad_() for t in (q, k, v)]
            ref = reference_attention(*ref_in, doc_ids, window=window, sink=sink)
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
                                out = bdcp.blockdiag_cp_attention(
                                    *local, window_size=None if window is None else (window, 0),
                                    softmax_offset=sink)
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
    from megatron_ext.testing import WorkerPool

    pool = WorkerPool(cp, env={STAGE_ENV: "1"})
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


def _compare(got, ref) -> dict:
    """Largest |got - ref| over the entries finite in both, relative to max |ref|; the non-finite counts."""
    import torch

    got, ref = got.detach().float(), ref.detach().float()
    both = torch.isfinite(got) & torch.isfinite(ref)
    scale = float(ref[both].abs().max()) if bool(both.any()) else 0.0
    diff = float((got - ref).abs()[both].max()) if bool(both.any()) else 0.0
    return {"rel": diff / max(scale, 1.0), "nonfinite": int((~torch.isfinite(got)).sum()),
            "nonfinite_ref": int((~torch.isfinite(ref)).sum())}


def _call_meta(seg, q, k, v) -> dict:
    return {"causal": seg.causal, "window": seg.window, "segments": len(seg.q_lens),
            "q_lens": list(seg.q_lens[:4]), "k_lens": list(seg.k_lens[:4]), "max_seqlen_q": seg.max_seqlen_q,
            "max_seqlen_k": seg.max_seqlen_k, "q": list(q.shape), "k": list(k.shape), "v": list(v.shape),
            "k_stride": list(k.stride())}


def w_flash_calls(dry_run):
    """On every rank (cp 4): each flash call of the variants case against the dense kernel on the same
    tensors (forward: out, lse; backward: dq, dk, dv), so a wrong call is named with its metadata."""
    import torch

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.testing import override_kernel

    device, dtype = device_and_dtype(dry_run)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tol = TOL_FP32 if dry_run else TOL_BF16
    rows = []
    with check_backends(dry_run) as _:
        flash = kernels.kernel_for("flash")
        log = {"calls": 0, "worst": {}, "bad": []}

        def note(where, seg, q, k, v, pairs):
            log["calls"] += where == "forward"
            bad = False
            for name, (got, ref) in pairs.items():
                c = _compare(got, ref)
                log["worst"][name] = max(log["worst"].get(name, 0.0), c["rel"])
                limit = tol.get(name, tol["out"])
                bad |= c["nonfinite"] > c["nonfinite_ref"] or c["rel"] > limit
                pairs[name] = c
            if bad and len(log["bad"]) < 3:
                log["bad"].append({"where": where, **_call_meta(seg, q, k, v), **pairs})

        def forward(q, k, v, seg, scale, dropout_p=0.0, seed=0):
            out, lse, aux = flash.forward(q, k, v, seg, scale, dropout_p, seed)
            ref_out, ref_lse, _ = kernels.dense_forward(q, k, v, seg, scale, dropout_p, seed)
            note("forward", seg, q, k, v, {"out": (out, ref_out), "lse": (lse, ref_lse)})
            return out, lse, aux

        def backward(dout, q, k, v, out, lse, aux, seg, scale, dropout_p=0.0):
            grads = flash.backward(dout, q, k, v, out, lse, aux, seg, scale, dropout_p)
            ref = kernels.dense_backward(dout, q, k, v, out, lse, 0, seg, scale, dropout_p)
            note("backward", seg, q, k, v, dict(zip(("dq", "dk", "dv"), zip(grads, ref))))
            return grads

        _, S, _ = [c for c in sizes(dry_run)["acc_cases"] if c[0] == "variants"][0]
        variant = sizes(dry_run)["variants"]
        hq, hkv, dk, dv = variant["heads"]
        doc_ids = case_doc_ids(S, 1)
        g = torch.Generator().manual_seed(8)
        q, k, v, w = (torch.randn(S, 1, h, d, generator=g).to(dtype).to(device)
                      for h, d in ((hq, dk), (hkv, dk), (hkv, dv), (hq, dv)))
        for layout in LAYOUTS:
            log.update(calls=0, worst={}, bad=[])
            state = bdcp.BlockDiagCPState.build(doc_ids, layout=layout, kv_exchange="a2a", attn_backend="flash",
                                                device=device)
            local = [state.shard(t).detach().requires_grad_() for t in (q, k, v)]
            with override_kernel("flash", kernels.Kernel(forward, backward)), bdcp.blockdiag_cp_step(state):
                out = bdcp.blockdiag_cp_attention(*local, window_size=(variant["window"], 0))
                (out.float() * state.shard(w).float()).sum().backward()
            rows.append({"layout": layout, "calls": log["calls"],
                         "worst_rel": {n: float(f"{x:.3e}") for n, x in log["worst"].items()},
                         "bad_calls": list(log["bad"])})
    return rows


def run_flash_calls(dry_run, emit, deadline):
    from megatron_ext.testing import WorkerPool

    pool = WorkerPool(4, env={STAGE_ENV: "1"})
    try:
        per_rank = pool.run(w_flash_calls, dry_run, timeout=max(30.0, min(180.0, deadline - time.time())))
    finally:
        pool.close()
    ok = True
    for i, row in enumerate(per_rank[0]):
        ranks = [rows[i] for rows in per_rank]
        bad = [dict(rank=r, **call) for r, rows in enumerate(ranks) for call in rows["bad_calls"]]
        line = {"check": "flash_calls", "cp": 4, "case": "variants", "layout": row["layout"], "exchange": "a2a",
                "calls_per_rank": [r["calls"] for r in ranks],
                "worst_rel": {n: max(r["worst_rel"].get(n, 0.0) for r in ranks) for n in row["worst_rel"]},
                "bad_calls": bad[:3], "passed": not bad and min(r["calls"] for r in ranks) > 0}
        ok &= line["passed"]
        emit(line)
    return ok


# ---------------------------------------------------------------------------
# peak, engine and kernel timing (this process)
# ---------------------------------------------------------------------------


def run_dropin_paths(dry_run, backends, emit):
    """Megatron's mask and THD paths (cp = 1, this process) per backend against the fp32 reference."""
    import torch

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp.resolve import state_from_mask, state_from_thd
    from megatron_ext.testing import doc_mask, reference_attention

    device, dtype = device_and_dtype(dry_run)
    hq, hkv, d = sizes(dry_run)["acc_heads"]
    _, S, _ = sizes(dry_run)["acc_cases"][0]
    doc_ids = case_doc_ids(S, 1)
    doc_ids = torch.where(doc_ids > 0, doc_ids, doc_ids.max() + 1)  # Megatron masks have no padding
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(S, 1, h, d, generator=g).to(dtype).to(device) for h in (hq, hkv, hkv))
    ref = reference_attention(q.float(), k.float(), v.float(), doc_ids)
    mask = (~doc_mask(doc_ids)).unsqueeze(1).to(device)  # [1, 1, S, S], True = masked out
    lengths = torch.unique_consecutive(doc_ids, return_counts=True)[1]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    params = type("PackedSeqParams", (), {"qkv_format": "thd", "cu_seqlens_q": cu,
                                           "cu_seqlens_q_padded": None})()
    ok = True
    for backend in backends:
        bdcp.configure_cp_varlen(backend, "allgather")
        try:
            for path, build in (("mask", lambda: state_from_mask(mask, None, batch=1, device=device)),
                                ("thd", lambda: state_from_thd(params, S, None, device=device))):
                state = build()
                out = bdcp.blockdiag_cp_attention(q, k, v, state=state)
                err = _max_rel(out, ref)
                passed = err <= (TOL_FP32 if dry_run else TOL_BF16)["out"]
                ok &= passed
                emit({"check": "dropin_paths", "path": path, "backend": backend,
                      "resolved": state.attn_backend, "S": S, "docs": int(cu.numel() - 1),
                      "out_rel_err": _sig(err), "passed": passed})
        finally:
            bdcp.configure_cp_varlen()
    return ok


def run_thd_indices(emit):
    """Our thd_partitioned_indices against TransformerEngine's kernel, when TE imports."""
    import importlib

    import torch

    import megatron_ext.blockdiag_cp as bdcp

    try:
        tex = importlib.import_module("transformer_engine_torch")
    except Exception as exc:  # noqa: BLE001 - TE absent: say so, do not pretend
        emit({"check": "thd_indices", "status": "not_run", "passed": True,
              "reason": f"transformer_engine_torch not importable ({type(exc).__name__}); not compared"})
        return True
    ok = True
    for cu_list, cp in (([0, 8, 16], 2), ([0, 4, 12, 28, 36], 2), ([0, 8, 40, 48, 96], 4)):
        cu = torch.tensor(cu_list, dtype=torch.int32)
        for rank in range(cp):
            ours = bdcp.thd_partitioned_indices(cu, cu_list[-1], cp, rank)
            theirs = tex.thd_get_partitioned_indices(cu.cuda(), cu_list[-1], cp, rank).cpu()
            same = torch.equal(ours.to(torch.long), theirs.to(torch.long))
            ok &= same
            emit({"check": "thd_indices", "cu_seqlens_padded": cu_list, "cp": cp, "rank": rank,
                  "passed": same})
    return ok


def run_merge_kernel(dry_run, emit):
    """The fused merge (``merge_rows_``: Triton on CUDA where it imports) against its eager body on the same
    tensors, on runs and on scattered rows, then the row ops (``copy_rows_``, ``add_rows_``) and the send
    gather (``gather_kv_rows_``) on scattered rows, and the row sums (``sum_rows_``) against ``add_rows_`` on
    rows that arrive six times each, each timed (CUDA events) at 16k rows x 32 heads x 128 (the gather: 8
    K/V heads)."""
    import torch

    from megatron_ext.blockdiag_cp import merge_kernel
    from megatron_ext.testing.timing import median_ms

    device, _ = device_and_dtype(dry_run)
    triton = device.type == "cuda" and merge_kernel._triton_imports()
    n, H, D = (64, 4, 8) if dry_run else (16384, 32, 128)
    g = torch.Generator().manual_seed(0)
    acc_out, out = (torch.randn(n, H, D, generator=g) for _ in range(2))
    acc_lse, lse = (3 * torch.randn(n, H, generator=g) for _ in range(2))
    acc_out, acc_lse, lse = acc_out.to(device), acc_lse.to(device), lse.to(device)
    out = out.to(device, torch.bfloat16)
    source, target = (torch.randperm(n, generator=g)[: n // 2].to(device) for _ in range(2))
    ok = True
    for name, args in (("runs", (None, None)), ("scattered", (source, target))):
        fused, eager = (acc_out.clone(), acc_lse.clone()), (acc_out.clone(), acc_lse.clone())
        merge_kernel.merge_rows_(*fused, out, lse, *args)
        merge_kernel.merge_rows_eager(*eager, out, lse, *args)
        err = max(float((fused[0] - eager[0]).abs().max()), float((fused[1] - eager[1]).abs().max()))
        row = {"check": "merge_kernel", "rows": name, "triton": triton, "max_abs_diff": err, "passed": err < 1e-4}
        if device.type == "cuda":
            for label, fn in (("fused", merge_kernel.merge_rows_), ("eager", merge_kernel.merge_rows_eager)):
                a, b = acc_out.clone(), acc_lse.clone()
                fn(a, b, out, lse, *args)  # warm (Triton compiles on first use)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    fn(a, b, out, lse, *args)
                end.record()
                torch.cuda.synchronize()
                row[f"{label}_ms"] = start.elapsed_time(end) / 20
        ok &= row["passed"]
        emit(row)
    # copy_rows_ / add_rows_ (Triton on CUDA where it imports): a write-back into bf16 and returned bf16
    # gradients added into the float32 buffer, scattered rows against the eager body
    grads = out[: n // 2]
    for name, op, dst, src in (("copy_rows_", merge_kernel.copy_rows_, out, acc_out[: n // 2]),
                               ("add_rows_", merge_kernel.add_rows_, acc_out, grads)):
        accumulate = name == "add_rows_"
        fused, eager = dst.clone(), dst.clone()
        op(fused, src, None, target)
        merge_kernel.rows_into_eager(eager, src, None, target, accumulate)
        err = float((fused.float() - eager.float()).abs().max())
        row = {"check": "merge_kernel", "op": name, "rows": "scattered", "triton": triton, "max_abs_diff": err,
               "passed": err < (1e-2 if dst.dtype == torch.bfloat16 else 1e-4)}
        if device.type == "cuda":
            for label, fn in (("fused", lambda d: op(d, src, None, target)),
                              ("eager", lambda d: merge_kernel.rows_into_eager(d, src, None, target, accumulate))):
                d = dst.clone()  # warmed first (Triton compiles on first use), then CUDA events per call
                row[f"{label}_ms"] = median_ms(lambda: fn(d), device, reps=20, warmup=1)
        ok &= row["passed"]
        emit(row)
    # sum_rows_ (Triton on CUDA where it imports): a band group's returned bf16 gradients, every buffer row
    # arriving from 6 ranks, summed into the float32 buffer, against add_rows_ over the same arrivals
    from megatron_ext.blockdiag_cp.merge import RowSums

    rows = n // 16
    slots = torch.arange(rows).repeat(6)[torch.randperm(6 * rows, generator=g)]  # [6 * rows]: each row 6 times
    sums = RowSums.of(torch.arange(6 * rows).numpy(), slots.numpy(), device)
    arrivals, slots = grads[: 6 * rows], slots.to(device)
    fused, atomic = acc_out.clone(), acc_out.clone()
    merge_kernel.sum_rows_(fused, arrivals, sums.source, sums.offsets, sums.target)
    merge_kernel.add_rows_(atomic, arrivals, None, slots)
    err = float((fused - atomic).abs().max())
    row = {"check": "merge_kernel", "op": "sum_rows_", "rows": "repeated", "triton": triton, "max_abs_diff": err,
           "passed": err < 1e-4}
    if device.type == "cuda":
        for label, fn in (("fused", lambda d: merge_kernel.sum_rows_(d, arrivals, sums.source, sums.offsets,
                                                                      sums.target)),
                          ("atomic", lambda d: merge_kernel.add_rows_(d, arrivals, None, slots))):
            d = acc_out.clone()
            row[f"{label}_ms"] = median_ms(lambda: fn(d), device, reps=20, warmup=1)
    ok &= row["passed"]
    emit(row)
    # gather_kv_rows_ (Triton on CUDA where it imports): a send buffer of K and V rows [n / 2, 8, 2 x 128]
    # gathered from [n, 8, 128] each, against the eager body (two gathers into its halves)
    k, v = (torch.randn(n, 8, D, generator=g).to(device, torch.bfloat16) for _ in range(2))
    fused, eager = (torch.empty(n // 2, 8, 2 * D, dtype=k.dtype, device=device) for _ in range(2))
    merge_kernel.gather_kv_rows_(fused, k, v, source)
    merge_kernel.gather_kv_rows_eager(eager, k, v, source)
    row = {"check": "merge_kernel", "op": "gather_kv_rows_", "rows": "scattered", "triton": triton,
           "passed": torch.equal(fused, eager)}
    if device.type == "cuda":
        for label, fn in (("fused", merge_kernel.gather_kv_rows_), ("eager", merge_kernel.gather_kv_rows_eager)):
            row[f"{label}_ms"] = median_ms(lambda: fn(fused, k, v, source), device, reps=20, warmup=1)
    ok &= row["passed"]
    emit(row)
    return ok


def run_matmul_peak(dry_run, emit):
    from megatron_ext.testing import matmul_tflops

    device, dtype = device_and_dtype(dry_run)
    peak = matmul_tflops(device, dtype, n=sizes(dry_run)["matmul_n"])
    emit({"check": "matmul_peak", **peak, "tflops": _sig(peak["tflops"]), "ms": round(peak["ms"], 3),
          "spec_tflops": None if dry_run else H200_BF16_SPEC_TFLOPS, "passed": peak["tflops"] > 0})
    return peak["tflops"]


def run_engine(dry_run, backends, emit, peak):
    """The whole engine call at cp=1 (no exchange): error vs fp32 dense, time, kernel share."""
    import torch

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing import median_ms
    from megatron_ext.testing.timing import time_kernels, useful_tflops

    device, dtype = device_and_dtype(dry_run)
    cfg = sizes(dry_run)
    S, (hq, hkv, d) = cfg["time_S"], cfg["time_heads"]
    reps, warmup = cfg["reps"], cfg["warmup"]
    doc_ids = timing_doc_ids(S)
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
    tol = TOL_FP32 if dry_run else TOL_BF16
    ok_all = True
    for backend in backends:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        state = build(backend)
        got = step(state, (q, k, v), w)
        engine_ms = median_ms(lambda: step(state, (q, k, v), w), device, reps, warmup)
        build_ms = median_ms(lambda: build(backend), device, reps, warmup)
        kernel = time_kernels(doc_ids, "contiguous", 1, (backend,), (hq, hkv, d), device, dtype, reps, warmup)
        kernel_ms = kernel["backends"][backend]["fwd_bwd_ms"][0]
        kernel_tflops = useful_tflops(kernel["pairs"][0], hq, d, kernel_ms)
        max_rel = {n: _max_rel(a, r) for n, a, r in zip(("out", "dq", "dk", "dv"), got, ref)}
        report = state.report()
        line = {"check": "engine_cp1", "S": S, "heads": [hq, hkv], "head_dim": d, "backend": backend,
                "resolved": report["attn_backend"], "dtype": str(dtype).replace("torch.", ""),
                "fwd_bwd_ms": round(engine_ms, 3), "kernel_fwd_bwd_ms": round(kernel_ms, 3),
                "build_ms": round(build_ms, 3),
                # what the engine adds around the kernel (packing, index gathers, autograd glue)
                "engine_overhead_fraction": round(max(0.0, engine_ms - kernel_ms) / engine_ms, 4),
                "kernel_fwd_bwd_tflops": _sig(kernel_tflops),
                "kernel_fraction_of_matmul_peak": round(kernel_tflops / peak, 4) if peak else None,
                "max_rel_vs_fp32_dense": _round(max_rel),
                "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                if device.type == "cuda" else None}
        line["passed"] = report["attn_backend"] == backend and all(max_rel[n] < tol[n] for n in max_rel)
        ok_all &= line["passed"]
        emit(line)
    return ok_all


def run_loopback(dry_run, emit, deadline):
    """One rank of cp = 8 per process, its chunks handed over on the device: calls, wall and host ms."""
    import os
    import subprocess
    import sys
    import tempfile

    import torch

    from gpu_model import LOOPBACK_CASES, doc_ids as model_doc_ids

    cfg = sizes(dry_run)
    S = 2048 if dry_run else 131072
    hq, hkv, d = cfg["time_heads"]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for mix, layout, ranks, *relaid in LOOPBACK_CASES:
            relayout = relaid[0] if relaid else "none"
            ids_path = os.path.join(tmp, f"{mix}_{layout}.pt")
            torch.save(model_doc_ids(mix, S, layout, 8), ids_path)
            for rank in ranks:
                where = {"check": "loopback_cp8", "mix": mix, "layout": layout, "rank": rank, "relayout": relayout}
                if time.time() > deadline:
                    emit({**where, "passed": False, "error": "skipped: out of time"})
                    return False
                cmd = [sys.executable, "-m", "megatron_ext.testing.loopback", "--cp", "8", "--rank", str(rank),
                       "--S", str(S), "--ids", ids_path, "--layout", layout, "--exchange", "a2a",
                       "--heads", str(hq), str(hkv), "--head-dim", str(d), "--relayout", relayout] + (
                           ["--device", "cpu"] if dry_run else [])
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      timeout=max(30.0, min(180.0, deadline - time.time())))
                if proc.returncode:
                    emit({**where, "passed": False, "error": proc.stderr[-2000:]})
                    ok = False
                    continue
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                line = {**where, "S": S, "documents": "gpu_model.doc_ids", **got,
                        **{k: round(got[k], 3) for k in ("fwd_bwd_ms", "host_ms", "first_fwd_bwd_ms", "first_host_ms",
                                                         "kernel_fwd_ms", "kernel_bwd_ms")}}
                line["passed"] = got["syncs"] == [0, 0]
                ok &= line["passed"]
                emit(line)
    return ok


def run_kernel_timing(dry_run, backends, emit, deadline, peak):
    from megatron_ext.testing.timing import time_kernels, useful_tflops

    device, dtype = device_and_dtype(dry_run)
    cfg = sizes(dry_run)
    S, (hq, hkv, d) = cfg["time_S"], cfg["time_heads"]
    doc_ids = timing_doc_ids(S)
    docs = int((doc_ids.diff() != 0).sum()) + 1
    tol = (TOL_FP32 if dry_run else TOL_BF16)["out"]
    ok_all = True
    for cp in (1, 2, 4):
        for layout in (("contiguous",) if cp == 1 else LAYOUTS):
            if time.time() > deadline:
                emit({"check": "timing", "cp": cp, "layout": layout, "passed": False,
                      "error": "skipped: out of time"})
                return False
            timed = time_kernels(doc_ids, layout, cp, backends, (hq, hkv, d), device, dtype,
                                 cfg["reps"], cfg["warmup"])
            pairs = timed["pairs"]
            line = {"check": "timing", "cp": cp, "layout": layout, "S": S, "docs": docs,
                    "heads": [hq, hkv], "head_dim": d, "dtype": str(dtype).replace("torch.", ""),
                    "pairs_per_rank": pairs, "kernels": {}}
            for backend, t in timed["backends"].items():
                slowest = max(t["fwd_ms"])
                fwd_tflops = useful_tflops(max(pairs), hq, d, slowest, fwd_bwd=False)
                line["kernels"][backend] = {
                    "fwd_ms_per_rank": [round(x, 3) for x in t["fwd_ms"]],
                    "fwd_bwd_ms_per_rank": [round(x, 3) for x in t["fwd_bwd_ms"]],
                    "fwd_ms_max_rank": round(slowest, 3),
                    "fwd_bwd_ms_max_rank": round(max(t["fwd_bwd_ms"]), 3),
                    # useful work of the busiest rank over the slowest rank's time
                    "fwd_tflops_effective": _sig(fwd_tflops) if slowest > 0 else None,
                    "fwd_fraction_of_matmul_peak": round(fwd_tflops / peak, 4) if slowest > 0 and peak else None}
            diff = timed["max_rel_diff_vs_dense"]
            line["max_rel_diff_vs_dense"] = float(f"{diff:.3e}") if diff is not None else None
            line["passed"] = diff is None or diff < 2 * tol
            ok_all &= line["passed"]
            emit(line)
    return ok_all


# ---------------------------------------------------------------------------
# the suite
# ---------------------------------------------------------------------------


def env_check(dry_run):
    import torch

    from megatron_ext.testing.isolation import megatron_installed, megatron_modules

    before = megatron_modules()
    import megatron_ext.blockdiag_cp  # noqa: F401 - the engine path must not need megatron
    from megatron_ext.blockdiag_cp import kernels

    pulled = sorted(megatron_modules() - before)
    te_ok, te_reason = kernels.installed("te")
    line = {"check": "env", "dry_run": dry_run, "python": platform.python_version(),
            "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "flash_impl": kernels.flash_impl_name(), "te_importable": te_ok, "te_reason": te_reason,
            "megatron_core_installed": megatron_installed(),
            "engine_imported_megatron": pulled, "approach": APPROACH}
    line["passed"] = not pulled and (dry_run or torch.cuda.is_available())
    return line


def run(dry_run=False, budget_s=420.0, skip=(), block_megatron=False, log=print):
    """Every check as one row (``suite`` = gpu_check, ``check`` = its name, ``passed``)."""
    from megatron_ext.testing.isolation import block_megatron as _block

    if block_megatron:
        _block()
    t0 = time.time()
    deadline = t0 + budget_s
    rows = []

    def emit(line):
        line = {"suite": "gpu_check", **line}
        line.setdefault("dry_run", dry_run)
        line["t_s"] = round(time.time() - t0, 1)
        print(json.dumps(line, sort_keys=False), flush=True)
        rows.append(line)

    results = {}
    env = env_check(dry_run)
    emit(env)
    results["env"] = env["passed"]
    if not env["passed"]:
        emit({"check": "summary", "passed": False, "failed": ["env"], "wall_s": round(time.time() - t0, 1)})
        return rows
    with check_backends(dry_run) as backends:
        if "te" not in backends:
            emit({"check": "te", "status": "not_run", "passed": True,
                  "reason": f"transformer_engine not importable ({env['te_reason']}); te was NOT checked"})
        peak = {}
        checks = (("matmul_peak", lambda: peak.setdefault("tflops", run_matmul_peak(dry_run, emit)) > 0),
                  ("accuracy_cp2", lambda: run_accuracy(2, dry_run, emit, deadline)),
                  ("accuracy_cp4", lambda: run_accuracy(4, dry_run, emit, deadline)),
                  ("flash_calls", lambda: run_flash_calls(dry_run, emit, deadline)),
                  ("dropin_paths", lambda: run_dropin_paths(dry_run, backends, emit)),
                  ("thd_indices", lambda: run_thd_indices(emit) if not dry_run else True),
                  ("merge_kernel", lambda: run_merge_kernel(dry_run, emit)),
                  ("engine", lambda: run_engine(dry_run, backends, emit, peak.get("tflops"))),
                  ("memory", lambda: run_memory(dry_run, backends, emit, deadline)),
                  ("loopback_cp8", lambda: run_loopback(dry_run, emit, deadline)),
                  ("timing", lambda: run_kernel_timing(dry_run, backends, emit, deadline, peak.get("tflops"))))
        for name, fn in checks:
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
          "te_checked": "te" in backends,
          "wall_s": round(time.time() - t0, 1)})
    log(f"  gpu_check: {'passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return rows
