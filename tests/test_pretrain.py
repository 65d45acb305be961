"""scripts/pretrain_gpt.py end to end, tiny sizes (2 CPU processes under torchrun, gloo).

(a) bad --cp-* values / sizes exit non-zero naming the accepted values, before any
    process group exists (a 2-rank world whose rank 1 never comes would otherwise hang);
(b) a missing or corrupt --data-path fails cleanly on every rank, no hang;
(c) a run SIGKILLed after a checkpoint and resumed with --load gives the same losses,
    iteration for iteration, as an uninterrupted run.
"""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "pretrain_gpt.py"
PREPARE = REPO / "scripts" / "prepare_data.py"

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "256", "--micro-batch-size", "1",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--log-interval", "1",
        "--no-plot"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT") and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}"]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A small indexed dataset: the stdlib's json + email packages, one document per file."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    src = tmp_path_factory.mktemp("texts")
    for pkg in ("json", "email"):
        for f in sorted((root / pkg).glob("*.py")):
            (src / f"{pkg}_{f.name}").write_bytes(f.read_bytes())
    prefix = tmp_path_factory.mktemp("data") / "tiny_text_document"
    res = subprocess.run([sys.executable, str(PREPARE), "--input", str(src), "--pattern", "*.py",
                          "--output-prefix", str(prefix), "--no-progress"],
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return str(prefix)


# ----------------------------------------------------------------------------- (a)

@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag,value,accepted", [
    ("--cp-attn-backend", "cudnn_magic", ["dense", "flash", "te", "sdpa"]),
    ("--cp-kv-exchange", "broadcast", ["allgather", "halo", "a2a"]),
    ("--cp-layout", "spiral", ["contiguous", "zigzag", "balanced"]),
])
def test_bad_cp_flag_exits_before_process_group(flag, value, accepted):
    # Rank 0 of a 2-rank world: if it reached init_process_group it would wait for rank 1.
    env = _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    t = time.time()
    res = subprocess.run([sys.executable, str(SCRIPT), flag, value], env=env,
                         capture_output=True, text=True, timeout=90)
    assert res.returncode != 0
    assert flag in res.stderr and value in res.stderr, res.stderr
    assert "accepted values" in res.stderr, res.stderr
    for word in accepted:
        assert word in res.stderr, (word, res.stderr)
    assert "[pretrain_gpt] torch" not in res.stdout  # printed only after the group exists
    assert time.time() - t < 60


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,message", [
    (["--context-parallel-size", "3"], "not divisible"),
    (["--context-parallel-size", "1", "--global-batch-size", "3"], "not divisible"),
    (["--num-attention-heads", "4", "--num-query-groups", "3"], "not divisible"),
])
def test_bad_sizes_exit_before_process_group(args, message):
    env = _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    res = subprocess.run([sys.executable, str(SCRIPT), *args], env=env,
                         capture_output=True, text=True, timeout=90)
    assert res.returncode != 0
    assert message in res.stderr, res.stderr


def _load_script(path: pathlib.Path):
    """The entry script as a module (it puts its own folder on sys.path for its helpers)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_synonyms_are_accepted():
    pretrain_gpt = _load_script(SCRIPT)
    args = pretrain_gpt.build_parser().parse_args(
        ["--cp-attn-backend", "SDPA", "--cp-kv-exchange", "all-gather", "--cp-layout", "Zig-Zag"])
    pretrain_gpt.validate_args(args, world_size=2)
    assert (args.cp_attn_backend_canonical, args.cp_kv_exchange_canonical,
            args.cp_layout_canonical) == ("dense", "allgather", "zigzag")
    assert (args.context_parallel_size, args.data_parallel_size) == (2, 1)


# ----------------------------------------------------------------------------- (b)

def _run_two_ranks_expect_data_error(data_args, expect):
    t = time.time()
    res = subprocess.run([*_torchrun(2), str(SCRIPT), *TINY, "--train-iters", "2", *data_args],
                         env=_env(), capture_output=True, text=True, timeout=150)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: error: .*{re.escape(expect)}", out), out
    assert "pretrain_gpt.py\", line" not in out, out  # a clean message, not a traceback
    assert time.time() - t < 120


@pytest.mark.timeout(180)
def test_missing_data_path_fails_on_every_rank(tmp_path):
    _run_two_ranks_expect_data_error(["--data-path", str(tmp_path / "nope_text_document")],
                                     "missing")


@pytest.mark.timeout(180)
def test_corrupt_data_path_fails_on_every_rank(tmp_path, tiny_data):
    bad = tmp_path / "bad_text_document"
    bad.with_suffix(".bin").write_bytes(b"\x01\x02" * 100)
    bad.with_suffix(".idx").write_bytes(b"NOTANIDX" + b"\x00" * 64)
    _run_two_ranks_expect_data_error(["--data-path", str(bad)], "bad magic")


@pytest.mark.timeout(180)
def test_truncated_bin_fails_on_every_rank(tmp_path, tiny_data):
    trunc = tmp_path / "trunc_text_document"
    idx = pathlib.Path(tiny_data + ".idx").read_bytes()
    data = pathlib.Path(tiny_data + ".bin").read_bytes()
    trunc.with_suffix(".idx").write_bytes(idx)
    trunc.with_suffix(".bin").write_bytes(data[: len(data) // 2])
    _run_two_ranks_expect_data_error(["--data-path", str(trunc)], "truncated")


# ----------------------------------------------------------------------------- (c)

N_ITERS = 40
SAVE_EVERY = 5
KILL_AFTER = 10  # SIGKILL once this checkpoint is announced


def _pids_mentioning(text):
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if text in cmd and stat != "Z":
                pids.append(int(entry.name))
    return pids


def _losses(folder):
    with open(pathlib.Path(folder) / "losses.json") as f:
        data = json.load(f)
    return dict(zip(data["iteration"], data["loss"]))


@pytest.mark.timeout(300)
def test_sigkill_and_resume_reproduces_losses(tmp_path, tiny_data):
    common = [*_torchrun(2), str(SCRIPT), *TINY, "--data-path", tiny_data,
              "--train-iters", str(N_ITERS), "--save-interval", str(SAVE_EVERY)]

    # A: uninterrupted
    a = tmp_path / "a"
    res = subprocess.run([*common, "--save", str(a)], env=_env(), capture_output=True, text=True,
                         timeout=200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "cp=2" in res.stdout, res.stdout[-2000:]  # the defaults give CP = 2 on 2 processes
    ref = _losses(a)
    assert sorted(ref) == list(range(1, N_ITERS + 1))

    # B: killed with SIGKILL (the whole torchrun process group) right after a checkpoint
    b = tmp_path / "b"
    proc = subprocess.Popen([*common, "--save", str(b)], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    killed = False
    try:
        for line in proc.stdout:
            seen.append(line)
            if f"saved checkpoint {b}/iter_{KILL_AFTER:07d}" in line:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert killed, "".join(seen[-50:])
    assert proc.returncode == -signal.SIGKILL
    pointer = int((b / "latest_checkpointed_iteration.txt").read_text())
    assert KILL_AFTER <= pointer < N_ITERS
    assert not (b / "losses.json").exists()  # it never finished
    # the workers must die with their launcher (no orphan keeps training and saving)
    deadline = time.time() + 10
    while _pids_mentioning(str(b)) and time.time() < deadline:
        time.sleep(0.2)
    survivors = _pids_mentioning(str(b))
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert survivors == [], f"worker processes survived torchrun's SIGKILL: {survivors}"

    # a crash in the middle of writing the next checkpoint leaves only a temp folder
    half = b / f"iter_{pointer + SAVE_EVERY:07d}.tmp"
    half.mkdir(exist_ok=True)
    (half / "rank_00000.pt").write_bytes(b"half-written")

    # C: resume B from its latest checkpoint
    res = subprocess.run([*common, "--save", str(b), "--load", str(b)], env=_env(),
                         capture_output=True, text=True, timeout=200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"resumed from {b} at iteration {pointer}" in res.stdout, res.stdout[-2000:]
    resumed_lines = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.Ee+-]+) \|", res.stdout)}
    assert sorted(resumed_lines) == list(range(pointer + 1, N_ITERS + 1))
    got = _losses(b)
    assert sorted(got) == sorted(ref)
    for it in ref:
        assert got[it] == pytest.approx(ref[it], rel=1e-6, abs=1e-6), (it, got[it], ref[it])
    for it, loss in resumed_lines.items():  # what the resumed process itself printed
        assert loss == pytest.approx(ref[it], rel=1e-6), (it, loss, ref[it])
    assert ref[N_ITERS] < ref[1] - 0.5  # and it learned something
    assert not list(b.glob("*.tmp")), "a stale temp checkpoint folder survived the next save"
    assert int((b / "latest_checkpointed_iteration.txt").read_text()) == N_ITERS


@pytest.mark.timeout(180)
def test_strict_backend_fallback_is_an_error_on_every_rank(tiny_data):
    pytest.importorskip("torch")
    import importlib.util
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed: 'te' does not fall back here")
    res = subprocess.run([*_torchrun(2), str(SCRIPT), *TINY, "--data-path", tiny_data,
                          "--train-iters", "2", "--cp-attn-backend", "te",
                          "--cp-attn-backend-strict"],
                         env=_env(), capture_output=True, text=True, timeout=150)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: error: strict mode", out), out
