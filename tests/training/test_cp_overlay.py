"""CP changes nothing: the same training at CP = 1 (one process) and CP = 2 (two processes).

A short scripts/cp_overlay.py run (tiny GPT, a few iterations, fp32): the test reads the
two runs' own losses.json files and asserts, at every iteration, that the losses agree
to 1e-3 relative and that the model learned (so agreement is not two flat lines). The
100-iteration version of the same comparison is docs/cp_overlay.png.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
OVERLAY = REPO / "scripts" / "cp_overlay.py"
ITERS = 6
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "256", "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-warmup-iters", "1", "--log-interval", "1"]


@pytest.mark.timeout(300)
def test_cp1_and_cp2_losses_agree_every_iteration(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, str(OVERLAY), "--train-iters", str(ITERS),
                          "--out-dir", str(tmp_path / "out"), "--work-dir", str(tmp_path / "runs"),
                          "--", *TINY], env=env, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    def losses(run):
        data = json.loads((tmp_path / "runs" / run / "losses.json").read_text())
        return dict(zip(data["iteration"], data["loss"]))

    cp1, cp2 = losses("cp1"), losses("cp2")
    assert sorted(cp1) == sorted(cp2) == list(range(1, ITERS + 1))
    for it in cp1:
        assert math.isfinite(cp1[it]) and math.isfinite(cp2[it])
        assert abs(cp2[it] - cp1[it]) <= 1e-3 * abs(cp1[it]), (it, cp1[it], cp2[it])
    assert cp1[ITERS] < cp1[1] - 0.3, cp1  # it trained: the curves are not flat
    summary = json.loads((tmp_path / "out" / "cp_overlay.json").read_text())
    assert summary["loss_cp1"] == [cp1[i] for i in range(1, ITERS + 1)]
    assert (tmp_path / "out" / "cp_overlay.png").stat().st_size > 1000
