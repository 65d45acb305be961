"""Where a kernel call's rows go (``blockdiag_cp.merge``): straight into the result, or merged in float32.

``MergePlan.of`` against a recount from the call tables; the op in bfloat16 at cp 2 keeps float32
buffers only as large as the rows several calls attend, and its output and gradients stay within
bfloat16's tolerance of the fp64 reference.
"""

import pytest
import torch

from megatron_ext.blockdiag_cp.merge import MergePlan, copied_rows
from megatron_ext.testing import pool_fixture, reference_attention, runs_to_doc_ids


def _rows(index, n):
    """A ``Rows`` (None, slice or tensor) over n rows as the list of rows it names."""
    if index is None:
        return list(range(n))
    if isinstance(index, slice):
        return list(range(n))[index]
    return index.tolist()


def _random_steps(seed, rows=(1, 40), steps=(1, 5)):
    """Per step, per call, sorted query rows of a random table: scattered rows, or runs (odd seeds) as most
    calls' rows are; rows of one to many writers."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(*rows, (1,), generator=g))
    table = []
    for _ in range(int(torch.randint(*steps, (1,), generator=g))):
        calls = []
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):
            picked = torch.randperm(n, generator=g)[:int(torch.randint(1, n + 1, (1,), generator=g))]
            if seed % 2:
                start = int(torch.randint(0, n, (1,), generator=g))
                picked = torch.arange(start, int(torch.randint(start + 1, n + 1, (1,), generator=g)))
            calls.append(torch.sort(picked).values)
        table.append(calls)
    return n, table


@pytest.mark.parametrize("seed", range(12))
def test_merge_plan_against_a_recount_of_the_calls(seed):
    rows, steps = _random_steps(seed)
    also = torch.tensor([0]) if seed % 6 == 5 else None
    plan = MergePlan.of(steps, rows, "cpu", also_merged=also)

    writers = [0] * rows
    for calls in steps:
        for rows_of_call in calls:
            for r in rows_of_call.tolist():
                writers[r] += 1
    merged = [r for r in range(rows) if writers[r] >= 3 or (also is not None and r == 0)]
    paired = {r for r in range(rows) if writers[r] == 2 and r not in merged}
    assert _rows(plan.merged, rows) == merged if merged else plan.merged_count == 0
    assert plan.merged_count == len(merged)
    never = [r for r in range(rows) if writers[r] == 0 and r not in merged]
    assert plan.covered == (not never)
    assert (_rows(plan.uncovered, rows) if never else plan.uncovered) == (never or None)
    seen, needs_zeros, written = set(), False, set()
    for calls, shares in zip(steps, plan.calls):
        assert len(calls) == len(shares)
        for rows_of_call, share in zip(calls, shares):
            call_rows = rows_of_call.tolist()
            mine = [r for r in call_rows if r in merged]
            late = [r for r in call_rows if r in paired and r in written]  # a pair's second writer
            written |= {r for r in call_rows if r in paired}
            own = [r for r in call_rows if r not in merged and r not in late]
            assert share.writes == bool(own)
            assert share.merges == bool(mine)
            if late:
                source, target = share.adds
                assert [call_rows[i] for i in _rows(source, len(call_rows))] == late
                assert _rows(target, rows) == late
            else:
                assert share.adds is None
            if own and (late or (mine and 2 * len(own) <= len(call_rows))):  # it writes only its own rows
                source, target = share.alone
                assert [call_rows[i] for i in _rows(source, len(call_rows))] == own
                assert _rows(target, rows) == own
            else:
                assert share.alone is None
            if mine:
                # the call's merged rows, in its order, land on their buffer rows
                assert [call_rows[i] for i in _rows(share.source, len(call_rows))] == mine
                assert _rows(share.target, plan.merged_count) == [merged.index(r) for r in mine]
                assert share.fresh == (not seen & set(mine))
                needs_zeros |= not share.fresh and not set(mine) <= seen  # merged into before any copy
                seen |= set(mine)
    needs_zeros |= not set(merged) <= seen  # a merged row no call writes
    assert plan.needs_zeros == needs_zeros


def _through(plan, steps, rows, seed, dtype=torch.bfloat16):
    """Forward out / lse and a gradient through ``plan`` as the op takes its calls (``Result.take_output``,
    ``Result.take``), for random call outputs of ``dtype``."""
    from megatron_ext.blockdiag_cp.merge import Accumulator, Result
    from megatron_ext.blockdiag_cp.merge import device_rows

    g = torch.Generator().manual_seed(1000 + seed)
    H, D = 3, 5
    out = Result(plan, H, D, dtype, torch.float32, "cpu", with_lse=True)
    acc = Accumulator(plan.merged_count, H, D, torch.float32, "cpu", zeros=plan.needs_zeros)
    grad = Result(plan, H, D, dtype, torch.float32, "cpu", with_lse=False)
    buffer = (torch.zeros if plan.needs_zeros else torch.empty)(plan.merged_count, H, D)
    for calls, shares in zip(steps, plan.calls):
        for q_index, share in zip(calls, shares):
            n = q_index.numel()
            o = torch.randn(n, H, D, generator=g).to(dtype)
            lse = 3 * torch.randn(n, H, generator=g)
            gq = torch.randn(n, H, D, generator=g).mul(10 ** torch.randn(n, 1, 1, generator=g)).to(dtype)
            index = device_rows(q_index, rows, "cpu")
            out.take_output(index, share, o, lse, acc)
            grad.take(index, share, gq, buffer)
    value, lse = out.finish(acc.out, acc.lse)
    return value, lse, grad.finish(buffer)[0]


@pytest.mark.parametrize("seed", range(16))
def test_merge_ends_give_the_bits_of_the_buffer_round_trip(seed):
    """``ends`` "forward" and "gradient" against "none" (first copied into the float32 buffer, written back
    at the end): the same out, lse and gradient bits; a merged row is opened (forward) by its second writer
    at most once, closed by its last at most once, the rest written back; no call merges more than once,
    but one that closes some rows and merges the rest where nothing is then written back."""
    _ends_against_round_trip(seed)


def _ends_against_round_trip(seed):
    """``test_merge_ends_give_the_bits_of_the_buffer_round_trip``'s checks; {ends: calls that split}."""
    rows, steps = _random_steps(seed, rows=(4, 48), steps=(2, 7))
    plans = {ends: MergePlan.of(steps, rows, "cpu", ends=ends) for ends in ("none", "forward", "gradient")}
    want = _through(plans["none"], steps, rows, seed)
    fwd = _through(plans["forward"], steps, rows, seed)
    bwd = _through(plans["gradient"], steps, rows, seed)
    written = torch.zeros(rows, dtype=torch.bool)
    for calls in steps:
        for q_index in calls:
            written[q_index] = True
    for got, ends in ((fwd[:2], "forward"), (bwd[2:], "gradient")):
        for a, b in zip(got, want[:2] if ends == "forward" else want[2:]):
            assert torch.equal(a[written], b[written]), (seed, ends)
    total = writers_total(steps, rows)
    splits = {"forward": 0, "gradient": 0}
    for ends in ("forward", "gradient"):
        plan = plans[ends]
        writers = torch.zeros(rows, dtype=torch.long)
        opened, closed = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)
        split = 0
        for calls, shares in zip(steps, plan.calls):
            for q_index, share in zip(calls, shares):
                writers[q_index] += 1
                # one merge op a call at most, as with "none": opening or closing replaces it; but a call that
                # closes some rows and merges the rest (``partial``), where that leaves nothing to write back
                ops = share.merges + (share.opens is not None) + (share.closes is not None)
                split += ops == 2 and share.merges and share.closes is not None
                assert ops <= 1 or (ops == 2 and share.merges and share.closes is not None), (seed, ends)
                for field, counted in (("opens", opened), ("closes", closed)):
                    rows_of = getattr(share, field)
                    if rows_of is None:
                        continue
                    picked = q_index[_rows(rows_of[0], q_index.numel())]
                    assert picked.tolist() == _rows(rows_of[2 if field == "closes" else 1], rows)
                    counted[picked] += 1
                    if field == "opens":
                        assert bool((writers[picked] == 2).all()), (seed, "opened by a row's second writer")
                    else:
                        assert bool((writers[picked] == total[picked]).all()), (seed, "closed by a row's last writer")
                    if ends == "gradient":
                        assert field == "closes" and not any(isinstance(r, torch.Tensor) for r in rows_of)
        merged = torch.from_numpy(plan.merged_mask)
        assert bool((opened <= 1).all() and (closed <= 1).all()) and not opened[~merged].any()
        back = [] if plan.write_back is None else _rows(plan.write_back[1], rows)
        assert back == [r for r in range(rows) if merged[r] and not closed[r]], (seed, ends)
        # split calls only where they take the write-back's place, and no more ops than it took
        assert not split or (not back and split <= 3), (seed, ends, split, back)
        splits[ends] += split
    return splits


def test_merge_ends_split_calls_somewhere():
    """The random tables above do exercise calls that close some rows and merge the rest."""
    splits = {"forward": 0, "gradient": 0}
    for seed in range(16):
        for ends, n in _ends_against_round_trip(seed).items():
            splits[ends] += n
    assert splits["forward"] > 0, splits


def writers_total(steps, rows):
    writers = torch.zeros(rows, dtype=torch.long)
    for calls in steps:
        for q_index in calls:
            writers[q_index] += 1
    return writers


def test_merge_ends_open_and_close_every_row_of_one_writer_per_source():
    """thd's shape: every call covers every row (the own keys, then one source each): the first writes the
    result, the second opens, the last closes; forward writes nothing back, and the gradient's last call
    adds the buffer straight into the result."""
    steps = [[torch.arange(10)] for _ in range(5)]
    forward = MergePlan.of(steps, 10, "cpu", ends="forward")
    assert [[(s.writes, s.merges, s.opens is not None, s.closes is not None) for s in c] for c in forward.calls] == [
        [(True, False, False, False)], [(False, False, True, False)], [(False, True, False, False)],
        [(False, True, False, False)], [(False, False, False, True)]]
    assert forward.write_back is None and not forward.needs_zeros
    gradient = MergePlan.of(steps, 10, "cpu", ends="gradient")
    assert [[(s.merges, s.fresh, s.closes is not None) for s in c] for c in gradient.calls] == [
        [(True, True, False)], [(True, False, False)], [(True, False, False)], [(True, False, False)],
        [(False, False, True)]]
    assert gradient.write_back is None
    for seed in range(3):
        want = _through(MergePlan.of(steps, 10, "cpu"), steps, 10, seed)
        for got in (_through(forward, steps, 10, seed)[:2], _through(gradient, steps, 10, seed)[2:]):
            assert all(torch.equal(a, b) for a, b in zip(got, want[:2] if len(got) == 2 else want[2:]))


def _copies_into_result(plan, steps, rows):
    """Rows the calls write into the result before a later call reads them (the first writer's copy of a
    merged or paired row), counted from the plan's shares."""
    copied = 0
    for calls, shares in zip(steps, plan.calls):
        for q_index, share in zip(calls, shares):
            if share.writes:
                copied += (len(_rows(share.alone[0], q_index.numel())) if share.alone is not None
                           else q_index.numel())
    return copied


def test_a_first_writer_the_next_call_merges_keeps_its_output():
    """thd's shape with a padding row: the own call covers every row but the last, one source after it
    covers the same rows. The own call's output is kept (written nowhere) and the second call merges it
    and its own straight into the result (forward) or adds them there (dq): no copy first, the same bits.
    A first writer that covers every row lends the result its output instead, and one whose rows two
    later calls read keeps it until both have."""
    rows = 10
    cases = {
        "pair": [[torch.arange(9)], [torch.arange(9)]],
        "opened": [[torch.arange(9)], [torch.arange(9)], [torch.arange(9)]],
        "two readers": [[torch.arange(9)], [torch.arange(5)], [torch.arange(5, 9)]],
    }
    for name, steps in cases.items():
        for ends in ("forward", "gradient"):
            plan = MergePlan.of(steps, rows, "cpu", ends=ends)
            first = plan.calls[0][0]
            kept = ends == "forward" or name != "opened"  # dq opens nothing: its three-writer rows are buffered
            assert (first.keeps is not None) == kept, (name, ends)
            if kept:
                readers = [s for c in plan.calls[1:] for s in c if s.adds_from or s.opens_from]
                assert first.keeps[1] == len(readers) == (2 if name == "two readers" else 1), (name, ends)
                assert not first.writes and _copies_into_result(plan, steps, rows) == 0, (name, ends)
            for seed in range(3):
                want = _through(MergePlan.of(steps, rows, "cpu"), steps, rows, seed)
                got = _through(plan, steps, rows, seed)
                pick = slice(0, 2) if ends == "forward" else slice(2, 3)
                assert all(torch.equal(a[:9], b[:9]) for a, b in zip(got[pick], want[pick])), (name, ends, seed)
                assert not got[2][9].any() and not got[0][9].any()  # the padding row stays zero
    # backward with the own keys last: two remote calls on scattered rows first, then the own call over every
    # row, which lends dq its output and adds both kept outputs there (one op each, as in place)
    scattered = [[torch.tensor([1, 4, 6])], [torch.tensor([2, 3, 8])], [torch.arange(rows)]]
    plan = MergePlan.of(scattered, rows, "cpu", ends="gradient")
    assert [plan.calls[s][0].keeps is not None for s in range(2)] == [True, True]
    assert len(plan.calls[2][0].adds_from) == 2 and copied_rows(plan, scattered) == 0  # lent
    for seed in range(3):
        want = _through(MergePlan.of(scattered, rows, "cpu"), scattered, rows, seed)[2]
        assert torch.equal(_through(plan, scattered, rows, seed)[2], want), seed
    # a forward reader over every row merges a kept output into a result it does not lend (in float32 the
    # eager merge would otherwise write the result before reading the call's rows there)
    cover = [[torch.arange(9)], [torch.arange(rows)]]
    plan = MergePlan.of(cover, rows, "cpu", ends="forward")
    assert plan.calls[0][0].keeps is not None
    for seed in range(3):
        want = _through(MergePlan.of(cover, rows, "cpu"), cover, rows, seed, dtype=torch.float32)
        got = _through(plan, cover, rows, seed, dtype=torch.float32)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), seed
    # every row of the first call: lent, not kept
    lend = MergePlan.of([[torch.arange(rows)], [torch.arange(rows)]], rows, "cpu", ends="forward")
    assert lend.calls[0][0].keeps is None and lend.calls[0][0].writes
    # a second writer that reads two first writers: neither is kept
    split = [[torch.arange(5)], [torch.arange(5, 9)], [torch.arange(9)]]
    assert all(s.keeps is None for c in MergePlan.of(split, rows, "cpu", ends="forward").calls for s in c)


def test_a_pair_added_in_bfloat16_rounds_once_as_through_float32():
    """Why a row's two gradients add in the result's dtype: bf16 + bf16 is computed in float32
    and rounded once, the same bits as the float32 buffer's sum written back."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(4096, generator=g).mul(10 ** torch.randn(4096, generator=g)).to(torch.bfloat16)
            for _ in range(2))
    through_fp32 = (a.float() + b.float()).to(torch.bfloat16)
    in_place = a.clone().add_(b)
    indexed = a.clone().index_add_(0, torch.arange(4096), b)
    assert torch.equal(in_place, through_fp32) and torch.equal(indexed, through_fp32)


# -- the op in bfloat16 at cp 2 ------------------------------------------------------------------------

pool2 = pool_fixture(2)


def _short_then_long(S: int = 256) -> torch.Tensor:
    runs = [(i + 1, 9 + (5 * i) % 13) for i in range(12)]
    return runs_to_doc_ids(runs + [(99, S - sum(n for _, n in runs))])


def bf16_case(exchange):
    """Float32 buffers the forward allocates (their first dims), the rows merged, and the errors of out
    and dq / dk / dv in bfloat16 against the fp64 reference."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp.chunks import chunk_kind
    from megatron_ext.testing.op_counter import OpCounter, OpEvent

    ids = _short_then_long()
    S = ids.shape[-1]
    g = torch.Generator().manual_seed(11)
    q, k, v, w = (torch.randn(S, 1, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = reference_attention(*ref, ids)
    (out_ref * w).sum().backward()
    state = bdcp.BlockDiagCPState.build(ids, layout="zigzag", kv_exchange=exchange, attn_backend="dense")
    local = [state.shard(t).to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    counter = OpCounter(log=True)
    with bdcp.blockdiag_cp_step(state), counter:
        with counter.region("forward"):
            out = bdcp.blockdiag_cp_attention(*local)
        with counter.region("backward"):
            (out.double() * state.shard(w)).sum().backward()
    fp32_rows = sorted({e.outputs[0][0][0] for e in counter.counts["forward"].events
                        if isinstance(e, OpEvent) and e.outputs and e.outputs[0][1] == torch.float32
                        and len(e.outputs[0][0]) == 3})
    merged = state.merges_on(chunk_kind(state.kv_exchange), torch.device("cpu")).merged_count
    merge_ops = sum(isinstance(e, OpEvent) and e.name == "merge_rows_" for e in counter.counts["forward"].events)
    kind = chunk_kind(state.kv_exchange)
    key_merged = state.key_merges_on(kind, torch.device("cpu"))[0].merged_count
    sent = sum(int(t.numel()) for t in state.plan_for(None).exchange.send_index)
    backward_fp32_rows = sorted({o[0][0] for e in counter.counts["backward"].events if isinstance(e, OpEvent)
                                 for o in e.outputs if o[1] == torch.float32 and len(o[0]) == 3})

    def rel(a, b):
        return float((a.double() - b).abs().max() / b.abs().max())

    errors = [rel(out, state.shard(out_ref.detach()))] + [rel(t.grad, state.shard(r.grad)) for t, r in zip(local, ref)]
    return {"fp32_rows": fp32_rows, "merged": merged, "merge_ops": merge_ops, "rows": state.local_len,
            "key_merged": key_merged, "sent": sent, "backward_fp32_rows": backward_fp32_rows, "errors": errors}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("exchange", ["a2a", "allgather"])
def test_bf16_op_keeps_float32_only_for_merged_rows(pool2, exchange):
    for rank, r in enumerate(pool2.run(bf16_case, exchange)):
        # the long document's rows see two calls at cp 2: merged in the bf16 result, in place; no row sees
        # three, so no [rows, H, D] float32 buffer at all
        assert r["merged"] == 0 and r["merge_ops"] >= 1, (rank, r)
        assert max(r["fp32_rows"], default=0) <= r["merged"], (rank, r)
        if exchange == "a2a":
            # a key row sent to the other rank has its own call's gradient and the one coming back: added
            # in place in dK / dV, so no float32 key buffer either (allgather's ring keeps returned rows in one)
            assert r["sent"] > 0 and r["key_merged"] == 0, (rank, r)
            assert not [n for n in r["backward_fp32_rows"] if n > 1], (rank, r)
        assert max(r["errors"]) < 2e-2, (rank, r)  # bfloat16's tolerance


def held_key_gradients(case, dtype):
    """This rank's float32 key-gradient buffer rows, its local rows, and how many of its backward kernel
    calls' dK tensors are still alive as the op hands dK back (a lent one is dK itself), after a cp 2
    allgather layer call in ``dtype`` (the real dense kernel, each dK in q's dtype watched by a weak
    reference); and whether a ``KeyGradients`` buffer existed as the first backward kernel call began."""
    import weakref

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp import kernels, merge
    from megatron_ext.testing import override_kernel

    S = 256
    if case == "one document":
        ids, layout = torch.ones(S, dtype=torch.long), "zigzag"
    else:  # rank 1 reads rank 0's last 8 rows only
        ids, layout = runs_to_doc_ids([(1, S // 2 - 8), (2, 16), (3, S // 2 - 8)]), "contiguous"
    dense = kernels.kernel_for("dense")
    alive, made, buffered = [], [], []

    def backward(*args, **kwargs):
        if not alive:  # the first backward call: is any key-gradient buffer there yet?
            buffered.append(any(grads._buffer is not None for grads in made))
        gq, gk, gv = dense.backward(*args, **kwargs)
        gk = gk.to(args[1].dtype).contiguous()  # as a CUDA kernel hands it: what the result may take as it is
        mark = [True]
        weakref.finalize(gk, mark.clear)
        alive.append(mark)
        return gq, gk, gv

    state = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange="allgather", attn_backend="dense")
    g = torch.Generator().manual_seed(3)
    q, k, v = (state.shard(torch.randn(S, 1, 2, 16, generator=g)).to(dtype).requires_grad_() for _ in range(3))
    held = []
    k.register_hook(lambda grad: held.append(sum(bool(m) for m in alive)))  # as dK leaves the op
    make = merge.KeyGradients.__init__

    def watched(grads, *args, **kwargs):
        make(grads, *args, **kwargs)
        made.append(grads)

    merge.KeyGradients.__init__ = watched
    try:
        with override_kernel("dense", kernels.Kernel(dense.forward, backward)), bdcp.blockdiag_cp_step(state):
            bdcp.blockdiag_cp_attention(q, k, v).float().sum().backward()
    finally:
        merge.KeyGradients.__init__ = make  # the pool's worker runs the next test
    plan = state.key_merges_on("ring", torch.device("cpu"), narrow=dtype != torch.float32)[0]
    return {"merged": plan.merged_count, "rows": state.local_len, "held": held[0], "calls": len(alive),
            "buffer at the first call": buffered[0], "buffers": len(made)}


@pytest.mark.timeout(120)
def test_key_gradients_are_not_held_beside_a_buffer_as_large(pool2):
    """A key row other ranks read comes back into the float32 buffer (the ring). Where that holds half a
    rank's rows or more, the own call's dK / dV go there too if that holds less than keeping them as the
    result from the first call to the end beside the buffer. One document, zigzag: rank 1 sends both
    chunks, so every row is in the buffer; rank 0 sends its first (half): in float32 every row goes there,
    in bfloat16 (a result of half the bytes: the same either way) its own call's dK is the result. Where
    a rank sends a few rows (rank 0's last 8, contiguous), its own call's dK is the result. The buffer is
    made after the first call's kernel (its workspace gone), not beside it."""
    for dtype in (torch.float32, torch.bfloat16):
        one = pool2.run(held_key_gradients, "one document", dtype)
        assert all(r["buffers"] == 1 and not r["buffer at the first call"] for r in one), one
        assert one[1]["merged"] == one[1]["rows"] and one[1]["held"] == 0 and one[1]["calls"] >= 2, (dtype, one)
        if dtype == torch.float32:
            assert one[0]["merged"] == one[0]["rows"] and one[0]["held"] == 0, one
        else:
            assert 2 * one[0]["merged"] == one[0]["rows"] and one[0]["held"] == 1, one
    few = pool2.run(held_key_gradients, "few rows", torch.bfloat16)
    assert few[0]["merged"] == 8 and few[0]["held"] == 1, few
    assert few[1]["merged"] == 0 and few[1]["held"] == 1, few  # nothing sent: every row the own call's
