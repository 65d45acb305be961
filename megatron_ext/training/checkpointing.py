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
"""

import json
import os
import pickle
import random
import re
import shutil

from .data import fsync_path

POINTER = "latest_checkpointed_iteration.txt"


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
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier save of this iteration
        os.makedirs(tmp)
    dist.barrier()
    with open(os.path.join(tmp, f"rank_{ctx.rank:05d}.pt"), "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "opt_param_scheduler": opt_param_scheduler.state_dict(),
                    "rng": get_rng_state(), "iteration": iteration,
                    "consumed_samples": consumed_samples, "rank": ctx.rank}, f)
        f.flush()
        os.fsync(f.fileno())
    dist.barrier()
    if ctx.rank == 0:
        meta = {"iteration": iteration, "consumed_samples": consumed_samples,
                "world_size": ctx.world, "tensor_model_parallel_size": args.tensor_model_parallel_size,
                "context_parallel_size": args.context_parallel_size,
                "data_parallel_size": args.data_parallel_size, "loss_history": history,
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


def load_rank_file(path: str) -> dict:
    """One rank's file as plain data; CheckpointError for anything that needs unpickling code."""
    import torch

    try:
        with open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = f"it needs {found.group(1)}" if found else str(exc).splitlines()[0]
        raise CheckpointError(
            f"refusing to load {path}: {what}, which is not plain data. megatron-ext checkpoints "
            "hold only tensors, numbers, strings and dicts/lists/tuples, and are read with "
            "torch.load(weights_only=True) because unpickling other objects can run arbitrary "
            "code on every rank. Use a checkpoint written by this script, from a source you "
            "trust.") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint was written by a run with a "
                              "different world size, or is incomplete") from None


def load_checkpoint(args, ctx, model, optimizer, opt_param_scheduler):
    """Resume from ``--load``: (iteration, consumed_samples, loss_history), or None if empty."""
    load = os.path.abspath(args.load)
    pointer = os.path.join(load, POINTER)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{pointer} holds {text!r}, not an iteration number")
    folder = os.path.join(load, f"iter_{int(text):07d}")
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    for key, have in (("world_size", ctx.world),
                      ("tensor_model_parallel_size", args.tensor_model_parallel_size),
                      ("context_parallel_size", args.context_parallel_size)):
        if meta.get(key) != have:
            raise CheckpointError(
                f"checkpoint {folder} was saved with {key}={meta.get(key)}, this run has {have}; "
                "resharding is not supported: resume with the sizes it was saved with")
    state = load_rank_file(os.path.join(folder, f"rank_{ctx.rank:05d}.pt"))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    opt_param_scheduler.load_state_dict(state["opt_param_scheduler"])
    set_rng_state(state["rng"])
    history = [tuple(x) for x in meta.get("loss_history", [])]
    return state["iteration"], state["consumed_samples"], history
