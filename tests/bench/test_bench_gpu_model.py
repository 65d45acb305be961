"""scripts/bench/gpu_model.py: the replay records what the op counter counts, and prices it as documented.

At cp 2 on a small short-and-long pack (zigzag, a2a and the all-gather ring, null kernel, bf16):
the recorded layer calls' counts equal ``layer_calls``' for the same state, and the event log
holds one event per counted launching op, kernel call and message, with the counted bytes. The
pricing on hand-made events (an op, a transfer waited on, a kernel call) and a case row's ideal
and roofline equal the arithmetic written out here.
"""

import json
import os
import sys

import numpy as np
import pytest
import torch

from megatron_ext.testing import WorkerPool, runs_to_doc_ids

BENCH_SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "scripts", "bench")


def _bench():
    if BENCH_SCRIPTS not in sys.path:
        sys.path.insert(0, BENCH_SCRIPTS)
    import gpu_model

    return gpu_model


def _ids() -> torch.Tensor:
    runs = [(i + 1, 6 + (5 * i) % 11) for i in range(8)]
    return runs_to_doc_ids(runs + [(99, 192 - sum(n for _, n in runs))])


def record_and_count(exchange: str):
    """On every rank: the replay's recorded layer calls and ``layer_calls``' counts of the same state."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing.op_counter import KernelEvent, OpEvent, PostEvent, layer_calls
    from megatron_ext.testing.overrides import override_kernel

    gm = _bench()

    def build():  # one fresh state each: a step's first call builds the state's device tables
        return bdcp.BlockDiagCPState.build(_ids(), layout="zigzag", kv_exchange=exchange, attn_backend="dense")

    state = build()
    run = gm.RUN_DIMS["gqa"]
    q, k, v = (torch.randn(state.local_len, 1, h, run.d).to(torch.bfloat16) for h in (run.hq, run.hkv, run.hkv))
    with override_kernel("dense", gm._null_kernel()):
        recorded = gm.record_layers(state, q, k, v, layers=2)  # a step's first call and a steady one
        counted = layer_calls(build(), q, k, v, layers=2)
    out = []
    for rec, cnt in zip(recorded, counted):
        for (c, _, _), want in zip(rec, cnt):
            ev = c.events
            messages = [m for e in ev if isinstance(e, PostEvent) for m in e.messages]
            out.append({
                "recorded": (c.summary(), c.bytes_sent, c.bytes_received, dict(c.ops), c.posts),
                "counted": (want.summary(), want.bytes_sent, want.bytes_received, dict(want.ops), want.posts),
                "logged": {"kernel_calls": sum(isinstance(e, KernelEvent) for e in ev),
                           "posts": sum(isinstance(e, PostEvent) for e in ev),
                           "launching": sum(isinstance(e, OpEvent) for e in ev), "transfers": len(messages),
                           "bytes_sent": sum(b for s, b, _ in messages if s),
                           "bytes_received": sum(b for s, b, _ in messages if not s)},
                "waits_after_posts": gm_waits_follow_posts(ev)})
    return out


def gm_waits_follow_posts(events) -> bool:
    from megatron_ext.testing.op_counter import PostEvent, WaitEvent

    posted = set()
    for e in events:
        if isinstance(e, PostEvent):
            posted.add(e.post)
        elif isinstance(e, WaitEvent) and e.post not in posted:
            return False
    return True


@pytest.mark.timeout(120)
def test_recorded_counts_are_the_op_counters():
    with WorkerPool(2) as pool:
        for exchange in ("a2a", "allgather"):
            for rank, calls in enumerate(pool.run(record_and_count, exchange, timeout=100)):
                for i, c in enumerate(calls):
                    assert c["recorded"] == c["counted"], (exchange, rank, i)
                    summary, sent, received, _, posts = c["recorded"]
                    assert c["logged"] == {"kernel_calls": summary["kernel_calls"], "posts": posts,
                                           "launching": summary["launching"], "transfers": summary["transfers"],
                                           "bytes_sent": sent, "bytes_received": received}, (exchange, rank, i)
                    assert 0 < posts <= summary["transfers"], (exchange, rank, i, posts)
                    assert c["waits_after_posts"], (exchange, rank, i)
                    assert summary["kernel_calls"] > 0 and summary["transfers"] > 0, (exchange, rank, i, c)


def attended_and_computed(ids, layout: str, exchange: str, window, relayout: str, model: str):
    """On every rank: the pairs its layout hands it (``attended_pairs``) and the pairs its recorded
    forward kernel calls covered (their FLOPs / (4 · Hq · D) at the model's dims), in a steady call."""
    gm = _bench()
    got = gm.replay_rank(ids, layout, exchange, window, model, relayout=relayout)
    target = gm.MODELS[model]
    return got["attended_pairs"], got["calls"][1]["forward"]["flops"] / (4 * target.hq * target.d)


@pytest.mark.timeout(120)
def test_attended_pairs_are_the_pairs_the_calls_cover():
    # The own roofline's work term is counted from the layout alone; the engine's calls must cover
    # exactly those pairs on every rank (no pair twice, none left out), and the ranks together every
    # document's pairs under the window.
    gm = _bench()
    thd_ids = runs_to_doc_ids([(1, 8), (2, 12), (3, 40), (4, 132)])
    cases = ((_ids(), "zigzag", "a2a", None, "none", "gqa"), (_ids(), "zigzag", "halo", 5, "none", "gqa"),
             (_ids(), "balanced", "allgather", None, "none", "gqa"), (thd_ids, "thd", "a2a", None, "none", "gqa"),
             (thd_ids, "thd", "a2a", None, "balanced", "gqa"), (_ids(), "zigzag", "ulysses", None, "none", "gqa_heads"))
    with WorkerPool(2) as pool:
        for ids, *case in cases:
            per_rank = pool.run(attended_and_computed, ids, *case, timeout=100)
            for attended, computed in per_rank:
                assert attended == pytest.approx(computed), case
            total = gm.document_pairs(ids, case[2])
            assert sum(a for a, _ in per_rank) == pytest.approx(total), case
            if case[1] != "ulysses":  # ulysses: every rank half the heads of every pair
                assert all(0 < a < total for a, _ in per_rank), case
    ids = torch.tensor([1] * 5 + [2] * 3 + [0] * 2)
    assert gm.position_pairs(ids, None).tolist() == [1, 2, 3, 4, 5, 1, 2, 3, 0, 0]
    assert gm.position_pairs(ids, 1).tolist() == [1, 2, 2, 2, 2, 1, 2, 2, 0, 0]
    assert int(gm.position_pairs(ids, 1).sum()) == gm.document_pairs(ids, 1)


def test_price_on_hand_made_events():
    from megatron_ext.testing.op_counter import KernelEvent, OpEvent, PostEvent, WaitEvent

    gm = _bench()
    hw = gm.H200(launch_s=1e-6, kernel_flops=1e12, backward_factor=2.0, hbm_bytes_per_s=1e9,
                 nvlink_bytes_per_s=1e8, ib_bytes_per_s=1e7)
    run, target = gm.Dims("run", 1, 1, 8), gm.Dims("model", 2, 2, 16)  # heads x2, dim x2
    bf16, fp32 = torch.bfloat16, torch.float32
    events = [
        # [100, 1, 8] fp32 in and out: 3200 B each, x4 at the model's dims -> 25600 B over HBM: 25.6 us
        OpEvent("add", (((100, 1, 8), fp32),), (((100, 1, 8), fp32),)),
        # 1600 B each way to rank 1 (same node): x (2 * 16) / (1 * 8) = 6400 B over NVLink: 64 us
        PostEvent(1, ((True, 1600, 1), (False, 1600, 1))),
        WaitEvent(1),
        # causal 4 x 4: 10 pairs -> 4 * 10 * 2 * 16 = 1280 FLOP (1.28 ns); bytes: q, k, v [4, 1, 8] bf16
        # 64 B each x4 = 768, out 256, lse [4, 1] fp32 16 B x2 = 32 -> 1056 B: 1.056 us
        KernelEvent(False, (4,), (4,), True, None, (((4, 1, 8), bf16), ((4, 1, 8), bf16), ((4, 1, 8), bf16))),
    ]
    got = gm.price(events, run, target, hw, lambda peer: (0 if peer is None else peer) // 2)
    # host issues at 1, 2, 3 us; the add ends at 1 + 25.6; the transfer starts there, ends at 90.6;
    # the wait holds the stream until then; the kernel ends at 91.656 us
    assert got["modeled_s"] == pytest.approx(91.656e-6)
    assert got["elementwise_s"] == pytest.approx(25.6e-6) and got["link_s"] == pytest.approx(64e-6)
    assert got["kernel_s"] == pytest.approx(1.056e-6) and got["launch_s"] == pytest.approx(3e-6)
    assert got["flops"] == 1280
    # the same transfer to rank 2 (the other node) goes over IB: 640 us
    events[1] = PostEvent(1, ((True, 1600, 2), (False, 1600, 2)))
    got = gm.price(events, run, target, hw, lambda peer: (0 if peer is None else peer) // 2)
    assert got["modeled_s"] == pytest.approx((26.6 + 640 + 1.056) * 1e-6)
    # launch-bound: 100 tiny ops take 100 launches
    tiny = [OpEvent("add", (((1,), fp32),), (((1,), fp32),))] * 100
    assert gm.price(tiny, run, target, hw, lambda p: 0)["modeled_s"] == pytest.approx(100e-6 + 16 / 1e9)
    # a call on a head shard (ulysses: one of the run's two query heads) does the FLOPs of its heads
    shard = KernelEvent(False, (4,), (4,), True, None, (((4, 1, 8), bf16),) * 3)
    assert gm.price([shard], gm.Dims("run", 2, 2, 8), target, hw, lambda p: 0)["flops"] == 640


def test_a_merge_is_priced_at_the_rows_it_merges():
    """``merge_rows_`` reads the call's merged rows of out / lse and reads and writes as many buffer rows,
    whatever the sizes of the tensors it indexes; the op as the counter records it (an OpEvent)."""
    from megatron_ext.blockdiag_cp.merge_kernel import merge_rows_
    from megatron_ext.testing.op_counter import OpCounter

    gm = _bench()
    run, target = gm.Dims("run", 1, 1, 8), gm.Dims("model", 2, 2, 16)  # [.., 1, 8] -> x4, [.., 1] -> x2
    counter = OpCounter(log=True)
    acc_out, acc_lse = torch.zeros(50, 1, 8), torch.zeros(50, 1)
    out, lse = torch.zeros(30, 1, 8, dtype=torch.bfloat16), torch.zeros(30, 1)
    source, target_rows = torch.arange(10), torch.arange(10) * 2
    with counter, counter.region("scattered"):
        merge_rows_(acc_out, acc_lse, out, lse, source, target_rows)
    with counter, counter.region("runs"):
        merge_rows_(acc_out[:30], acc_lse[:30], out, lse)
    result, result_lse = torch.zeros(40, 1, 8, dtype=torch.bfloat16), torch.zeros(40, 1)
    result_rows = torch.arange(10) + 5
    with counter, counter.region("closed"):  # a last writer: the buffer's rows read, the result's written
        merge_rows_(acc_out, acc_lse, out, lse, source, target_rows, result, result_lse, result_rows)
    (scattered,), (runs,) = counter.counts["scattered"].events, counter.counts["runs"].events
    (closed,) = counter.counts["closed"].events
    assert scattered.name == runs.name == closed.name == "merge_rows_"
    # 10 rows: out 10 x 8 x 2 B x4 = 640, lse 10 x 4 B x2 = 80; buffer 2 x (10 x 8 x 4 x4 + 10 x 4 x2) =
    # 2 x 1360; the two index tensors 80 B each
    assert gm._op_bytes(scattered, run, target) == pytest.approx(640 + 80 + 2 * 1360 + 160)
    assert gm._op_bytes(runs, run, target) == pytest.approx(3 * (640 + 80 + 2 * 1360))
    # closed: out and lse read (720), the buffer's rows read once (1360), the result's written (bf16: 720),
    # three index tensors
    assert gm._op_bytes(closed, run, target) == pytest.approx(720 + 1360 + 720 + 240)


def test_row_copies_and_adds_are_priced_at_the_rows_they_move():
    """``copy_rows_`` reads the source's moved rows and writes as many destination rows, each in its own
    dtype, whatever the tensors' sizes; ``add_rows_`` also reads the destination's rows."""
    from megatron_ext.blockdiag_cp.merge_kernel import add_rows_, copy_rows_
    from megatron_ext.testing.op_counter import OpCounter

    gm = _bench()
    run, target = gm.Dims("run", 1, 1, 8), gm.Dims("model", 2, 2, 16)  # [.., 1, 8] -> x4, [.., 1, 1] -> x2
    counter = OpCounter(log=True)
    buffer, grad = torch.zeros(50, 1, 8), torch.zeros(30, 1, 8, dtype=torch.bfloat16)
    source, target_rows = torch.arange(10), torch.arange(10) * 2
    with counter, counter.region("add"):
        add_rows_(buffer, grad, source, target_rows)
    with counter, counter.region("copy"):  # a write-back: the buffer's rows into the bf16 result, a run
        copy_rows_(grad[:10], buffer, target_rows)
    lse_dst, lse_src = torch.zeros(40, 1, 1), torch.zeros(30, 1, 1)
    with counter, counter.region("lse"):
        copy_rows_(lse_dst, lse_src, source, target_rows)
    (add,), (copy,), (lse,) = (counter.counts[k].events for k in ("add", "copy", "lse"))
    assert (add.name, copy.name, lse.name) == ("add_rows_", "copy_rows_", "copy_rows_")
    # 10 rows: bf16 10 x 8 x 2 B x4 = 640, float32 1280; the index tensors 80 B each
    assert gm._op_bytes(add, run, target) == pytest.approx(640 + 2 * 1280 + 160)
    assert gm._op_bytes(copy, run, target) == pytest.approx(1280 + 640 + 80)
    assert gm._op_bytes(lse, run, target) == pytest.approx(2 * 10 * 4 * 2 + 160)  # [rows, H, 1]: lse-like, x2


def test_row_sums_are_priced_at_their_arrivals_and_each_target_row_once():
    """``sum_rows_`` reads each arriving row and reads and writes each buffer row it adds to once, whatever
    the tensors' sizes: against ``add_rows_`` over the same arrivals, which reads and writes a buffer row once
    an arrival."""
    from megatron_ext.blockdiag_cp.merge import RowSums
    from megatron_ext.blockdiag_cp.merge_kernel import add_rows_, sum_rows_
    from megatron_ext.testing.op_counter import OpCounter

    gm = _bench()
    run, target = gm.Dims("run", 1, 1, 8), gm.Dims("model", 2, 2, 16)  # [.., 1, 8] -> x4
    counter = OpCounter(log=True)
    buffer, grad = torch.zeros(50, 1, 8), torch.zeros(30, 1, 8, dtype=torch.bfloat16)
    rows, slots = np.arange(12), np.arange(4).repeat(3)  # 12 arrivals, 4 buffer rows three times each
    sums = RowSums.of(rows, slots, "cpu")
    with counter, counter.region("sum"):
        sum_rows_(buffer, grad, sums.source, sums.offsets, sums.target)
    with counter, counter.region("add"):
        add_rows_(buffer, grad, torch.from_numpy(rows), torch.from_numpy(slots))
    (summed,), (added,) = counter.counts["sum"].events, counter.counts["add"].events
    assert summed.name == "sum_rows_"
    # arrivals: bf16 12 x 8 x 2 B x4 = 768 read; 4 float32 rows (4 x 8 x 4 B x4 = 512) read and written;
    # source 96 B, offsets 40, target 32
    assert gm._op_bytes(summed, run, target) == pytest.approx(768 + 2 * 512 + 96 + 40 + 32)
    assert gm._op_bytes(added, run, target) == pytest.approx(768 + 2 * 3 * 512 + 2 * 96)


def test_a_kv_gather_is_priced_at_the_rows_it_moves():
    """``gather_kv_rows_`` writes its destination's rows and reads as many of K and V, whatever their sizes."""
    from megatron_ext.blockdiag_cp.merge_kernel import gather_kv_rows_
    from megatron_ext.testing.op_counter import OpCounter

    gm = _bench()
    run, target = gm.Dims("run", 1, 1, 8), gm.Dims("model", 2, 2, 16)  # [.., 1, 16] -> x4
    counter = OpCounter(log=True)
    k, v, index = torch.zeros(50, 1, 8, dtype=torch.bfloat16), torch.zeros(50, 1, 8, dtype=torch.bfloat16), torch.arange(10)
    with counter, counter.region("gather"):
        gather_kv_rows_(torch.empty(10, 1, 16, dtype=torch.bfloat16), k, v, index)
    (event,) = counter.counts["gather"].events
    # 10 rows of K and V: bf16 10 x 16 x 2 B x4 = 1280 written, as many read; the index 80 B
    assert event.name == "gather_kv_rows_" and gm._op_bytes(event, run, target) == pytest.approx(2 * 1280 + 80)


def test_an_out_tensor_is_priced_as_written_not_read():
    """``torch.add(a, b, out=c)`` and ``index_select(..., out=)`` (a dq's pair added into the result, a send's
    half gathered into its buffer): the counter records ``out`` as the op's output only, so the price is
    a and b read and c written once, as the in-place ``add_`` that it replaces reads two and writes one."""
    from megatron_ext.testing.op_counter import OpCounter

    gm = _bench()
    run = target = gm.Dims("run", 1, 1, 8)
    a, b, c = (torch.zeros(10, 1, 8, dtype=torch.bfloat16) for _ in range(3))
    counter = OpCounter(log=True)
    with counter, counter.region("out"):
        torch.add(a, b, out=c)
    with counter, counter.region("in place"):
        c.add_(b)
    buffer, rows, index = torch.zeros(4, 1, 16), torch.ones(10, 1, 8), torch.arange(4)
    with counter, counter.region("gather"):
        torch.index_select(rows, 0, index, out=buffer[..., :8])
    (added,), (in_place,) = counter.counts["out"].events, counter.counts["in place"].events
    (gathered,) = counter.counts["gather"].events
    assert len(added.inputs) == 2 and gm._op_bytes(added, run, target) == 3 * 160
    assert gm._op_bytes(added, run, target) == gm._op_bytes(in_place, run, target)
    assert gathered.outputs == (((4, 1, 8), torch.float32),)
    assert gm._op_bytes(gathered, run, target) == 2 * 4 * 8 * 4 + 4 * 8  # rows read and written, the index


def shared_counts(layout: str, exchange: str, window, relayout: str):
    """On every rank: the steady layer call's kernel calls, launching ops and transfers, forward and
    backward, as the gpu_model replay records them with every rank running at once."""
    gm = _bench()
    got = gm.replay_rank(_ids(), layout, exchange, window, "gqa", relayout=relayout)
    c = got["calls"][1]
    return {f"{key}_{short}": c[phase][key] for phase, short in (("forward", "fwd"), ("backward", "bwd"))
            for key in ("kernel_calls", "launching", "transfers")}


@pytest.mark.timeout(300)
def test_alone_host_runs_each_ranks_own_ops_alone():
    # The ranks-alone host time stands in for the shared run's only if each rank issues the same ops
    # there: rank r of the fake process group makes the kernel calls, launching ops and transfers the
    # gloo run's rank r makes (two nodes' cost model included, and a relaid step's all-to-alls).
    import concurrent.futures
    import multiprocessing

    gm = _bench()
    spawn = multiprocessing.get_context("spawn")
    nodes = {"LOCAL_WORLD_SIZE": "2"}
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as alone:
        for cp, env, cases in ((2, {}, (("zigzag", "a2a", None, "none"), ("zigzag", "allgather", None, "none"),
                                        ("zigzag", "halo", 5, "none"), ("zigzag", "a2a", None, "balanced"))),
                               (4, nodes, (("balanced", "a2a", None, "none"),))):
            with WorkerPool(cp, env=env) as pool:
                for layout, exchange, window, relayout in cases:
                    shared = pool.run(shared_counts, layout, exchange, window, relayout, timeout=100)
                    per_rank = alone.submit(gm.alone_host, _ids(), layout, exchange, window, "gqa", cp, relayout,
                                            env, 2).result()
                    assert len(per_rank) == cp
                    for rank, (mine, theirs) in enumerate(zip(per_rank, shared)):
                        assert {key: mine[key] for key in theirs} == theirs, (exchange, relayout, rank)
                        assert 0 < mine["host_s_fwd"] < 1 and 0 < mine["host_s_bwd"] < 1
                        # on meta tensors the op issues the same calls, ops and transfers
                        assert mine["dispatch_counts"] == theirs, (exchange, relayout, rank)
                        assert 0 < mine["host_dispatch_s_fwd"] < 1 and 0 < mine["host_dispatch_s_bwd"] < 1
                    assert any(r["transfers_fwd"] for r in per_rank), (exchange, relayout)
    counts = {"kernel_calls_fwd": 2, "launching_fwd": 3, "transfers_fwd": 2,
              "kernel_calls_bwd": 2, "launching_bwd": 7, "transfers_bwd": 4}
    ranks = [{"host_s_fwd": 1e-3, "host_s_bwd": 4e-3, "host_dispatch_s_fwd": 3e-4, "host_dispatch_s_bwd": 5e-4,
              **counts, "dispatch_counts": dict(counts)},
             {"host_s_fwd": 2e-3, "host_s_bwd": 3e-3, "host_dispatch_s_fwd": 4e-4, "host_dispatch_s_bwd": 2e-4,
              **counts, "dispatch_counts": dict(counts)}]
    row = {"host_s_fwd": 5e-3, "host_s_bwd": 6e-3}
    gm.with_alone_host(row, ranks)
    assert row == {"host_s_fwd": 2e-3, "host_s_bwd": 4e-3, "host_shared_s_fwd": 5e-3, "host_shared_s_bwd": 6e-3,
                   "host_dispatch_s_fwd": 4e-4, "host_dispatch_s_bwd": 5e-4, "host_measured": "alone"}
    # a meta run that issued other ops than its CPU run stands for nothing: no dispatch figure
    ranks[1]["dispatch_counts"]["launching_bwd"] += 1
    row = {"host_s_fwd": 5e-3, "host_s_bwd": 6e-3}
    gm.with_alone_host(row, ranks)
    assert row["dispatch_counts_differ"] == [1] and "host_dispatch_s_fwd" not in row


def test_pairs_and_case_row_arithmetic():
    gm = _bench()
    assert gm.segment_pairs((4,), (4,), True, None) == 10
    assert gm.segment_pairs((4,), (4,), True, 1) == 1 + 2 + 2 + 2  # query i sees keys i - 1 .. i
    assert gm.segment_pairs((2,), (5,), False, None) == 10
    assert gm.segment_pairs((2,), (5,), False, 2) == 4 + 3  # query i sees keys i + 1 .. 4
    ids = torch.tensor([1] * 8 + [2] * 4)
    assert gm.document_pairs(ids, None) == 36 + 10
    assert gm.document_pairs(ids, 2) == (1 + 2 + 3 * 6) + (1 + 2 + 3 + 3)
    # counts[src, dst]: rank 0 receives 6 positions from rank 1 and sends it 2; K/V row of the 8B model
    # = 2 * 8 * 128 * 2 = 4096 B -> 6 * 4096 / 400e9 on NVLink
    hw = gm.H200()
    counts = torch.tensor([[0, 2], [6, 0]])
    assert gm.needed_seconds(counts, lambda r: 0, 4096, hw) == pytest.approx(6 * 4096 / 400e9)
    assert gm.needed_seconds(counts, lambda r: r, 4096, hw) == pytest.approx(6 * 4096 / 50e9)
    phase = {"kernel_calls": 1, "launching": 2, "transfers": 0, "syncs": 0, "bytes_sent": 0, "bytes_received": 0,
             "modeled_s": 2e-3, "kernel_s": 0, "elementwise_s": 0, "link_s": 0, "launch_s": 0,
             "elementwise_bytes": 0, "flops": 0, "tiles_over_pairs": 1.5, "host_thread_s": 1e-3, "host_wall_s": 1e-3}
    rank = {"calls": [{"forward": phase, "backward": {**phase, "modeled_s": 4e-3}}] * 2, "counts": counts,
            "per_node": 2, "local_len": 6, "build_s": 0.0, "attended_pairs": 30}
    row = gm.case_row(gm.Case(12, 2, "single", "zigzag", "a2a", None, "gqa"), [rank, {**rank, "attended_pairs": 16}],
                      ids, hw)
    ideal = 4.0 * 46 * 32 * 128 / 2 / 450e12
    assert row["ideal_fwd_s"] == pytest.approx(ideal) and row["ideal_bwd_s"] == pytest.approx(2.5 * ideal)
    assert row["roofline_fwd_s"] == pytest.approx(max(ideal, 6 * 4096 / 400e9))
    assert row["ratio_fwd"] == pytest.approx(2e-3 / row["roofline_fwd_s"])
    assert row["ratio"] == pytest.approx(6e-3 / (row["roofline_fwd_s"] + row["roofline_bwd_s"]))
    assert row["tiles_over_pairs_fwd"] == row["tiles_over_pairs_bwd"] == 1.5  # the busiest rank's, as recorded
    own = 4.0 * 30 * 32 * 128 / 450e12  # the rank handed the most pairs (30 of 46), at the kernel rate
    assert row["rank_work_fwd_s"] == pytest.approx(own) and row["rank_work_bwd_s"] == pytest.approx(2.5 * own)
    assert row["own_roofline_fwd_s"] == pytest.approx(max(own, 6 * 4096 / 400e9))
    assert row["own_ratio_bwd"] == pytest.approx(4e-3 / max(2.5 * own, 6 * 4096 / 400e9))


def test_measured_kernel_reads_the_gpu_check_timing_rows(tmp_path):
    # rates per rank: 4 * pairs * Hq * D / forward seconds; backward factor (fwd+bwd - fwd) / fwd; medians
    gm = _bench()
    timing = {"suite": "gpu_check", "check": "timing", "heads": [2, 1], "head_dim": 8, "dry_run": False,
              "pairs_per_rank": [1000, 3000],
              "kernels": {"flash": {"fwd_ms_per_rank": [1.0, 2.0], "fwd_bwd_ms_per_rank": [4.0, 8.0]},
                          "dense": {"fwd_ms_per_rank": [9.0, 9.0], "fwd_bwd_ms_per_rank": [9.0, 9.0]}}}
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        {"suite": "gpu_check", "check": "env"}, timing, {**timing, "dry_run": True, "pairs_per_rank": [1, 1]},
        {**timing, "pairs_per_rank": [5000, 5000], "kernels": {"flash": {"fwd_ms_per_rank": [1.0, 1.0],
                                                                       "fwd_bwd_ms_per_rank": [3.0, 3.0]}}})))
    hw = gm.measured_kernel(str(path))
    rates = sorted(4.0 * p * 2 * 8 / (ms * 1e-3) for p, ms in ((1000, 1.0), (3000, 2.0), (5000, 1.0), (5000, 1.0)))
    assert hw.kernel_flops == pytest.approx((rates[1] + rates[2]) / 2)
    assert hw.backward_factor == pytest.approx((2.0 + 3.0) / 2)  # factors 3, 3, 2, 2 (the dry run is not read)
    assert (hw.launch_s, hw.hbm_bytes_per_s) == (gm.H200().launch_s, gm.H200().hbm_bytes_per_s)
    assert gm.measured_kernel(str(tmp_path / "absent.jsonl")) is None


def test_case_row_on_the_measured_kernel():
    gm = _bench()
    ids = torch.tensor([1] * 8 + [2] * 4)
    counts = torch.tensor([[0, 2], [6, 0]])
    hw, measured = gm.H200(), gm.H200(kernel_flops=300e12, backward_factor=3.0)
    phase = {"kernel_calls": 1, "launching": 2, "transfers": 0, "syncs": 0, "bytes_sent": 0, "bytes_received": 0,
             "modeled_s": 2e-3, "kernel_s": 0, "elementwise_s": 0, "link_s": 0, "launch_s": 0,
             "elementwise_bytes": 0, "flops": 0, "tiles_over_pairs": 1.0, "host_thread_s": 1e-3, "host_wall_s": 1e-3,
             "modeled_s_measured_kernel": 3e-3}
    rank = {"calls": [{"forward": phase, "backward": {**phase, "modeled_s_measured_kernel": 9e-3}}] * 2,
            "counts": counts, "per_node": 2, "local_len": 6, "build_s": 0.0, "attended_pairs": 23}
    row = gm.case_row(gm.Case(12, 2, "single", "zigzag", "a2a", None, "gqa"), [rank, rank], ids, hw,
                      hw_measured=measured)
    ideal = 4.0 * 46 * 32 * 128 / 2 / 300e12
    link = 6 * 4096 / 400e9
    assert row["roofline_fwd_s_measured_kernel"] == pytest.approx(max(ideal, link))
    assert row["roofline_bwd_s_measured_kernel"] == pytest.approx(max(3.0 * ideal, link))
    assert row["ratio_fwd_measured_kernel"] == pytest.approx(3e-3 / max(ideal, link))
    assert row["ratio_bwd_measured_kernel"] == pytest.approx(9e-3 / max(3.0 * ideal, link))
    assert (row["measured_kernel_tflops"], row["measured_backward_factor"]) == (300.0, 3.0)
    assert row["ratio_fwd"] == pytest.approx(2e-3 / row["roofline_fwd_s"])  # the constants unchanged


@pytest.mark.timeout(240)
def test_loopback_twin_models_the_loopbacks_rank_and_joins_the_h200_row(tmp_path):
    # The twin runs the loopback's own plan for rank r (thd at cp 8, rank 7; the short mix): the kernel
    # calls and forward ops the loopback counts on CPU (dense, a real kernel) in a process of its own; in
    # backward the null kernel returns dK / dV as one buffer's halves (as te and flash-attn do), so the
    # dense path's fuse per call is absent there. The H200 row joined is the steady call's, not a dry run's.
    import subprocess

    gm = _bench()
    S, rank = 2048, 7
    ids_path = tmp_path / "ids.pt"
    torch.save(gm.doc_ids("short", S, "thd", 8), ids_path)
    proc = subprocess.run([sys.executable, "-m", "megatron_ext.testing.loopback", "--cp", "8", "--rank", str(rank),
                           "--S", str(S), "--ids", str(ids_path), "--layout", "thd", "--exchange", "a2a",
                           "--heads", "4", "1", "--head-dim", "8", "--device", "cpu"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loop = json.loads(proc.stdout.strip().splitlines()[-1])
    steady = {"suite": "gpu_check", "check": "loopback_cp8", "mix": "short", "layout": "thd", "rank": rank,
              "timed": "steady", "passed": True, "dry_run": False, "fwd_bwd_ms": 7.5, "host_ms": 1.25,
              "kernel_calls": [8, 8], "launching": [12, 40], "attn_backend": "flash", "kv_backward": "refetch",
              "kernel_fwd_ms": 1.5, "kernel_bwd_ms": 3.0, "relayout": "none", "cost_model": None}
    rows_path = tmp_path / "h200.jsonl"
    timing = {"suite": "gpu_check", "check": "timing", "heads": [32, 8], "head_dim": 128, "dry_run": False,
              "pairs_per_rank": [1000], "kernels": {"flash": {"fwd_ms_per_rank": [1.0], "fwd_bwd_ms_per_rank": [4.0]}}}
    rows_path.write_text("\n".join(json.dumps(r) for r in (
        timing, {**steady, "fwd_bwd_ms": 99.0, "timed": None},  # an earlier run's first-call timing: not read
        steady, {**steady, "fwd_bwd_ms": 1.0, "dry_run": True})))
    (row,) = gm.loopback_rows(S=S, cases=(("short", "thd", (rank,)),), gpu_rows=str(rows_path), log=lambda m: None)
    assert (row["kernel_calls_fwd"], row["kernel_calls_bwd"]) == tuple(loop["kernel_calls"])
    assert row["launching_fwd"] == loop["launching"][0]
    assert row["launching_bwd"] < loop["launching"][1]
    assert row["kv_backward"] == loop["kv_backward"] == "refetch" and row["syncs_fwd"] == row["syncs_bwd"] == 0
    assert row["device_ms"] == pytest.approx((row["device_s_fwd"] + row["device_s_bwd"]) * 1e3)
    assert row["device_s_fwd"] >= row["kernel_s_fwd"] + row["elementwise_s_fwd"] > 0  # one stream, link free
    assert row["h200_fwd_bwd_ms"] == 7.5 and row["h200_launching"] == [12, 40] and row["h200_kernel_ms"] == 4.5
    assert row["kernel_ms"] == pytest.approx((row["kernel_s_fwd"] + row["kernel_s_bwd"]) * 1e3)
    assert 0 < row["kernel_ms"] < row["device_ms"]
    # thd at cp 8 cuts each short document into 16 chunks: segments far smaller than a tile
    assert row["segments_fwd"] > row["kernel_calls_fwd"] and row["tiles_over_pairs"] > 1.5, row
    assert row["device_ms_measured_kernel"] > row["device_ms"]  # that kernel: 4e3 * 32 * 128 FLOP/ms, bwd 3x
    assert row["h200_over_modeled"] == pytest.approx(7.5 / row["device_ms_measured_kernel"])
    assert row["cost_model"] is None and "h200_row_skipped" not in row  # thd searches no cut
    # a row of the earlier loopback (no send gathers, no cost model recorded) is not compared
    earlier = {k: v for k, v in steady.items() if k not in ("cost_model", "relayout")}
    rows_path.write_text("\n".join(json.dumps(r) for r in (timing, earlier)))
    (row,) = gm.loopback_rows(S=S, cases=(("short", "thd", (rank,)),), gpu_rows=str(rows_path), log=lambda m: None)
    assert "h200_fwd_bwd_ms" not in row and "earlier loopback" in row["h200_row_skipped"]


def test_segment_tiles_counts_whole_tiles_a_segment_touches():
    gm = _bench()
    t = 128 * 64
    assert gm.segment_tiles([8], [8], False, None) == t  # a tiny segment still costs one tile
    # causal 200 x 200: query block 0 (rows 0-127) reaches key block 1, block 1 (128-199) key block 3
    assert gm.segment_tiles([200], [200], True, None) == (2 + 4) * t
    # window 63 (bottom-right): block 1's first query 128 sees keys from 65 on (key block 1)
    assert gm.segment_tiles([256], [256], True, 63) == (2 + 3) * t
    assert gm.segment_tiles([0, 8], [8, 0], False, None) == 0
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        nq, nk = (int(x) for x in torch.randint(1, 700, (2,), generator=g))
        causal = bool(torch.randint(0, 2, (), generator=g)) and nq == nk
        window = None if torch.rand((), generator=g) < 0.5 else int(torch.randint(0, 300, (), generator=g))
        assert gm.segment_tiles([nq], [nk], causal, window) >= gm.segment_pairs([nq], [nk], causal, window) > 0


def test_dispatch_target_adds_the_launch_term_to_the_meta_run():
    # The host line judged on meta: (meta thread time + the model's launch term) / modeled, per phase,
    # over the rows whose ideal is >= 1 ms and that have a meta figure (ulysses in, hierarchical out).
    _bench()
    import report_specs

    def row(exchange, model_key, dispatch, launch, modeled, ideal=2e-3):
        r = {"suite": "gpu_model", "point": "32k / cp 2", "mix": "short", "layout": "thd", "exchange": exchange,
             "window": 0, "model_key": model_key, "ideal_fwd_s": ideal}
        for phase, d, l, m in zip(("fwd", "bwd"), dispatch, launch, modeled):
            r.update({f"launch_s_{phase}": l, f"modeled_s_{phase}": m})
            if d is not None:
                r[f"host_dispatch_s_{phase}"] = d
        return r

    rows = [row("a2a", "gqa", (1e-3, 2e-3), (5e-4, 1e-3), (2e-3, 2.5e-3)),
            row("ulysses", "gqa_heads", (1e-3, 1e-3), (1e-4, 1e-4), (1e-3, 2e-3)),
            row("hierarchical", "gqa", (None, None), (1e-4, 1e-4), (1e-3, 1e-3)),
            row("a2a", "mha", (9e-3, 9e-3), (1e-4, 1e-4), (1e-3, 1e-3), ideal=5e-4)]
    checks = {c.label.rsplit("/", 2)[-2] + "/" + c.label.rsplit("/", 1)[-1]: (c.ok, round(c.value, 6))
              for c in report_specs._gm_dispatch_under_gpu(rows)}
    assert checks == {"gqa/fwd": (True, 0.75), "gqa/bwd": (False, 1.2),
                      "gqa_heads/fwd": (False, 1.1), "gqa_heads/bwd": (True, 0.55)}
