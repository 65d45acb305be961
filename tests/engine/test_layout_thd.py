"""The THD layout: TransformerEngine's per-document DualChunkSwap partition from doc ids."""

import pytest
import torch

import megatron_ext.blockdiag_cp as bdcp
from megatron_ext.blockdiag_cp.layouts import build_layout
from megatron_ext.blockdiag_cp.layouts.thd import thd_padded_cu_seqlens
from megatron_ext.blockdiag_cp.state import normalize_layout
from megatron_ext.testing.cases import THD_EMPTY_DOCUMENT_CASES, thd_case


def _brute_force(extents, cp, rank):
    """Rank r's tokens, chunk by chunk: chunks r and 2cp-1-r of every padded document."""
    out, start = [], 0
    for ext in extents:
        c = ext // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            out += list(range(start + chunk * c, start + (chunk + 1) * c))
        start += ext
    return out


def test_matches_transformer_engines_documented_example():
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert bdcp.thd_partitioned_indices(cu, 16, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert bdcp.thd_partitioned_indices(cu, 16, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_partition_equals_brute_force_and_the_layout(cp):
    g = torch.Generator().manual_seed(cp)
    real = torch.randint(1, 50, (6,), generator=g).tolist()
    extents = [-(-n // (2 * cp)) * (2 * cp) for n in real]
    cu = torch.tensor([0] + extents).cumsum(0)
    total = int(cu[-1])
    ids = torch.cat([torch.cat([torch.full((n,), i + 1), torch.zeros(e - n, dtype=torch.long)])
                     for i, (n, e) in enumerate(zip(real, extents))])
    assert torch.equal(thd_padded_cu_seqlens(ids, cp), cu)
    lay = build_layout("thd", ids.unsqueeze(0), cp)
    for rank in range(cp):
        want = _brute_force(extents, cp, rank)
        assert bdcp.thd_partitioned_indices(cu, total, cp, rank).tolist() == want
        if cp > 1:
            assert lay.positions[rank].tolist() == want


def test_knob_synonyms():
    for alias in ("thd", "te_thd", "dual-chunk-swap", "per_document"):
        assert normalize_layout(alias) == "thd"


def test_bad_extents_and_rows_raise_clear_errors():
    ids = torch.tensor([1] * 6 + [2] * 2).unsqueeze(0)  # document 1 has extent 6 at cp = 2
    with pytest.raises(ValueError, match=r"document 1 .*extent 6.*multiple of 2\*cp = 4"):
        build_layout("thd", ids, 2)
    with pytest.raises(ValueError, match="one row of doc ids"):
        build_layout("thd", torch.ones(2, 8, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="multiples of 2\\*cp"):
        bdcp.thd_partitioned_indices(torch.tensor([0, 6, 8]), 8, 2, 0)


def test_cp1_state_with_thd_layout_runs_the_document_rule():
    from megatron_ext.testing.reference import reference_attention

    ids = torch.tensor([1] * 5 + [0] + [2] * 4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, 1, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    state = bdcp.BlockDiagCPState.build(ids, layout="thd", attn_backend="dense")
    with bdcp.blockdiag_cp_step(state):
        out = bdcp.blockdiag_cp_attention(q, k, v)
    assert torch.allclose(out, reference_attention(q, k, v, ids), atol=1e-12)


@pytest.mark.parametrize("cp", [2, 3, 8])
def test_closed_form_counts_equal_the_interval_count(cp):
    """thd_exchange_counts against the generic interval count: leading padding, 1-token, long documents."""
    from megatron_ext.blockdiag_cp.intervals import document_runs, overlap_counts, work_and_intervals
    from megatron_ext.blockdiag_cp.layouts.thd import thd_exchange_counts

    g = torch.Generator().manual_seed(cp)
    lengths = [1, 2 * cp, 2 * cp + 1, 5 * cp - 1] + torch.randint(1, 12 * cp, (9,), generator=g).tolist()
    parts = [torch.zeros(2 * cp, dtype=torch.long)]  # a padding-only extent first
    for i, n in enumerate(lengths):
        ext = -(-n // (2 * cp)) * (2 * cp)
        parts += [torch.full((n,), i + 1), torch.zeros(ext - n, dtype=torch.long)]
    ids = torch.cat(parts)
    runs = build_layout("thd", ids.unsqueeze(0), cp).runs
    _, dst, a, b = work_and_intervals(runs, [document_runs(ids)])
    assert torch.equal(thd_exchange_counts(ids, cp), overlap_counts(runs, dst, a, b))


def _padded_documents(cp, seed):
    """One THD row: a padding-only extent, 1-token, 2cp, 2cp + 1, 5cp - 1 and random documents, each
    padded at its end to a multiple of 2cp."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2 * cp, 2 * cp + 1, 5 * cp - 1] + torch.randint(1, 12 * cp, (9,), generator=g).tolist()
    parts = [torch.zeros(2 * cp, dtype=torch.long)]
    for i, n in enumerate(lengths):
        ext = -(-n // (2 * cp)) * (2 * cp)
        parts += [torch.full((n,), i + 1), torch.zeros(ext - n, dtype=torch.long)]
    return torch.cat(parts)


def _chunk_runs(ids, cp):
    """RankRuns of the layout from its definition: chunks r and 2cp-1-r of every extent, merged by ``build``."""
    from megatron_ext.blockdiag_cp.intervals import RankRuns

    cu = thd_padded_cu_seqlens(ids, cp).tolist()
    rank, start, length = [], [], []
    for lo, hi in zip(cu[:-1], cu[1:]):
        c = (hi - lo) // (2 * cp)
        for r in range(cp):
            rank += [r, r]
            start += [lo + r * c, lo + (2 * cp - 1 - r) * c]
            length += [c, c]
    return RankRuns.build(cp, ids.numel(), torch.tensor(rank), torch.tensor(start), torch.tensor(length))


@pytest.mark.parametrize("cp", [2, 3, 8])
def test_runs_come_merged_as_build_merges_the_chunks(cp):
    """The layout's runs (touching chunks merged by the layout itself) equal ``RankRuns.build`` of its chunks."""
    ids = _padded_documents(cp, cp + 10)
    want = _chunk_runs(ids, cp)
    rank, start, length = bdcp.layouts.THDLayout().runs(ids.unsqueeze(0), cp, None)
    assert torch.equal(rank, want.rank) and torch.equal(start, want.start) and torch.equal(length, want.length)
    got = build_layout("thd", ids.unsqueeze(0), cp).runs
    assert all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("rank", "start", "length", "local"))


@pytest.mark.parametrize("cp", [2, 3, 8])
def test_closed_form_work_and_intervals_equal_the_clip(cp):
    """thd_work_and_intervals against the generic clip of the layout's chunks by the documents."""
    from megatron_ext.blockdiag_cp.intervals import document_runs, work_intervals_and_docs
    from megatron_ext.blockdiag_cp.layouts.thd import thd_extents, thd_work_and_intervals

    for seed in range(3):
        ids = _padded_documents(cp, seed)
        want = work_intervals_and_docs(_chunk_runs(ids, cp), [document_runs(ids)])
        got = thd_work_and_intervals(thd_extents(ids, cp), cp)
        assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("cp", [2, 3, 8])
def test_closed_form_owned_and_sent_ranges_equal_the_searches(cp):
    """thd_owned_ranges and thd_send_ranges against the generic owned_ranges and flat_ranges through
    the layout's chunks, every rank."""
    from megatron_ext.blockdiag_cp.intervals import flat_ranges, owned_ranges
    from megatron_ext.blockdiag_cp.layouts.thd import (thd_extents, thd_owned_ranges, thd_send_ranges,
                                                       thd_work_and_intervals)

    for seed in range(3):
        ids = _padded_documents(cp, seed)
        runs = _chunk_runs(ids, cp)
        extents = thd_extents(ids, cp)
        _, dst, a, b, doc = thd_work_and_intervals(extents, cp)
        for rank in range(cp):
            mine = dst == rank
            got = thd_owned_ranges(extents, cp, a[mine], b[mine], rank)
            want = owned_ranges(runs, a[mine], b[mine], rank)
            assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(got, want))
            other = dst != rank
            got = thd_send_ranges(extents, cp, rank, a[other], b[other], doc[other])
            want = flat_ranges(runs, a[other], b[other], rank)
            assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(got, want))


# ---------------------------------------------------------------------------
# Padded extents as a THD batch gives them: empty documents, empty trailing padding
# ---------------------------------------------------------------------------

def _thd_params(cu, cu_padded):
    """The fields of megatron's THD PackedSeqParams that ThdSource reads (no megatron import here)."""
    from types import SimpleNamespace

    return SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded)


def _source_layout(cu, cu_padded, cp):
    """The layout a THD state at cp gets: ThdSource's documents and extents, build_layout as the state calls it."""
    from megatron_ext.blockdiag_cp.resolve import ThdSource

    T = int(cu_padded[-1])
    source = ThdSource(_thd_params(cu, cu_padded), T // cp, cp, "auto")
    code, detail = source._thd_check()
    assert code == 0, detail
    return source, build_layout(source.layout, source.raw.unsqueeze(0), cp,
                                cu_seqlens_padded=source.cu_seqlens_padded)


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("name", list(THD_EMPTY_DOCUMENT_CASES))
def test_empty_documents_keep_their_extents_as_te_partitions_them(name, cp):
    """Every rank's positions equal TE's partition of the padded extents (its index kernel's
    definition, chunk by chunk, and thd_partitioned_indices, what megatron's
    get_thd_batch_on_this_cp_rank hands the rank), empty extents included."""
    cu, cu_padded, ids = thd_case(name, cp)
    extents = cu_padded.diff().tolist()
    source, lay = _source_layout(cu, cu_padded, cp)
    assert torch.equal(source.raw, ids)
    T = int(cu_padded[-1])
    for rank in range(cp):
        want = _brute_force(extents, cp, rank)
        assert bdcp.thd_partitioned_indices(cu_padded, T, cp, rank).tolist() == want
        assert lay.positions[rank].tolist() == want, (name, cp, rank)


@pytest.mark.parametrize("cp", [2, 3])
def test_issue_cases_rank0_positions(cp):
    """Issue 32's figures at cp = 2: rank 0 holds [0, 1, 6, 7, 8, 11, 12, 13, 18, 19] (TE's), not the
    previous document's padding run on into the empty extent."""
    cu, cu_padded, _ = thd_case("empty_middle", cp)
    _, lay = _source_layout(cu, cu_padded, cp)
    if cp == 2:
        assert cu.tolist() == [0, 5, 5, 11] and cu_padded.tolist() == [0, 8, 12, 20]
        assert lay.positions[0].tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 18, 19]
    cu, cu_padded, _ = thd_case("empty_trailing", cp)
    _, lay = _source_layout(cu, cu_padded, cp)
    if cp == 2:
        assert cu.tolist() == [0, 5, 11, 11] and cu_padded.tolist() == [0, 8, 16, 20]
        assert lay.positions[0].tolist() == [0, 1, 6, 7, 8, 9, 14, 15, 16, 19]
    assert lay.positions.reshape(-1).sort().values.tolist() == list(range(int(cu_padded[-1])))


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("name", list(THD_EMPTY_DOCUMENT_CASES))
def test_plan_closed_forms_with_empty_extents_equal_the_generic_count(name, cp):
    """The THD plan's closed forms, read off the layout's extents, equal the generic interval
    arithmetic over the layout's runs (counts, work, every rank's send and receive ranges)."""
    from megatron_ext.blockdiag_cp.intervals import (document_runs, flat_ranges, overlap_counts, owned_ranges,
                                                     work_intervals_and_docs)
    from megatron_ext.blockdiag_cp.layouts.thd import (thd_exchange_counts, thd_extents, thd_owned_ranges,
                                                       thd_send_ranges, thd_work_and_intervals)

    cu, cu_padded, ids = thd_case(name, cp)
    _, lay = _source_layout(cu, cu_padded, cp)
    runs = lay.runs
    extents = thd_extents(ids, cp, cu_seqlens_padded=lay.cu_seqlens_padded)
    want = work_intervals_and_docs(runs, [document_runs(ids)])
    got = thd_work_and_intervals(extents, cp)
    assert all(torch.equal(x, y) for x, y in zip(got[:4], want[:4])), name
    _, dst, a, b, doc = got
    assert torch.equal(thd_exchange_counts(ids, cp, extents=extents), overlap_counts(runs, dst, a, b))
    for rank in range(cp):
        mine, other = dst == rank, dst != rank
        got_owned = thd_owned_ranges(extents, cp, a[mine], b[mine], rank)
        assert all(torch.equal(x, y) for x, y in zip(got_owned, owned_ranges(runs, a[mine], b[mine], rank)))
        got_sent = thd_send_ranges(extents, cp, rank, a[other], b[other], doc[other])
        assert all(torch.equal(x, y) for x, y in zip(got_sent, flat_ranges(runs, a[other], b[other], rank)))


def test_cu_seqlens_padded_errors_name_the_value():
    from megatron_ext.blockdiag_cp.resolve import ThdSource

    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    # An empty document's extent of 4 at cp = 3: not TE's partition (its kernel asserts multiples of 2cp).
    code, detail = ThdSource(_thd_params(i32(0, 5, 5, 11), i32(0, 6, 10, 18)), 6, 3, "auto")._thd_check()
    assert code == 13 and ("document 1 (0-based; 0 tokens, padded positions 6..9) has padded extent 4, not a "
                           "multiple of 2 * cp = 6") in detail, detail
    ids = torch.tensor([1] * 5 + [0] * 3 + [0] * 4 + [2] * 6 + [0] * 2).unsqueeze(0)
    with pytest.raises(ValueError, match=r"padding-only extent \(positions 6\.\.9\) has padded extent 4, "
                                         r"not a multiple of 2\*cp = 6"):
        build_layout("thd", torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1), 3,
                     cu_seqlens_padded=[0, 6, 10, 24])
    with pytest.raises(ValueError, match=r"must start at 0, not decrease and end at the padded length 20"):
        build_layout("thd", ids, 2, cu_seqlens_padded=[0, 8, 16])
    with pytest.raises(ValueError, match=r"document at positions 12\.\.17 does not start a padded extent"):
        build_layout("thd", ids, 2, cu_seqlens_padded=[0, 8, 16, 20])
    with pytest.raises(ValueError, match="cuts the 'thd' layout only"):
        build_layout("zigzag", ids, 2, cu_seqlens_padded=[0, 8, 12, 20])


def test_from_doc_ids_the_layout_pads_the_end_only():
    """As docs/design.md's layout table says: padded_length pads the sequence's end (the last
    document's extent) to 2cp; every other document must come padded, else the error names it."""
    from megatron_ext.blockdiag_cp.layouts import padded_length

    last_short = torch.tensor([1] * 8 + [2] * 3)  # document 2 unpadded at the end: the layout pads it
    P = padded_length(last_short.numel(), "thd", 2)
    lay = build_layout("thd", torch.nn.functional.pad(last_short, (0, P - last_short.numel())).unsqueeze(0), 2)
    assert P == 12 and lay.positions.tolist() == [_brute_force([8, 4], 2, r) for r in range(2)]
    first_short = torch.tensor([1] * 5 + [2] * 3)  # document 1 unpadded before document 2: refused
    with pytest.raises(ValueError, match=r"document 1 \(positions 0\.\.4\) has padded extent 5.*pad every "
                                         r"document at its end to a multiple of 4"):
        build_layout("thd", first_short.unsqueeze(0), 2)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_plan_takes_the_closed_forms_only_where_they_hold(cp):
    """THD's plan tables are its closed forms for one row of whole documents at cp > 1, else the intervals."""
    from megatron_ext.blockdiag_cp.intervals import document_runs
    from megatron_ext.blockdiag_cp.layouts import LAYOUT_STRATEGIES, LayoutTables
    from megatron_ext.blockdiag_cp.layouts.thd import THDTables

    ids = _padded_documents(cp, 0).unsqueeze(0)
    rows = [document_runs(ids[0])]
    thd, layout = LAYOUT_STRATEGIES["thd"], build_layout("thd", ids, cp)
    assert type(thd.plan_tables(layout, ids, rows, None)) is THDTables
    assert type(thd.plan_tables(layout, ids, rows, 8)) is LayoutTables  # a window
    assert type(thd.plan_tables(layout, ids.repeat(2, 1), rows * 2, None)) is LayoutTables  # two rows
    assert type(thd.plan_tables(build_layout("thd", ids, 1), ids, rows, None)) is LayoutTables  # one rank
    for name in ("contiguous", "zigzag", "balanced"):
        assert type(LAYOUT_STRATEGIES[name].plan_tables(build_layout(name, ids, cp), ids, rows, None)) is LayoutTables
