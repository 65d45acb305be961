"""Checkpoints that cannot be resumed as they are: refused on every rank, naming the file and the way out.

Two gloo ranks save a tiny model at iterations 2 and 4 with the real ``save_checkpoint``; the
parent then damages or mixes the files and every rank calls ``load_checkpoint``. A refusal must
be the same ``CheckpointError`` on every rank (a barrier after it proves no rank is left in a
collective), and an untouched checkpoint must still load the saved weights.
"""

import io
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import zipfile

import pytest
import torch

from megatron_ext.testing import catch, pool_fixture

pool2 = pool_fixture(2)

FLAGS = ["--train-iters", "6", "--lr-warmup-iters", "1", "--lr", "1e-2", "--min-lr", "1e-3"]
SAVED = (2, 4)


def _args(folder, extra=(), world=2):
    from megatron_ext.training import arguments

    args = arguments.build_parser().parse_args([*FLAGS, *extra, "--save", folder, "--load", folder,
                                                "--context-parallel-size", str(world)])
    arguments.validate_args(args, world)
    return args


def _parts(args):
    import types

    import torch.distributed as dist

    from megatron_ext.training.training import build_opt_param_scheduler, build_optimizer

    ctx = types.SimpleNamespace(rank=dist.get_rank(), world=dist.get_world_size())
    torch.manual_seed(100 + ctx.rank)  # rank files differ, as CP ranks' optimizer states do
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    optimizer = build_optimizer(args, model)
    return ctx, model, optimizer, build_opt_param_scheduler(args, optimizer)


def save_iterations(folder):
    """Train a step before each saved iteration; returns each saved iteration's weights on this rank."""
    from megatron_ext.training import checkpointing

    args = _args(folder)
    ctx, model, optimizer, scheduler = _parts(args)
    weights = {}
    for iteration in range(1, max(SAVED) + 1):
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step(increment=args.global_batch_size)
        if iteration in SAVED:
            checkpointing.save_checkpoint(args, ctx, iteration, iteration * args.global_batch_size,
                                          [(iteration, 1.0)], model, optimizer, scheduler)
            weights[iteration] = {k: v.clone() for k, v in model.state_dict().items()}
    return weights


def try_load(folder, extra=()):
    """('ok', iteration, weights, lr decay steps) or the error every rank got, after a barrier."""
    import torch.distributed as dist

    from megatron_ext.training import checkpointing

    args = _args(folder, extra)
    ctx, model, optimizer, scheduler = _parts(args)
    box = {}
    error = catch(lambda: box.update(loaded=checkpointing.load_checkpoint(args, ctx, model, optimizer,
                                                                          scheduler)))
    dist.barrier()  # nobody is stuck in the agreement
    if error is not None:
        return error
    return "ok", box["loaded"][0], model.state_dict(), scheduler.lr_decay_steps


def save_once(folder, iteration):
    from megatron_ext.training import checkpointing

    args = _args(folder)
    ctx, model, optimizer, scheduler = _parts(args)
    checkpointing.save_checkpoint(args, ctx, iteration, iteration, [], model, optimizer, scheduler)
    return sorted(os.listdir(folder))


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "save"
    weights = pool2.run(save_iterations, str(folder), timeout=120)
    return folder, weights


@pytest.fixture
def ckpt(saved, tmp_path):
    """A fresh copy of the saved folder per test, to damage."""
    folder, weights = saved
    copy = tmp_path / "save"
    shutil.copytree(folder, copy)
    return copy, weights


def _rank_file(folder, iteration, rank):
    return folder / f"iter_{iteration:07d}" / f"rank_{rank:05d}.pt"


def _refused_everywhere(results, *needles):
    """Every rank raised the same CheckpointError, containing every needle; returns its message."""
    assert all(r is not None and r[0] == "CheckpointError" for r in results), results
    assert len({r[1] for r in results}) == 1, results
    message = results[0][1]
    for needle in needles:
        assert needle in message, (needle, message)
    return message


@pytest.mark.timeout(120)
def test_untouched_checkpoint_resumes_the_saved_weights(pool2, ckpt):
    folder, weights = ckpt
    results = pool2.run(try_load, str(folder))
    for rank, (status, iteration, state, _) in enumerate(results):
        assert (status, iteration) == ("ok", 4)
        for key, value in weights[rank][4].items():
            assert torch.equal(state[key], value), key


@pytest.mark.timeout(120)
def test_rank_file_from_an_older_iteration_is_refused_on_every_rank(pool2, ckpt):
    # The issue's case: pointer and meta.json at 4, rank 1's file copied from iteration 2.
    folder, _ = ckpt
    shutil.copy(_rank_file(folder, 2, 1), _rank_file(folder, 4, 1))
    message = _refused_everywhere(pool2.run(try_load, str(folder)), str(_rank_file(folder, 4, 1)),
                                  "rank 1:", "holds iteration 2, meta.json and the pointer say 4",
                                  "another save wrote it", "refusing")
    assert "rank 0:" not in message  # rank 0's own file is fine; it stops because rank 1 refused


@pytest.mark.timeout(120)
def test_swapped_rank_files_are_refused_on_every_rank(pool2, ckpt):
    folder, _ = ckpt
    a, b = _rank_file(folder, 4, 0), _rank_file(folder, 4, 1)
    a.rename(folder / "swap")
    b.rename(a)
    (folder / "swap").rename(b)
    _refused_everywhere(pool2.run(try_load, str(folder)), f"rank 0: {a} does not belong",
                        "holds rank 1's state, this is rank 0", f"rank 1: {b} does not belong",
                        "holds rank 0's state, this is rank 1")


@pytest.mark.timeout(120)
def test_a_rank_file_saved_in_another_layout_is_refused(pool2, ckpt):
    # The same iteration and rank, but meta.json says another world: the layout each file stores.
    folder, _ = ckpt
    meta_path = folder / "iter_0000004" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["data_parallel_size"] = 2
    meta_path.write_text(json.dumps(meta))
    _refused_everywhere(pool2.run(try_load, str(folder)), "was saved in the layout",
                        "'data_parallel_size': 1", "'data_parallel_size': 2")


INTACT = "The previous checkpoint {folder}/iter_0000002 is intact (its meta.json reads and its 2 rank " \
         "files are there): to resume from it, write 2 into {folder}/latest_checkpointed_iteration.txt."


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage,needles", [
    ("empty", ["rank 1: {path} is damaged", "it is empty (0 bytes)"]),
    ("random", ["rank 1: {path} is damaged", "not a torch.save archive"]),
    ("truncated", ["rank 1: {path} is damaged", "not a torch.save archive"]),
    ("garbled", ["rank 1: {path} is damaged", "its pickled data is corrupt (Unsupported operand"]),
], ids=["empty", "random", "truncated", "garbled"])
def test_damaged_rank_file_names_the_path_and_the_intact_previous_checkpoint(pool2, ckpt, damage, needles):
    folder, _ = ckpt
    path = _rank_file(folder, 4, 1)
    data = path.read_bytes()
    if damage == "garbled":  # a whole zip archive whose pickle is noise after its first opcode
        with zipfile.ZipFile(io.BytesIO(data)) as archive, zipfile.ZipFile(path, "w") as out:
            for item in archive.infolist():
                member = archive.read(item.filename)
                if item.filename.endswith("data.pkl"):
                    member = member[:1] + bytes(random.Random(0).randrange(128, 256) for _ in member[1:])
                out.writestr(item, member)
    else:
        path.write_bytes({"empty": b"", "random": os.urandom(4096), "truncated": data[: len(data) // 2]}[damage])
    message = _refused_everywhere(pool2.run(try_load, str(folder)),
                                  *[n.format(path=path) for n in needles], INTACT.format(folder=folder))
    assert "Weights only load failed" not in message and "EOFError" not in message, message
    assert "unsafe" not in message and "arbitrary code" not in message, message  # not blamed on pickling


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage,needle", [
    ("missing", "meta.json is missing, so {folder}/iter_0000004 is incomplete"),
    ("broken", "meta.json is damaged: not valid JSON (JSONDecodeError"),
    ("folder", "latest_checkpointed_iteration.txt names iteration 4, but {folder}/iter_0000004 does not exist"),
], ids=["missing", "broken", "folder"])
def test_missing_or_broken_meta_names_the_path_and_the_intact_previous_checkpoint(pool2, ckpt, damage,
                                                                                  needle):
    folder, _ = ckpt
    meta = folder / "iter_0000004" / "meta.json"
    if damage == "missing":
        meta.unlink()
    elif damage == "broken":
        meta.write_text(meta.read_text()[:40])
    else:
        shutil.rmtree(folder / "iter_0000004")
    _refused_everywhere(pool2.run(try_load, str(folder)), needle.format(folder=folder),
                        INTACT.format(folder=folder))


@pytest.mark.timeout(120)
def test_no_whole_earlier_checkpoint_is_said_so(pool2, ckpt):
    folder, _ = ckpt
    _rank_file(folder, 2, 0).unlink()
    _rank_file(folder, 4, 0).write_bytes(b"")
    _refused_everywhere(pool2.run(try_load, str(folder)), f"No earlier whole checkpoint is in {folder}")


@pytest.mark.timeout(120)
def test_a_longer_run_says_which_scheduler_flag_to_choose(pool2, ckpt):
    folder, _ = ckpt
    _refused_everywhere(
        pool2.run(try_load, str(folder), ("--train-iters", "8")),
        "was saved with another learning-rate / weight-decay schedule",
        "--train-iters 8 (checkpoint: 6)", "--lr-decay-iters 8 (checkpoint: 6)",
        "class input value 8 and checkpointvalue 6",  # megatron's own check, quoted
        "--use-checkpoint-opt-param-scheduler", "--override-opt-param-scheduler")
    # Each choice loads, and megatron's scheduler then decays over the chosen length (in samples).
    for flag, decay in (("--override-opt-param-scheduler", 8), ("--use-checkpoint-opt-param-scheduler", 6),
                        ("--override-opt_param-scheduler", 8)):  # Megatron-LM's spelling too
        for status, iteration, _, steps in pool2.run(try_load, str(folder), ("--train-iters", "8", flag)):
            assert (status, iteration, steps) == ("ok", 4, decay), flag
    # The decay length kept: only --train-iters' weight-decay length differs, which constant weight
    # decay never reads, so it is no schedule change.
    for status, iteration, _, steps in pool2.run(try_load, str(folder),
                                                 ("--train-iters", "8", "--lr-decay-iters", "6")):
        assert (status, iteration, steps) == ("ok", 4, 6)


@pytest.mark.timeout(120)
def test_a_save_removes_the_pointer_temp_file_a_kill_left(pool2, tmp_path):
    # Kill a 1-rank save between the pointer's write and its rename: the temp file stays behind...
    folder = tmp_path / "save"
    code = f"""
import os, signal, sys, types
import torch, torch.distributed as dist
sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
import test_checkpointing as t
from megatron_ext.training import checkpointing
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
args = t._args({str(folder)!r}, world=1)
model = torch.nn.Linear(2, 2)
opt = torch.optim.AdamW(model.parameters())
from megatron_ext.training.training import build_opt_param_scheduler
os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)  # dies where the rename would be
checkpointing.save_checkpoint(args, types.SimpleNamespace(rank=0, world=1), 3, 3, [], model, opt,
                              build_opt_param_scheduler(args, opt))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90,
                         env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    left = [p.name for p in folder.iterdir() if p.name.startswith("latest_checkpointed_iteration.txt.tmp")]
    assert len(left) == 1 and not (folder / "latest_checkpointed_iteration.txt").exists(), left
    # ... and the next save removes it.
    names = pool2.run(save_once, str(folder), 4)[0]
    assert [n for n in names if "tmp" in n] == [], names
    assert (folder / "latest_checkpointed_iteration.txt").read_text() == "4\n"
