"""torch_cp: this engine beside torch's own context parallelism (ring attention), CPU, gloo.

    python scripts/bench/torch_cp.py --S 8192,16384 --out bench/results.jsonl

One long causal document, cp = 2, fp32, b = 1, 8 heads x 64, forward + backward per iteration:

* ours: ``BlockDiagCPState.build(one document, layout="zigzag", kv_exchange=a2a | allgather,
  attn_backend="dense")`` and ``blockdiag_cp_attention`` on ``[s_local, 1, 8, 64]``;
* torch: its ring attention ``_templated_ring_attention`` / ``_templated_ring_attention_backward``
  (torch.distributed.tensor.experimental._context_parallel) with its head-tail load balancing
  (``_HeadTailLoadBalancer``, enable_load_balance on) and its rotaters (``set_rotate_method``
  "alltoall" | "allgather"; its backward always sends dK/dV with all-to-all), on ``[1, 8, s_local, 64]``
  with the CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward).

Why torch's ring functions are called directly: the public ``context_parallel`` context patches
``F.scaled_dot_product_attention`` and routes only the CUDA SDPA kernels (flash, efficient, cuDNN)
to the ring; on CPU SDPA picks ``_scaled_dot_product_flash_attention_for_cpu``, which its CP
dispatcher does not map: on torch 2.13 CPU, fwd+bwd under ``context_parallel`` raises
``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not
have a sharding strategy registered.`` (``probe_public_api`` runs it; each row's ``public_api`` keeps
what it said). The wrapper here is the same
autograd pairing the DTensor handler does: forward ring returns (out, logsumexp), backward ring
takes them.

Method: per round one fresh pair of gloo processes (one thread each) runs both implementations,
alternating iteration by iteration (ours, torch, ours, torch, ...) after one warm-up iteration each,
so drift of a shared machine hits both alike; an iteration's time is the slowest rank's (a MAX
all-reduce of each rank's wall time after a barrier). Both implementations live in the same torch
install, so unlike layer_ab (two checkouts) nothing forces separate processes per engine; a
fresh pair per round keeps rounds independent. Before timing, each pair checks that both give the
same output and dQ/dK/dV (fp32, gathered to global positions) on the same inputs.
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
EXCHANGES = ("a2a", "allgather")
TORCH_ROTATE = {"a2a": "alltoall", "allgather": "allgather"}
HEADS, DIM = 8, 64
METHOD = ("one fresh gloo process pair per round (cp 2, 1 thread each) running both implementations, "
          "alternated per iteration after a warm-up each; iteration = slowest rank's fwd+bwd wall time; "
          "seconds = median over rounds of per-round medians; torch = _templated_ring_attention(+_backward) "
          "with head-tail load balance and the CPU flash kernel, called directly (the public "
          "context_parallel maps only CUDA SDPA kernels)")


def head_tail_positions(S: int, cp: int, rank: int):
    """torch's _HeadTailLoadBalancer: 2 cp chunks, rank r holds chunk r then chunk 2 cp - 1 - r."""
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    idx = _HeadTailLoadBalancer(S, cp, "cpu")._generate_indices()[0]
    return idx.view(cp, S // cp)[rank].long()


def make_torch_ring(group):
    """An autograd function running torch's ring attention forward and backward (causal)."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention as tcp

    aten = torch.ops.aten

    class TorchRing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = tcp._templated_ring_attention(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v,
                is_causal=True, dropout_p=0.0)[:2]
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = tcp._templated_ring_attention_backward(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                grad_out=dout.contiguous(), grad_out_name="grad_out", query=q, key=k, value=v, out=out,
                logsumexp=lse, is_causal=True, dropout_p=0.0)[:3]
            return dq, dk, dv

    return TorchRing.apply


def set_torch_cp(rotate: str) -> None:
    from torch.distributed.tensor.experimental._context_parallel import _attention as tcp

    tcp._cp_options.enable_load_balance = True  # head-tail: what context_parallel does for causal SDPA
    tcp.set_rotate_method(rotate)


def probe_public_api(S: int = 64) -> str:
    """Run torch's public context_parallel on this CPU build (fwd+bwd); return 'ok' or the error."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, S, DIM, generator=g) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))  # buffers are resized back on exit
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            out.sum().backward()
        return f"ran: output {type(out).__name__} {tuple(out.shape)} (not the ring: no CP op on CPU)"
    except Exception as e:  # noqa: BLE001 - the point is to record it
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _inputs(S: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn(S, 1, HEADS, DIM, generator=g) for _ in range(4)]  # q, k, v, dout (global, [S,b,h,d])


def _to_global(local, pos, S):
    """[s_local, ...] rows at global positions pos -> [S, ...], summed over ranks."""
    import torch.distributed as dist

    full = local.new_zeros((S,) + tuple(local.shape[1:]))
    full.index_copy_(0, pos, local)
    dist.all_reduce(full)
    return full


def _worker(rank, port, sizes, exchanges, reps, check, probe, queue):
    import logging

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import megatron_ext.blockdiag_cp as bdcp

    logging.getLogger("megatron_ext.blockdiag_cp").setLevel(logging.ERROR)
    group = dist.group.WORLD
    ring = make_torch_ring(group)
    result = {"public_api": probe_public_api() if probe else None, "runs": []}
    for S in sizes:
        ids = torch.ones(S, dtype=torch.long)  # one document (id 0 is padding)
        for exchange in exchanges:
            state = bdcp.BlockDiagCPState.build(ids, layout="zigzag", kv_exchange=exchange, attn_backend="dense")
            ours_pos = state.local_positions.long()
            torch_pos = head_tail_positions(S, 2, rank)
            q, k, v, dout = _inputs(S)
            oq, ok, ov, od = (state.shard(t) for t in (q, k, v, dout))  # [s_local, 1, h, d]
            # torch's layout [b, h, s_local, d], its own head-tail rows
            tq, tk, tv, td = (t.index_select(0, torch_pos).permute(1, 2, 0, 3).contiguous() for t in (q, k, v, dout))
            for t in (oq, ok, ov, tq, tk, tv):
                t.requires_grad_()

            def run_ours():
                with bdcp.blockdiag_cp_step(state):
                    out = bdcp.blockdiag_cp_attention(oq, ok, ov)
                out.backward(od)
                return out

            def run_torch():
                set_torch_cp(TORCH_ROTATE[exchange])
                out = ring(tq, tk, tv)
                out.backward(td)
                return out

            def clear():
                for t in (oq, ok, ov, tq, tk, tv):
                    t.grad = None

            row = {"S": S, "exchange": exchange, "torch_rotate": TORCH_ROTATE[exchange],
                   "same_rows": bool(torch.equal(ours_pos, torch_pos))}
            if check:  # both on the same inputs, gathered to global positions
                clear()
                outs = {"ours": run_ours(), "torch": run_torch()}
                got = {"ours": [outs["ours"]] + [t.grad for t in (oq, ok, ov)],
                       "torch": [t.permute(2, 0, 1, 3) for t in [outs["torch"]] + [x.grad for x in (tq, tk, tv)]]}
                g_ours = [_to_global(t.detach().reshape(-1, 1, HEADS, DIM), ours_pos, S) for t in got["ours"]]
                g_torch = [_to_global(t.detach().reshape(-1, 1, HEADS, DIM), torch_pos, S) for t in got["torch"]]
                diffs = {}
                for name, a, b in zip(("out", "dq", "dk", "dv"), g_ours, g_torch):
                    diffs[name] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                row["max_rel_diff"] = diffs
                if S <= 4096:  # and both against one unsharded causal SDPA (fp64), cheap at small S
                    qq, kk, vv = (t.double().permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v))
                    ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
                    ref.backward(dout.double().permute(1, 2, 0, 3))
                    refs = [t.permute(2, 0, 1, 3).float() for t in (ref.detach(), qq.grad, kk.grad, vv.grad)]
                    row["max_rel_diff_ref"] = {
                        impl: max(float((a - r).abs().max() / r.abs().max()) for a, r in zip(gl, refs))
                        for impl, gl in (("ours", g_ours), ("torch", g_torch))}
            times = {"ours": [], "torch": []}
            for it in range(reps + 1):  # the first is the warm-up of each
                for name, fn in (("ours", run_ours), ("torch", run_torch)):
                    clear()
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    t = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    if it:
                        times[name].append(float(t))
            row["seconds"] = statistics.median(times["ours"])
            row["seconds_torch"] = statistics.median(times["torch"])
            row["seconds_reps"], row["seconds_torch_reps"] = times["ours"], times["torch"]
            result["runs"].append(row)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def _spawn(sizes, exchanges, reps, check, probe):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, sizes, exchanges, reps, check, probe, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    import queue as queue_mod

    result = None
    while result is None:  # a worker that dies leaves nothing in the queue: stop instead of waiting
        try:
            result = queue.get(timeout=5)
        except queue_mod.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit("torch_cp: a worker failed")
    for p in procs:
        p.join()
    print(json.dumps(result))


def one_round(sizes, exchanges, reps, check=True, probe=False, timeout=3600) -> dict:
    """One fresh process pair: {"public_api": str | None, "runs": [per S x exchange dict]}."""
    code = (f"import sys; sys.path.insert(0, {REPO!r}); sys.path.insert(1, {HERE!r}); import torch_cp; "
            f"torch_cp._spawn({list(sizes)!r}, {list(exchanges)!r}, {reps}, {check}, {probe})")
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"torch_cp round failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def run(sizes=(8192, 16384), exchanges=EXCHANGES, reps=3, rounds=1, log=print) -> list:
    """Rows of suite torch_cp, one per S x exchange."""
    rounds_out = []
    for r in range(rounds):
        rounds_out.append(one_round(sizes, exchanges, reps, check=(r == 0), probe=(r == 0)))
        for run_ in rounds_out[-1]["runs"]:
            log(f"round {r} S={run_['S']} {run_['exchange']}: ours {run_['seconds']:.3f}s "
                f"torch {run_['seconds_torch']:.3f}s")
    import torch

    public = rounds_out[0]["public_api"]
    rows = []
    for i, first in enumerate(rounds_out[0]["runs"]):
        mine = [ro["runs"][i]["seconds"] for ro in rounds_out]
        other = [ro["runs"][i]["seconds_torch"] for ro in rounds_out]
        ours_s, torch_s = statistics.median(mine), statistics.median(other)
        rows.append({"suite": "torch_cp", "S": first["S"], "cp": 2, "docs": 1, "causal": True, "dtype": "float32",
                     "heads": HEADS, "head_dim": DIM, "b": 1, "layout": "zigzag", "exchange": first["exchange"],
                     "backend": "dense", "torch_rotate": first["torch_rotate"], "torch_balancer": "head-tail",
                     "torch_kernel": "_scaled_dot_product_flash_attention_for_cpu", "same_rows": first["same_rows"],
                     "seconds": ours_s, "seconds_torch": torch_s, "ratio_ours_over_torch": ours_s / torch_s,
                     "seconds_rounds": mine, "seconds_torch_rounds": other,
                     "seconds_reps": [ro["runs"][i]["seconds_reps"] for ro in rounds_out],
                     "seconds_torch_reps": [ro["runs"][i]["seconds_torch_reps"] for ro in rounds_out],
                     "reps": len(first["seconds_reps"]), "rounds": rounds,
                     "max_rel_diff": first.get("max_rel_diff"), "max_rel_diff_ref": first.get("max_rel_diff_ref"),
                     "public_api": public, "torch_version": torch.__version__, "method": METHOD})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--S", default="8192,16384", help="comma list of sequence lengths (multiples of 4)")
    p.add_argument("--exchanges", default=",".join(EXCHANGES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rows = run(tuple(int(s) for s in args.S.split(",")), tuple(args.exchanges.split(",")), args.reps, args.rounds)
    from summary import append

    append(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
