#!/usr/bin/env python3
"""Pretrain a megatron-core GPTModel whose attention is block-diagonal context-parallel.

Packed documents, causal attention within each document only, the sequence split
across the ranks of a context-parallel (CP) group by ``megatron_ext.blockdiag_cp``.

    torchrun --standalone --nproc-per-node=2 scripts/pretrain_gpt.py            # the defaults
    torchrun ... scripts/pretrain_gpt.py --data-path data/my_text_document --save ckpt \\
        --context-parallel-size 2 --cp-kv-exchange halo --cp-layout balanced
    srun ... python scripts/pretrain_gpt.py ...    (see scripts/slurm/pretrain_gpt.sbatch)

Without --data-path it trains on the embedded default: the Python standard library's
own *.py files, tokenized to bytes once and cached under data_cache/.
"""

import argparse
import contextlib
import datetime
import json
import math
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import time
import traceback
import warnings

SCRIPT_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = SCRIPT_DIR.parent
for _p in (str(SCRIPT_DIR), str(REPO_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")

import gpt_data  # noqa: E402  (no torch / megatron import at module level)

# The defaults `make train` runs with (torchrun --standalone --nproc-per-node=2, two CPU
# processes): a small GPT over 2048-token packed sequences, CP = 2, a few hundred steps,
# measured well under 10 minutes on a 2-core machine including the dataset build.
DEFAULTS = dict(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
    seq_length=2048,
    micro_batch_size=1,
    global_batch_size=None,      # None -> micro batch * data-parallel size
    train_iters=300,
    lr=2e-3,
    min_lr=2e-4,
    lr_warmup_iters=None,        # None -> min(100, train_iters // 10)
    lr_decay_style="cosine",
    weight_decay=0.1,
    adam_beta1=0.9,
    adam_beta2=0.95,
    adam_eps=1e-8,
    clip_grad=1.0,
    init_method_std=0.02,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    tensor_model_parallel_size=1,
    context_parallel_size=None,  # None -> 2 when the world size allows it, else 1
    log_interval=10,
    save_interval=None,
    seed=1234,
)

LOG_PREFIX = "[pretrain_gpt]"


# ======================================================================================
# Arguments
# ======================================================================================

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Pretrain a megatron-core GPTModel with block-diagonal context-parallel "
                    "attention (megatron_ext).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = DEFAULTS
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=d["num_layers"])
    g.add_argument("--hidden-size", type=int, default=d["hidden_size"])
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden")
    g.add_argument("--num-attention-heads", type=int, default=d["num_attention_heads"])
    g.add_argument("--num-query-groups", type=int, default=d["num_query_groups"],
                   help="GQA groups (K/V heads); equal to heads for MHA")
    g.add_argument("--seq-length", type=int, default=d["seq_length"])
    g.add_argument("--init-method-std", type=float, default=d["init_method_std"])
    g.add_argument("--hidden-dropout", type=float, default=d["hidden_dropout"])
    g.add_argument("--attention-dropout", type=float, default=d["attention_dropout"])
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute",
                   help="rope re-slices megatron's table for our CP layout (micro batch 1)")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--bf16", dest="bf16", action="store_true", default=None,
                   help="bf16 compute (default on GPU; CPUs here have no bf16 hardware)")
    g.add_argument("--fp32", dest="bf16", action="store_false", help="fp32 compute")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=d["micro_batch_size"])
    g.add_argument("--global-batch-size", type=int, default=d["global_batch_size"],
                   help="default: micro batch size * data-parallel size")
    g.add_argument("--train-iters", type=int, default=d["train_iters"])
    g.add_argument("--lr", type=float, default=d["lr"])
    g.add_argument("--min-lr", type=float, default=d["min_lr"])
    g.add_argument("--lr-warmup-iters", type=int, default=d["lr_warmup_iters"],
                   help="default min(100, train_iters // 10)")
    g.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant"],
                   default=d["lr_decay_style"])
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--weight-decay", type=float, default=d["weight_decay"])
    g.add_argument("--adam-beta1", type=float, default=d["adam_beta1"])
    g.add_argument("--adam-beta2", type=float, default=d["adam_beta2"])
    g.add_argument("--adam-eps", type=float, default=d["adam_eps"])
    g.add_argument("--clip-grad", type=float, default=d["clip_grad"], help="0 disables")
    g.add_argument("--seed", type=int, default=d["seed"])

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=d["tensor_model_parallel_size"])
    g.add_argument("--context-parallel-size", type=int, default=d["context_parallel_size"],
                   help="default: 2 when world size / TP is even, else 1")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, gloo otherwise")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)

    g = p.add_argument_group("block-diagonal CP attention (megatron_ext)")
    g.add_argument("--cp-attn-backend", default=None,
                   help="te | flash | dense, or a synonym (transformer_engine, flash_attn, sdpa...); "
                        "default: the engine's default with its fallbacks")
    g.add_argument("--cp-kv-exchange", default=None,
                   help="allgather | halo | a2a, or a synonym; default: the engine's default")
    g.add_argument("--cp-layout", default=None,
                   help="contiguous | zigzag | balanced, or a synonym; default: the engine's default")
    g.add_argument("--cp-attn-backend-strict", action="store_true",
                   help="a backend/exchange fallback is an error instead of a logged downgrade")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="indexed dataset PREFIX (PREFIX.bin/.idx), or 'W1 P1 W2 P2 ...' to blend; "
                        "default: the embedded stdlib dataset under data_cache/")
    g.add_argument("--data-cache-path", default=None,
                   help="where megatron's sample-index cache goes (default data_cache/index_cache)")

    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", default=None, help="checkpoint folder")
    g.add_argument("--save-interval", type=int, default=d["save_interval"],
                   help="save every N iterations (and at the end) when --save is given")
    g.add_argument("--load", default=None, help="resume from the latest checkpoint in this folder")
    g.add_argument("--log-interval", type=int, default=d["log_interval"])
    g.add_argument("--no-plot", action="store_true", help="do not write loss_curve.png")
    return p


class UsageError(ValueError):
    pass


def world_from_env():
    """(rank, world_size, local_rank, local_world_size) from torchrun's or SLURM's variables."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", 0))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local = int(env.get("SLURM_LOCALID", 0))
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        local_world = int(per_node) if per_node.isdigit() else max(
            1, world // max(1, int(env.get("SLURM_NNODES", "1") or 1)))
    else:
        rank, world, local, local_world = 0, 1, 0, 1
    return rank, world, local, local_world


def _knob_module():
    """megatron_ext.blockdiag_cp.state, loaded without the engine package's heavy imports.

    state.py is a dependency-free leaf; loading it on its own keeps a bad flag's exit
    to well under a second (no torch/megatron import before the error).
    """
    import importlib.util
    loaded = sys.modules.get("megatron_ext.blockdiag_cp.state")
    if loaded is not None:
        return loaded
    pkg = importlib.util.find_spec("megatron_ext")
    path = pathlib.Path(pkg.origin).parent / "blockdiag_cp" / "state.py" if pkg else None
    if path is None or not path.is_file():
        from megatron_ext.blockdiag_cp import state
        return state
    spec = importlib.util.spec_from_file_location("_megatron_ext_cp_knobs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def validate_args(args, world_size: int) -> None:
    """Every check that needs no process group; raises UsageError."""
    cp_state = _knob_module()

    for flag, fn in (("--cp-attn-backend", cp_state.normalize_attn_backend),
                     ("--cp-kv-exchange", cp_state.normalize_kv_exchange),
                     ("--cp-layout", cp_state.normalize_layout)):
        attr = flag[2:].replace("-", "_")
        try:
            value = fn(getattr(args, attr))
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None
        setattr(args, attr + "_canonical", value)

    positive = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "seq_length", "micro_batch_size", "train_iters", "tensor_model_parallel_size",
                "log_interval")
    for name in positive:
        if getattr(args, name) is None or getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    tp = args.tensor_model_parallel_size
    if args.context_parallel_size is None:
        args.context_parallel_size = 2 if (world_size % tp == 0 and (world_size // tp) % 2 == 0) else 1
    cp = args.context_parallel_size
    if cp < 1:
        raise UsageError(f"--context-parallel-size must be >= 1, got {cp}")
    if world_size % (tp * cp):
        raise UsageError(
            f"world size {world_size} is not divisible by tensor-model-parallel-size ({tp}) x "
            f"context-parallel-size ({cp}) = {tp * cp}")
    dp = world_size // (tp * cp)
    args.data_parallel_size = dp
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise UsageError(
            f"--global-batch-size {args.global_batch_size} is not divisible by micro-batch-size "
            f"({args.micro_batch_size}) x data-parallel size ({dp}) = {args.micro_batch_size * dp}")
    args.num_micro_batches = args.global_batch_size // (args.micro_batch_size * dp)
    h, heads, groups = args.hidden_size, args.num_attention_heads, args.num_query_groups
    if h % heads:
        raise UsageError(f"--hidden-size {h} is not divisible by --num-attention-heads {heads}")
    if heads % groups:
        raise UsageError(f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
    if heads % tp or groups % tp:
        raise UsageError(f"--num-attention-heads {heads} and --num-query-groups {groups} must be "
                         f"divisible by --tensor-model-parallel-size {tp}")
    if gpt_data.PADDED_VOCAB_SIZE % tp:
        raise UsageError(f"the vocabulary ({gpt_data.PADDED_VOCAB_SIZE}) is not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    if args.seq_length < cp:
        raise UsageError(f"--seq-length {args.seq_length} is shorter than the CP size {cp}")
    if args.position_embedding_type == "rope" and args.micro_batch_size != 1:
        raise UsageError("--position-embedding-type rope restarts positions per document, which "
                         "needs --micro-batch-size 1 (documents differ between batch rows)")
    if args.save_interval is not None and args.save_interval < 1:
        raise UsageError(f"--save-interval must be >= 1, got {args.save_interval}")
    if args.lr_warmup_iters is None:
        args.lr_warmup_iters = min(100, args.train_iters // 10)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if not 0.0 <= args.hidden_dropout < 1.0 or not 0.0 <= args.attention_dropout < 1.0:
        raise UsageError("dropout probabilities must be in [0, 1)")


def resolve_data_paths(args) -> None:
    """Validate --data-path (every rank, before any process group) or build the default."""
    if args.data_path is None:
        args.data_prefixes, args.data_weights = [gpt_data.default_dataset_prefix(
            progress=int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0)], None
    else:
        items = list(args.data_path)
        weights = None
        try:
            float(items[0])
            is_weighted = len(items) % 2 == 0 and len(items) > 1
        except ValueError:
            is_weighted = False
        if is_weighted:
            try:
                weights = [float(w) for w in items[0::2]]
            except ValueError:
                raise gpt_data.DataPathError(
                    f"--data-path {' '.join(items)}: expected 'PREFIX' or 'W1 P1 W2 P2 ...'") from None
            items = items[1::2]
        args.data_prefixes = [gpt_data.strip_prefix(os.path.abspath(p)) for p in items]
        args.data_weights = weights
        for prefix in args.data_prefixes:
            gpt_data.validate_indexed_dataset(prefix)
    if args.data_cache_path is None:
        args.data_cache_path = str(gpt_data.DATA_CACHE / "index_cache")


# ======================================================================================
# Distributed setup
# ======================================================================================

def _slurm_first_node_addr() -> str:
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                               text=True, timeout=30, check=True).stdout.split()
        first = hosts[0]
    except Exception:
        return socket.gethostname()
    try:  # NodeAddr may differ from the node name (emulated nodes, private networks)
        out = subprocess.run(["scontrol", "show", "node", first, "-o"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        for field in out.split():
            if field.startswith("NodeAddr="):
                return field.split("=", 1)[1]
    except Exception:
        pass
    return first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_loopback(addr: str) -> bool:
    try:
        return socket.gethostbyname(addr).startswith("127.")
    except OSError:
        return False


def init_distributed(args):
    import torch
    import torch.distributed as dist

    rank, world, local_rank, local_world = world_from_env()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(local_world))
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = _slurm_first_node_addr() if "SLURM_PROCID" in os.environ \
            else "127.0.0.1"
    if "MASTER_PORT" not in os.environ:
        if "SLURM_JOB_ID" in os.environ:  # every rank derives the same port
            os.environ["MASTER_PORT"] = str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000)
        elif world == 1:
            os.environ["MASTER_PORT"] = str(_free_port())
        else:
            os.environ["MASTER_PORT"] = "29500"
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and (
            _is_loopback(os.environ["MASTER_ADDR"]) or local_world == world):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo on one machine: stay on loopback
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(backend=backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    from megatron.core import parallel_state as mpu
    mpu.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                  context_parallel_size=args.context_parallel_size)
    return rank, world, local_rank, local_world, backend


# ======================================================================================
# Model
# ======================================================================================



def build_model(args, device):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        # fp32 master weights; on GPU the compute runs under bf16 autocast (see train_step)
        params_dtype=torch.float32,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    from megatron_ext.layers import get_gpt_layer_spec_with_blockdiag_cp, use_blockdiag_rope

    # megatron-core's GPT layer spec (TE modules when TE imports) with BlockDiagCPAttention
    spec = get_gpt_layer_spec_with_blockdiag_cp()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=gpt_data.PADDED_VOCAB_SIZE,
        max_sequence_length=args.seq_length,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        # learned absolute: embeddings indexed by the position ids shard_batch slices;
        # rope: megatron's table re-sliced by our layout (use_blockdiag_rope below)
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
    )
    if args.position_embedding_type == "rope":
        # positions restart at each document, like the dataset's reset_position_ids
        use_blockdiag_rope(model, reset_position_ids=True)
    return model.to(device)


def build_optimizer(args, model):
    import torch
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or name.endswith(".bias") else decay).append(param)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
        foreach=False)


def lr_at(args, iteration: int) -> float:
    """Learning rate for the step that produces `iteration` (1-based)."""
    warmup = args.lr_warmup_iters
    if warmup > 0 and iteration <= warmup:
        return args.lr * iteration / warmup
    if args.lr_decay_style == "constant":
        return args.lr
    span = max(1, args.lr_decay_iters - warmup)
    frac = min(1.0, max(0.0, (iteration - warmup) / span))
    if args.lr_decay_style == "linear":
        coeff = 1.0 - frac
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * frac))
    return args.min_lr + coeff * (args.lr - args.min_lr)


# ======================================================================================
# Checkpoints
# ======================================================================================

POINTER = "latest_checkpointed_iteration.txt"


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(os.path.dirname(os.path.abspath(path)))


def _rng_state():
    import numpy as np
    import torch
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        try:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
            state["cuda_tracker"] = get_cuda_rng_tracker().get_states()
        except Exception:
            pass
    return state


def _set_rng_state(state) -> None:
    import numpy as np
    import torch
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        if "cuda_tracker" in state:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
            get_cuda_rng_tracker().set_states(state["cuda_tracker"])


def save_checkpoint(args, ctx, model, optimizer, iteration, consumed_samples, history) -> str:
    """Atomic, per-rank checkpoint: SAVE/iter_NNNNNNN/{meta.json, rank_RRRRR.pt} + pointer.

    Every rank writes its file into a temp folder and fsyncs it; after a barrier rank 0
    writes meta.json, renames the folder into place and only then replaces the pointer
    file. A crash at any point leaves the previous checkpoint the one that loads.
    """
    import torch
    import torch.distributed as dist

    save = os.path.abspath(args.save)
    name = f"iter_{iteration:07d}"
    final, tmp = os.path.join(save, name), os.path.join(save, name + ".tmp")
    if ctx.rank == 0:
        os.makedirs(save, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    path = os.path.join(tmp, f"rank_{ctx.rank:05d}.pt")
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "rng": _rng_state(), "iteration": iteration,
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
        _fsync_path(tmp)
        if os.path.exists(final):  # re-saving an iteration: move the old one out of the way
            old = final + f".old{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_path(save)
        _atomic_write_text(os.path.join(save, POINTER), f"{iteration}\n")
    dist.barrier()
    return final


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def load_checkpoint(args, ctx, model, optimizer):
    """Returns (iteration, consumed_samples, loss_history) or None when there is nothing to load."""
    import torch

    load = os.path.abspath(args.load)
    pointer = os.path.join(load, POINTER)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        iteration = int(f.read().strip())
    folder = os.path.join(load, f"iter_{iteration:07d}")
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    for key, have in (("world_size", ctx.world),
                      ("tensor_model_parallel_size", args.tensor_model_parallel_size),
                      ("context_parallel_size", args.context_parallel_size)):
        if meta[key] != have:
            raise RuntimeError(f"checkpoint {folder} was saved with {key}={meta[key]}, this run "
                               f"has {have}; resharding is not supported")
    with open(os.path.join(folder, f"rank_{ctx.rank:05d}.pt"), "rb") as f:
        state = torch.load(f, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    _set_rng_state(state["rng"])
    history = [tuple(x) for x in meta.get("loss_history", [])]
    return state["iteration"], state["consumed_samples"], history


# ======================================================================================
# Training
# ======================================================================================

class Ctx:
    pass


def log(msg: str, ctx=None) -> None:
    """One write per line (lines of different ranks must not interleave)."""
    if ctx is None or ctx.rank == 0:
        os.write(1, (msg.rstrip("\n") + "\n").encode())


def get_micro_batch(args, ctx, dataset, consumed_samples: int, micro: int, device):
    import torch
    base = consumed_samples + micro * args.micro_batch_size * args.data_parallel_size \
        + ctx.dp_rank * args.micro_batch_size
    samples = [dataset[(base + j) % len(dataset)] for j in range(args.micro_batch_size)]
    return {key: torch.stack([s[key] for s in samples]).to(device)
            for key in ("tokens", "labels", "loss_mask", "position_ids")}


def train_step(args, ctx, model, optimizer, dataset, consumed_samples, iteration):
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    import megatron_ext.blockdiag_cp as bdcp

    device = ctx.device
    micro_batches = [get_micro_batch(args, ctx, dataset, consumed_samples, m, device)
                     for m in range(args.num_micro_batches)]
    # Tokens that count in the loss over the whole global batch: this DP rank's full
    # sequences (identical on its CP ranks), summed over DP ranks.
    count = torch.stack([mb["loss_mask"].sum() for mb in micro_batches]).sum().double().reshape(1)
    if args.data_parallel_size > 1:
        dist.all_reduce(count, group=ctx.dp_group)
    global_count = max(float(count.item()), 1.0)

    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    reports = []
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if ctx.bf16 else contextlib.nullcontext()
    for mb in micro_batches:
        # this CP rank's slice of the sequence + the step state (plan, resolved knobs)
        batch, state = bdcp.shard_batch(
            mb, cp_group=None, layout=args.cp_layout_canonical, eod_token=gpt_data.EOD,
            attn_backend=args.cp_attn_backend_canonical,
            kv_exchange=args.cp_kv_exchange_canonical, strict=args.cp_attn_backend_strict)
        with bdcp.blockdiag_cp_step(state):  # forward and backward run inside
            with autocast:
                losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            local_sum = (losses.float() * batch["loss_mask"].float()).sum()
            (local_sum / global_count).backward()
        loss_sum += local_sum.detach().double()
        reports.append(state.report())

    # Gradients: CP ranks hold partial gradients of the same weights (sum), DP ranks
    # hold gradients of different samples; the loss is already divided by the global
    # token count, so a SUM over the DP x CP group gives the gradient of the mean loss.
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads] + [loss_sum.float().reshape(1)])
    if ctx.dp_cp_size > 1:
        dist.all_reduce(flat, group=ctx.dp_cp_group)
    loss = float(flat[-1].item()) / global_count  # fp32 sum of fp64 partials
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
        offset += n

    # Global gradient norm (TP-sharded params counted once per shard) and clipping.
    sq = torch.zeros(1, dtype=torch.float32, device=device)
    for p in params:
        if param_is_not_tensor_parallel_duplicate(p):
            sq += p.grad.float().pow(2).sum()
    if args.tensor_model_parallel_size > 1:
        dist.all_reduce(sq, group=ctx.tp_group)
    grad_norm = float(sq.sqrt().item())
    if args.clip_grad > 0 and grad_norm > args.clip_grad:
        coeff = args.clip_grad / (grad_norm + 1e-6)
        for p in params:
            p.grad.mul_(coeff)

    lr = lr_at(args, iteration)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, lr, reports


def summarize_reports(args, reports):
    r = reports[0]
    sent = sum(x.get("bytes_sent") or 0 for x in reports) * args.num_layers
    recv = sum(x.get("bytes_received") or 0 for x in reports) * args.num_layers
    work = max(float(x.get("work_max_over_mean") or 1.0) for x in reports)
    return (f"cp: backend={r.get('attn_backend')} exchange={r.get('kv_exchange')} "
            f"layout={r.get('layout')} | kv bytes/step (fwd, all layers): "
            f"sent {sent / 2**20:.2f} MiB recv {recv / 2**20:.2f} MiB | "
            f"attn work max/mean: {work:.3f}")


def write_curve(out_dir: str, history, args) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "losses.json"), "w") as f:
        json.dump({"iteration": [h[0] for h in history], "loss": [h[1] for h in history]}, f)
    if args.no_plot or not history:
        return ""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    its, losses = [h[0] for h in history], [h[1] for h in history]
    ax.plot(its, losses, lw=0.8, alpha=0.5, label="loss")
    k = max(1, min(20, len(losses) // 10))
    if k > 1:  # trailing moving average: the trend under the per-batch noise
        avg = [sum(losses[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1))
               for i in range(len(losses))]
        ax.plot(its, avg, lw=1.8, label=f"{k}-iteration mean")
    ax.legend()
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title(f"GPT {args.num_layers}L h{args.hidden_size} seq {args.seq_length}, "
                 f"TP{args.tensor_model_parallel_size} CP{args.context_parallel_size} "
                 f"DP{args.data_parallel_size}")
    ax.grid(alpha=0.3)
    path = os.path.join(out_dir, "loss_curve.png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def train(args, ctx):
    import torch
    import torch.distributed as dist

    random.seed(args.seed)
    import numpy as np
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(args.seed)

    model = build_model(args, ctx.device)
    optimizer = build_optimizer(args, model)
    n_params = sum(p.numel() for p in model.parameters())

    iteration, consumed, history = 0, 0, []
    if args.load:
        loaded = load_checkpoint(args, ctx, model, optimizer)
        if loaded is None:
            log(f"{LOG_PREFIX} WARNING: no checkpoint in {args.load}; starting from scratch", ctx)
        else:
            iteration, consumed, history = loaded
            log(f"{LOG_PREFIX} resumed from {args.load} at iteration {iteration} "
                f"(consumed samples {consumed})", ctx)

    dataset = gpt_data.build_gpt_dataset(
        args.data_prefixes, gpt_data.ByteTokenizer(), args.seq_length,
        args.train_iters * args.global_batch_size, args.seed, args.data_cache_path,
        weights=args.data_weights)
    log(f"{LOG_PREFIX} model: {n_params / 1e6:.2f}M parameters (this rank) | layers "
        f"{args.num_layers} hidden {args.hidden_size} heads {args.num_attention_heads} "
        f"groups {args.num_query_groups} seq {args.seq_length} vocab {gpt_data.PADDED_VOCAB_SIZE}"
        f" | world {ctx.world} = TP {args.tensor_model_parallel_size} x CP "
        f"{args.context_parallel_size} x DP {args.data_parallel_size} | backend {ctx.backend} "
        f"| micro batch {args.micro_batch_size} global batch {args.global_batch_size} | "
        f"train samples {len(dataset)} | data {', '.join(args.data_prefixes)}", ctx)

    first_report_logged = False
    interval_loss, interval_n, interval_t = 0.0, 0, time.time()
    tokens_per_iter = args.global_batch_size * args.seq_length
    train_t0, iters_run = time.time(), 0
    while iteration < args.train_iters:
        loss, grad_norm, lr, reports = train_step(
            args, ctx, model, optimizer, dataset, consumed, iteration + 1)
        iteration += 1
        iters_run += 1
        consumed += args.global_batch_size
        history.append((iteration, loss))
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at iteration {iteration}")
        if reports and not first_report_logged:
            first_report_logged = True
            r = reports[0]
            log(f"{LOG_PREFIX} cp attention: backend {r.get('attn_backend_requested')} -> "
                f"{r.get('attn_backend')} ({r.get('attn_backend_reason')}), exchange "
                f"{r.get('kv_exchange_requested')} -> {r.get('kv_exchange')} "
                f"({r.get('kv_exchange_reason')}), layout {r.get('layout')}", ctx)
        interval_loss += loss
        interval_n += 1
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            now = time.time()
            dt = (now - interval_t) / interval_n
            log(f" iteration {iteration:8d}/{args.train_iters:8d} | consumed samples: "
                f"{consumed:10d} | elapsed time per iteration (ms): {dt * 1000:.1f} | "
                f"learning rate: {lr:.6E} | global batch size: {args.global_batch_size:5d} | "
                f"lm loss: {interval_loss / interval_n:.6E} | grad norm: {grad_norm:.3f} | "
                f"tokens/s: {tokens_per_iter / dt:.0f} | {summarize_reports(args, reports)}", ctx)
            interval_loss, interval_n, interval_t = 0.0, 0, now
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            path = save_checkpoint(args, ctx, model, optimizer, iteration, consumed, history)
            log(f"{LOG_PREFIX} saved checkpoint {path}", ctx)

    if args.save and (not args.save_interval or iteration % args.save_interval):
        path = save_checkpoint(args, ctx, model, optimizer, iteration, consumed, history)
        log(f"{LOG_PREFIX} saved checkpoint {path}", ctx)
    train_time = time.time() - train_t0
    if ctx.rank == 0:
        run_name = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        out_dir = args.save or str(REPO_ROOT / "runs" / run_name)
        png = write_curve(out_dir, history, args)
        first = history[0][1] if history else float("nan")
        last = history[-1][1] if history else float("nan")
        k = min(10, len(history))
        last_avg = sum(h[1] for h in history[-k:]) / max(1, k)
        log(f"{LOG_PREFIX} summary: iterations={iteration} run_here={iters_run} "
            f"first_loss={first:.6f} last_loss={last:.6f} last{k}_avg={last_avg:.6f} "
            f"train_s={train_time:.1f} total_s={time.time() - ctx.t0:.1f} "
            f"tokens_per_s={iters_run * tokens_per_iter / max(train_time, 1e-9):.0f} "
            f"world={ctx.world} tp={args.tensor_model_parallel_size} "
            f"cp={args.context_parallel_size} dp={args.data_parallel_size} png={png or '-'}")
    dist.barrier()
    return history


def _die_with_launcher() -> None:
    """Under torchrun, die when the launcher dies (even by SIGKILL), like srun's tasks.

    torchrun starts workers in their own sessions; if torchrun itself is SIGKILLed
    they would otherwise run on, orphaned, and keep writing checkpoints.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)
    except Exception:
        pass


def main(argv=None) -> int:
    t0 = time.time()
    _die_with_launcher()
    parser = build_parser()
    args = parser.parse_args(argv)
    rank, world, local_rank, local_world = world_from_env()
    # ---- everything below until init_distributed runs on every rank, without a group ----
    try:
        validate_args(args, world)
    except UsageError as exc:
        parser.error(str(exc))  # exit 2, message on stderr
    try:
        resolve_data_paths(args)
    except gpt_data.DataPathError as exc:
        sys.stderr.write(f"{LOG_PREFIX} rank {rank}: error: {exc}\n")
        sys.stderr.flush()
        if world > 1:
            # torchrun tears the whole group down at the first failed rank; give the
            # other ranks (which run this same check) a moment to report it too.
            time.sleep(2)
        return 1

    import torch
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets 1; an explicit value wins
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, cores // max(1, local_world)))
    ctx = Ctx()
    ctx.t0 = t0
    ctx.rank, ctx.world, ctx.local_rank, ctx.local_world, ctx.backend = init_distributed(args)
    try:
        from megatron.core import parallel_state as mpu
        ctx.device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        ctx.bf16 = bool(args.bf16) if args.bf16 is not None else ctx.device.type == "cuda"
        if ctx.bf16 and ctx.device.type != "cuda":
            log(f"{LOG_PREFIX} WARNING: --bf16 on CPU is slow and only autocast on CUDA is "
                "implemented; running fp32", ctx)
            ctx.bf16 = False
        ctx.dp_rank = mpu.get_data_parallel_rank()
        ctx.dp_group = mpu.get_data_parallel_group()
        ctx.dp_cp_group = mpu.get_data_parallel_group(with_context_parallel=True)
        ctx.dp_cp_size = mpu.get_data_parallel_world_size(with_context_parallel=True)
        ctx.tp_group = mpu.get_tensor_model_parallel_group()
        log(f"{LOG_PREFIX} torch {torch.__version__} threads {torch.get_num_threads()} | "
            f"MASTER_ADDR {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} | "
            f"cp knobs: attn_backend={args.cp_attn_backend_canonical} "
            f"kv_exchange={args.cp_kv_exchange_canonical} layout={args.cp_layout_canonical} "
            f"strict={args.cp_attn_backend_strict}", ctx)
        train(args, ctx)
    except BaseException as exc:
        from megatron_ext.blockdiag_cp import BlockDiagCPError
        if isinstance(exc, BlockDiagCPError):  # a configuration problem: the message says it all
            sys.stderr.write(f"{LOG_PREFIX} rank {ctx.rank}: error: {exc}\n")
        else:
            sys.stderr.write(f"{LOG_PREFIX} rank {ctx.rank}: failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)  # do not wait in a collective for ranks that will never arrive
    import torch.distributed as dist
    mpu.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
