"""Megatron-style command line of the pretrain script, checked before any process group exists.

Flag names and meanings follow Megatron-LM's ``megatron/training/arguments.py``
(``--lr``, ``--min-lr``, ``--lr-decay-style``, ``--lr-warmup-iters`` /
``--lr-warmup-fraction``, ``--start-weight-decay`` ...), plus the ``--cp-*`` knobs of
the block-diagonal CP engine. ``validate_args`` runs on every rank right after
parsing: a bad value exits non-zero on every rank at once, naming the value and the
fix, instead of one rank raising while the others wait in ``init_process_group``.

Nothing here imports torch or megatron: the knob names are checked by the engine's
dependency-free ``state`` module (importing it does not import the engine's torch modules),
so a typo costs well under a second.
"""

import argparse
import math
import os
import pathlib

from .. import megatron_lm
from ..blockdiag_cp import state as cp_state
from . import data

_GLOBAL_ARGS = None


class UsageError(ValueError):
    """A flag value that no run could use; reported like argparse's own errors (exit 2)."""


def get_args():
    """The parsed arguments of this run (Megatron's ``megatron.training.get_args``)."""
    if _GLOBAL_ARGS is None:
        raise RuntimeError("get_args() called before pretrain() parsed the command line")
    return _GLOBAL_ARGS


def set_args(args) -> None:
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def add_data_path_argument(group, default_help: str = None, required: bool = False) -> None:
    """Megatron's --data-path (``PREFIX [PREFIX ...]`` or ``W1 P1 W2 P2 ...``); ``data.parse_data_path``
    reads it. Shared with the planner CLI, which samples what the pretrain script trains on."""
    group.add_argument("--data-path", nargs="+", default=None, required=required,
                       help="indexed dataset PREFIX (PREFIX.bin/.idx), several prefixes, or "
                            "'W1 P1 W2 P2 ...' to blend" + (f"; {default_help}" if default_help else ""))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Pretrain a megatron-core GPTModel with block-diagonal context-parallel "
                    "attention (megatron_ext).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=2,
                   help="GQA groups (K/V heads); equal to heads for MHA")
    g.add_argument("--seq-length", type=int, default=2048)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute",
                   help="rope re-slices megatron's table for our CP layout (micro batch 1)")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--window-size", type=int, nargs=2, default=None, metavar=("LEFT", "RIGHT"),
                   help="sliding-window attention, as Megatron-LM's flag: LEFT 0 (causal), a query sees the "
                        "LEFT keys before it in its document; the CP plan moves only those keys")
    g.add_argument("--window-attn-skip-freq", type=int, default=None, metavar="N",
                   help="with --window-size: every N-th layer attends in full (megatron's "
                        "window_attn_skip_freq); default: every layer windowed")
    g.add_argument("--bf16", dest="bf16", action="store_true", default=None,
                   help="bf16 compute (default on GPU; CPUs here have no bf16 hardware)")
    g.add_argument("--fp32", dest="bf16", action="store_false", help="fp32 compute")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch size * data-parallel size")
    g.add_argument("--train-iters", type=int, default=300)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables")
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("learning rate and weight decay (megatron-core's OptimizerParamScheduler)")
    g.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=2e-4, help="floor of the decay")
    g.add_argument("--lr-decay-style", default="cosine",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=None,
                   help="linear warmup from --lr-warmup-init; default min(100, train_iters // 10) "
                        "unless --lr-warmup-fraction is given")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="learning rate at step 0")
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["linear", "cosine", "exponential", "minus_sqrt"])
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="iterations of the final anneal of --lr-decay-style WSD")
    g.add_argument("--weight-decay", type=float, default=0.1,
                   help="constant weight decay (biases and norms get none)")
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="weight decay at step 0 with --weight-decay-incr-style linear/cosine")
    g.add_argument("--end-weight-decay", type=float, default=None,
                   help="weight decay at --train-iters with --weight-decay-incr-style linear/cosine")
    g.add_argument("--weight-decay-incr-style", default="constant",
                   choices=["constant", "linear", "cosine"])
    # Both spellings, as Megatron-LM's: the underscore one is what its scripts pass.
    g.add_argument("--override-opt-param-scheduler", "--override-opt_param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="on --load, take the schedule from these flags, not the checkpoint (the "
                        "learning rate moves to the new curve at the resumed iteration)")
    g.add_argument("--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on --load, take the schedule from the checkpoint, ignoring these flags; "
                        "neither flag: a schedule that differs from the checkpoint's is refused")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=None,
                   help="default: 2 when world size / TP is even, else 1")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, gloo otherwise")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)

    # One definition of the --cp-* knobs, shared with Megatron-LM's extra_args_provider.
    megatron_lm.add_blockdiag_cp_arguments(p)
    g = p.add_argument_group("block-diagonal CP attention: this script only")
    g.add_argument("--no-cp-plan-ahead", dest="cp_plan_ahead", action="store_false",
                   help="plan each micro batch in line instead of on a background thread one step "
                        "ahead (the plan is the same; only the agreement all-reduce stays in line)")

    g = p.add_argument_group("data")
    add_data_path_argument(g, default_help="default: the embedded stdlib dataset")
    g.add_argument("--data-cache-path", default=None,
                   help="where megatron's sample-index cache goes (default <data cache>/index_cache)")

    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", default=None, help="checkpoint folder")
    g.add_argument("--save-interval", type=int, default=None,
                   help="save every N iterations (and at the end) when --save is given")
    g.add_argument("--load", default=None, help="resume from the latest checkpoint in this folder")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--run-dir", default=None,
                   help="where losses.json and loss_curve.png go (default: --save, else "
                        "runs/<time>-<pid>)")
    g.add_argument("--no-plot", action="store_true", help="do not write loss_curve.png")
    return p


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


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_numbers(args) -> None:
    """Every numeric flag in its meaningful range (argparse's float() also takes nan and inf)."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                 "seq_length", "micro_batch_size", "train_iters", "tensor_model_parallel_size",
                 "log_interval", "rotary_base"):
        value = getattr(args, name)
        _require(value is not None and value >= 1, f"{flag_name(name)} must be >= 1, got {value}")
    for name in ("ffn_hidden_size", "global_batch_size", "save_interval", "lr_decay_iters",
                 "lr_wsd_decay_iters"):
        value = getattr(args, name)
        _require(value is None or value >= 1, f"{flag_name(name)} must be >= 1, got {value}")
    _require(args.lr_warmup_iters is None or args.lr_warmup_iters >= 0,
             f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    for name in ("lr", "adam_eps", "init_method_std", "distributed_timeout_minutes"):
        value = getattr(args, name)
        _require(math.isfinite(value) and value > 0,
                 f"{flag_name(name)} must be a finite number > 0, got {value}")
    for name in ("min_lr", "lr_warmup_init", "weight_decay", "start_weight_decay",
                 "end_weight_decay", "clip_grad", "lr_warmup_fraction"):
        value = getattr(args, name)
        _require(value is None or (math.isfinite(value) and value >= 0),
                 f"{flag_name(name)} must be a finite number >= 0, got {value}")
    for name in ("adam_beta1", "adam_beta2", "hidden_dropout", "attention_dropout"):
        value = getattr(args, name)
        _require(0 <= value < 1, f"{flag_name(name)} must be in [0, 1), got {value}")
    _require(args.window_size is None or (args.window_size[0] >= 0 and args.window_size[1] == 0),
             f"--window-size takes LEFT 0 (LEFT >= 0 keys before each query, causal), got {args.window_size}")
    _require(args.window_attn_skip_freq is None or (args.window_size is not None and args.window_attn_skip_freq >= 1),
             f"--window-attn-skip-freq needs --window-size and must be >= 1, got {args.window_attn_skip_freq}")


def _resolve_schedule(args) -> None:
    """Megatron's rules for the learning-rate and weight-decay schedule flags."""
    _require(args.min_lr <= args.lr, f"--min-lr {args.min_lr} must not exceed --lr {args.lr}")
    _require(args.lr_warmup_init <= args.lr,
             f"--lr-warmup-init {args.lr_warmup_init} must not exceed --lr {args.lr}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        _require(args.lr_warmup_iters is None,
                 "give one of --lr-warmup-fraction and --lr-warmup-iters, not both")
        _require(args.lr_warmup_fraction < 1,
                 f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    elif args.lr_warmup_iters is None:
        args.lr_warmup_iters = min(100, args.train_iters // 10)
    _require(args.lr_warmup_iters < args.lr_decay_iters,
             f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
             f"{args.lr_decay_iters} (megatron's scheduler decays after the warmup)")
    if args.lr_decay_style == "WSD":
        _require(args.lr_wsd_decay_iters is not None,
                 "--lr-decay-style WSD needs --lr-wsd-decay-iters (the length of the final anneal)")
        _require(args.lr_wsd_decay_iters <= args.lr_decay_iters,
                 f"--lr-wsd-decay-iters {args.lr_wsd_decay_iters} exceeds --lr-decay-iters "
                 f"{args.lr_decay_iters}")
    if args.weight_decay_incr_style == "constant":
        _require(args.start_weight_decay is None and args.end_weight_decay is None,
                 "--start-weight-decay / --end-weight-decay need --weight-decay-incr-style "
                 "linear or cosine (constant uses --weight-decay)")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    else:
        _require(args.start_weight_decay is not None and args.end_weight_decay is not None,
                 f"--weight-decay-incr-style {args.weight_decay_incr_style} needs both "
                 "--start-weight-decay and --end-weight-decay")
        _require(args.start_weight_decay <= args.end_weight_decay,
                 f"--start-weight-decay {args.start_weight_decay} must not exceed "
                 f"--end-weight-decay {args.end_weight_decay} (megatron's scheduler only increases it)")
    _require(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
             "give one of --override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler")


def validate_args(args, world_size: int) -> None:
    """Every check that needs no process group; raises UsageError. Fills in derived sizes."""
    for flag, normalize in (("--cp-attn-backend", cp_state.normalize_attn_backend),
                            ("--cp-kv-exchange", cp_state.normalize_kv_exchange),
                            ("--cp-layout", cp_state.normalize_layout),
                            ("--cp-kv-backward", cp_state.normalize_kv_backward),
                            ("--cp-ulysses-size", cp_state.normalize_ulysses_size),
                            ("--cp-relayout", cp_state.normalize_relayout)):
        attr = flag[2:].replace("-", "_")
        try:
            value = normalize(getattr(args, attr))
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None
        setattr(args, attr + "_canonical", value)

    _check_numbers(args)
    tp = args.tensor_model_parallel_size
    if args.context_parallel_size is None:
        args.context_parallel_size = 2 if (world_size % tp == 0 and (world_size // tp) % 2 == 0) else 1
    cp = args.context_parallel_size
    _require(cp >= 1, f"--context-parallel-size must be >= 1, got {cp}")
    _require(world_size % (tp * cp) == 0,
             f"world size {world_size} is not divisible by tensor-model-parallel-size ({tp}) x "
             f"context-parallel-size ({cp}) = {tp * cp}")
    u = args.cp_ulysses_size_canonical
    _require(cp % u == 0, f"--cp-ulysses-size {u} does not divide --context-parallel-size {cp} (two-dimensional "
                          f"CP runs cp / u groups of u ranks); use a size dividing {cp}, or 1")
    _require(u in (1, cp) or args.cp_kv_exchange_canonical != "ulysses",
             f"--cp-kv-exchange ulysses is head-parallel over the whole CP group; with --cp-ulysses-size {u} < "
             f"{cp} name the exchange between the groups (--cp-kv-exchange a2a | halo | allgather | hierarchical)")
    dp = world_size // (tp * cp)
    args.world_size, args.data_parallel_size = world_size, dp
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    _require(args.global_batch_size % (args.micro_batch_size * dp) == 0,
             f"--global-batch-size {args.global_batch_size} is not divisible by micro-batch-size "
             f"({args.micro_batch_size}) x data-parallel size ({dp}) = {args.micro_batch_size * dp}")
    args.num_micro_batches = args.global_batch_size // (args.micro_batch_size * dp)
    h, heads, groups = args.hidden_size, args.num_attention_heads, args.num_query_groups
    _require(h % heads == 0, f"--hidden-size {h} is not divisible by --num-attention-heads {heads}")
    _require(heads % groups == 0,
             f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
    _require(heads % tp == 0 and groups % tp == 0,
             f"--num-attention-heads {heads} and --num-query-groups {groups} must be divisible "
             f"by --tensor-model-parallel-size {tp}")
    _require(data.PADDED_VOCAB_SIZE % tp == 0,
             f"the vocabulary ({data.PADDED_VOCAB_SIZE}) is not divisible by "
             f"--tensor-model-parallel-size {tp}")
    _require(args.seq_length >= cp, f"--seq-length {args.seq_length} is shorter than the CP size {cp}")
    _require(args.position_embedding_type != "rope" or args.micro_batch_size == 1,
             "--position-embedding-type rope restarts positions per document, which needs "
             "--micro-batch-size 1 (documents differ between batch rows)")
    _resolve_schedule(args)
    if args.data_path is not None:
        try:
            args.data_prefixes, args.data_weights = data.parse_data_path(args.data_path)
        except data.DataPathError as exc:
            raise UsageError(str(exc)) from None


def resolve_data_paths(args, rank: int) -> None:
    """Check every --data-path prefix on disk, or build the embedded default; DataPathError."""
    cache_dir = pathlib.Path(args.data_cache_dir)
    if args.data_path is None:
        args.data_prefixes = [data.default_dataset_prefix(cache_dir, progress=rank == 0)]
        args.data_weights = None
    else:
        args.data_prefixes = [data.strip_prefix(os.path.abspath(p)) for p in args.data_prefixes]
        for prefix in args.data_prefixes:
            data.validate_indexed_dataset(prefix)
    if args.data_cache_path is None:
        args.data_cache_path = str(cache_dir / "index_cache")
