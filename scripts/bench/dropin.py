"""dropin suite: what Megatron's own data paths and the per-call agreement cost, side by side.

On a cp-process gloo group (one thread per rank), short-document mix, 8 heads, head
dim 64, fp32, per configuration the slowest rank's median over ``reps`` (after a
barrier each):

- ``mask_derive``: documents from Megatron's mask ([1, 1, S/cp, S] bool, rows in
  zigzag order, as ``get_batch_on_this_cp_rank`` leaves them): the per-row check,
  the all-gather of starts and the doc ids (``MegatronMaskSource``), once per step;
- ``mask_state``: the whole mask-mode build (derive + agreement + layout + plan);
- ``layer_fwd_bwd``: one attention layer forward + backward with that state
  (dense kernel, a2a exchange), what the derivation is compared against;
- ``qkv_agreement``: the per-forward-call all-reduce of the q/k/v signature.
"""

import statistics
import time
from typing import List

import torch

HEADS, HEAD_DIM = 8, 64


def _mask_rows(doc_ids: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's rows of Megatron's reset-attention mask (True = masked out), [1, 1, S/cp, S]."""
    from megatron_ext.blockdiag_cp.layouts import document_starts
    from megatron_ext.blockdiag_cp.resolve import _zigzag_rows

    S = doc_ids.numel()
    rows = _zigzag_rows(S, cp, rank)
    starts = document_starts(doc_ids.view(1, -1))[0, rows]
    keys = torch.arange(S)
    return ((keys < starts[:, None]) | (keys > rows[:, None])).view(1, 1, -1, S)


def _timed(fn, reps: int) -> List[float]:
    import torch.distributed as dist

    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure(S: int, reps: int, seed: int):
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp.attention_op import agree_on_qkv
    from megatron_ext.blockdiag_cp.resolve import MegatronMaskSource
    from megatron_ext.testing.mixes import make_doc_ids

    torch.set_num_threads(1)
    group, cp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    doc_ids = make_doc_ids("short", S, seed=seed)
    mask = _mask_rows(doc_ids, cp, rank)
    bdcp.configure_cp_varlen("dense", "a2a")

    def derive():
        source = MegatronMaskSource(mask, cp, rank, batch=1)
        source.local_facts()
        source.doc_ids(group, cp, rank)

    def state():
        return bdcp.BlockDiagCPState.from_source(MegatronMaskSource(mask, cp, rank, batch=1), cp_group=group)

    st = state()
    g = torch.Generator().manual_seed(seed + rank)
    q = torch.randn(st.local_len, 1, HEADS, HEAD_DIM, generator=g, requires_grad=True)
    k = torch.randn(st.local_len, 1, HEADS, HEAD_DIM, generator=g, requires_grad=True)
    v = torch.randn(st.local_len, 1, HEADS, HEAD_DIM, generator=g, requires_grad=True)

    def layer():
        bdcp.blockdiag_cp_attention(q, k, v, state=st).sum().backward()

    def agreement():
        agree_on_qkv(st, q, k, v, None)

    out = {}
    for name, fn, n in (("mask_derive", derive, reps), ("mask_state", state, reps),
                        ("layer_fwd_bwd", layer, reps), ("qkv_agreement", agreement, 20 * reps)):
        fn()  # warm-up
        out[name] = _timed(fn, n)
    bdcp.configure_cp_varlen()
    return out


def run(cp: int = 4, seq_lens=(32768,), reps: int = 3, log=print):
    from megatron_ext.testing import WorkerPool

    rows = []
    pool = WorkerPool(cp)
    try:
        for S in seq_lens:
            log(f"dropin: S={S} cp={cp}")
            per_rank = pool.run(measure, S, reps, 7, timeout=1800)
            for name in per_rank[0]:
                # The slowest rank of each repetition, then the median over repetitions.
                samples = [max(r[name][i] for r in per_rank) for i in range(len(per_rank[0][name]))]
                rows.append({"suite": "dropin", "mix": "short", "S": S, "cp": cp, "layout": "zigzag",
                             "exchange": "a2a", "backend": "dense", "measure": name,
                             "median_seconds": statistics.median(samples), "samples": samples})
    finally:
        pool.close()
    layer = next(r["median_seconds"] for r in rows if r["measure"] == "layer_fwd_bwd")
    for r in rows:
        r["over_layer_fwd_bwd"] = r["median_seconds"] / layer
    return rows
