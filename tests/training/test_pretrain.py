"""scripts/pretrain_gpt.py end to end, tiny sizes (2 CPU processes under torchrun, gloo).

(a) bad --cp-* values / sizes / numbers / --data-path syntax exit non-zero naming the
    value and the fix, before any process group exists (a 2-rank world whose rank 1
    never comes would otherwise hang);
(b) a missing or corrupt --data-path fails cleanly on every rank, no hang;
(c) a run SIGKILLed after a checkpoint and resumed with --load gives the same losses,
    iteration for iteration, as an uninterrupted run, and the learning rate follows
    Megatron's schedule (an independent formula) across the resume; with one rank file
    taken from an older checkpoint, every rank refuses the resume;
(d) --load never unpickles code: a crafted checkpoint is refused with the reason.
"""

import json
import math
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

REPO = pathlib.Path(__file__).resolve().parents[2]
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
    # numbers no run can use: rejected here, not by megatron's scheduler after the group starts
    (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--min-lr", "0.1", "--lr", "0.01"], "--min-lr 0.1 must not exceed --lr 0.01"),
    (["--train-iters", "20", "--lr-warmup-iters", "20"], "must be smaller than --lr-decay-iters 20"),
    (["--adam-beta2", "1.5"], "--adam-beta2 must be in [0, 1), got 1.5"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], "one of --lr-warmup-fraction"),
    (["--start-weight-decay", "0.0"], "--weight-decay-incr-style linear or cosine"),
    # megatron's blended syntax is W1 P1 W2 P2 ...: the problem is the unpaired weight
    (["--data-path", "0.5", "PFX", "0.5"], "the weight 0.5 has no prefix after it"),
    (["--data-path", "PFX_A", "0.3", "PFX_B"], "mixes plain prefixes with what look like weights"),
    (["--data-path", "0.5", "PFX_A", "PFX_B", "PFX_C"], "entry 3 ('PFX_B') should be the weight"),
    (["--data-path", "-1", "PFX_A"], "must be a positive finite number"),
    (["--window-size", "64", "8"], "--window-size takes LEFT 0"),
    (["--window-attn-skip-freq", "2"], "--window-attn-skip-freq needs --window-size"),
])
def test_bad_values_exit_before_process_group(args, message):
    # Rank 0 of a 2-rank world: reaching init_process_group would hang until the timeout.
    env = _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    t = time.time()
    res = subprocess.run([sys.executable, str(SCRIPT), *args], env=env,
                         capture_output=True, text=True, timeout=90)
    assert res.returncode == 2, res.stdout + res.stderr  # argparse's usage-error code
    assert message in res.stderr, res.stderr
    assert "missing" not in res.stderr, res.stderr  # never "dataset '0.5' is missing"
    assert "[pretrain_gpt] torch" not in res.stdout  # printed only after the group exists
    assert time.time() - t < 30


def test_validation_imports_no_torch():
    # The fast exit above relies on this: flags are checked before torch is imported.
    code = ("import sys; from megatron_ext.training import arguments; "
            "a = arguments.build_parser().parse_args(['--lr', '1e-3']); "
            "arguments.validate_args(a, 2); "
            "print(sorted(m for m in ('torch', 'megatron', 'numpy') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], env=_env(PYTHONPATH=str(REPO)),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


def test_synonyms_are_accepted():
    from megatron_ext.training import arguments
    args = arguments.build_parser().parse_args(
        ["--cp-attn-backend", "SDPA", "--cp-kv-exchange", "all-gather", "--cp-layout", "Zig-Zag"])
    arguments.validate_args(args, world_size=2)
    assert (args.cp_attn_backend_canonical, args.cp_kv_exchange_canonical,
            args.cp_layout_canonical) == ("dense", "allgather", "zigzag")
    assert (args.context_parallel_size, args.data_parallel_size) == (2, 1)


# ----------------------------------------------------------------------------- (b)

def _run_two_ranks_expect_data_error(data_args, expect):
    t = time.time()
    res = subprocess.run([*_torchrun(2), str(SCRIPT), *TINY, "--train-iters", "3", *data_args],
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


def _megatron_lr(iteration, lr=3e-3, min_lr=3e-4, warmup=2, decay=N_ITERS):
    """The lr megatron applies at 1-based `iteration` (its scheduler steps after the update):
    linear warmup from 0 over `warmup` steps, then cosine from lr to min_lr at `decay`."""
    steps = iteration - 1
    if steps <= warmup:
        return lr * steps / warmup
    ratio = (steps - warmup) / (decay - warmup)
    return min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr - min_lr)


def _logged(stdout, field):
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        rf"iteration\s+(\d+)/\s*\d+ \|.*?\| {field}: ([0-9.Ee+-]+) \|", stdout)}


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
    lrs = _logged(res.stdout, "learning rate")
    assert sorted(lrs) == list(range(1, N_ITERS + 1))
    for it, lr in lrs.items():  # megatron-core's OptimizerParamScheduler, Megatron's semantics
        assert lr == pytest.approx(_megatron_lr(it), rel=1e-6, abs=1e-12), (it, lr)

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

    # B': rank 1's file of the latest checkpoint replaced by its file of the one before (issue
    # 32): every rank refuses, naming it, instead of rank 1 resuming from the older iteration
    rank1 = b / f"iter_{pointer:07d}" / "rank_00001.pt"
    rank1.rename(tmp_path / "rank_00001.pt")
    rank1.write_bytes((b / f"iter_{pointer - SAVE_EVERY:07d}" / "rank_00001.pt").read_bytes())
    res = subprocess.run([*common, "--save", str(b), "--load", str(b)], env=_env(),
                         capture_output=True, text=True, timeout=200)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: error: cannot resume from {re.escape(str(b))}, every rank stops: "
                         rf"rank 1: {re.escape(str(rank1))} does not belong to this checkpoint: it holds "
                         rf"iteration {pointer - SAVE_EVERY}, meta.json and the pointer say {pointer}", out), \
            out[-3000:]
    assert "resumed from" not in out and "pretrain_gpt.py\", line" not in out, out[-3000:]  # no traceback of ours
    assert "lm loss" not in res.stdout  # no rank trained
    (tmp_path / "rank_00001.pt").replace(rank1)

    # C: resume B from its latest checkpoint
    res = subprocess.run([*common, "--save", str(b), "--load", str(b)], env=_env(),
                         capture_output=True, text=True, timeout=200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"resumed from {b} at iteration {pointer}" in res.stdout, res.stdout[-2000:]
    resumed_lines = _logged(res.stdout, "lm loss")
    assert sorted(resumed_lines) == list(range(pointer + 1, N_ITERS + 1))
    for it, lr in _logged(res.stdout, "learning rate").items():  # the schedule resumed too
        assert lr == pytest.approx(_megatron_lr(it), rel=1e-6, abs=1e-12), (it, lr)
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
                          "--train-iters", "3", "--cp-attn-backend", "te",
                          "--cp-attn-backend-strict"],
                         env=_env(), capture_output=True, text=True, timeout=150)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: error: strict mode", out), out


# ----------------------------------------------------------------------------- (d)

class _RunsCodeWhenUnpickled:
    """What a hostile checkpoint holds: unpickling it calls exec(), which writes a marker."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


def _crafted_checkpoint(folder, marker, iteration=5):
    """A checkpoint folder in our layout (pointer, meta.json for 1 rank) with a hostile rank file."""
    import torch
    it_dir = folder / f"iter_{iteration:07d}"
    it_dir.mkdir(parents=True)
    torch.save({"model": {}, "optimizer": {}, "opt_param_scheduler": {},
                "rng": _RunsCodeWhenUnpickled(marker), "iteration": iteration,
                "consumed_samples": iteration, "rank": 0}, it_dir / "rank_00000.pt")
    (it_dir / "meta.json").write_text(json.dumps({
        "iteration": iteration, "consumed_samples": iteration, "world_size": 1,
        "tensor_model_parallel_size": 1, "context_parallel_size": 1, "data_parallel_size": 1,
        "loss_history": []}))
    (folder / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return it_dir / "rank_00000.pt"


def test_crafted_checkpoint_is_refused_not_unpickled(tmp_path):
    import torch
    from megatron_ext.training.checkpointing import CheckpointError, load_rank_file

    marker = tmp_path / "marker"
    path = _crafted_checkpoint(tmp_path / "ckpt", marker)
    with pytest.raises(CheckpointError) as info:
        load_rank_file(str(path))
    assert not marker.exists(), "unpickling the checkpoint ran its code"
    message = str(info.value)
    for words in ("refusing to load", "exec", "not plain data", "weights_only=True",
                  "arbitrary code"):
        assert words in message, message
    # The file is a real threat: a plain unpickle runs its code (what --load did before).
    torch.load(path, weights_only=False)
    assert marker.read_text() == "code ran"


@pytest.mark.timeout(180)
def test_load_of_crafted_checkpoint_exits_with_the_reason(tmp_path, tiny_data):
    marker = tmp_path / "marker"
    _crafted_checkpoint(tmp_path / "ckpt", marker)
    res = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--data-path", tiny_data,
                          "--train-iters", "3", "--context-parallel-size", "1",
                          "--load", str(tmp_path / "ckpt")],
                         env=_env(), capture_output=True, text=True, timeout=150)
    assert res.returncode == 1, res.stdout + res.stderr
    assert not marker.exists(), "--load ran code from the checkpoint"
    assert re.search(r"rank 0: error: refusing to load .*rank_00000\.pt: it needs exec", res.stderr), \
        res.stderr
    assert "Traceback" not in res.stderr, res.stderr


@pytest.mark.timeout(300)
def test_relayout_trains_like_attending_in_place(tmp_path, tiny_data):
    # --cp-relayout balanced moves each step's zigzag rows to the balanced layout for the attention and
    # back: the same attention in other kernel calls, so the losses agree to float32 rounding. The plan
    # made ahead is for the batch's layout, so the loop makes none (and no build warns about one).
    common = [*_torchrun(2), str(SCRIPT), *TINY, "--data-path", tiny_data, "--train-iters", "5",
              "--cp-layout", "zigzag", "--cp-kv-exchange", "a2a"]
    runs = {}
    for name, extra in (("in_place", []), ("relaid", ["--cp-relayout", "balanced"])):
        res = subprocess.run([*common, *extra, "--run-dir", str(tmp_path / name)], env=_env(),
                             capture_output=True, text=True, timeout=200)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        runs[name] = (_losses(tmp_path / name), res.stdout + res.stderr)
    assert runs["relaid"][0].keys() == runs["in_place"][0].keys() and len(runs["relaid"][0]) == 5
    for it, loss in runs["in_place"][0].items():
        assert runs["relaid"][0][it] == pytest.approx(loss, rel=1e-5), (it, runs["relaid"][0], runs["in_place"][0])
    assert "prepared plan was made for other" not in runs["relaid"][1], runs["relaid"][1][-2000:]
    assert "layout=zigzag->balanced" in runs["relaid"][1] and "layout=zigzag |" in runs["in_place"][1]
    assert "relayout balanced (q/k/v moved from 'zigzag' to 'balanced'" in runs["relaid"][1], runs["relaid"][1][-2000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", [[], ["--window-size", "24", "0", "--window-attn-skip-freq", "2"]],
                         ids=["full", "windowed"])
def test_plan_ahead_gives_the_losses_of_planning_in_line(tmp_path, tiny_data, model):
    # The balanced layout makes the plan matter; the plan-ahead run must use its prepared plans
    # (the log says how much was hidden) and still train exactly like planning in line. Windowed:
    # half the layers slide a window, which balanced prices and the prepared plans include.
    common = [*_torchrun(2), str(SCRIPT), *TINY, *model, "--data-path", tiny_data, "--train-iters", "5",
              "--cp-layout", "balanced", "--cp-kv-exchange", "a2a"]
    runs = {}
    for name, extra in (("ahead", []), ("inline", ["--no-cp-plan-ahead"])):
        res = subprocess.run([*common, *extra, "--run-dir", str(tmp_path / name)], env=_env(),
                             capture_output=True, text=True, timeout=200)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        runs[name] = (_losses(tmp_path / name), res.stdout)
    assert runs["ahead"][0] == runs["inline"][0]  # bit for bit
    assert "ms ahead" in runs["ahead"][1] and "% hidden" in runs["ahead"][1], runs["ahead"][1][-2000:]
    assert "plan in line" in runs["inline"][1]
    assert "prepared plan was made for other" not in runs["ahead"][1] + runs["inline"][1]

