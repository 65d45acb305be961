"""torch_cp_flex: this engine beside torch's flex-attention context parallelism on packed short documents.

    python scripts/bench/torch_cp_flex.py --S 8192,16384 --out bench/results.jsonl

The short mix (``megatron_ext.testing.mixes``, every document cut down to a multiple of 2 * cp tokens,
the tokens left over ending the sequence as padding), cp = 2, fp32, b = 1, 8 heads x 64, forward only:

* torch: its module-wrapper CP for flex attention (torch.distributed.tensor.experimental.
  _context_parallel): ``_PerDocumentHeadTailLoadBalancer`` (each document's 2 * cp chunks in head-tail
  order, document after document; ``_context_parallel_shard`` then hands rank r the r-th contiguous
  part of that order), ``_context_parallel_shard`` of q / k / v, ``_create_cp_block_mask``
  of the document-causal ``mask_mod``, and ``parallelize_module(..., _ContextParallel(seq_dim=2,
  attention_type=FLEX))`` around ``torch.compile(flex_attention)``: it all-gathers K and V
  (``flex_cp_allgather``) and runs the fused flex kernel over the local queries' blocks;
* ours: ``BlockDiagCPState.build(ids, layout=thd | balanced, kv_exchange="a2a", attn_backend="dense")``
  and ``blockdiag_cp_attention``. ``thd`` is TE's partition (rank r holds chunks r and 2 * cp - 1 - r
  of every document); torch's rows differ (``same_rows``), so the outputs are compared at global
  positions.

Forward only: flex attention has no backward on CPU (torch's error is kept in each row's
``torch_backward``).

Method: one pool of two gloo processes (one thread each); per S, after one warm-up of each (the
first flex call compiles), the implementations alternate iteration by iteration; an iteration's
time is the slowest rank's (a MAX all-reduce of each rank's wall time after a barrier); seconds =
median. Before timing, both outputs are gathered to global positions and compared.
"""

import argparse
import statistics
import sys
import time
from typing import Dict, List, Sequence

HEADS, DIM, CP = 8, 64, 2
LAYOUTS = ("thd", "balanced")
METHOD = ("one pool of two gloo processes (cp 2, 1 thread each); per S one warm-up of each (flex compiles), "
          "then ours and torch alternated per iteration; iteration = slowest rank's forward wall time; "
          "seconds = median; torch = _ContextParallel(FLEX) around torch.compile(flex_attention), "
          "per-document head-tail load balance")


def short_ids(S: int, cp: int = CP):
    """The short mix with every document cut down to a multiple of 2 * cp tokens (torch's per-document
    balancer and THD need it; shorter ones dropped), the rest padding (id 0) at the end."""
    import torch

    from megatron_ext.testing.mixes import make_doc_ids

    _, lengths = torch.unique_consecutive(make_doc_ids("short", S), return_counts=True)
    kept = [n - n % (2 * cp) for n in lengths.tolist() if n >= 2 * cp]
    ids = torch.repeat_interleave(torch.arange(1, len(kept) + 1), torch.tensor(kept))
    return torch.nn.functional.pad(ids, (0, S - ids.numel()))


def _probe_backward(attention, mesh, S: int = 512) -> str:
    """torch's flex CP forward + backward on one causal document of ``S`` (small: a failed grad-mode
    call may leave its full score matrix behind): "ran", or the error it raised."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _context_parallel_shard, _create_cp_block_mask)
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    balancer = _HeadTailLoadBalancer(S, CP, "cpu")
    block_mask = _create_cp_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, HEADS, S, S, mesh, balancer)
    q, k, v = (t.requires_grad_() for t in _context_parallel_shard(
        mesh, [torch.randn(1, HEADS, S, DIM) for _ in range(3)], [2, 2, 2], balancer))
    try:
        attention(q, k, v, block_mask=block_mask).sum().backward()
        return "ran"
    except Exception as exc:  # noqa: BLE001 - the point is to record it
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def compare(sizes: Sequence[int], layouts: Sequence[str], reps: int) -> List[Dict]:
    """On each rank of a pool of 2: per S, torch's flex CP forward and ours per layout (rank 0's list)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _ContextParallel, _context_parallel_shard, _create_cp_block_mask)
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _PerDocumentHeadTailLoadBalancer)
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import flex_attention

    import megatron_ext.blockdiag_cp as bdcp
    from torch_cp import _to_global  # this folder: on the path of the script, run_all and the pool's workers

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (CP,))
    flex = torch.compile(flex_attention, dynamic=False)

    class Attention(nn.Module):
        def forward(self, q, k, v, block_mask):
            return flex(q, k, v, block_mask=block_mask)

    attention = parallelize_module(Attention(), mesh, _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    rows = []
    for S in sizes:
        ids = short_ids(S)
        _, lengths = torch.unique_consecutive(ids, return_counts=True)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, HEADS, S, DIM, generator=g) for _ in range(3))  # [b, h, S, d]

        def mask_mod(b, h, q_idx, kv_idx):  # document-causal; padding attends nothing
            return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx) & (ids[q_idx] != 0)

        balancer = _PerDocumentHeadTailLoadBalancer([lengths.tolist()], CP, "cpu")
        t0 = time.perf_counter()
        block_mask = _create_cp_block_mask(mask_mod, 1, HEADS, S, S, mesh, balancer)
        tq, tk, tv = _context_parallel_shard(mesh, [q, k, v], [2, 2, 2], balancer)
        mask_s = time.perf_counter() - t0
        torch_rows = balancer._generate_indices()[0].view(CP, S // CP)[rank]  # global position of each row

        def run_torch():
            with torch.no_grad():
                return attention(tq, tk, tv, block_mask=block_mask)

        t0 = time.perf_counter()
        torch_out = run_torch()
        compile_s = time.perf_counter() - t0
        reference = _to_global(torch_out[0].transpose(0, 1).contiguous(), torch_rows, S)  # [S, h, d]
        for layout in layouts:
            state = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange="a2a", attn_backend="dense")
            oq, ok, ov = (state.shard(t[0].transpose(0, 1).unsqueeze(1)) for t in (q, k, v))  # [s_local, 1, h, d]

            def run_ours():
                with torch.no_grad(), bdcp.blockdiag_cp_step(state):
                    return bdcp.blockdiag_cp_attention(oq, ok, ov)

            ours = _to_global(run_ours()[:, 0], state.local_positions.long(), S)
            diff = float((ours - reference).abs().max() / reference.abs().max())
            times = {"ours": [], "torch": []}
            for _ in range(reps):
                for name, fn in (("ours", run_ours), ("torch", run_torch)):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    t = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    times[name].append(float(t))
            rows.append({"S": S, "layout": layout, "exchange": state.kv_exchange, "docs": int((lengths > 0).sum()),
                         "same_rows": bool(torch.equal(state.local_positions.long(), torch_rows)),
                         "seconds": statistics.median(times["ours"]), "seconds_torch": statistics.median(times["torch"]),
                         "seconds_reps": times["ours"], "seconds_torch_reps": times["torch"],
                         "max_rel_diff": diff, "torch_mask_s": mask_s, "torch_first_call_s": compile_s})
    # last: a compile that fails in grad mode leaves torch.compile running flex eagerly from then on
    backward = _probe_backward(attention, mesh)
    return [{**r, "torch_backward": backward} for r in rows]


def run(sizes=(8192, 16384), layouts=LAYOUTS, reps=3, log=print) -> List[Dict]:
    """Rows of suite torch_cp_flex, one per S x layout."""
    import torch

    from megatron_ext.testing import WorkerPool

    with WorkerPool(CP, timeout=1800) as pool:
        got = pool.run(compare, tuple(sizes), tuple(layouts), reps)[0]
    rows = []
    for r in got:
        log(f"torch_cp_flex S={r['S']} {r['layout']}: ours {r['seconds']:.3f}s torch flex {r['seconds_torch']:.3f}s "
            f"(max rel diff {r['max_rel_diff']:.1e})")
        rows.append({"suite": "torch_cp_flex", "cp": CP, "mix": "short", "causal": True, "dtype": "float32",
                     "heads": HEADS, "head_dim": DIM, "b": 1, "backend": "dense", "phase": "forward",
                     "torch_balancer": "per-document head-tail", "torch_kernel": "flex_attention (torch.compile, CPU)",
                     **r, "ratio_ours_over_torch": r["seconds"] / r["seconds_torch"], "reps": reps,
                     "torch_version": torch.__version__, "method": METHOD})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--S", default="8192,16384", help="comma list of sequence lengths (multiples of 256)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rows = run(tuple(int(s) for s in args.S.split(",")), reps=args.reps)
    from summary import append

    append(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
