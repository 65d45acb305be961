"""scripts/slurm/pretrain_gpt.sbatch on a real SLURM started on this machine.

munged + slurmctld + two emulated slurmd nodes (n1, n2), all state in a temp folder
(megatron_ext/testing/slurm.py). A 2-node x 2-process CPU job (gloo, CP = 2, DP = 2) trains a
tiny GPT for a few iterations through `sbatch --wait`; the job must exit 0 with a
falling loss, and every daemon this test started must be gone afterwards.

Skips when slurm-wlm / munge are not installed (scripts/ci/install_slurm.sh installs
them), except under CI (env CI set), where that is a failure.
"""

import os
import pathlib
import re
import sys
import time

import pytest

from megatron_ext.testing.slurm import SlurmCluster, missing_requirements

REPO = pathlib.Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "slurm" / "pretrain_gpt.sbatch"

TRAIN_ITERS = 16


def _require_slurm():
    missing = missing_requirements()
    if missing:
        why = (f"SLURM test needs {', '.join(missing)} "
               "(install with scripts/ci/install_slurm.sh)")
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the SLURM test: {why}")
        pytest.skip(why)


def _processes_mentioning(text: str):
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline.strip()}")
    return found


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_sbatch_two_nodes_cp2_dp2_trains(tmp_path):
    _require_slurm()
    cluster = SlurmCluster(nodes=("n1", "n2"), cpus_per_node=2, root=str(tmp_path / "slurm"))
    jobs = tmp_path / "jobs"  # sbatch -o does not create folders
    jobs.mkdir()
    logs = tmp_path / "logs"
    t0 = time.time()
    try:
        cluster.start()
        t_started = time.time()
        env = {
            "REPO": str(REPO),
            "PYTHON": sys.executable,
            "LOG_DIR": str(logs),
            "TP": "1",
            "CP": "2",
            "DIST_BACKEND": "gloo",
            "CP_KV_EXCHANGE": "allgather",
            "TRAIN_ITERS": str(TRAIN_ITERS),
            "SEQ_LENGTH": "256",
            "LOG_INTERVAL": "1",
            "TRAIN_ARGS": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                          "--num-query-groups 2 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 2 "
                          "--no-plot",
            "OMP_NUM_THREADS": "1",
        }
        rc, sbatch_out = cluster.sbatch_wait(
            ["-N", "2", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
             "-o", str(jobs / "%x-%j.out"), str(SBATCH)],
            minutes=4, env=env, cwd=str(REPO))
        t_job = time.time() - t_started
        outputs = sorted(jobs.glob("*.out"))
        text = "\n".join(p.read_text(errors="replace") for p in outputs)
        assert rc == 0, (f"sbatch --wait exit {rc}: {sbatch_out}\n--- job output\n{text[-6000:]}"
                         f"\n--- daemons\n{cluster.logs()}")
    finally:
        survivors = cluster.stop()
    t_total = time.time() - t0

    assert survivors == [], f"daemons still running after stop: {survivors}"
    leftovers = _processes_mentioning(str(tmp_path))
    assert leftovers == [], f"processes left behind: {leftovers}"

    summary = [line for line in text.splitlines() if "[pretrain_gpt] summary:" in line]
    assert len(summary) == 1, f"expected one summary line from rank 0:\n{text[-4000:]}"
    fields = dict(kv.split("=", 1) for kv in summary[0].split("summary:", 1)[1].split())
    assert (fields["world"], fields["tp"], fields["cp"], fields["dp"]) == ("4", "1", "2", "2"), \
        summary[0]
    assert int(fields["iterations"]) == TRAIN_ITERS, summary[0]

    losses = [float(m) for m in re.findall(r"\| lm loss: ([0-9.Ee+-]+) \|", text)]
    assert len(losses) == TRAIN_ITERS, f"expected {TRAIN_ITERS} loss lines:\n{text[-4000:]}"
    first, last = losses[0], sum(losses[-4:]) / 4
    assert last < first - 0.5, f"loss did not fall: {losses}"
    # the CP engine really exchanged K/V between the two CP ranks
    sent = [float(m) for m in re.findall(r"sent ([0-9.]+) MiB", text)]
    assert sent and max(sent) > 0, "no K/V bytes exchanged across the CP group"
    print(f"\nSLURM 2x2 job: {t_job:.1f}s, total with daemons {t_total:.1f}s; "
          f"loss {first:.3f} -> {last:.3f}")
