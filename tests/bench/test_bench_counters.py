"""The exchange's byte counters (report()['bytes_sent'/'bytes_received']) against a count
made here from the document ids alone, on real gloo groups (cp = 2 and 4).

The independent count: a query at global position p of document [a, ...) needs the K/V
of positions a..p; a rank needs the union over its queries (padding queries need
nothing); what it needs and does not own is what halo / a2a must deliver (its lower
bound); every position a rank owns is sent once to each rank that needs it. All-gather
is a ring of each rank's K/V in two pieces (its local rows cut in halves, rounded up): a piece
goes round to the farthest rank that needs one of its rows, so every rank up to there
receives it and every rank before there sends it on. One K/V row is b * Hkv * 2D * element size.
scripts/bench/comm_balance.py reads the same counters for bench/results.jsonl.
"""

import pytest
import torch

from megatron_ext.testing import pool_per_cp_fixture, ring_routes

B, HKV, HQ, D = 2, 2, 4, 4
ROW_BYTES = B * HKV * 2 * D * 4  # K and V, fp32
LAYOUTS = ("contiguous", "zigzag", "balanced")
EXCHANGES = ("allgather", "halo", "a2a")


def _doc_ids(case: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    if case == "short":  # many short documents
        S, lengths = 240, []
        while sum(lengths) < S:
            lengths.append(min(int(torch.randint(3, 29, (1,), generator=g)), S - sum(lengths)))
    elif case == "long_and_short":  # one document over several shards, then short ones
        lengths = [150, 7, 30, 1, 40, 12]
    elif case == "padded":  # S not a multiple of the layout granularity, padding in the middle
        return torch.cat([torch.full((60,), 1), torch.zeros(13, dtype=torch.long),
                          torch.full((90,), 2), torch.full((34,), 3)])
    else:
        raise KeyError(case)
    return torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))


def measure(case: str):
    """Runs on every rank: one forward call per layout x exchange; counters + positions."""
    import megatron_ext.blockdiag_cp as bdcp

    doc_ids = _doc_ids(case)
    out = {}
    for layout in LAYOUTS:
        for exchange in EXCHANGES:
            state = bdcp.BlockDiagCPState.build(doc_ids, layout=layout, kv_exchange=exchange,
                                                attn_backend="dense")
            g = torch.Generator().manual_seed(state.rank)
            q = torch.randn(state.local_len, B, HQ, D, generator=g)
            k = torch.randn(state.local_len, B, HKV, D, generator=g)
            v = torch.randn(state.local_len, B, HKV, D, generator=g)
            with torch.no_grad(), bdcp.blockdiag_cp_step(state):
                bdcp.blockdiag_cp_attention(q, k, v)
            rep = state.report()
            out[(layout, exchange)] = {
                "positions": state.local_positions.tolist(), "padded_len": state.padded_len,
                "bytes_sent": rep["bytes_sent"], "bytes_received": rep["bytes_received"],
                "lower_bound_bytes": rep["lower_bound_bytes"], "kv_exchange": rep["kv_exchange"]}
    return out


def _ring_rows(needed, reps, cp: int, local_len: int, rank: int):
    """(rows sent, rows received) by ``rank`` around the ring, routed by ``testing.ring_routes`` from which
    rows of each source every rank needs (half-shard pieces)."""
    read = [[{row for row, p in enumerate(reps[s]["positions"]) if p in needed[dst]} if dst != s else set()
             for dst in range(cp)] for s in range(cp)]
    return ring_routes(read, local_len, -(-local_len // 2))["rows"][rank]


def _needed_remote(doc_ids, padded_len, owned):
    """Global positions the queries at ``owned`` need and ``owned`` lacks: from the ids alone."""
    ids = doc_ids.tolist() + [0] * (padded_len - doc_ids.numel())
    start, starts = 0, []
    for p, d in enumerate(ids):
        if p == 0 or d != ids[p - 1]:
            start = p
        starts.append(start)
    mine, need = set(owned), set()
    for p in owned:
        if ids[p] != 0:
            need.update(range(starts[p], p + 1))
    return need - mine


pool = pool_per_cp_fixture([2, 4])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["short", "long_and_short", "padded"])
def test_counters_equal_independent_count(pool, case):
    per_rank = pool.run(measure, case, timeout=100)
    cp = pool.world
    doc_ids = _doc_ids(case)
    for key in per_rank[0]:
        reps = [r[key] for r in per_rank]
        owned = [set(r["positions"]) for r in reps]
        local_len = len(reps[0]["positions"])
        assert sorted(set().union(*owned)) == list(range(reps[0]["padded_len"])), key
        needed = [_needed_remote(doc_ids, reps[0]["padded_len"], r["positions"]) for r in reps]
        layout, exchange = key
        for rank, r in enumerate(reps):
            lower = len(needed[rank]) * ROW_BYTES
            assert r["lower_bound_bytes"] == lower, (key, rank, r, lower)
            if exchange == "allgather":
                expect_sent, expect_recv = _ring_rows(needed, reps, cp, local_len, rank)
                expect_sent, expect_recv = expect_sent * ROW_BYTES, expect_recv * ROW_BYTES
            else:  # halo (or its a2a fallback) and a2a move exactly what is needed
                expect_recv = lower
                expect_sent = sum(len(needed[dst] & owned[rank]) for dst in range(cp)) * ROW_BYTES
            assert (r["bytes_sent"], r["bytes_received"]) == (expect_sent, expect_recv), (
                key, rank, r["kv_exchange"], r["bytes_sent"], r["bytes_received"], expect_sent, expect_recv)
