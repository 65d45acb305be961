"""The gathered plan (``gathered``) against a brute force: every (query, key) pair once, a call per band.

For the test cases' document ids, every layout and rank: the own step and the band steps (one over every
received row, or one per group: piece g of every source) (read in ``GatheredPlan.order`` from the
needed-only buffer, ``recv_positions`` by source) cover exactly the per-document causal pairs of the
rank's queries, each once; the received rows are each read by one call, as one run of its group's
buffer; every remote segment is full; a call per band, or one per run of its query rows. a2a takes the
needed rows in groups of pieces and attends them by bands where its rule says (exact against the
reference, fewer calls), and streams them elsewhere.
"""

import numpy as np
import pytest
import torch

from megatron_ext.blockdiag_cp.chunks import RUN_CALLS
from megatron_ext.blockdiag_cp.gathered import gathered_stream_plan
from megatron_ext.blockdiag_cp.intervals import document_runs
from megatron_ext.blockdiag_cp.layouts import build_layout, padded_length
from megatron_ext.blockdiag_cp.plan import build_plan
from megatron_ext.testing import pool_fixture, runs_to_doc_ids
from megatron_ext.testing.cases import CASES, make_doc_ids

from test_chunks import _expected_pairs


def _bands(ids, mine, received):
    """Per received position, how many local runs of its document start before it (positions ``mine``,
    ascending), position by position: a list."""
    d = ids[0].tolist()
    doc = list(range(len(d)))  # a document: a run of equal ids, named by its first position
    for p in range(1, len(d)):
        if d[p] == d[p - 1]:
            doc[p] = doc[p - 1]
    mine = mine.tolist()
    starts = [p for i, p in enumerate(mine) if i == 0 or mine[i - 1] != p - 1 or doc[mine[i - 1]] != doc[p]]
    return [sum(1 for s in starts if doc[s] == doc[x] and s < x) for x in received.tolist()]


def _check(ids, cp, layout, groups=1):
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    ids = torch.nn.functional.pad(ids, (0, padded_length(ids.shape[1], layout, cp) - ids.shape[1]))
    lay = build_layout(layout, ids, cp)
    for rank in range(cp):
        plan = build_plan(ids, lay, rank)
        needed = plan.stream["needed"]
        got_plan = gathered_stream_plan(needed, lay.runs, [document_runs(ids[0])], plan.exchange.recv_positions,
                                        groups)
        if ids.shape[0] > 1:
            assert got_plan is None  # several rows of doc ids keep chunks' plan
            continue
        stream = got_plan.stream
        assert stream.steps[0] == needed.steps[0]
        if len(needed.steps) == 1:
            assert stream is needed
            continue
        assert len(stream.steps) == 1 + groups, "one step per group"
        mine = lay.runs.positions(rank)
        by_source = [plan.exchange.recv_positions[s] for s in range(cp) if s != rank]
        received = torch.cat(by_source)
        assert sorted(got_plan.order.tolist()) == list(range(received.numel()))  # a permutation
        buffer = received[torch.from_numpy(got_plan.order)]
        first = np.cumsum([0] + [p.numel() for p in by_source])
        pairs = [pair for call in stream.steps[0].calls for pair in _pairs(call, mine, mine)]
        for g, (band_step, start) in enumerate(zip(stream.steps[1:], got_plan.starts)):
            chunk = buffer[start:start + band_step.chunk_len]
            # group g: piece g of every source, rows [g * c, (g + 1) * c) of its c = ceil(n / groups) per part
            piece = [int(first[s]) + c * g + i for s, p in enumerate(by_source)
                     for c in [-(-p.numel() // groups)] for i in range(max(0, min(c, p.numel() - c * g)))]
            assert sorted(got_plan.order[start:start + band_step.chunk_len].tolist()) == piece, (layout, rank, g)
            for call in band_step.calls:
                pairs += _pairs(call, mine, chunk)
            _check_bands(ids, layout, cp, rank, mine, chunk, band_step)
        assert len(pairs) == len(set(pairs)), (layout, cp, rank, "a pair attended twice")
        assert set(pairs) == _expected_pairs(ids, mine), (layout, cp, rank)


def _pairs(call, mine, chunk):
    """The (0, query, key) positions a call attends, its segments checked: causal on the diagonal, else every
    key before every query."""
    assert call.q_index.unique().numel() == call.q_index.numel()
    pairs = []
    for qs, ks in zip(call.q_index.split(list(call.q_lens)), call.k_index.split(list(call.k_lens))):
        q_pos, k_pos = mine[qs], chunk[ks]
        if call.causal:
            assert torch.equal(q_pos, k_pos)
            pairs += [(0, int(q), int(k)) for i, q in enumerate(q_pos) for k in k_pos[:i + 1]]
        else:
            assert int(k_pos.max()) < int(q_pos.min())  # every key precedes every query
            pairs += [(0, int(q), int(k)) for q in q_pos for k in k_pos]
    return pairs


def _check_bands(ids, layout, cp, rank, mine, buffer, whole):
    """A band step: each received row read by one call, each call's keys one run, a call per band."""
    if not whole.calls:
        assert buffer.numel() == 0
        return
    runs = sorted((int(c.k_index[0]), int(c.k_index.numel())) for c in whole.calls)
    assert all(torch.equal(c.k_index, torch.arange(int(c.k_index[0]), int(c.k_index[0]) + c.k_index.numel()))
               for c in whole.calls)
    assert [start for start, _ in runs] == np.cumsum([0] + [n for _, n in runs])[:-1].tolist()
    assert sum(n for _, n in runs) == buffer.numel()
    assert all(not c.causal and c.window is None for c in whole.calls)
    # A call's keys lie in one band; a band takes one call, or one per run of its query rows (<= RUN_CALLS)
    band = _bands(ids, mine, buffer)
    per_band = {}
    for c in whole.calls:
        first, n = int(c.k_index[0]), int(c.k_index.numel())
        assert len(set(band[first:first + n])) == 1, (layout, cp, rank)
        per_band.setdefault(band[first], []).append(c)
    assert set(per_band) == set(band), (layout, cp, rank)

    def runs(rows):
        return 1 + int((rows[1:] != rows[:-1] + 1).sum())

    for calls in per_band.values():
        assert len(calls) <= RUN_CALLS
        if len(calls) > 1:  # split only where each call's rows are one run, read in place
            assert all(runs(c.q_index) == 1 for c in calls), (layout, cp, rank)
        elif runs(calls[0].q_index) > 1:  # one call gathering its rows: they break too often to split
            c = calls[0]
            whole_segments = all(runs(q) == 1 for q in c.q_index.split(list(c.q_lens)))
            assert runs(c.q_index) > RUN_CALLS or not whole_segments, (layout, cp, rank)
    assert len(per_band) <= 2 or layout == "balanced", (layout, cp, rank)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_bands_cover_every_pair_once(case, cp):
    for layout in ("contiguous", "zigzag", "balanced"):
        _check(make_doc_ids(case, 96, cp), cp, layout)


@pytest.mark.parametrize("groups", [2, 3])
@pytest.mark.parametrize("cp", [2, 4])
def test_groups_of_pieces_cover_every_pair_once(groups, cp):
    """Band step g reads piece g of every source (each source's rows cut into ``groups`` parts): the steps
    together attend every pair once, each by bands."""
    for case in ("short", "single", "uneven", "pad_middle"):
        for layout in ("contiguous", "zigzag", "balanced"):
            _check(make_doc_ids(case, 96, cp), cp, layout, groups)


def test_thd_layout_takes_two_calls():
    g = torch.Generator().manual_seed(5)
    for cp in (2, 3, 4):
        lengths = torch.randint(1, 30, (7,), generator=g).tolist()
        parts = []
        for i, n in enumerate(lengths):  # each document padded to a multiple of 2 * cp, as THD packs
            parts += [torch.full((n,), i + 1), torch.zeros(-(-n // (2 * cp)) * 2 * cp - n, dtype=torch.long)]
        for groups in (1, 3):
            _check(torch.cat(parts), cp, "thd", groups)


def test_route_places_each_row_where_the_plan_reads_it():
    # The reordered route puts needed-only row order[j] at gathered row j: slots past the local rows map
    # through the inverse permutation, the local rows and slot1's "not needed here" (-1) stay.
    from megatron_ext.blockdiag_cp.gathered import GatheredPlan
    from megatron_ext.blockdiag_cp.hierarchy import build_hierarchical_route

    ids = make_doc_ids("short", 96, 4).unsqueeze(0)
    lay = build_layout("zigzag", ids, 4)
    for rank in range(4):
        route = build_hierarchical_route(lay, ids, rank, 2)
        n = route.out_rows - route.local_len
        order = np.random.default_rng(rank).permutation(n)
        placed = GatheredPlan(None, order).route(route)
        L = route.local_len
        for name in ("slot1", "slot2", "kept1_slot"):
            old, new = getattr(route, name), getattr(placed, name)
            keep = old < L
            assert torch.equal(new[keep], old[keep])
            assert torch.equal(torch.from_numpy(order)[new[~keep] - L], old[~keep] - L), name


pool4 = pool_fixture(4)


def whole_a2a(layout, kv_backward, min_chunks=None, multiple=None, min_piece=None, group_multiple=None,
              one_batch=None, cut_share=None):
    """a2a on 4 ranks over short documents (each a multiple of 2 * cp, as thd packs them), float64, dense:
    whether the group took every needed row at once, the steps the op walks, the kernel calls of a steady
    layer call (forward, backward), the largest error of out / dq / dk / dv against the reference and the
    transfers (forward, backward, this rank's peers that send or receive), the posted batches (forward,
    backward), the band groups that go in one batch and the launching ops (forward, backward, and of backward's the
    ``sum_rows_``). ``min_chunks`` / ``multiple``: the rule's constants
    for this run; ``min_piece``: the band mode's (rows, documents) a piece; ``group_multiple``: the refetch's
    bound on a group (``REFETCH_GROUP_LOCAL_MULTIPLE``); ``one_batch``: ``ONE_BATCH_GROUP_LOCAL_MULTIPLE``;
    ``cut_share``: ``BAND_CUT_ROWS_SHARE``."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp import step_tables as tables_module
    from megatron_ext.testing import reference_attention
    from megatron_ext.testing.op_counter import layer_calls

    ids = runs_to_doc_ids([(i + 1, 8 * (1 + i % 3)) for i in range(8)] + [(99, 32)])  # 160 positions
    g = torch.Generator().manual_seed(11)
    q, k, v, w = (torch.randn(ids.shape[-1], 1, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = reference_attention(*ref, ids)
    (ref_out * w).sum().backward()
    saved = (tables_module.WHOLE_MIN_CHUNKS_PER_RANK, tables_module.WHOLE_RECEIVED_LOCAL_MULTIPLE,
             tables_module.BAND_MIN_PIECE_ROWS, tables_module.BAND_MIN_DOCS_PER_PIECE,
             tables_module.REFETCH_GROUP_LOCAL_MULTIPLE, tables_module.ONE_BATCH_GROUP_LOCAL_MULTIPLE,
             tables_module.BAND_CUT_ROWS_SHARE)
    tables_module.WHOLE_MIN_CHUNKS_PER_RANK = saved[0] if min_chunks is None else min_chunks
    tables_module.WHOLE_RECEIVED_LOCAL_MULTIPLE = saved[1] if multiple is None else multiple
    tables_module.BAND_MIN_PIECE_ROWS, tables_module.BAND_MIN_DOCS_PER_PIECE = min_piece or saved[2:4]
    tables_module.REFETCH_GROUP_LOCAL_MULTIPLE = saved[4] if group_multiple is None else group_multiple
    tables_module.ONE_BATCH_GROUP_LOCAL_MULTIPLE = saved[5] if one_batch is None else one_batch
    tables_module.BAND_CUT_ROWS_SHARE = saved[6] if cut_share is None else cut_share
    try:
        state = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange="a2a", attn_backend="dense",
                                            kv_backward=kv_backward)
        if state.needed_whole() and kv_backward == "refetch":  # no group above the refetch's bound
            received = state.whole_delivery_on(torch.device("cpu")).received
            assert max(received) <= tables_module.REFETCH_GROUP_LOCAL_MULTIPLE * state.local_len, received
        errors = []
        with bdcp.blockdiag_cp_step(state):
            for _ in range(2):
                inputs = [state.shard(t).requires_grad_() for t in (q, k, v)]
                out = bdcp.blockdiag_cp_attention(*inputs)
                (out * state.shard(w)).sum().backward()
                errors += [float((got - state.shard(want)).abs().max()) for got, want in
                           zip([out.detach()] + [t.grad for t in inputs], [ref_out.detach()] + [r.grad for r in ref])]
        fwd, bwd = layer_calls(state, *(state.shard(t) for t in (q, k, v)), layers=2)[1]
        counts = state.plan.exchange.counts.clone()
        counts.fill_diagonal_(0)
        peers = int((counts[state.rank] > 0).sum() + (counts[:, state.rank] > 0).sum())  # sends + receives
        batched = (sum(m.one_batch for m in state.whole_delivery_on(torch.device("cpu")).messages)
                   if state.needed_whole() else 0)
        return (state.needed_whole(), len(state.stream_plan("needed").steps), fwd.kernel_calls, bwd.kernel_calls,
                max(errors), (fwd.summary()["transfers"], bwd.summary()["transfers"], peers), int(counts[counts > 0].min()),
                (fwd.posts, bwd.posts), batched, (fwd.launching, bwd.launching, bwd.ops.get("sum_rows_", 0)))
    finally:
        (tables_module.WHOLE_MIN_CHUNKS_PER_RANK, tables_module.WHOLE_RECEIVED_LOCAL_MULTIPLE,
         tables_module.BAND_MIN_PIECE_ROWS, tables_module.BAND_MIN_DOCS_PER_PIECE,
         tables_module.REFETCH_GROUP_LOCAL_MULTIPLE, tables_module.ONE_BATCH_GROUP_LOCAL_MULTIPLE,
         tables_module.BAND_CUT_ROWS_SHARE) = saved


@pytest.mark.timeout(180)
def test_a2a_takes_every_needed_row_at_once_where_the_ranks_receive_many_chunks(pool4):
    """thd cuts every document over the 4 ranks: the ranks receive chunks from each of the 3 others, so
    with the received K/V kept (``kv_backward="save"``) the group takes every needed row at once
    (``needed_whole``: ``exchange.WholeNeededTransport``) and attends them by bands: the own step and one
    more, fewer kernel calls than a call per chunk, one message a pair each way, the reference's out and
    gradients. Where the largest pair moves ``BAND_MIN_PIECE_ROWS`` rows a piece, and every pair
    ``BAND_MIN_DOCS_PER_PIECE`` times its largest document, each pair's rows go in up to ``BAND_GROUPS``
    pieces and step g attends piece g of every source: here (one row a piece, any document) four steps,
    four messages a pair each way; with one document a piece, as many as the pair that moves the fewest
    rows holds the longest document (32 positions, 8 on each rank) times.
    A group within ``ONE_BATCH_GROUP_LOCAL_MULTIPLE`` of the local rows on every rank goes in one batch (one
    post a group each way, its calls writing the band gradient in the order it goes home), a larger one
    pair by pair (a post a pair), exact either way with the same messages. The rule's two bounds each turn it off, on every rank alike (the transfers pair up only then).
    With a refetch, one group of every needed row is more than ``REFETCH_GROUP_LOCAL_MULTIPLE`` times a rank's
    local rows and the chunks stream, while with one row a piece the groups are as many as keep each within
    that multiple on every rank (four at one; more than ``BAND_GROUPS`` at a quarter; 0 turns it off), each
    in one batch, and backward fetches them again group by group, exact too. With one document a piece, the
    document bound leaves two or three groups where refetch needs four: the pairs that move 19 rows cut at 5
    rows a piece, which cuts the two 24-position documents (6 rows of the pair each) and the 32-position one
    (8): 20 of the pair's 38 rows, a share of 0.53. So the chunks stream where ``BAND_CUT_ROWS_SHARE`` is
    0.5 and the band mode takes the four groups the memory bound needs at 0.6, exact too."""
    whole = pool4.run(whole_a2a, "thd", "save")
    streamed = pool4.run(whole_a2a, "thd", "save", 99)
    grouped = pool4.run(whole_a2a, "thd", "save", None, None, (1, 0))
    by_documents = pool4.run(whole_a2a, "thd", "save", None, None, (1, 1))
    pair_by_pair = pool4.run(whole_a2a, "thd", "save", None, None, (1, 0), None, 0.0)
    for rank, ((on, steps, fwd, bwd, error, moved, fewest, posts, batched, _),
               (off, steps0, fwd0, bwd0, error0, moved0, *_),
               (on4, steps4, fwd4, bwd4, error4, moved4, _, posts4, batched4, ops4), (_, steps_docs, *_),
               (_, steps_pairs, fwd_pairs, bwd_pairs, error_pairs, moved_pairs, _, posts_pairs, batched_pairs,
                ops_pairs)) in enumerate(
            zip(whole, streamed, grouped, by_documents, pair_by_pair)):
        assert on and steps == 2 and not off and steps0 > 3 and on4 and steps4 == 5, (rank, steps, steps0, steps4)
        assert 1 < steps_docs - 1 == min(4, fewest // 8) < 4, (rank, steps_docs, fewest)
        assert max(error, error0, error4, error_pairs) < 1e-12, (rank, error, error0, error4, error_pairs)
        assert fwd < fwd0 and bwd < bwd0, (rank, fwd, fwd0, bwd, bwd0)
        assert moved == (moved[2],) * 3 and moved0[0] > moved0[2], (rank, moved, moved0)
        assert moved4 == moved_pairs == (4 * moved[2], 4 * moved[2], moved[2]), (rank, moved4, moved_pairs)
        # one step of every needed row (about three times the local rows) goes pair by pair, a post a round;
        # groups of about three quarters of them in one batch each; pair by pair when told to
        assert batched == 0 and posts == (3, 3), (rank, batched, posts)
        assert batched4 == 4 and posts4 == (4, 4), (rank, batched4, posts4)
        assert steps_pairs == 5 and batched_pairs == 0 and posts_pairs == (12, 12), (rank, posts_pairs)
        # a batch's gradients, which several ranks send back for one key row, sum into each buffer row
        # once (one ``sum_rows_`` a group); pair by pair each source's rows add on their own
        assert ops4[2] == batched4 and ops_pairs[2] == 0, (rank, ops4, ops_pairs)
        # the same calls; a batch gathers, places, selects and adds once a group, not once a source
        assert (fwd4, bwd4) == (fwd_pairs, bwd_pairs) and ops4[0] < ops_pairs[0] and ops4[1] < ops_pairs[1], (
            rank, ops4, ops_pairs)
    assert not any(on for on, *_ in pool4.run(whole_a2a, "thd", "save", None, 0.5))
    for group_multiple in (None, 1.0):
        refetched = pool4.run(whole_a2a, "thd", "refetch", None, None, None, group_multiple)
        assert not any(on for on, *_ in refetched) and max(r[4] for r in refetched) < 1e-12
    assert not any(on for on, *_ in pool4.run(whole_a2a, "thd", "refetch", None, None, (1, 0), 0.0))  # 0: off
    for group_multiple, groups in ((None, 4), (0.25, 5)):
        for on, steps, fwd, bwd, error, moved, _, posts, batched, ops in pool4.run(
                whole_a2a, "thd", "refetch", None, None, (1, 0), group_multiple):
            assert on and (steps - 1 == groups if group_multiple is None else steps - 1 >= groups), (on, steps)
            # a group's gradients sum in one op where some row comes back from several ranks (every one of
            # the four; of the smaller ones, any where none does takes one add_rows_)
            assert error < 1e-12 and (ops[2] == batched if group_multiple is None else 0 < ops[2] <= batched), (
                error, ops, batched)
            # every group's pieces fetched again in backward, beside their gradients going home
            assert moved[0] * 2 == moved[1] and moved[0] >= groups * moved[2] / 2, moved
            # groups within the local rows: one batch each, fetched twice and its gradients once
            assert batched == steps - 1 and posts == (batched, 2 * batched), (batched, posts)
    assert not any(on for on, *_ in pool4.run(whole_a2a, "thd", "refetch", None, None, (1, 1), None, None, 0.5))
    for on, steps, fwd, bwd, error, moved, _, posts, batched, _ in pool4.run(
            whole_a2a, "thd", "refetch", None, None, (1, 1), None, None, 0.6):
        assert on and steps - 1 == 4 and batched == 4 and posts == (4, 8), (on, steps, batched, posts)
        assert error < 1e-12, error


def grouped_order(min_piece):
    """The band mode at cp 4 over the thd documents of ``whole_a2a`` with the band constants ``min_piece``:
    per phase of one layer call, its posts and kernel calls in order ("post", or "call": a remote one, its
    segments full, or "own": causal)."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp import step_tables as tables_module
    from megatron_ext.testing.op_counter import KernelEvent, OpCounter, PostEvent

    ids = runs_to_doc_ids([(i + 1, 8 * (1 + i % 3)) for i in range(8)] + [(99, 32)])
    saved = tables_module.BAND_MIN_PIECE_ROWS, tables_module.BAND_MIN_DOCS_PER_PIECE
    tables_module.BAND_MIN_PIECE_ROWS, tables_module.BAND_MIN_DOCS_PER_PIECE = min_piece
    try:
        state = bdcp.BlockDiagCPState.build(ids, layout="thd", kv_exchange="a2a", attn_backend="dense",
                                            kv_backward="save")
        g = torch.Generator().manual_seed(3)
        q, k, v = (state.shard(torch.randn(ids.shape[-1], 1, h, 8, generator=g, dtype=torch.float64))
                   .requires_grad_() for h in (4, 2, 2))
        counter = OpCounter(log=True)
        with bdcp.blockdiag_cp_step(state), counter:
            with counter.region("forward"):
                out = bdcp.blockdiag_cp_attention(q, k, v)
            with counter.region("backward"):
                out.sum().backward()
        return len(state.stream_plan("needed").steps), {
            phase: ["post" if isinstance(e, PostEvent) else "own" if e.causal else "call"
                    for e in counter.counts[phase].events if isinstance(e, (PostEvent, KernelEvent))]
            for phase in ("forward", "backward")}
    finally:
        tables_module.BAND_MIN_PIECE_ROWS, tables_module.BAND_MIN_DOCS_PER_PIECE = saved


@pytest.mark.timeout(120)
def test_groups_move_while_the_last_one_is_attended(pool4):
    """In groups, forward attends a group before it posts the last group's pieces, and backward sends a
    group's gradient home before it differentiates the last group; in one step, every piece is posted
    before the first remote call and every gradient after the last."""
    for min_piece, grouped in (((1, 0), True), (None, False)):
        for steps, order in pool4.run(grouped_order, min_piece or (256, 2)):
            assert (steps > 2) == grouped, (min_piece, steps)
            forward, backward = order["forward"], order["backward"]
            last_post = max(i for i, x in enumerate(forward) if x == "post")
            first_call = forward.index("call")
            assert (first_call < last_post) == grouped, forward
            last_call = max(i for i, x in enumerate(backward) if x == "call")
            first_post = backward.index("post")
            assert (first_post < last_call) == grouped, backward


_EVERYWHERE = {"WHOLE_MIN_CHUNKS_PER_RANK": 0, "BAND_MIN_PIECE_ROWS": 1, "BAND_MIN_DOCS_PER_PIECE": 0,
               "REFETCH_GROUP_LOCAL_MULTIPLE": 99.0}


def in_groups_everywhere(fn, *args):
    """(``fn(*args)``, the fewer needed steps of zigzag / a2a, save or refetch, over the short case) with
    the band mode on wherever it applies (a2a / halo, save or refetch, one row of ids, no window) and each
    pair's rows in up to ``BAND_GROUPS`` pieces of any size."""
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp import step_tables as tables_module

    saved = {name: getattr(tables_module, name) for name in _EVERYWHERE}
    for name, value in _EVERYWHERE.items():
        setattr(tables_module, name, value)
    try:
        states = [bdcp.BlockDiagCPState.build(make_doc_ids("short", 96, dist.get_world_size()), layout="zigzag",
                                              kv_exchange="a2a", attn_backend="dense", kv_backward=kv_backward)
                  for kv_backward in ("save", "refetch")]
        return fn(*args), min(len(state.stream_plan("needed").steps) for state in states)
    finally:
        for name, value in saved.items():
            setattr(tables_module, name, value)


@pytest.mark.timeout(300)
def test_groups_with_sinks_mla_heads_and_dropout(pool4):
    """The band mode's groups (forced on wherever the band mode applies) against the fp64 reference with a
    learnable sink and MLA head dims over grouped K/V, every layout and exchange, the received K/V kept or
    refetched group by group in backward; and dropout: a directional derivative of the group's loss, and
    masks replayed from the same seed."""
    from test_engine_dist import dropout_checks
    from test_variants import TOL, check_variant

    for errors, steps in pool4.run(in_groups_everywhere, check_variant, "short", None, "learnable", (4, 2, 12, 8),
                                   ("save", "refetch"), 96, ("contiguous", "zigzag", "balanced")):
        assert steps > 2, steps  # groups, not one step
        assert {key[2] for key in errors} == {"save", "refetch"}, sorted(errors)
        for key, errs in errors.items():
            assert max(errs) < TOL, (key, errs)
    for kv_backward in ("save", "refetch"):
        for r, steps in pool4.run(in_groups_everywhere, dropout_checks, "zigzag", "a2a", kv_backward):
            assert steps > 2, steps
            assert abs(r["analytic"] - r["numeric"]) <= 1e-6 * max(1.0, abs(r["numeric"])), (kv_backward, r)
            assert r["out"] == r["same_seed"], (kv_backward, r)
            assert r["other_seed"] != r["same_seed"] and r["clean"] != r["out"], (kv_backward, r)


def test_group_rows_are_the_pieces_the_transport_cuts():
    """``_group_rows`` (the refetch's bound on a band group) counts, per group and destination, the rows of
    ``exchange.Pieces(parts=...)``'s piece g of every source, as the transport cuts them."""
    from megatron_ext.blockdiag_cp.exchange import Pieces
    from megatron_ext.blockdiag_cp.step_tables import _group_rows

    rng = np.random.default_rng(0)
    for _ in range(100):
        cp, parts = int(rng.integers(2, 9)), int(rng.integers(1, 12))
        received = rng.integers(0, 50, (cp, cp))
        np.fill_diagonal(received, 0)
        want = [[sum(Pieces(parts=parts).span(int(n), g)[1] for n in received[:, dst]) for dst in range(cp)]
                for g in range(parts)]
        assert np.array_equal(_group_rows(received, parts), np.array(want)), (received, parts)


def batch_primitives(layout, kv_backward, one_batch=None):
    """``whole_a2a`` (band groups of one row a piece, any document, the rule's chunk bound off) with the
    transfer primitives counted: (whether the band mode is on, per band group whether it goes as one
    all-to-all, the ``all_to_all_single`` calls, the ``batch_isend_irecv`` calls, the largest error)."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp import step_tables as tables_module
    from test_backends import counted_collectives

    names = ("WHOLE_MIN_CHUNKS_PER_RANK", "BAND_MIN_PIECE_ROWS", "BAND_MIN_DOCS_PER_PIECE",
             "ONE_BATCH_GROUP_LOCAL_MULTIPLE")
    saved = {name: getattr(tables_module, name) for name in names}
    try:
        with counted_collectives() as calls:
            on, *_, error = whole_a2a(layout, kv_backward, 0, None, (1, 0), None, one_batch)[:5]
        for name, value in zip(names, (0, 1, 0, saved[names[-1]] if one_batch is None else one_batch)):
            setattr(tables_module, name, value)  # as whole_a2a ran: the groups it posted
        ids = runs_to_doc_ids([(i + 1, 8 * (1 + i % 3)) for i in range(8)] + [(99, 32)])
        state = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange="a2a", attn_backend="dense",
                                            kv_backward=kv_backward)
        groups = ([m.all_to_all for m in state.whole_delivery_on(torch.device("cpu")).messages]
                  if state.needed_whole() else [])
    finally:
        for name in names:
            setattr(tables_module, name, saved[name])
    return on, groups, calls["all_to_all_single"], calls["batch_isend_irecv"], error


@pytest.mark.timeout(120)
def test_a_batch_every_rank_sends_and_receives_in_is_one_all_to_all(pool4):
    """A band group in one batch where every rank sends rows and receives rows (thd: every document over
    every rank) goes as one ``all_to_all_single`` each way, not a send and a receive per peer: no
    ``batch_isend_irecv`` at all, exact. Pair by pair (the one-batch bound 0) every group posts peer by
    peer. Where a rank receives nothing in a group (contiguous: rank 0 attends only its own keys) the
    batch posts its pairs (an all-to-all is a collective every rank takes; the rule reads the global
    counts, so every rank decides alike), exact too."""
    for rank, (on, groups, a2a, p2p, error) in enumerate(pool4.run(batch_primitives, "thd", "save")):
        assert on and len(groups) == 4 and all(groups), (rank, groups)
        assert a2a > 0 and a2a % 8 == 0 and p2p == 0 and error < 1e-12, (rank, a2a, p2p, error)
    for rank, (on, groups, a2a, p2p, error) in enumerate(pool4.run(batch_primitives, "thd", "save", 0.0)):
        assert on and not any(groups) and a2a == 0 and p2p > 0 and error < 1e-12, (rank, groups, a2a, p2p)
    for rank, (on, groups, a2a, p2p, error) in enumerate(pool4.run(batch_primitives, "contiguous", "save")):
        assert on and groups and not any(groups) and a2a == 0 and p2p > 0 and error < 1e-12, (rank, groups, a2a)


def test_all_to_all_groups_are_those_every_rank_sends_and_receives_in():
    """``_every_rank_sends_and_receives`` (which band batches go as one all-to-all) says, per group, whether
    every rank sends and receives rows of ``exchange.Pieces(parts=...)``'s piece g, as the transport cuts
    them."""
    from megatron_ext.blockdiag_cp.exchange import Pieces
    from megatron_ext.blockdiag_cp.step_tables import _every_rank_sends_and_receives

    rng = np.random.default_rng(1)
    seen = set()
    for _ in range(200):
        cp, parts = int(rng.integers(2, 7)), int(rng.integers(1, 6))
        received = rng.integers(0, 12, (cp, cp)) * (rng.random((cp, cp)) < 0.8)
        np.fill_diagonal(received, 0)
        rows = np.array([[[Pieces(parts=parts).span(int(received[s, d]), g)[1] for d in range(cp)] for s in range(cp)]
                         for g in range(parts)])
        want = [bool((rows[g].sum(1) > 0).all() and (rows[g].sum(0) > 0).all()) for g in range(parts)]
        got = _every_rank_sends_and_receives(received, parts)
        assert got.tolist() == want, (received, parts)
        seen.update(want)
    assert seen == {True, False}
