"""Atomic per-rank checkpoints that load without running any code from the file.

Layout, like Megatron-LM's legacy format: ``SAVE/iter_NNNNNNN/{meta.json,
rank_RRRRR.pt}`` and the pointer ``SAVE/latest_checkpointed_iteration.txt``.
Every rank writes its file into ``iter_NNNNNNN.tmp`` and fsyncs it; after a barrier
rank 0 writes meta.json, renames the folder into place and only then replaces the
pointer, so a crash at any moment leaves the previous checkpoint the one that loads.

A rank file holds plain data only: tensors, numbers, strings, None and
dicts / lists / tuples of them (the model and optimizer state dicts, the
learning-rate scheduler's state, and the RNG states, numpy's stored as a list).
It is read with ``torch.load(weights_only=True)``, which builds nothing else; a
file that needs any other class or function is refused with ``CheckpointError``
rather than unpickled, because unpickling can run arbitrary code on every rank.
(megatron-core's ``dist_checkpointing.save`` would be the Megatron way, but it
hard-codes CUDA devices; this format needs none.)

Every rank file also stores its iteration, its rank, the world layout and the save's
random id, all of which meta.json holds too; a load checks them against meta.json and
the pointer, so a rank file copied from another iteration or another save, or moved to
another rank's name, is refused rather than trained on. Each rank checks and loads its
own file, then the ranks agree (one ``all_gather_object``) and, if any refused, every
rank raises the same ``CheckpointError``. A damaged checkpoint (an empty or corrupt rank
file, a missing or broken meta.json) is refused naming the file, and the message names
the newest earlier checkpoint that is still whole and how to resume from it.
"""

import contextlib
import json
import os
import pickle
import random
import re
import shutil
import zipfile

from .arguments import flag_name
from .data import fsync_path

POINTER = "latest_checkpointed_iteration.txt"
POINTER_TMP = POINTER + ".tmp"  # + the writer's pid; a kill before its rename leaves it behind
RANK_FILE_KEYS = ("model", "optimizer", "opt_param_scheduler", "rng", "iteration", "consumed_samples", "rank")
# The flags megatron's OptimizerParamScheduler is built from (steps in samples: x global batch).
SCHEDULE_FLAGS = ("train_iters", "lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters", "lr", "min_lr",
                  "lr_warmup_init", "lr_decay_style", "weight_decay", "start_weight_decay",
                  "end_weight_decay", "weight_decay_incr_style", "global_batch_size")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from here; the message says why and what to do."""


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def get_rng_state() -> dict:
    """python, numpy, torch (and CUDA, megatron's CUDA tracker) RNG states as plain data."""
    import numpy as np
    import torch

    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(),  # (version, tuple of 625 ints, None)
             "numpy": (name, keys.tolist(), int(pos), int(has_gauss), float(cached_gaussian)),
             "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = get_cuda_rng_tracker().get_states()  # {name: ByteTensor}
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch_cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["cuda_tracker"])


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):  # e.g. a Path or a namespace: meta.json keeps only plain flags
        return False


def _layout(args, ctx) -> dict:
    """The world a checkpoint belongs to (loads do not reshard): in meta.json and in every rank file."""
    return {"world_size": ctx.world,
            "tensor_model_parallel_size": args.tensor_model_parallel_size,
            "context_parallel_size": args.context_parallel_size,
            "data_parallel_size": args.data_parallel_size,
            "pipeline_model_parallel_size": 1}  # this loop runs no pipeline parallelism


def _remove_stale_temporaries(save: str, tmp: str) -> None:
    """What a save killed part way left: this iteration's temp folder, the pointer's temp files."""
    shutil.rmtree(tmp, ignore_errors=True)
    for name in os.listdir(save):
        if name.startswith(POINTER_TMP):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(save, name))


def save_checkpoint(args, ctx, iteration, consumed_samples, history, model, optimizer,
                    opt_param_scheduler) -> str:
    """Every rank calls this at the same iteration; returns the final folder."""
    import torch
    import torch.distributed as dist

    save = os.path.abspath(args.save)
    name = f"iter_{iteration:07d}"
    final, tmp = os.path.join(save, name), os.path.join(save, name + ".tmp")
    if ctx.rank == 0:
        os.makedirs(save, exist_ok=True)
        _remove_stale_temporaries(save, tmp)
        os.makedirs(tmp)
    # Rank 0 sends the save's id once tmp exists, so receiving it also means tmp is there.
    # os.urandom: drawing from torch's or python's generator would shift the training's RNG.
    save_id = [os.urandom(8).hex() if ctx.rank == 0 else None]
    dist.broadcast_object_list(save_id, src=0)
    save_id = save_id[0]
    layout = _layout(args, ctx)
    with open(os.path.join(tmp, f"rank_{ctx.rank:05d}.pt"), "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "opt_param_scheduler": opt_param_scheduler.state_dict(),
                    "rng": get_rng_state(), "iteration": iteration,
                    "consumed_samples": consumed_samples, "rank": ctx.rank, "layout": layout,
                    "save_id": save_id}, f)
        f.flush()
        os.fsync(f.fileno())
    dist.barrier()
    if ctx.rank == 0:
        meta = {"iteration": iteration, "consumed_samples": consumed_samples, **layout,
                "save_id": save_id, "loss_history": history,
                "args": {k: v for k, v in vars(args).items() if _jsonable(v)}}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        if os.path.exists(final):  # re-saving an iteration: move the old one out of the way
            old = final + f".old{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_path(save)
        _atomic_write_text(os.path.join(save, POINTER), f"{iteration}\n")
    dist.barrier()
    return final


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def load_rank_file(path: str) -> dict:
    """One rank's file as plain data; CheckpointError naming the path for a missing, damaged or
    foreign file and for anything that needs unpickling code."""
    import torch

    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint was written by a run with a "
                              "different world size, or is incomplete") from None
    # saves fsync every rank file before the folder is renamed into place: damage came later
    damaged = f"{path} is damaged"
    if size == 0:
        raise CheckpointError(f"{damaged}: it is empty (0 bytes).")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; truncation cuts off its directory
        raise CheckpointError(f"{damaged}: its {size} bytes are not a torch.save archive (no zip "
                              "directory: truncated or overwritten).")
    try:
        with open(path, "rb") as f:
            state = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if found is None:  # the weights-only unpickler stopped on bytes no pickler writes
            reason = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(exc))
            raise CheckpointError(f"{damaged}: its pickled data is corrupt "
                                  f"({reason.group(1) if reason else _first_line(exc)}).") from None
        raise CheckpointError(
            f"refusing to load {path}: it needs {found.group(1)}, which is not plain data. "
            "megatron-ext checkpoints hold only tensors, numbers, strings and dicts/lists/tuples, "
            "and are read with torch.load(weights_only=True) because unpickling other objects can "
            "run arbitrary code on every rank. Use a checkpoint written by this script, from a "
            "source you trust.") from None
    except Exception as exc:  # noqa: BLE001 - torch's reader fails on damage in many ways (EOF, zip, keys)
        raise CheckpointError(f"{damaged}: torch.load failed ({_first_line(exc)}).") from None
    missing = [key for key in RANK_FILE_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise CheckpointError(f"{path} is not a megatron-ext rank file: it lacks {', '.join(missing)}.")
    return state


def _complete_checkpoint(folder: str, iteration: int):
    """The world size of the checkpoint in ``folder`` if its meta.json reads and every rank file is there."""
    try:
        with open(os.path.join(folder, "meta.json")) as f:
            meta = json.load(f)
        world = meta["world_size"]
        if meta["iteration"] != iteration or not all(
                os.path.getsize(os.path.join(folder, f"rank_{r:05d}.pt")) > 0 for r in range(world)):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return world


def _earlier_checkpoint(load: str, below) -> str:
    """Where the newest whole checkpoint before iteration ``below`` is, and how to resume from it."""
    pointer = os.path.join(load, POINTER)
    found = sorted((int(m.group(1)) for m in map(re.compile(r"iter_(\d+)").fullmatch, os.listdir(load))
                    if m and (below is None or int(m.group(1)) < below)), reverse=True)
    for iteration in found:
        folder = os.path.join(load, f"iter_{iteration:07d}")
        world = _complete_checkpoint(folder, iteration)
        if world is not None:
            return (f"The previous checkpoint {folder} is intact (its meta.json reads and its {world} "
                    f"rank files are there): to resume from it, write {iteration} into {pointer}.")
    return f"No earlier whole checkpoint is in {load}: restore this one from a copy, or start without --load."


def _read_meta(load: str, folder: str, iteration: int) -> dict:
    pointer, path = os.path.join(load, POINTER), os.path.join(folder, "meta.json")
    if not os.path.isdir(folder):
        raise CheckpointError(f"{pointer} names iteration {iteration}, but {folder} does not exist. "
                              + _earlier_checkpoint(load, iteration))
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing, so {folder} is incomplete (saves write meta.json before the folder is "
            "renamed into place: it was removed, or the folder copied in part). "
            + _earlier_checkpoint(load, iteration)) from None
    except (ValueError, UnicodeDecodeError) as exc:  # json.JSONDecodeError is a ValueError
        raise CheckpointError(f"{path} is damaged: not valid JSON ({_first_line(exc)}). "
                              + _earlier_checkpoint(load, iteration)) from None
    if not isinstance(meta, dict) or meta.get("iteration") != iteration:
        said = meta.get("iteration") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path} says iteration {said}, but {pointer} and the folder name say "
                              f"{iteration}: the folder holds another checkpoint. "
                              + _earlier_checkpoint(load, iteration))
    return meta


def _check_rank_file(path: str, state: dict, iteration: int, rank: int, meta: dict) -> None:
    """The rank file belongs to this checkpoint and this rank (files of older saves lack layout / save_id)."""
    problems = []
    if state["iteration"] != iteration:
        problems.append(f"it holds iteration {state['iteration']}, meta.json and the pointer say {iteration}")
    if state["rank"] != rank:
        problems.append(f"it holds rank {state['rank']}'s state, this is rank {rank}")
    stored, saved = state.get("layout"), {k: meta.get(k) for k in state.get("layout", {})}
    if stored is not None and stored != saved:
        problems.append(f"it was saved in the layout {stored}, meta.json says {saved}")
    if state.get("save_id") is not None and state.get("save_id") != meta.get("save_id"):
        problems.append(f"another save wrote it (save id {state['save_id']}, meta.json's {meta.get('save_id')})")
    elif state["consumed_samples"] != meta.get("consumed_samples"):
        problems.append(f"it holds consumed samples {state['consumed_samples']}, meta.json "
                        f"{meta.get('consumed_samples')}")
    if problems:
        raise CheckpointError(
            f"{path} does not belong to this checkpoint: {'; '.join(problems)}. A rank file copied or moved "
            "from another checkpoint would resume this rank from a different state than the others; "
            "refusing. Put back the rank files this save wrote.")


def _schedule_mismatch(folder: str, meta: dict, args, iteration: int, exc: AssertionError) -> str:
    saved = meta.get("args", {})
    changed = [f"{flag_name(name)} {getattr(args, name)} (checkpoint: {saved[name]})"
               for name in SCHEDULE_FLAGS if name in saved and saved[name] != getattr(args, name, None)]
    return (f"{folder} was saved with another learning-rate / weight-decay schedule than this run's flags "
            f"give: {', '.join(changed) or 'see below'} (megatron's check: {str(exc).strip()}). "
            "Choose, as with Megatron-LM: --use-checkpoint-opt-param-scheduler continues the checkpoint's "
            f"schedule (past its decay end the learning rate stays at its minimum); "
            f"--override-opt-param-scheduler follows this run's flags from iteration {iteration} on (the "
            "learning rate moves to the new curve at once); or resume with the checkpoint's values.")


def _load_this_rank(args, ctx, load, model, optimizer, opt_param_scheduler):
    """Check and load this rank's part: (iteration, consumed_samples, history), None, or CheckpointError."""
    pointer = os.path.join(load, POINTER)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{pointer} holds {text!r}, not an iteration number. "
                              + _earlier_checkpoint(load, None))
    iteration = int(text)
    folder = os.path.join(load, f"iter_{iteration:07d}")
    meta = _read_meta(load, folder, iteration)
    for key, have in (("world_size", ctx.world),
                      ("tensor_model_parallel_size", args.tensor_model_parallel_size),
                      ("context_parallel_size", args.context_parallel_size)):
        if meta.get(key) != have:
            raise CheckpointError(
                f"checkpoint {folder} was saved with {key}={meta.get(key)}, this run has {have}; "
                "resharding is not supported: resume with the sizes it was saved with")
    path = os.path.join(folder, f"rank_{ctx.rank:05d}.pt")
    try:
        state = load_rank_file(path)
        _check_rank_file(path, state, iteration, ctx.rank, meta)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc} {_earlier_checkpoint(load, iteration)}") from None
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:  # torch's messages for other shapes / groups
        raise CheckpointError(f"{path} does not fit this model ({_first_line(exc)}): resume with the model "
                              f"flags it was saved with (the args in {folder}/meta.json)") from None
    scheduler = dict(state["opt_param_scheduler"])
    if scheduler.get("wd_incr_style") == "constant" == opt_param_scheduler.wd_incr_style:
        # Constant weight decay never reads its increment length (--train-iters x batch), so a
        # longer run is no schedule change there; megatron would refuse it all the same.
        scheduler["wd_incr_steps"] = opt_param_scheduler.wd_incr_steps
    try:
        opt_param_scheduler.load_state_dict(scheduler)
    except AssertionError as exc:  # megatron's OptimizerParamScheduler._check_and_set
        raise CheckpointError(_schedule_mismatch(folder, meta, args, iteration, exc)) from None
    set_rng_state(state["rng"])
    history = [tuple(x) for x in meta.get("loss_history", [])]
    return state["iteration"], state["consumed_samples"], history


def _ranks(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _agree(load: str, verdicts) -> None:
    """Raise the same CheckpointError on every rank unless every rank loaded the same iteration."""
    refusals = {}
    for rank, (_, error) in enumerate(verdicts):
        if error is not None:
            refusals.setdefault(error, []).append(rank)
    if len(refusals) == 1 and len(next(iter(refusals.values()))) == len(verdicts):
        raise CheckpointError(next(iter(refusals)))  # the same refusal everywhere: say it once
    if refusals:
        raise CheckpointError(f"cannot resume from {load}, every rank stops: " + " | ".join(
            f"{_ranks(ranks)}: {error}" for error, ranks in refusals.items()))
    found = {}
    for rank, (what, _) in enumerate(verdicts):
        found.setdefault(what, []).append(rank)
    if len(found) > 1:
        raise CheckpointError(f"the ranks see different checkpoints in {load}: " + ", ".join(
            f"{_ranks(ranks)} found {what}" for what, ranks in found.items())
            + "; every rank must read the same folder (a shared filesystem)")


def load_checkpoint(args, ctx, model, optimizer, opt_param_scheduler):
    """Resume from ``--load``: (iteration, consumed_samples, loss_history), or None if empty.

    A collective: every rank checks and loads its own file, then all agree. If any rank
    refused, every rank raises the same CheckpointError (its model and optimizer may be
    loaded in part, so the run must stop, as pretrain() does).
    """
    import torch.distributed as dist

    load = os.path.abspath(args.load)
    try:
        loaded = _load_this_rank(args, ctx, load, model, optimizer, opt_param_scheduler)
        verdict = ("no checkpoint" if loaded is None else f"iteration {loaded[0]}", None)
    except CheckpointError as exc:
        loaded, verdict = None, (None, str(exc))
    verdicts = [verdict]
    if ctx.world > 1:
        verdicts = [None] * ctx.world
        dist.all_gather_object(verdicts, verdict)
    _agree(load, verdicts)
    return loaded
