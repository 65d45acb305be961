"""scripts/bench/torch_cp_flex.py: ours and torch's flex-attention context parallelism attend the same packed documents.

One pool of two gloo processes at S=1024, cp 2 (ours thd and balanced, a2a): torch's compiled flex
kernel behind its own CP module wrapper and our op give the same output at global positions, the
documents are cut to whole THD chunks, and the rows carry the fields SUMMARY.md reads.
"""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_SCRIPTS = os.path.join(ROOT, "scripts", "bench")


@pytest.fixture(scope="module")
def flex():
    sys.path.insert(0, BENCH_SCRIPTS)
    try:
        import torch_cp_flex

        yield torch_cp_flex
    finally:
        sys.path.remove(BENCH_SCRIPTS)


@pytest.fixture(scope="module")
def rows(flex):
    return flex.run(sizes=(1024,), reps=1, log=lambda *_: None)


def test_short_ids_are_whole_thd_chunks(flex):
    from megatron_ext.testing.mixes import make_doc_ids

    ids = flex.short_ids(8192)
    docs, lengths = torch.unique_consecutive(ids, return_counts=True)
    assert ids.numel() == 8192 and (docs[:-1] > 0).all() and docs[-1] == 0  # padding only at the end
    assert all(n % 4 == 0 for n in lengths[:-1].tolist())
    _, raw = torch.unique_consecutive(make_doc_ids("short", 8192), return_counts=True)
    assert lengths[:-1].tolist() == [n - n % 4 for n in raw.tolist() if n >= 4]


@pytest.mark.timeout(300)
def test_same_output_as_torch_flex(rows):
    assert [(r["S"], r["layout"], r["exchange"]) for r in rows] == [(1024, "thd", "a2a"), (1024, "balanced", "a2a")]
    for r in rows:
        assert r["max_rel_diff"] < 1e-5, r
        assert r["torch_backward"] != "ran", r  # forward only: said why


def test_row_fields(rows):
    for r in rows:
        assert r["suite"] == "torch_cp_flex" and r["cp"] == 2 and r["mix"] == "short" and r["phase"] == "forward"
        assert (r["dtype"], r["heads"], r["head_dim"], r["backend"]) == ("float32", 8, 64, "dense")
        assert r["seconds"] > 0 and r["seconds_torch"] > 0 and r["docs"] >= 2
        assert r["ratio_ours_over_torch"] == pytest.approx(r["seconds"] / r["seconds_torch"])
        assert len(r["seconds_reps"]) == len(r["seconds_torch_reps"]) == r["reps"] == 1
        assert "alternated" in r["method"] and "slowest rank" in r["method"]
