"""What the streamed op asks of a device per layer call, counted by ``testing.op_counter``.

The counter's rules on single ops; at cp 2 (and hierarchical at cp 4 = 2 nodes x 2) no
host sync in a step's layer calls after the first, forward and backward, for every
exchange; the all-gather ring sending home only the K/V gradients some query produced
(against a count from the doc ids, gradients exact against the fp64 reference); and each
exchange's kernel calls, launching ops, transfers and syncs per layer call, pinned.
"""

import contextlib
from typing import Optional

import pytest
import torch

from megatron_ext.testing import pool_fixture, ring_routes, runs_to_doc_ids
from megatron_ext.testing.cases import CASES, make_doc_ids
from megatron_ext.testing.op_counter import OpCounter, layer_calls


def test_counter_sorts_views_allocations_launching_ops_and_syncs():
    x = torch.randn(10, 3)
    mask = x[:, 0] > 0
    index = torch.tensor([1, 2])
    with OpCounter() as counter:
        with counter.region("syncs"):
            x[mask]
            x.clone()[mask] = 0
            int(x.sum())
            bool(mask.any())
            torch.nonzero(mask)
            torch.repeat_interleave(index)
        with counter.region("quiet"):
            torch.repeat_interleave(index, output_size=3)
            x.index_select(0, index)
            x.view(-1), x.t(), x[1:3], x.unsqueeze(0), x.detach()
            torch.empty(3)
            x.new_zeros(3)
    syncs, quiet = counter.counts["syncs"], counter.counts["quiet"]
    assert dict(syncs.sync_ops) == {"index": 1, "index_put_": 1, "_local_scalar_dense": 2, "nonzero": 1,
                                    "repeat_interleave": 1}
    assert syncs.syncs == 6
    assert quiet.syncs == 0
    assert dict(quiet.ops) == {"repeat_interleave": 1, "index_select": 1, "new_zeros": 1}
    assert (quiet.views, quiet.allocations) == (5, 1)


def test_counter_counts_kernel_calls_not_their_ops():
    import megatron_ext.blockdiag_cp as bdcp

    ids = torch.tensor([1] * 5 + [2] * 11)
    state = bdcp.BlockDiagCPState.build(ids, attn_backend="dense")
    q, k, v = (torch.randn(16, 1, 2, 4) for _ in range(3))
    (forward, backward), = layer_calls(state, q, k, v, layers=1)
    assert (forward.kernel_calls, backward.kernel_calls) == (1, 1)
    assert forward.sends == forward.receives == backward.sends == backward.receives == 0
    assert forward.launching < 30 and backward.launching < 30  # the dense kernel's own ops are not here


# -- the engine at cp 2, and hierarchical at cp 4 = 2 nodes x 2 ---------------------------------------

pool2 = pool_fixture(2)
pool4 = pool_fixture(4, env={"LOCAL_WORLD_SIZE": "2"})


def _mix(S: int) -> torch.Tensor:
    """Eight short documents, then one long one across every shard."""
    runs = [(i + 1, 6 + (5 * i) % 11) for i in range(8)]
    return runs_to_doc_ids(runs + [(99, S - sum(n for _, n in runs))])


def count_layers(exchange, kv_backward, ids, layers=3, layout="zigzag", relayout=None, **attention_kwargs):
    """Per layer (forward, backward) ``Counts`` on this rank, dense kernel, fp32."""
    import megatron_ext.blockdiag_cp as bdcp

    S = ids.shape[-1]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(S, 1, h, 8, generator=g) for h in (4, 2, 2))
    state = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange=exchange, attn_backend="dense",
                                        kv_backward=kv_backward, relayout=relayout)
    assert state.kv_exchange == exchange, state.kv_exchange_reason
    return layer_calls(state, *(state.shard(t) for t in (q, k, v)), layers=layers, **attention_kwargs)


def later_syncs(exchange, kv_backward, windowed=False):
    """{(layer, phase): the sync ops} of every layer call after the first, where there are any."""
    extra = {"window_size": (9, 0), "softmax_offset": torch.zeros(4)} if windowed else {}
    per_layer = count_layers(exchange, kv_backward, _mix(128), **extra)
    return {(layer, phase): dict(c.sync_ops) for layer, calls in enumerate(per_layer) if layer
            for phase, c in zip(("forward", "backward"), calls) if c.syncs}


SYNC_CASES = [(exchange, kv_backward, False) for exchange in ("allgather", "a2a", "halo", "hierarchical")
              for kv_backward in ("refetch", "save")]
SYNC_CASES += [("a2a", "refetch", True), ("hierarchical", "refetch", True)]  # a window and sinks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("exchange,kv_backward,windowed", SYNC_CASES)
def test_no_host_sync_after_a_steps_first_layer_call(pool2, pool4, exchange, kv_backward, windowed):
    pool = pool4 if exchange == "hierarchical" else pool2
    for rank, syncs in enumerate(pool.run(later_syncs, exchange, kv_backward, windowed)):
        assert syncs == {}, (rank, syncs)


# -- the ring moves only the K/V someone attends, and returns only the gradients someone produced --


def _short_documents(S: int = 1024, n: int = 64) -> torch.Tensor:
    """``n`` short documents of 8-20 tokens (some straddle a shard's chunks), the rest one more."""
    runs = [(i + 1, 8 + (7 * i) % 13) for i in range(n)]
    return runs_to_doc_ids(runs + [(n + 1, S - sum(length for _, length in runs))])


def _needed_rows(ids, positions, dst, src):
    """Local rows of ``src`` holding a key some query of ``dst`` attends, from the ids alone: a query at p
    sees its document's positions up to p."""
    ids = ids.tolist() + [0] * (len(positions[0]) * len(positions) - ids.numel())
    start, first = 0, []
    for p, d in enumerate(ids):
        start = p if p == 0 or d != ids[p - 1] else start
        first.append(start)
    row_of = {p: row for row, p in enumerate(positions[src])}
    rows = set()
    for p in positions[dst]:
        if ids[p]:
            rows.update(row_of[key] for key in range(first[p], p) if key in row_of)
    return rows


def ring_transfers_against_reference(ids):
    """Forward and backward transfers of the ring (save mode: backward moves gradients only) against an
    independent count from the ids, and the output and gradients against the fp64 reference."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp.chunks import chunk_rows_for
    from megatron_ext.testing import reference_attention

    rank, cp = torch.distributed.get_rank(), torch.distributed.get_world_size()
    S = ids.shape[-1]
    g = torch.Generator().manual_seed(5)
    q, k, v, w = (torch.randn(S, 1, h, 4, generator=g, dtype=torch.float64) for h in (2, 1, 1, 2))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference_attention(*ref_in, ids)
    (want * w).sum().backward()
    state = bdcp.BlockDiagCPState.build(ids, layout="zigzag", kv_exchange="allgather", attn_backend="dense",
                                        kv_backward="save")
    local = [state.shard(t).detach().requires_grad_() for t in (q, k, v)]
    counter = OpCounter()
    with bdcp.blockdiag_cp_step(state), counter:
        with counter.region("forward") as forward:
            out = bdcp.blockdiag_cp_attention(*local)
        with counter.region("backward") as backward:
            torch.autograd.backward(out, state.shard(w))
    errors = [float((out - state.shard(want)).abs().max())]
    errors += [float((t.grad - state.shard(r.grad)).abs().max()) for t, r in zip(local, ref_in)]
    positions = [state.layout.rank_positions(r).tolist() for r in range(cp)]
    c = chunk_rows_for(state.local_len)
    pieces = -(-state.local_len // c)
    read = [[_needed_rows(ids, positions, dst, s) if dst != s else set() for dst in range(cp)] for s in range(cp)]
    # a ring piece is a run of a shard's rows: it travels planar, K and V (dK and dV going home) as two messages
    sends = 2 * sum(len({r // c for r in read[(rank - i) % cp][rank]}) for i in range(1, cp))
    receives = 2 * sum(len({r // c for r in read[rank][(rank + i) % cp]}) for i in range(1, cp))
    # piece j of s goes around the ring as far as the last rank that attends one of its keys, the way that
    # leaves the busiest rank the fewest rows to move, its rows from the first one read to the last
    route = ring_routes(read, state.local_len, c)
    kv_sends, kv_receives = 2 * route["hops"][rank][0], 2 * route["hops"][rank][1]
    rep = state.report()  # its positions are the hops posted: what the forward measured moving
    return {"sent": (backward.sends, sends), "received": (backward.receives, receives),
            "kv_sent": (forward.sends, kv_sends), "kv_received": (forward.receives, kv_receives),
            "bytes_sent": (rep["bytes_sent"], rep["positions_sent"] * rep["kv_row_bytes"]),
            "bytes_received": (rep["bytes_received"], rep["positions_received"] * rep["kv_row_bytes"]),
            "kv_bytes": ((rep["bytes_sent"], rep["bytes_received"]),
                         tuple(n * rep["kv_row_bytes"] for n in route["rows"][rank])),
            "every_piece": (cp - 1) * pieces, "errors": errors}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_moves_only_what_the_plan_says_is_attended(pool2, pool4, cp):
    """Forward: a piece of K/V goes around the ring only as far as the last rank that attends one of its
    keys (``exchange.RingReach``). Backward: only gradients some rank produced go home."""
    results = (pool2 if cp == 2 else pool4).run(ring_transfers_against_reference, _short_documents())
    for rank, r in enumerate(results):
        for key in ("sent", "received", "kv_sent", "kv_received", "bytes_sent", "bytes_received", "kv_bytes"):
            assert r[key][0] == r[key][1], (rank, key, r)
        assert max(r["errors"]) < 1e-12, (rank, r["errors"])
    # Short documents: some pieces hold no key another rank attends, and their gradients stay home; the
    # hops past a piece's last reader are not posted.
    assert sum(r["sent"][0] for r in results) < 2 * sum(r["every_piece"] for r in results), results
    assert sum(r["kv_sent"][0] for r in results) < 2 * sum(r["every_piece"] for r in results), results


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [None, 5])
def test_ring_reach_is_the_last_hop_that_attends_each_piece(case, window):
    """``RingReach.of`` (every rank's needed ranges, through the layout's runs) against what each rank's own
    plan says it attends (its needed exchange's positions, through the layout's positions): piece j of s
    goes to hop h = the farthest rank s + h (or s - h, the way ``testing.ring_routes`` picks) that attends
    it, and only its rows from the first one read to the last travel."""
    from megatron_ext.blockdiag_cp.exchange import RingGradients, RingReach

    for cp, layout, lay, plans in _ring_plans(case, window):
        c = plans[0].stream["ring"].chunk_rows
        row_of = [{p: row for row, p in enumerate(lay.rank_positions(s).tolist())} for s in range(cp)]
        read = [[{row_of[s][p] for p in plans[dst].exchange.recv_positions[s].tolist()} if dst != s else set()
                 for dst in range(cp)] for s in range(cp)]
        want = ring_routes(read, lay.local_len, c)
        for rank, plan in enumerate(plans):  # what each rank's own needed tables say it reads
            for i, j in RingGradients.of(plan, lay.runs, c).sent:
                assert any(r // c == j for r in read[(rank - i) % cp][rank]), (cp, layout, rank, i, j)
        for rank, plan in enumerate(plans):  # the global table, alike from every rank's plan
            reach = RingReach.of(lay.runs, plan.intervals, c)
            assert [list(row) for row in reach.far] == want["far"], (cp, layout, rank)
            assert list(reach.reverse) == want["reverse"], (cp, layout, rank)
            assert [list(row) for row in reach.span] == want["span"], (cp, layout, rank)
            assert plan.stream["ring"].reach == reach, (cp, layout, rank)


def _ring_plans(case, window):
    """(cp, layout name, layout, every rank's ring plan) for cp 2-4 and three layouts of ``case`` (96 tokens)."""
    from megatron_ext.blockdiag_cp.layouts import build_layout, padded_length
    from megatron_ext.blockdiag_cp.plan import build_plan

    for cp in (2, 3, 4):
        for layout in ("contiguous", "zigzag", "balanced"):
            ids = make_doc_ids(case, 96, cp)
            ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
            ids = torch.nn.functional.pad(ids, (0, padded_length(ids.shape[1], layout, cp) - ids.shape[1]))
            lay = build_layout(layout, ids, cp)
            yield cp, layout, lay, [build_plan(ids, lay, rank, kinds=("ring",), window=window) for rank in range(cp)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [None, 5])
def test_ring_gradient_steps_cover_every_call_and_pair_up(case, window):
    """A ring step with calls sends its gradient, and each sent gradient is one its home expects."""
    from megatron_ext.blockdiag_cp.exchange import RingGradients

    for cp, layout, lay, plans in _ring_plans(case, window):
        grads = [RingGradients.of(p, lay.runs, p.stream["ring"].chunk_rows) for p in plans]
        for rank, (plan, got) in enumerate(zip(plans, grads)):
            attended = {(s.round, s.piece) for s in plan.stream["ring"].steps[1:] if s.calls}
            assert attended <= got.sent, (cp, layout, rank)
            for i, j in got.sent:
                assert (i, j) in grads[(rank - i) % cp].returned, (cp, layout, rank, i, j)
            for i, j in got.returned:
                assert (i, j) in grads[(rank + i) % cp].sent, (cp, layout, rank, i, j)


# -- pinned counts: a regression in calls, ops, transfers or syncs fails ---------------------------


def steady_counts(exchange):
    """This rank's (forward, backward) summary of a step's second layer call (the third must match it)."""
    per_layer = count_layers(exchange, "refetch", _mix(128))
    later = [tuple(c.summary() for c in calls) for calls in per_layer[1:]]
    assert all(calls == later[0] for calls in later), later
    return later[0]


def _summary(kernel_calls, launching, transfers, syncs):
    return {"kernel_calls": kernel_calls, "launching": launching, "transfers": transfers, "syncs": syncs}


# Per exchange, per rank: (forward, backward) of a later layer call, refetch, on ``_mix(128)``
# (zigzag, GQA 4 / 2 heads of 8, fp32, dense kernel); cp 2, hierarchical at cp 4 = 2 nodes x 2.
PINNED = {  # (kernel calls, launching ops, transfers (sends + receives), host syncs)
    "allgather": [((2, 1, 4, 0), (2, 7, 8, 0)), ((2, 1, 4, 0), (2, 7, 8, 0))],
    "a2a": [((2, 1, 4, 0), (2, 3, 8, 0)), ((2, 1, 4, 0), (2, 3, 8, 0))],  # runs planar: two messages, no op
    "halo": [((2, 1, 4, 0), (2, 3, 8, 0)), ((2, 1, 4, 0), (2, 3, 8, 0))],
    "hierarchical": [((2, 5, 5, 0), (2, 15, 10, 0)), ((3, 6, 7, 0), (3, 18, 14, 0)),
                     ((3, 6, 6, 0), (3, 18, 12, 0)), ((2, 5, 4, 0), (2, 16, 8, 0))],
}


def steady_counts_at(exchange, ids):
    per_layer = count_layers(exchange, "refetch", ids)
    return tuple(tuple(c.summary().values()) for c in per_layer[1])


@pytest.mark.timeout(120)
def test_a2a_at_cp4_sends_runs_planar(pool4):
    """One document over 4 ranks (zigzag): a rank's rows go to up to three ranks, and each pair's rows are a
    run of the source's (its first chunk, or its whole shard): K rows and V rows travel as they lie (no op,
    two messages a piece), and their gradients come home as the kernel's dK and dV (no cat, two messages),
    forward and backward (``plan.PairRuns``; scattered rows, thd's, are gathered in one op: the thd pins).
    Rank 2's forward closes the rows each call is the last writer of and merges the rest, so nothing is
    written back (``MergePlan.of``'s ``partial``)."""
    got = pool4.run(steady_counts_at, "a2a", torch.ones(128, dtype=torch.long))
    assert got == [((7, 6, 18, 0), (7, 17, 36, 0)), ((6, 8, 18, 0), (6, 19, 36, 0)),
                   ((5, 5, 18, 0), (5, 20, 36, 0)), ((4, 3, 18, 0), (4, 20, 36, 0))], got


def _thd_mix() -> torch.Tensor:
    """Ten short documents (multiples of 2 * cp at cp 2, as thd needs), then one long one."""
    runs = [(i + 1, 4 * (1 + i % 5)) for i in range(10)]
    return runs_to_doc_ids(runs + [(99, 128 - sum(n for _, n in runs))])


def dense_and_te_counts(window):
    """Steady (forward, backward) counts of thd / a2a on ``_thd_mix``: the dense kernel, then TE's kernel
    functions over the TE double (te_forward / te_backward as they run on a GPU, K and V as thd_th2d)."""
    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.testing import doubles as fd
    from megatron_ext.testing import override_kernel, override_libraries

    kwargs = {} if window is None else {"window_size": (window, 0)}
    dense = count_layers("a2a", "refetch", _thd_mix(), layout="thd", **kwargs)[1]
    with override_libraries(fd.fake_te()), override_kernel("dense", kernels.kernel_for("te")):
        te = count_layers("a2a", "refetch", _thd_mix(), layout="thd", **kwargs)[1]
    return [tuple(tuple(c.summary().values()) for c in calls) for calls in (dense, te)]


@pytest.mark.timeout(120)
def test_te_hands_a_chunks_gradient_back_in_the_chunks_layout(pool2):
    """TE (and flash-attn) write a received fused chunk's dK / dV as the halves of one [t, h, 2, d] buffer,
    the chunk's own layout: a chunk that one call reads whole sends that buffer home as it is (no cat), and
    a call on part of a chunk adds its rows once, not once per half. Forward is the same as dense's.
    Without a window rank 1 sends rank 0 its whole shard: planar, K and V as they lie, and the gradient home
    as the kernel's two tensors, so there dense and TE count alike."""
    got = {window: pool2.run(dense_and_te_counts, window) for window in (None, 5)}
    assert got == {  # per rank: [dense (fwd, bwd), te (fwd, bwd)]
        None: [[((3, 5, 5, 0), (3, 13, 10, 0)), ((3, 5, 5, 0), (3, 13, 10, 0))],
               [((2, 1, 5, 0), (2, 6, 10, 0)), ((2, 1, 5, 0), (2, 5, 10, 0))]],
        5: [[((9, 20, 3, 0), (9, 53, 6, 0)), ((9, 20, 3, 0), (9, 46, 6, 0))],
            [((3, 8, 3, 0), (3, 22, 6, 0)), ((3, 8, 3, 0), (3, 20, 6, 0))]],
    }, got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("exchange", list(PINNED))
def test_layer_call_counts_are_pinned(pool2, pool4, exchange):
    """Kernel calls, launching ops, transfers and host syncs per layer call, forward and backward, pinned
    at the values the engine has now: a change that adds calls, merge ops, transfers or syncs fails here.
    A change that lowers them updates the numbers (and says so in its commit)."""
    pool = pool4 if exchange == "hierarchical" else pool2
    got = [list(calls) for calls in pool.run(steady_counts, exchange)]
    want = [[_summary(*f), _summary(*b)] for f, b in PINNED[exchange]]
    assert got == want, [[tuple(c.values()) for c in calls] for calls in got]


# Per rank, (forward, backward) of a steady call moved to balanced: (kernel calls, launching ops, transfers,
# syncs); every document whole, so per group of heads (2: ``head_groups``) one kernel call and no K/V
# exchange, 4 all-to-alls of 3 peers each way.
RELAID_PINNED = [[(2, 16, 48, 0), (2, 16, 48, 0)]] * 4
THD_PINNED = [[(7, 18, 15, 0), (7, 42, 30, 0)], [(6, 15, 15, 0), (6, 37, 30, 0)],  # the same documents in thd
              [(5, 9, 15, 0), (5, 30, 30, 0)], [(4, 3, 15, 0), (4, 23, 30, 0)]]


def relaid_counts(relayout):
    """Steady (forward, backward) counts and every call's syncs after a step's first, thd / a2a on 64 short
    documents (each a multiple of 2 * cp), attended in thd or moved to balanced."""
    cp = torch.distributed.get_world_size()
    runs = [(i + 1, 2 * cp * (1 + i % 3)) for i in range(64)]
    ids = runs_to_doc_ids(runs + [(99, 1024 - sum(n for _, n in runs))])
    per_layer = count_layers("a2a", "refetch", ids, layout="thd", relayout=relayout)
    syncs = sum(c.syncs for calls in per_layer[1:] for c in calls)
    return [tuple(c.summary().values()) for c in per_layer[1]], syncs


@pytest.mark.timeout(120)
def test_relayout_attends_short_thd_documents_in_fewer_calls(pool4):
    """thd cuts each short document over all 4 ranks: a call per source rank, each merging into every row
    (a write, an open, merges and a close: one op each). Moved to balanced, the documents are whole: one
    call per group of heads, q / k / v / out each one all-to-all per group (3 peers: 6 messages), no sync
    after the first call."""
    kept = pool4.run(relaid_counts, None)
    moved = pool4.run(relaid_counts, "balanced")
    for rank, ((thd, thd_syncs), (relaid, relaid_syncs)) in enumerate(zip(kept, moved)):
        assert thd_syncs == relaid_syncs == 0, (rank, thd_syncs, relaid_syncs)
        assert relaid[0][0] < thd[0][0], (rank, thd, relaid)  # kernel calls
    assert [thd for thd, _ in kept] == THD_PINNED, [thd for thd, _ in kept]
    assert [relaid for relaid, _ in moved] == RELAID_PINNED, [relaid for relaid, _ in moved]


@contextlib.contextmanager
def own_last_rows_per_launch(rows: Optional[int]):
    """``step_tables.OWN_LAST_ROWS_PER_LAUNCH`` set to ``rows`` (None: as it is) inside, restored after: the pool's
    worker runs the next test."""
    from megatron_ext.blockdiag_cp import step_tables as tables_module

    rule = tables_module.OWN_LAST_ROWS_PER_LAUNCH
    if rows is not None:
        tables_module.OWN_LAST_ROWS_PER_LAUNCH = rows
    try:
        yield
    finally:
        tables_module.OWN_LAST_ROWS_PER_LAUNCH = rule


def backward_order(kv_backward, layout):
    """This rank's backward events of a steady layer call (thd or zigzag, a2a, ``_thd_mix``, float64): per
    event "kernel", "post" or "wait"; the own step's calls; whether the step took the own keys last (the
    rows-per-launch rule set to 0: these documents are small); the largest error against the reference."""
    with own_last_rows_per_launch(0):
        return _backward_order(kv_backward, layout)


def _backward_order(kv_backward, layout):
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing import reference_attention
    from megatron_ext.testing.op_counter import KernelEvent, OpCounter, PostEvent, WaitEvent

    ids = _thd_mix()
    g = torch.Generator().manual_seed(3)
    q, k, v, w = (torch.randn(ids.shape[-1], 1, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    (reference_attention(*ref, ids) * w).sum().backward()
    state = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange="a2a", attn_backend="dense",
                                        kv_backward=kv_backward)
    counter = OpCounter(log=True)
    errors = []
    with bdcp.blockdiag_cp_step(state):
        for layer in range(2):
            inputs = [state.shard(t).requires_grad_() for t in (q, k, v)]
            with counter, counter.region(("forward", layer)):
                out = bdcp.blockdiag_cp_attention(*inputs)
            with counter, counter.region(("backward", layer)):
                (out * state.shard(w)).sum().backward()
            errors += [float((t.grad - state.shard(r.grad)).abs().max()) for t, r in zip(inputs, ref)]
    kinds = {KernelEvent: "kernel", PostEvent: "post", WaitEvent: "wait"}
    order = [kinds[type(e)] for e in counter.counts[("backward", 1)].events if type(e) in kinds]
    own_calls = len(state.stream_plan("needed").steps[0].calls)
    return order, own_calls, state.backward_own_last("needed", torch.device("cpu")), max(errors)


@pytest.mark.timeout(120)
def test_backward_with_kept_kv_takes_the_own_keys_while_the_last_gradient_travels(pool2):
    """``kv_backward="save"``: nothing to fetch, so backward differentiates the received chunks first and the
    own keys last, their calls between the last gradient's post and its wait (what comes back for our rows
    is added after the own calls wrote dK / dV), with the reference's gradients. With a refetch the own
    keys go first, hiding the fetch."""
    for layout in ("thd", "zigzag"):
        for rank, (order, own_calls, own_last, error) in enumerate(pool2.run(backward_order, "save", layout)):
            assert own_last and error < 1e-12, (layout, rank, error)
            last_post = len(order) - 1 - order[::-1].index("post")
            tail = ["kernel"] * own_calls + ["wait"] * order.count("post")
            assert order[last_post + 1:] == tail, (layout, rank, order)
        for rank, (order, own_calls, own_last, error) in enumerate(pool2.run(backward_order, "refetch", layout)):
            assert not own_last and error < 1e-12 and order[1:1 + own_calls] == ["kernel"] * own_calls, (
                layout, rank, order)


def own_last_at_32k(ids):
    """Whether this rank's backward takes the own keys last (zigzag, a2a, save), the rule's own terms, and the
    positions that come back at the last step."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp.step_tables import OWN_LAST_ROWS_PER_LAUNCH

    state = bdcp.BlockDiagCPState.build(ids, layout="zigzag", kv_exchange="a2a", attn_backend="dense",
                                        kv_backward="save")
    steps = state.stream_plan("needed").steps
    launches = sum(len(step.calls) + 1 for step in steps[1:])
    back = state._last_gradient_rows("needed", None) if len(steps) > 1 else 0
    return state.backward_own_last("needed", torch.device("cpu")), back >= OWN_LAST_ROWS_PER_LAUNCH * launches, back


@pytest.mark.timeout(120)
def test_the_own_keys_go_last_only_where_the_last_gradient_back_outweighs_the_launches_before_them(pool2):
    """One 32k document at cp 2: the last step moves thousands of positions' gradients (home or back), after a
    launch or four: the own keys go last on both ranks. 100-token documents: the one cut document's few
    positions: they go first."""
    one = torch.ones(32768, dtype=torch.long)
    for rank, (own_last, rule, back) in enumerate(pool2.run(own_last_at_32k, one)):
        assert own_last and rule and back >= 8192, (rank, back)
    short = runs_to_doc_ids([(i + 1, 100) for i in range(327)] + [(999, 68)])
    for rank, (own_last, rule, back) in enumerate(pool2.run(own_last_at_32k, short)):
        assert not own_last and not rule and back < 200, (rank, back)


def padded_pack(layout, padded=True):
    """A pack of short documents and 8 padding positions (doc id 0) at its end, a2a, float64, dense: this
    rank's ``own_padding``, the largest error of out / dq / dk / dv over real rows against the reference,
    the largest magnitude on padding rows, and the steady call's copies and launching ops (forward, backward).
    ``padded`` False: the own call without its padding segment (the plan as ``stream_plan`` has it)."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp.step import BlockDiagCPState
    from megatron_ext.testing import reference_attention

    runs = [(i + 1, 4 * (1 + i % 5)) for i in range(10)]  # 120 positions, multiples of 2 * cp
    ids = runs_to_doc_ids(runs + [(0, 8)])
    g = torch.Generator().manual_seed(5)
    q, k, v, w = (torch.randn(128, 1, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = reference_attention(*ref, ids)
    (ref_out * w).sum().backward()
    own_padding = BlockDiagCPState.own_padding
    if not padded:
        BlockDiagCPState.own_padding = lambda self, kind, window=None: None
    try:
        state = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange="a2a", attn_backend="dense")
        real = state.shard(ids) > 0
        errors, on_padding = [], []
        with bdcp.blockdiag_cp_step(state):
            inputs = [state.shard(t).requires_grad_() for t in (q, k, v)]
            out = bdcp.blockdiag_cp_attention(*inputs)
            (out * state.shard(w)).sum().backward()  # upstream nonzero on the padding rows too
        for got, want in zip([out.detach()] + [t.grad for t in inputs], [ref_out.detach()] + [r.grad for r in ref]):
            errors.append(float((got[real] - state.shard(want)[real]).abs().max()))
            on_padding.append(float(got[~real].abs().max()) if (~real).any() else 0.0)
        fwd, bwd = count_layers("a2a", state.kv_backward, ids, layers=2, layout=layout)[1]
        return (state.own_padding("needed"), max(errors), max(on_padding),
                [(c.ops["copy_"], c.launching) for c in (fwd, bwd)])
    finally:
        BlockDiagCPState.own_padding = own_padding


@pytest.mark.timeout(120)
def test_the_own_call_attends_the_padding_so_its_outputs_are_the_results(pool2):
    """Padding at the end of a rank's rows: the own call gets one more causal segment over it, so it covers
    every local row, and its out, dq, dK and dV are the results (before, each was copied into a tensor one
    padding longer). The padding rows are zeros, the real rows the reference's; fewer copies, no more ops."""
    for layout in ("thd", "zigzag"):
        ranks = pool2.run(padded_pack, layout)
        before = pool2.run(padded_pack, layout, False)
        assert any(padding is not None for padding, *_ in ranks), (layout, ranks)
        for rank, ((padding, error, zeros, counts), (_, error0, zeros0, counts0)) in enumerate(zip(ranks, before)):
            assert error < 1e-12 and zeros == 0.0 and error0 < 1e-12 and zeros0 == 0.0, (layout, rank, error, zeros)
            for (copies, ops), (copies0, ops0) in zip(counts, counts0):
                assert ops <= ops0 and copies <= copies0, (layout, rank, counts, counts0)
                if padding is not None:
                    assert copies < copies0 or ops < ops0, (layout, rank, counts, counts0)



def forward_order(exchange):
    """This rank's forward events of a steady layer call (zigzag, one document over the 4 ranks, refetch,
    float64): "kernel", or ("post" | "wait", the step of the batch); the largest error of out against the
    reference. A step that moves nothing either way posts nothing."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp.chunks import chunk_kind
    from megatron_ext.blockdiag_cp.exchange import piece_rows
    from megatron_ext.testing import reference_attention
    from megatron_ext.testing.op_counter import KernelEvent, PostEvent, WaitEvent

    ids = runs_to_doc_ids([(1, 256)])
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(ids.shape[-1], 1, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    want = reference_attention(q, k, v, ids)
    state = bdcp.BlockDiagCPState.build(ids, layout="zigzag", kv_exchange=exchange, attn_backend="dense",
                                        kv_backward="refetch")
    counter = OpCounter(log=True)
    with bdcp.blockdiag_cp_step(state):
        for layer in range(2):
            with counter, counter.region(("forward", layer)):
                out = bdcp.blockdiag_cp_attention(*(state.shard(t) for t in (q, k, v)))
    stream = state.stream_plan(chunk_kind(exchange))
    counts, r, cp = state.plan.exchange.counts, state.rank, state.cp
    reach = stream.reach  # the ring's hops (test_ring_reach_is_the_last_hop_that_attends_each_piece checks it)
    moving = [s for s, step in enumerate(stream.steps) if s and (
        (reach.sends(r, (step.round, step.piece)) or reach.receives(r, (step.round, step.piece)))
        if exchange == "allgather" else
        piece_rows(int(counts[r, (r + step.round) % cp]), stream.chunk_rows, step.piece)
        or piece_rows(int(counts[(r - step.round) % cp, r]), stream.chunk_rows, step.piece))]
    events = [e for e in counter.counts[("forward", 1)].events if isinstance(e, (KernelEvent, PostEvent, WaitEvent))]
    step_of = dict(zip([e.post for e in events if isinstance(e, PostEvent)], moving))
    order = [("post", step_of[e.post]) if isinstance(e, PostEvent) else ("wait", step_of[e.post])
             if isinstance(e, WaitEvent) else "kernel" for e in events]
    steps = [(step.round, step.piece) for step in stream.steps]
    return order, moving, steps, float((out - state.shard(want)).abs().max())


def _posted_when_waited(steps, ahead: int, ring: bool):
    """Step s -> the steps posted by the time s is waited for, and the steps posted before the own keys'
    call: steps go in order, at most ``ahead`` in flight; the ring walks each piece's hops in order, so a
    ring step after its piece's first forwards what the step before it brought, and goes only once that one
    landed and nothing landed after it."""
    posted, landed, last, before, at_wait = 1, 1, None, None, {}

    def fill():
        nonlocal posted
        while posted < len(steps) and posted - landed < ahead and (
                not ring or posted == 1 or steps[posted - 1][1] != steps[posted][1] or last == steps[posted - 1]):
            posted += 1

    fill()
    before = list(range(1, posted))
    for s in range(1, len(steps)):
        at_wait[s] = list(range(1, posted))
        landed, last = s + 1, steps[s]
        fill()
    return before, at_wait


@pytest.mark.timeout(120)
def test_forward_posts_two_steps_ahead(pool4):
    """Forward posts two steps' chunks before the own keys' call and the next one as each lands
    (``streamed.FORWARD_FETCHES_AHEAD``): a2a / halo every step's chunk but the last is waited for with the
    next one in flight. The ring forwards the piece it received the step before, so a forwarding step
    goes once that piece landed (``RingTransport.can_start``): at cp 4 one ahead within a piece, two where
    the next piece's first hop can go while the last hop of this one moves."""
    for exchange in ("a2a", "halo", "allgather"):
        for rank, (order, moving, steps, error) in enumerate(pool4.run(forward_order, exchange)):
            assert error < 1e-12 and len(moving) >= 3, (exchange, rank, order)
            before, at_wait = _posted_when_waited(steps, 2, exchange == "allgather")
            first_kernel = order.index("kernel")
            assert order[:first_kernel] == [("post", s) for s in before if s in moving], (exchange, rank, order)
            for s in moving:
                waited = order.index(("wait", s))
                posted = [t for t in moving if ("post", t) in order[:waited]]
                assert posted == [t for t in at_wait[s] if t in moving], (exchange, rank, s, order)
            if exchange == "allgather":  # piece 0's last hop and piece 1's first in flight together
                next_piece = [j for _, j in steps].index(1)
                last_hop = next_piece - 1
                assert order.index(("post", next_piece)) < order.index(("wait", last_hop)), (rank, order)
            else:
                assert before == [1, 2]


def backward_events(exchange, kv_backward="save", layout="zigzag", runs=((1, 256),), rows_per_launch=None):
    """``_backward_events`` under ``own_last_rows_per_launch(rows_per_launch)``."""
    with own_last_rows_per_launch(rows_per_launch):
        return _backward_events(exchange, kv_backward, layout, runs)


def _backward_events(exchange, kv_backward, layout, runs):
    """This rank's backward events of a steady layer call (documents ``runs`` (id, length), by default one
    over the 4 ranks; with kv_backward
    "save" backward fetches nothing, so every post moves K/V gradients): "kernel", or ("post" | "wait",
    number of the post); the largest error of dq, dK and dV against the fp64 reference."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing import reference_attention
    from megatron_ext.testing.op_counter import KernelEvent, PostEvent, WaitEvent

    ids = runs_to_doc_ids(list(runs))
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(ids.shape[-1], 1, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    w = torch.randn(ids.shape[-1], 1, 4, 8, generator=g, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    (reference_attention(*full, ids) * w).sum().backward()
    state = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange=exchange, attn_backend="dense",
                                        kv_backward=kv_backward)
    counter = OpCounter(log=True)
    with bdcp.blockdiag_cp_step(state):
        for layer in range(2):
            mine = [state.shard(t).detach().requires_grad_() for t in (q, k, v)]
            out = bdcp.blockdiag_cp_attention(*mine)
            with counter, counter.region(("backward", layer)):
                (out * state.shard(w)).sum().backward()
    error = max(float((t.grad - state.shard(f.grad)).abs().max()) for t, f in zip(mine, full))
    events = counter.counts[("backward", 1)].events
    order = [("post", e.post) if isinstance(e, PostEvent) else ("wait", e.post) if isinstance(e, WaitEvent)
             else "kernel" for e in events if isinstance(e, (KernelEvent, PostEvent, WaitEvent))]
    return order, error


def _most_in_flight(order) -> int:
    """The most posts in flight (posted, not yet waited for) when the layer call waits for one."""
    live, most = set(), 0
    for event in order:
        if event == "kernel":
            continue
        kind, n = event
        if kind == "post":
            live.add(n)
        else:
            most = max(most, len(live))
            live.discard(n)
    return most


@pytest.mark.timeout(120)
def test_backward_posts_a_gradient_before_it_waits_for_the_last_one(pool4):
    """Backward sends step s's K/V gradient home before it waits for (and adds) the one of step s - 1: two
    gradient transfers in flight, so a step that attends nothing here (it only gets our rows' gradients
    back) does not hold the next one behind the last one's landing, and never more than two. The ring,
    zigzag: with the received K/V kept (no fetch in backward) a wait finds two posts in flight; with
    refetch, three (the next piece's fetch beside them). dq, dK and dV match the reference."""
    for kv_backward, most in (("save", 2), ("refetch", 3)):
        for rank, (order, error) in enumerate(pool4.run(backward_events, "allgather", kv_backward)):
            assert error < 1e-12, (kv_backward, rank, error)
            assert _most_in_flight(order) == most, (kv_backward, rank, order)


@pytest.mark.timeout(120)
def test_a_rank_that_attends_no_received_key_posts_for_its_gradients_first(pool4):
    """With a refetch, backward differentiates the own keys right after the first fetch is posted, to hide
    it. A rank that attends no received key has nothing to hide: contiguous, two documents of two ranks
    each, ranks 0 and 2 post every step (the fetches they only send, and the receives of their rows'
    gradients) before their own calls, and wait for the fetches with the gradients, after them
    (``backward_own_last``; its rows-per-launch rule set to 0: these documents are small); ranks 1 and 3
    keep the own keys first. dq, dK and dV match the reference."""
    for exchange in ("a2a", "halo"):
        ranks = pool4.run(backward_events, exchange, "refetch", "contiguous", ((1, 128), (2, 128)), 0)
        for rank, (order, error) in enumerate(ranks):
            assert error < 1e-12, (exchange, rank, error)
            first_kernel = order.index("kernel")
            posts = [e for e in order if e != "kernel" and e[0] == "post"]
            if rank in (0, 2):
                assert order[:first_kernel] == posts and len(posts) >= 2, (exchange, rank, order)
            else:
                assert first_kernel == 1 and order[0][0] == "post", (exchange, rank, order)
        # with the rule as it is, 64 rows coming back are worth no launch before the own calls
        for rank, (order, error) in enumerate(pool4.run(backward_events, exchange, "refetch", "contiguous",
                                                        ((1, 128), (2, 128)))):
            assert error < 1e-12 and order.index("kernel") == 1, (exchange, rank, order)


def _cut_by_runs_mix() -> torch.Tensor:
    """Three documents that the balanced layout at cp 4 deals out so that rank 0's remote chunk meets its
    query rows in two runs, the break between two segments (rank 2's already takes two calls)."""
    return runs_to_doc_ids([(1, 23), (2, 157), (3, 172)])


def counts_and_error_by_runs(run_calls):
    """With ``chunks.RUN_CALLS = run_calls``: this rank's remote steps' calls, the (kernel calls, launching
    ops, row gathers) of a steady layer call (forward, backward; balanced a2a, refetch, dense, float64), and the largest
    error of out / dq / dk / dv against the reference."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp import chunks
    from megatron_ext.testing import reference_attention

    saved, chunks.RUN_CALLS = chunks.RUN_CALLS, run_calls
    try:
        ids = _cut_by_runs_mix()
        g = torch.Generator().manual_seed(5)
        q, k, v, w = (torch.randn(ids.shape[-1], 1, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out = reference_attention(*ref, ids)
        (ref_out * w).sum().backward()
        state = bdcp.BlockDiagCPState.build(ids, layout="balanced", kv_exchange="a2a", attn_backend="dense",
                                            kv_backward="refetch")
        with bdcp.blockdiag_cp_step(state):
            inputs = [state.shard(t).requires_grad_() for t in (q, k, v)]
            out = bdcp.blockdiag_cp_attention(*inputs)
            (out * state.shard(w)).sum().backward()
        error = max(float((got - state.shard(want)).abs().max()) for got, want in
                    zip([out.detach()] + [t.grad for t in inputs], [ref_out.detach()] + [r.grad for r in ref]))
        fwd, bwd = layer_calls(state, *(state.shard(t) for t in (q, k, v)), layers=2)[1]
        steps = [len(step.calls) for step in state.stream_plan("needed").steps[1:]]
        return (steps, (fwd.kernel_calls, fwd.launching, fwd.ops["index_select"]),
                (bwd.kernel_calls, bwd.launching, bwd.ops["index_select"]), error)
    finally:
        chunks.RUN_CALLS = saved


@pytest.mark.timeout(120)
def test_a_remote_call_over_two_runs_of_rows_reads_them_in_place(pool4):
    """A remote chunk whose query rows fall in two runs, the break between segments, takes a call per run
    (``chunks.calls_by_runs``): one kernel call more, and no gather of q (forward) or of q, dout, out and
    the lse (backward). Forward then merges each call's rows where they lie, one merge a call where one
    call took a gather and a merge (as many launching ops, fewer bytes); backward adds each call's dq in
    place, fewer launching ops. The same out and gradients as the reference. ``RUN_CALLS = 1`` keeps every
    call whole."""
    cut, whole = pool4.run(counts_and_error_by_runs, 2), pool4.run(counts_and_error_by_runs, 1)
    for rank, ((steps, fwd, bwd, error), (steps1, fwd1, bwd1, error1)) in enumerate(zip(cut, whole)):
        assert max(error, error1) < 1e-12, (rank, error, error1)
        more = sum(steps) - sum(steps1)
        assert all(n <= 2 for n in steps + steps1), (rank, steps, steps1)  # at most two calls a chunk
        assert fwd[0] - fwd1[0] == bwd[0] - bwd1[0] == more, (rank, fwd, fwd1, bwd, bwd1)
        if more:
            assert fwd[1] == fwd1[1] and bwd[1] < bwd1[1], (rank, fwd, fwd1, bwd, bwd1)
            assert (fwd1[2] - fwd[2], bwd1[2] - bwd[2]) == (1, 4), (rank, fwd, fwd1, bwd, bwd1)
        else:
            assert (fwd, bwd) == (fwd1, bwd1), (rank, fwd, fwd1, bwd, bwd1)
    assert [sum(s) - sum(s1) for (s, *_), (s1, *_) in zip(cut, whole)] == [1, 0, 0, 0], (cut, whole)
