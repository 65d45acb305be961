"""``cost_options.price_exchange_options``: 1-D and 2-D CP priced on one pack, no process group.

The 2-D option's edges are the 1-D options it generalizes (u = cp is ulysses, u = 1 the K/V
exchange at cp), its bytes and seconds are checked by hand on a 16-token pack, and a ulysses_size
the query heads, cp or a node cannot take is refused with the numbers. The relaid option is the
balanced layout's price plus the moves the two layouts' owners give, by hand. Every sequence option
adds the busiest rank's merges, counted against a per-row reference (the other ranks holding a key
of the row's document at or before it).
"""

import pytest
import torch

from megatron_ext.blockdiag_cp import plan_summary
from megatron_ext.blockdiag_cp.cost import CostModel
from megatron_ext.blockdiag_cp.cost_options import (default_options, merge_seconds, merged_rows,
                                                    price_exchange_options, price_option, relaid_options,
                                                    ulysses_forward_bytes, ulysses_link_bytes, ulysses_seconds)

DIMS = (32, 8, 128, 2)


def _mixed(S=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 900, (S // 16,), generator=g)
    lengths = lengths[:int((lengths.cumsum(0) < S).sum())]
    lengths = torch.cat([lengths, torch.tensor([S - int(lengths.sum())])])
    return torch.repeat_interleave(torch.arange(1, lengths.numel() + 1), lengths)


def reference_merges(ids: torch.Tensor, positions: torch.Tensor) -> list:
    """Per rank: sum over its attended rows of the other ranks owning a key of the row's document at or
    before the row (ids [b, padded S], positions [cp, L]); row by row, no runs."""
    cp = positions.shape[0]
    owner = {int(p): r for r in range(cp) for p in positions[r]}
    out = [0] * cp
    for row in ids.tolist():
        start = 0
        for p, doc in enumerate(row):
            if p and doc != row[p - 1]:
                start = p
            if doc:
                out[owner[p]] += len({owner[k] for k in range(start, p + 1)} - {owner[p]})
    return out


def _busiest_merge_seconds(ids, summary, hq, d=128):
    padded = torch.nn.functional.pad(ids.reshape(1, -1), (0, summary["padded_len"] - ids.numel()))
    return merge_seconds(max(reference_merges(padded, summary["positions"])), hq, d)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced", "thd"])
def test_merged_rows_against_the_row_by_row_count(layout):
    from megatron_ext.blockdiag_cp.layouts import build_layout

    from test_variants import _thd_padded

    cp = 4
    ids = torch.stack([_mixed(512, seed=1), _mixed(512, seed=2)])
    ids[1, -40:] = 0  # padding is not attended
    if layout == "thd":  # THD packs one sequence of documents padded to multiples of 2 * cp
        ids = _thd_padded(ids[0], 2 * cp).unsqueeze(0)
    lay = build_layout(layout, ids, cp)
    padded = torch.nn.functional.pad(ids, (0, lay.padded_len - ids.shape[1]))
    got = merged_rows(padded, lay.positions)
    assert got.tolist() == reference_merges(padded, lay.positions)
    assert got.sum() > 0
    # one document of 8 under thd at cp 2: rank 0 holds 0, 1, 6, 7 and rank 1 2..5; rows 2..7 see the other rank
    one = torch.ones(1, 8, dtype=torch.long)
    assert merged_rows(one, build_layout("thd", one, 2).positions).tolist() == [2, 4]


@pytest.mark.parametrize("cp,G", [(8, None), (16, 8), (16, 4)])
def test_u_equal_to_cp_is_ulysses(cp, G):
    ids = _mixed()
    uly = price_option(ids, cp, "zigzag", "ulysses", dims=DIMS, gpus_per_node=G)
    as_2d = price_option(ids, cp, "zigzag", "a2a", u=cp, dims=DIMS, gpus_per_node=G)
    assert uly == as_2d and uly.name == "ulysses" and uly.ulysses_size == cp and not uly.refused
    # The 1-D pricing: the engine's byte count, the link split, the cost model's links.
    local_len = 4096 // cp
    moved, repeats, _ = ulysses_forward_bytes(local_len, 1, 32, 8, 128, 128, 2, cp)
    intra, inter = ulysses_link_bytes(local_len, 32, 8, 128, 2, cp, repeats, G or 0)
    cost = CostModel.two_level(G, *DIMS) if G else CostModel.preset("nvlink", *DIMS)
    lengths = torch.unique_consecutive(ids, return_counts=True)[1].double()
    pairs = float((lengths * (lengths + 1) / 2).sum())
    modeled, ideal, _ = ulysses_seconds(cost, pairs, cp, intra, inter, 2 * 8 * 128 * 2)
    assert uly.bytes_max == moved and uly.inter_node_bytes_max == round(inter)
    assert uly.modeled_seconds == pytest.approx(modeled, rel=1e-12)
    assert uly.ideal_seconds == pytest.approx(ideal, rel=1e-12)
    assert uly.merge_seconds == 0  # every head shard attends the whole sequence in one call
    # Streamed, as the engine moves them: per rank 32 / cp query heads over one K/V head (8 * repeats / cp),
    # two groups with K/V moved whole: K, V and group 0's q in and group 1's output home stay exposed, the
    # rest hides behind the ideal as far as it lasts.
    hq, hkv = 32 // cp, 8 * repeats // cp
    assert hkv == 1
    exposed = (2 * hkv + hq // 2 + hq // 2) / (2 * hq + 2 * hkv)
    comm = modeled - ideal
    assert uly.overlap_seconds == pytest.approx(ideal + comm - min((1 - exposed) * comm, ideal), rel=1e-12)


@pytest.mark.parametrize("exchange", ["a2a", "allgather", "hierarchical"])
def test_u_one_is_the_1d_exchange(exchange):
    ids = _mixed()
    cp, G = 16, 8
    opt = price_option(ids, cp, "balanced", exchange, u=1, dims=DIMS, gpus_per_node=G)
    cost = CostModel.two_level(G, *DIMS, hierarchical=exchange == "hierarchical")
    s = plan_summary(ids, cp, layout="balanced", cost_model=cost)
    traffic = s["traffic_allgather" if exchange == "allgather" else "traffic"]
    both = torch.maximum(traffic.intra_in + traffic.inter_in, traffic.intra_out + traffic.inter_out)
    assert opt.name == exchange and opt.ulysses_size == 1 and not opt.refused
    assert opt.bytes_max == int(both.max()) * 2 * 8 * 128 * 2
    assert opt.merge_seconds == pytest.approx(_busiest_merge_seconds(ids, s, 32), rel=1e-12)
    assert opt.merge_seconds > 0
    assert opt.modeled_seconds == pytest.approx(
        s["modeled_allgather_seconds" if exchange == "allgather" else "modeled_seconds"] + opt.merge_seconds, rel=1e-12)
    assert opt.ideal_seconds == pytest.approx(s["ideal_seconds"], rel=1e-12)


def test_2d_bytes_and_seconds_by_hand():
    # One document of 16 tokens, cp 4 = u 2 x r 2, contiguous; Hq 4, Hkv 2, D 8, 2-byte elements.
    # Outer layout at r = 2: group 0 holds [0, 8), group 1 holds [8, 16) and needs keys 0-7.
    # Per rank: Hq / u = 2 query heads, Hkv * rep / u = 1 K/V head (rep = 2 / gcd(2, 2) = 1).
    ids = torch.ones(16, dtype=torch.long)
    opt = price_option(ids, 4, "contiguous", "a2a", u=2, dims=(4, 2, 8, 2))
    assert opt.name == "2d u2 x r2 a2a" and opt.exchange == "a2a" and opt.ulysses_size == 2
    # Inner: local_len 16 / 4 = 4; q 4*4*8, k 4*2*8, v 4*2*8, out 4*4*8 elements, 2 bytes, half leaves.
    inner = (128 + 64 + 64 + 128) * 2 // 2
    row = 2 * 1 * 8 * 2  # K and V of one position, one K/V head per rank
    assert opt.bytes_max == inner + 8 * row == 640
    assert opt.inter_node_bytes_max == 0
    # Busiest group: group 1, queries 8..15 over keys 0..p: 9 + ... + 16 = 100 pairs, 8 positions in.
    pair = 14 * 2 * 8 / 500e12  # forward + backward flops of a pair on 2 query heads
    position = 2 * row / 400e9  # a position's K/V forward and its gradient backward, NVLink
    a2a = 2 * inner / 400e9  # the all-to-alls, forward and backward
    # Group 1's 8 rows each merge group 0's partial: 14 bytes per element of 2 heads x 8 at 3.3e12 B/s
    # forward, backward 1.5x that.
    merges = 2.5 * 8 * 2 * 8 * 14 / 3.3e12
    assert opt.merge_seconds == pytest.approx(merges, rel=1e-12)
    assert opt.modeled_seconds == pytest.approx(100 * pair + 8 * position + a2a + merges, rel=1e-12)
    assert opt.ideal_seconds == pytest.approx(136 / 4 * 14 * 4 * 8 / 500e12, rel=1e-12)


@pytest.mark.parametrize("heads, kv_whole_allowed, share", [
    ((4, 1, True), True, (2 + 2 + 2) / 10),  # Llama-3-8B ulysses at cp 8: K/V whole, 2 groups of 2 q heads
    ((32, 8, False), False, 0.5),  # relaid, 2 groups: 1 / 2 of every move
    ((8, 8, True), True, 0.25),  # K/V split in 4 groups: 1 / 4
    ((3, 1, True), True, 1.0),  # 3 query heads do not split in two: one group, all exposed
])
def test_pipelined_seconds_expose_the_first_move_in_and_the_last_home(heads, kv_whole_allowed, share):
    from megatron_ext.blockdiag_cp.cost_options import head_groups_for, pipelined_seconds

    groups = head_groups_for(heads[0], heads[1], exchanging=not kv_whole_allowed)
    assert groups.exposed_share() == pytest.approx(share, rel=1e-12)
    assert pipelined_seconds(10.0, 4.0, groups) == pytest.approx(10.0 + 4.0 * share, rel=1e-12)  # compute hides it
    # link-bound: the moves, and what of the attention the hideable moves do not cover
    assert pipelined_seconds(1.0, 4.0, groups) == pytest.approx(4.0 + max(0.0, 1.0 - (1 - share) * 4.0), rel=1e-12)


def test_2d_across_nodes_prices_the_outer_level_on_ib():
    # u = G: one group per node, every outer transfer crosses IB; u < G: two levels between groups.
    ids = _mixed()
    whole = price_option(ids, 16, "balanced", "a2a", u=8, dims=DIMS, gpus_per_node=8)
    inner, repeats, _ = ulysses_forward_bytes(4096 // 16, 1, 32, 8, 128, 128, 2, 8)
    assert repeats == 1 and whole.inter_node_bytes_max == whole.bytes_max - inner > 0
    cost = CostModel.preset("ib", 32 // 8, 8 // 8, 128, 2)
    s = plan_summary(ids, 2, layout="balanced", cost_model=cost)
    assert whole.merge_seconds == pytest.approx(_busiest_merge_seconds(ids, s, 32 // 8), rel=1e-12)
    assert whole.modeled_seconds == pytest.approx(s["modeled_seconds"] + 2 * inner / 400e9 + whole.merge_seconds,
                                                  rel=1e-12)
    half = price_option(ids, 16, "balanced", "hierarchical", u=4, dims=DIMS, gpus_per_node=8)
    cost = CostModel.two_level(2, 32 // 4, 8 // 4, 128, 2, hierarchical=True)
    s = plan_summary(ids, 4, layout="balanced", cost_model=cost)
    inner, _, _ = ulysses_forward_bytes(4096 // 16, 1, 32, 8, 128, 128, 2, 4)
    assert half.merge_seconds == pytest.approx(_busiest_merge_seconds(ids, s, 32 // 4), rel=1e-12)
    assert half.modeled_seconds == pytest.approx(s["modeled_seconds"] + 2 * inner / 400e9 + half.merge_seconds,
                                                 rel=1e-12)


def test_refusals_name_the_numbers():
    ids = _mixed()
    heads = price_option(ids, 8, "balanced", "a2a", u=4, dims=(6, 2, 64, 2))
    assert heads.refused.startswith("ulysses_size 4 splits the 6 query heads") and "6 % 4 = 2" in heads.refused
    node = price_option(ids, 16, "balanced", "a2a", u=8, dims=DIMS, gpus_per_node=4)
    assert "divide the 4 GPUs per node (4 % 8 = 4)" in node.refused
    assert "must divide cp=8" in price_option(ids, 8, "balanced", "a2a", u=3, dims=DIMS).refused
    assert "32 % 64 = 32" in price_option(ids, 64, "balanced", "ulysses", dims=DIMS, gpus_per_node=8).refused
    assert "span several nodes" in price_option(ids, 8, "balanced", "hierarchical", dims=DIMS).refused


def test_default_options_and_one_call():
    assert [(x, u) for x, u in default_options(8, 8)] == [
        ("allgather", 1), ("a2a", 1), ("halo", 1), ("ulysses", 8), ("a2a", 2), ("a2a", 4)]
    assert default_options(64, 8)[3:] == [
        ("hierarchical", 1), ("ulysses", 64), ("a2a", 2), ("hierarchical", 2), ("a2a", 4), ("hierarchical", 4),
        ("a2a", 8)]
    opts = price_exchange_options(_mixed(), 8, dims=DIMS, gpus_per_node=8)
    assert [o.name for o in opts] == ["allgather", "a2a", "halo", "ulysses", "2d u2 x r4 a2a", "2d u4 x r2 a2a"]
    for o in opts:
        if not o.refused:
            assert o.modeled_seconds >= o.ideal_seconds * (1 - 1e-9) > 0, o


@pytest.mark.parametrize("layout", ["zigzag", "thd"])
def test_relaid_is_the_balanced_price_plus_the_moves_by_hand(layout):
    from megatron_ext.blockdiag_cp.layouts import build_layout

    from test_variants import _thd_padded

    cp, ids = 4, _mixed(4096, seed=3)
    if layout == "thd":  # every document padded to a multiple of 2 * cp, as THD packs
        ids = _thd_padded(ids, 2 * cp)
    relaid = price_option(ids, cp, layout, "relaid a2a", dims=DIMS)
    assert (relaid.name, relaid.exchange, relaid.relayout, relaid.layout) == ("relaid a2a", "a2a", "balanced",
                                                                              "balanced")
    s = plan_summary(ids, cp, layout="balanced", cost_model=CostModel.preset("nvlink", *DIMS))
    # The rows each rank sends / receives, from the two layouts' owners: q, k, v and out of each, there and
    # (backward) back, at NVLink's 400e9 B/s; the busiest rank's.
    source = build_layout(layout, ids.unsqueeze(0), cp)
    owner = torch.empty(ids.numel(), dtype=torch.long)
    for r in range(cp):
        owner[s["positions"][r]] = r
    sent = [int((owner[source.positions[r]] != r).sum()) for r in range(cp)]
    received = [int((source.owner()[s["positions"][r]] != r).sum()) for r in range(cp)]
    row = 128 * 2 * (2 * 32 + 2 * 8)
    moves = 2 * max(max(a, b) for a, b in zip(sent, received)) * row / 400e9
    assert relaid.merge_seconds == pytest.approx(_busiest_merge_seconds(ids, s, 32), rel=1e-12)
    assert relaid.modeled_seconds == pytest.approx(s["modeled_seconds"] + moves + relaid.merge_seconds, rel=1e-9)
    # Streamed: two head groups of 16 query and 4 K/V heads; group 0's q, k, v in (16 + 8 of 80 head rows) and
    # group 1's output home (16) stay exposed, the rest hides behind the balanced layout's streamed time.
    streamed = s["overlap_seconds"]
    assert relaid.overlap_seconds == pytest.approx(
        streamed + moves - min((1 - 40 / 80) * moves, streamed) + relaid.merge_seconds, rel=1e-9)
    assert max(sent) > 0
    assert "balanced already" in price_option(ids, cp, "balanced", "relaid a2a", dims=DIMS).refused
    assert "span several nodes" in price_option(ids, cp, layout, "relaid hierarchical", dims=DIMS).refused


def test_merges_make_relaid_the_cheaper_for_short_documents_under_thd():
    # Short documents (64-1024 tokens) under THD at cp 8, 128k tokens, 28 query / 4 K/V heads: THD cuts
    # every document into 16 chunks, so each row merges a partial from every earlier chunk's rank, while
    # balanced keeps each document whole. Priced on exchange bytes and pairs alone, a2a would come out
    # no dearer than relaid a2a; its merges decide for relaid.
    from test_variants import _thd_padded

    cp, S = 8, 131072
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 65, (S // 256,), generator=g) * 16
    lengths = lengths[:int((lengths.cumsum(0) <= S).sum())]
    ids = _thd_padded(torch.repeat_interleave(torch.arange(1, lengths.numel() + 1), lengths), 2 * cp)
    opts = {o.name: o for o in price_exchange_options(ids, cp, "thd", dims=(28, 4, 128, 2),
                                                       options=[("a2a", 1)] + relaid_options(cp))}
    a2a, relaid = opts["a2a"], opts["relaid a2a"]
    assert a2a.modeled_seconds - a2a.merge_seconds <= relaid.modeled_seconds - relaid.merge_seconds
    assert relaid.modeled_seconds < a2a.modeled_seconds
    assert relaid.merge_seconds < 0.1 * a2a.merge_seconds
