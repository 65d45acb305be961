"""``testing.loopback``: one CP rank's real plan in one process (torch's fake process group, chunks handed
over on the rank's device). Rank r's out and dq equal the fp64 reference on its positions (they depend
on r's work alone), and its kernel calls and launching ops per layer call (the send buffers it gathers included) equal those of
the same rank in a gloo group."""

import pytest
import torch

from megatron_ext.testing import pool_fixture, reference_attention, runs_to_doc_ids


def _ids(S: int = 192) -> torch.Tensor:
    runs = [(i + 1, 7 + (5 * i) % 11) for i in range(9)]
    return runs_to_doc_ids(runs + [(99, S - sum(n for _, n in runs))])


def loopback_rank(rank, cp, layout, exchange):
    """In a process of its own (a pool worker with its gloo group torn down): rank r through the loopback."""
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing.loopback import loopback_state
    from megatron_ext.testing.op_counter import layer_calls

    if dist.is_initialized():  # the pool's gloo group: this process becomes rank r of cp alone
        dist.destroy_process_group()
    ids = _ids()
    g = torch.Generator().manual_seed(2)
    q, k, v, w = (torch.randn(ids.numel(), 1, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    (reference_attention(*ref, ids) * w).sum().backward()
    out_ref = reference_attention(q, k, v, ids)
    state, ql, kl, vl = loopback_state(ids, rank, cp, q, k, v, layout=layout, kv_exchange=exchange,
                                       attn_backend="dense")
    try:
        leaves = [t.detach().requires_grad_() for t in (ql, kl, vl)]
        with bdcp.blockdiag_cp_step(state):
            out = bdcp.blockdiag_cp_attention(*leaves)
            (out * state.shard(w)).sum().backward()
        calls = [(f.kernel_calls, b.kernel_calls, f.launching, b.launching, f.sends + f.receives)
                 for f, b in layer_calls(state, ql, kl, vl, layers=2)]
        errors = [float((out - state.shard(out_ref)).abs().max()), float((leaves[0].grad - state.shard(ref[0].grad)).abs().max())]
        return {"errors": errors, "calls": calls[1], "exchange": state.kv_exchange}
    finally:
        dist.destroy_process_group()


def gloo_calls(layout, exchange):
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing.op_counter import layer_calls

    ids = _ids()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(ids.numel(), 1, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    state = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange=exchange, attn_backend="dense")
    f, b = layer_calls(state, *(state.shard(t) for t in (q, k, v)), layers=2)[1]
    return f.kernel_calls, b.kernel_calls, f.launching, b.launching


pool4 = pool_fixture(4)
pool1 = pool_fixture(1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,exchange", [("zigzag", "a2a"), ("balanced", "allgather"), ("contiguous", "halo")])
def test_loopback_rank_matches_the_reference_and_the_gloo_run(pool4, pool1, layout, exchange):
    expected = pool4.run(gloo_calls, layout, exchange)
    for rank in (0, 3):
        got, = pool1.run(loopback_rank, rank, 4, layout, exchange)
        assert got["exchange"] == exchange
        assert max(got["errors"]) < 1e-12, (rank, got)
        assert got["calls"][:4] == expected[rank], (rank, got, expected)  # the same ops, send gathers included
        assert got["calls"][4] == 0  # nothing crossed a process: the chunks were handed over
