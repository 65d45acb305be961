"""``testing.loopback``: one CP rank's real plan in one process (torch's fake process group, chunks handed
over on the rank's device). Rank r's out and dq equal the fp64 reference on its positions (they depend
on r's work alone), and its kernel calls and launching ops per layer call (the send buffers it gathers included) equal those of
the same rank in a gloo group."""

import contextlib
import os

import pytest
import torch

from megatron_ext.testing import pool_fixture, reference_attention, runs_to_doc_ids


def _ids(S: int = 192) -> torch.Tensor:
    runs = [(i + 1, 7 + (5 * i) % 11) for i in range(9)]
    return runs_to_doc_ids(runs + [(99, S - sum(n for _, n in runs))])


@contextlib.contextmanager
def band_pieces(min_piece):
    """The band mode's (rows, documents) a piece for this block (None: the defaults)."""
    from megatron_ext.blockdiag_cp import step_tables as tables_module

    saved = tables_module.BAND_MIN_PIECE_ROWS, tables_module.BAND_MIN_DOCS_PER_PIECE
    tables_module.BAND_MIN_PIECE_ROWS, tables_module.BAND_MIN_DOCS_PER_PIECE = min_piece or saved
    try:
        yield
    finally:
        tables_module.BAND_MIN_PIECE_ROWS, tables_module.BAND_MIN_DOCS_PER_PIECE = saved


def loopback_rank(rank, cp, layout, exchange, kv_backward="auto", min_piece=None):
    """In a process of its own (a pool worker with its gloo group torn down): rank r through the loopback."""
    with band_pieces(min_piece):
        return _loopback_rank(rank, cp, layout, exchange, kv_backward)


def _loopback_rank(rank, cp, layout, exchange, kv_backward):
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
                                       attn_backend="dense", kv_backward=kv_backward)
    try:
        leaves = [t.detach().requires_grad_() for t in (ql, kl, vl)]
        with bdcp.blockdiag_cp_step(state):
            out = bdcp.blockdiag_cp_attention(*leaves)
            (out * state.shard(w)).sum().backward()
        calls = [(f.kernel_calls, b.kernel_calls, f.launching, b.launching, f.sends + f.receives)
                 for f, b in layer_calls(state, ql, kl, vl, layers=2)]
        errors = [float((out - state.shard(out_ref)).abs().max()), float((leaves[0].grad - state.shard(ref[0].grad)).abs().max())]
        return {"errors": errors, "calls": calls[1], "exchange": state.kv_exchange, "whole": state.needed_whole(),
                "steps": len(state.stream_plan("needed").steps)}
    finally:
        dist.destroy_process_group()


def gloo_calls(layout, exchange, relayout="none", kv_backward="auto", min_piece=None):
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing.op_counter import layer_calls

    ids = _ids()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(ids.numel(), 1, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    with band_pieces(min_piece):
        state = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange=exchange, attn_backend="dense",
                                            relayout=relayout, kv_backward=kv_backward)
        f, b = layer_calls(state, *(state.shard(t) for t in (q, k, v)), layers=2)[1]
    return f.kernel_calls, b.kernel_calls, f.launching, b.launching


pool4 = pool_fixture(4)
pool1 = pool_fixture(1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,exchange,kv_backward,min_piece", [
    ("zigzag", "a2a", "auto", None), ("balanced", "allgather", "auto", None), ("contiguous", "halo", "auto", None),
    ("zigzag", "a2a", "save", None), ("zigzag", "a2a", "save", (1, 0))])
def test_loopback_rank_matches_the_reference_and_the_gloo_run(pool4, pool1, layout, exchange, kv_backward, min_piece):
    """Ranks 0 and 3 through the loopback: the reference's out and dq, the gloo run's kernel calls and launching
    ops, nothing sent. zigzag / a2a with the received K/V kept takes the band mode,
    in one step, or with one row a piece (any document) in groups of pieces."""
    expected = pool4.run(gloo_calls, layout, exchange, "none", kv_backward, min_piece)
    for rank in (0, 3):
        got, = pool1.run(loopback_rank, rank, 4, layout, exchange, kv_backward, min_piece)
        assert got["exchange"] == exchange and got["whole"] == (kv_backward == "save"), (rank, got)
        assert not got["whole"] or (got["steps"] == 2) == (min_piece is None), (rank, got)
        assert max(got["errors"]) < 1e-12, (rank, got)
        assert got["calls"][:4] == expected[rank], (rank, got, expected)  # the same ops, send gathers included
        assert got["calls"][4] == 0  # nothing crossed a process: the chunks were handed over


def relaid_loopback_rank(rank, cp):
    """Rank r through the loopback with relayout "balanced" (timing only), in a process of its own."""
    import torch.distributed as dist

    from megatron_ext.testing.loopback import run_rank

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.pop("LOCAL_WORLD_SIZE", None)  # the pool's 1; the loopback's own process has none
    return run_rank(_ids(), rank, cp, heads=(4, 2), head_dim=8, layers=2, dtype=torch.float64, reps=1,
                    layout="zigzag", kv_exchange="a2a", attn_backend="dense", relayout="balanced")


@pytest.mark.timeout(240)
def test_relaid_loopback_rank_makes_the_gloo_ranks_calls(pool4, pool1):
    # The rows' all-to-alls and the balanced layout's exchange post through the fake group, so the values
    # are not rank r's; its kernel calls and launching ops are, balanced searched as on one node of cp.
    expected = pool4.run(gloo_calls, "zigzag", "a2a", "balanced")
    for rank in (0, 3):
        got, = pool1.run(relaid_loopback_rank, rank, 4)
        assert (got["relayout"], got["values"]) == ("balanced", "timing only")
        assert (*got["kernel_calls"], *got["launching"]) == expected[rank], (rank, got, expected)
        assert got["syncs"] == [0, 0] and got["fwd_bwd_ms"] > 0
        assert got["cost_model"].startswith("nvlink:"), got["cost_model"]  # one node, not one per rank
