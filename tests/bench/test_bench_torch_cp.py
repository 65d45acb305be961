"""scripts/bench/torch_cp.py: ours and torch's own ring attention do the same work on one causal document.

One round at S=256, cp 2 (one fresh gloo process pair, both exchanges): the two implementations
give the same output and dQ/dK/dV at global positions, both equal one unsharded fp64 causal SDPA,
they hold the same rows (zigzag = torch's head-tail), and the rows carry the fields SUMMARY.md reads.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_SCRIPTS = os.path.join(ROOT, "scripts", "bench")


@pytest.fixture(scope="module")
def rows():
    sys.path.insert(0, BENCH_SCRIPTS)
    try:
        import torch_cp

        yield torch_cp.run(sizes=(256,), exchanges=("a2a", "allgather"), reps=1, rounds=1, log=lambda *_: None)
    finally:
        sys.path.remove(BENCH_SCRIPTS)


def test_same_work(rows):
    assert [(r["S"], r["exchange"], r["torch_rotate"]) for r in rows] == [(256, "a2a", "alltoall"),
                                                                           (256, "allgather", "allgather")]
    for r in rows:
        assert r["same_rows"], r
        assert set(r["max_rel_diff"]) == {"out", "dq", "dk", "dv"}
        assert max(r["max_rel_diff"].values()) < 1e-5, r["max_rel_diff"]
        assert max(r["max_rel_diff_ref"].values()) < 1e-5, r["max_rel_diff_ref"]


def test_row_fields(rows):
    for r in rows:
        assert r["suite"] == "torch_cp" and r["cp"] == 2 and r["docs"] == 1 and r["causal"]
        assert (r["dtype"], r["heads"], r["head_dim"], r["layout"], r["backend"]) == ("float32", 8, 64, "zigzag",
                                                                                      "dense")
        assert r["seconds"] > 0 and r["seconds_torch"] > 0
        assert r["ratio_ours_over_torch"] == pytest.approx(r["seconds"] / r["seconds_torch"])
        assert len(r["seconds_rounds"]) == len(r["seconds_torch_rounds"]) == r["rounds"] == 1
        assert "alternated" in r["method"] and "slowest rank" in r["method"]
        assert isinstance(r["public_api"], str) and r["public_api"]  # what torch's public API said on CPU
