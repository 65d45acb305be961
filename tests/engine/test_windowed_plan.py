"""Issue 16 item 1: the planner knows the model's sliding windows (``cost.WindowMix``).

``balanced`` prices every candidate as the layers' mix of windowed work and windowed needed
keys: its counts equal a position-by-position brute force, and under that windowed cost it is
never worse than contiguous or zigzag. The windows are agreed across the CP group like the
cost model, and a plan made ahead for them is the one the build uses.
"""

import pytest
import torch

import megatron_ext.blockdiag_cp as bdcp
from megatron_ext.blockdiag_cp.cost import CostModel, WindowMix, resolve_windows
from megatron_ext.blockdiag_cp.intervals import document_runs, pair_work
from megatron_ext.blockdiag_cp.layouts import build_layout, padded_length
from megatron_ext.blockdiag_cp.layouts.balanced.traffic import candidate_traffic, flatten
from megatron_ext.blockdiag_cp.layouts.balanced.units import UnitTable
from megatron_ext.blockdiag_cp.prepare import layout_cost
from megatron_ext.testing import pool_fixture


def _ids(S, g, max_doc, hole=0.0):
    lengths = torch.randint(1, max_doc + 1, (S,), generator=g)
    ids = torch.repeat_interleave(torch.arange(1, S + 1), lengths)[:S]
    return torch.where(torch.rand(S, generator=g) < hole, torch.zeros_like(ids), ids)


def _brute_force(ids_row, owner, cp, window):
    """Per rank: query-key pairs, keys it needs and does not own, and own keys others need; pairs
    per (key owner, query owner) -- from the doc ids, position by position."""
    P = len(ids_row)
    start = list(range(P))
    for p in range(1, P):
        if ids_row[p] == ids_row[p - 1]:
            start[p] = start[p - 1]
    work, sent = [0] * cp, [0] * cp
    need = [set() for _ in range(cp)]
    pairs = torch.zeros(cp, cp, dtype=torch.long)
    for p in range(P):
        if ids_row[p] == 0:
            continue
        r = owner[p]
        first = start[p] if window is None else max(start[p], p - window)
        work[r] += p - first + 1
        for k in range(first, p + 1):
            pairs[owner[k], r] += 1
            if owner[k] != r:
                need[r].add(k)
    for r in range(cp):
        for k in need[r]:
            sent[owner[k]] += 1
    return work, [len(n) for n in need], sent, pairs


def _owned(layouts, cp):
    out = []
    for lay in layouts:
        o = [[] for _ in range(cp)]
        for r, s, n in zip(lay.runs.rank.tolist(), lay.runs.start.tolist(), lay.runs.length.tolist()):
            o[r].append((s, s + n))
        out.append(o)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_windowed_work_and_keys_of_every_candidate_equal_a_brute_force(seed):
    # balanced's batched scoring (every candidate at once) and the op model's pair_work, against a
    # brute force: windows from 0 to past a document, padding holes, documents over many ranks.
    g = torch.Generator().manual_seed(seed)
    for cp in (2, 3, 4, 6):
        S = int(torch.randint(4 * cp, 160, (1,), generator=g))
        ids = _ids(S, g, max_doc=int(torch.randint(2, 2 * S, (1,), generator=g)), hole=0.1 * (seed % 2))
        P = padded_length(S, "zigzag", cp)
        ids = torch.nn.functional.pad(ids, (0, P - S)).unsqueeze(0)
        rows = [document_runs(ids[0])]
        layouts = [build_layout(name, ids, cp, windows=w) for name in ("contiguous", "zigzag", "balanced")
                   for w in (None, 3)]
        flat = flatten(_owned(layouts, cp), cp)
        table = UnitTable(rows, P)
        for window in (None, 0, 1, 4, 11, 200):
            work, inn, out = candidate_traffic(table, cp, *flat, window=window)
            for c, lay in enumerate(layouts):
                want_work, want_in, want_out, want_pairs = _brute_force(ids[0].tolist(), lay.owner().tolist(),
                                                                         cp, window)
                assert work[c].tolist() == want_work, (cp, window, c)
                assert inn[c].tolist() == want_in, (cp, window, c)
                assert out[c].tolist() == want_out, (cp, window, c)
                assert torch.equal(pair_work(lay.runs, rows, window), want_pairs), (cp, window, c)


def test_plan_summary_counts_the_windowed_keys_and_prices_the_mix():
    g = torch.Generator().manual_seed(7)
    cp, window = 4, 9
    ids = _ids(300, g, max_doc=120)
    cm = CostModel.preset("ib")
    for layout in ("contiguous", "zigzag", "balanced"):
        s = bdcp.plan_summary(ids, cp, layout=layout, cost_model=cm, window=window)
        P = s["padded_len"]
        owner = torch.empty(P, dtype=torch.long)
        owner[s["positions"].flatten()] = torch.arange(cp).repeat_interleave(P // cp)
        padded = torch.nn.functional.pad(ids, (0, P - ids.numel())).tolist()
        work, need, sent, _ = _brute_force(padded, owner.tolist(), cp, window)
        assert s["work_per_rank"] == work and s["needed_positions_per_rank"] == need, layout
        assert s["traffic"].intra_in.tolist() == need and s["traffic"].intra_out.tolist() == sent, layout
        modeled = max(w * cm.seconds_per_pair + max(n, o) * cm.seconds_per_position for w, n, o in zip(work, need, sent))
        assert s["modeled_seconds"] == pytest.approx(modeled, rel=1e-12), layout
        # A mix: each share of layers priced alone, weighed by its share.
        lay = build_layout(layout, torch.tensor(padded).unsqueeze(0), cp, cm, windows=WindowMix.of(window, 0.75))
        mixed = layout_cost(torch.tensor(padded), lay, cm, windows=WindowMix.of(window, 0.75))["modeled_seconds"]
        alone = [layout_cost(torch.tensor(padded), lay, cm, windows=w)["modeled_seconds"] for w in (window, None)]
        assert mixed == pytest.approx(0.75 * alone[0] + 0.25 * alone[1], rel=1e-12)


def _mix_ids(kind, S, g):
    if kind == "long":  # documents of S/4 - S (balanced used to move most keys here, issue 16)
        lengths = torch.randint(S // 4, S + 1, (8,), generator=g)
    elif kind == "short":
        lengths = torch.randint(8, S // 16 + 9, (4 * 16,), generator=g)
    else:
        lengths = torch.exp(4 + 1.3 * torch.randn(200, generator=g)).long().clamp(1, S)
    ids = torch.repeat_interleave(torch.arange(1, lengths.numel() + 1), lengths)[:S]
    return torch.nn.functional.pad(ids, (0, S - ids.numel()))


@pytest.mark.parametrize("link", ["nvlink", "ib", "2lvl"])
def test_balanced_with_windows_is_never_worse_than_contiguous_or_zigzag(link):
    g = torch.Generator().manual_seed({"nvlink": 1, "ib": 2, "2lvl": 3}[link])
    cp = 8
    cm = CostModel.two_level(4) if link == "2lvl" else CostModel.preset(link)
    for trial in range(6):
        S = 4096 * (1 + trial % 2)
        ids = _mix_ids(("long", "short", "lognormal")[trial % 3], S, g)
        for windows in (WindowMix.of(64), WindowMix.of(512, 0.5), [256, None, 256, 256], (32, 0)):
            mix = resolve_windows(windows)
            got = {}
            for layout in ("balanced", "contiguous", "zigzag"):
                x = torch.nn.functional.pad(ids, (0, padded_length(S, layout, cp) - S)).unsqueeze(0)
                lay = build_layout(layout, x, cp, cm, windows=mix)
                got[layout] = layout_cost(x, lay, cm, overlap=False, windows=mix)["modeled_seconds"]
            assert got["balanced"] <= min(got["contiguous"], got["zigzag"]) * (1 + 1e-9), (trial, mix, got)


def test_balanced_moves_no_more_keys_than_contiguous_on_long_documents_with_a_window():
    # The case in small: long documents, a window far below the shard. Priced without the
    # window, balanced split documents for full attention and moved 3x contiguous's keys.
    ids = torch.repeat_interleave(torch.arange(1, 5), torch.tensor([4000, 6000, 3000, 3384]))
    got = {}
    for layout in ("balanced", "contiguous", "zigzag"):
        s = bdcp.plan_summary(ids, 8, layout=layout, cost_model=CostModel.preset("nvlink"), window=256)
        got[layout] = max(s["needed_positions_per_rank"])
    assert got["balanced"] <= min(got["contiguous"], got["zigzag"]), got


def test_window_mix_refuses_bad_input():
    assert resolve_windows((128, 0)) == WindowMix.of(128) == resolve_windows(128)
    assert resolve_windows([128, None, (64, 0), None]) == WindowMix(((64, .25), (128, .25), (None, .5)))
    for bad, match in (((128, 5), "causal"), (-1, ">= 0"), ("128", "windows must be"), ([], "no layers")):
        with pytest.raises(ValueError, match=match):
            resolve_windows(bad)
    with pytest.raises(ValueError, match="sum to 1"):
        WindowMix(((128, 0.5),))
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        WindowMix.of(128, 1.5)


def test_a_plan_prepared_for_the_windows_is_the_one_the_build_uses():
    ids = torch.repeat_interleave(torch.arange(1, 6), torch.tensor([40, 9, 70, 3, 22]))
    mix = WindowMix.of(16, 0.5)
    prep = bdcp.prepare_plan(ids, 1, 0, layout="balanced", windows=mix)
    assert set(prep.window_plans) == {16} and prep.window_plans[16].window == 16
    state = bdcp.BlockDiagCPState.build(ids, layout="balanced", attn_backend="dense", prepared=prep, windows=mix)
    assert state.plan is prep.plan and state.plan_for(16) is prep.window_plans[16]
    assert state.report()["windows"] == mix.describe()
    # Prepared for other windows: balanced plans again (its cuts depend on them).
    other = bdcp.BlockDiagCPState.build(ids, layout="balanced", attn_backend="dense", prepared=prep, windows=64)
    assert other.plan is not prep.plan


pool2 = pool_fixture(2)


def _build_with(windows_by_rank, layout):
    import torch.distributed as dist

    rank = dist.get_rank()
    try:
        state = bdcp.BlockDiagCPState.build(torch.ones(64, dtype=torch.long), layout=layout, attn_backend="dense",
                                            windows=windows_by_rank[rank])
        return "ok", state.report()["windows"]
    except bdcp.BlockDiagCPError as exc:
        return "error", str(exc)


def test_the_windows_are_agreed_across_the_cp_group(pool2):
    for kind, text in pool2.run(_build_with, [128, 256], "balanced"):
        assert kind == "error" and "sliding windows differ" in text, text
    for kind, text in pool2.run(_build_with, [128, 128], "balanced"):
        assert kind == "ok" and text == WindowMix.of(128).describe(), text
    for kind, text in pool2.run(_build_with, ["bad", 128], "balanced"):  # a bad value on one rank: both raise
        assert kind == "error", text
    # Layouts that do not price windows do not need them to agree (each layer's own window is
    # checked with its q/k/v when it runs).
    for kind, _ in pool2.run(_build_with, [128, 256], "zigzag"):
        assert kind == "ok"


def test_a_state_derived_from_megatrons_mask_records_the_layers_windows():
    from megatron_ext.layers.attention import _model_windows
    from types import SimpleNamespace

    ids = torch.tensor([1] * 6 + [2] * 10)
    mask = ~((ids[:, None] == ids[None, :]) & torch.ones(16, 16, dtype=torch.bool).tril())  # True: masked
    windows = _model_windows(SimpleNamespace(num_layers=4, window_size=(4, 0), window_attn_skip_freq=2))
    assert windows == WindowMix.of(4, 0.5)
    state = bdcp.resolve_step_state(attention_mask=mask[None, None], windows=windows, local_tokens=16, batch=1)
    assert state.report()["windows"] == windows.describe()
