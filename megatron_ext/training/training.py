"""``pretrain()``: the loop behind scripts/pretrain_gpt.py, shaped like Megatron-LM's.

The entry script supplies the providers, as in Megatron-LM's ``pretrain_gpt.py``:
``model_provider()``, ``train_dataset_provider(num_samples)`` and ``forward_step(data_iterator,
model)``. One difference: our ``forward_step`` is a context manager yielding
``(output_tensor, loss_func)``, and backward runs inside it, because the
block-diagonal CP step state must be published for forward *and* backward.

What is megatron-core here and what is ours:
- megatron-core: ``parallel_state`` (TP x CP x DP groups), ``GPTModel`` and its layer
  spec, ``GPTDataset`` via ``BlendedMegatronDatasetBuilder``, and the learning rate /
  weight decay schedule (``OptimizerParamScheduler``, which has no CUDA in it).
- ours, because megatron-core's versions hard-code CUDA (``torch.cuda.current_device()``,
  ``device='cuda'``) and this loop must run on CPU processes: the gradient all-reduce
  (megatron's ``DistributedDataParallel``), clipping and the optimizer step (its
  ``MegatronOptimizer`` wrappers around torch's AdamW), the micro-batch loop (its
  pipeline schedules; we run no pipeline parallelism), and checkpoints
  (its ``dist_checkpointing.save``).

Loss: Megatron's per-token loss. Every micro batch's ``loss_func`` returns the sum of
its token losses and the number of tokens; backward runs on the sum, and after the
gradient all-reduce over data- x context-parallel ranks the gradients are divided by
the global token count, so every CP and DP split gives the gradient of the same mean.
"""

import math
import os
import sys
import time
import traceback

from . import arguments, checkpointing, data
from .arguments import UsageError, set_args
from .initialize import ParallelContext, die_with_launcher, initialize_distributed, shutdown_distributed
from .logs import LOG_PREFIX, cp_resolution_line, iteration_line, log, write_curve
from .plan_ahead import PlanAhead


def build_optimizer(args, model):
    """torch AdamW; biases and norm weights get no weight decay (``wd_mult`` 0, Megatron's key)."""
    import torch

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or name.endswith(".bias") else decay).append(param)
    return torch.optim.AdamW(
        [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
        lr=args.lr, weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps, foreach=False)


def build_opt_param_scheduler(args, optimizer):
    """megatron-core's scheduler, counting steps in samples as Megatron-LM does with --train-iters."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=(args.lr_wsd_decay_iters * gbs) if args.lr_wsd_decay_iters else None,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def build_data_iterator(args, ctx: ParallelContext, dataset, consumed_samples: int):
    """Micro batches of this DP rank, from ``consumed_samples`` on (Megatron's pretraining sampler).

    A global batch is ``num_micro_batches`` micro batches of ``micro_batch_size x dp``
    consecutive samples; DP rank r takes its ``micro_batch_size`` of each. CP ranks of
    one DP rank read the same full sequences (the entry script's get_batch shards them).
    """
    import torch

    mbs, dp = args.micro_batch_size, args.data_parallel_size
    start = consumed_samples
    while True:
        base = start + ctx.dp_rank * mbs
        samples = [dataset[(base + j) % len(dataset)] for j in range(mbs)]
        yield {key: torch.stack([s[key] for s in samples]).to(ctx.device)
               for key in ("tokens", "labels", "loss_mask", "position_ids")}
        start += mbs * dp


def _all_reduce_grads_and_loss(args, ctx, params, loss_sum, num_tokens):
    """SUM gradients, loss and token count over DP x CP; divide the gradients by the tokens.

    CP ranks hold partial gradients of the same weights and DP ranks gradients of other
    samples; one flat all-reduce covers both (megatron's DDP does this with buckets on CUDA).
    """
    import torch
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads]
                     + [loss_sum.float().reshape(1), num_tokens.float().reshape(1)])
    if ctx.dp_cp_size > 1:
        dist.all_reduce(flat, group=ctx.dp_cp_group)
    global_tokens = max(float(flat[-1].item()), 1.0)
    loss = float(flat[-2].item()) / global_tokens
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = (flat[offset:offset + n] / global_tokens).view_as(p).to(p.dtype)
        offset += n
    return loss


def _clip_grad_norm(args, ctx, params) -> float:
    """Global gradient norm (TP-sharded params counted once per shard), then clipping."""
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    sq = torch.zeros(1, dtype=torch.float32, device=ctx.device)
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
    return grad_norm


def train_step(args, ctx, forward_step_func, data_iterator, model, optimizer, opt_param_scheduler):
    """One global batch: forward/backward per micro batch, reduce, clip, step; Megatron's order."""
    import torch

    loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
    num_tokens = torch.zeros((), dtype=torch.float64, device=ctx.device)
    reports = []
    for _ in range(args.num_micro_batches):
        with forward_step_func(data_iterator, model) as (output_tensor, loss_func):
            loss, tokens, report = loss_func(output_tensor)
            loss.backward()
        loss_sum += loss.detach().double()
        num_tokens += tokens.detach().double()
        reports.append(report)
    params = [p for p in model.parameters() if p.requires_grad]
    loss = _all_reduce_grads_and_loss(args, ctx, params, loss_sum, num_tokens)
    grad_norm = _clip_grad_norm(args, ctx, params)
    lr = optimizer.param_groups[0]["lr"]  # what this step applies (the scheduler set it)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    opt_param_scheduler.step(increment=args.global_batch_size)
    return loss, grad_norm, lr, reports


def train(args, ctx, model, optimizer, opt_param_scheduler, dataset, forward_step_func,
          iteration, consumed, history, plan_ahead_provider=None):
    first_report_logged = False
    interval_loss, interval_n, interval_t = 0.0, 0, time.time()
    data_iterator = build_data_iterator(args, ctx, dataset, consumed)
    if plan_ahead_provider is not None and args.cp_plan_ahead:
        data_iterator = PlanAhead(data_iterator, plan_ahead_provider)
    train_t0, iters_run = time.time(), 0
    while iteration < args.train_iters:
        loss, grad_norm, lr, reports = train_step(args, ctx, forward_step_func, data_iterator,
                                                  model, optimizer, opt_param_scheduler)
        iteration += 1
        iters_run += 1
        consumed += args.global_batch_size
        history.append((iteration, loss))
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at iteration {iteration}")
        if not first_report_logged:
            first_report_logged = True
            log(cp_resolution_line(reports[0]), ctx)
        interval_loss += loss
        interval_n += 1
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            now = time.time()
            ms = (now - interval_t) / interval_n * 1000
            log(iteration_line(args, iteration, consumed, ms, lr, interval_loss / interval_n,
                               grad_norm, reports), ctx)
            interval_loss, interval_n, interval_t = 0.0, 0, now
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            path = checkpointing.save_checkpoint(args, ctx, iteration, consumed, history, model,
                                                 optimizer, opt_param_scheduler)
            log(f"{LOG_PREFIX} saved checkpoint {path}", ctx)
    if args.save and (not args.save_interval or iteration % args.save_interval):
        path = checkpointing.save_checkpoint(args, ctx, iteration, consumed, history, model,
                                             optimizer, opt_param_scheduler)
        log(f"{LOG_PREFIX} saved checkpoint {path}", ctx)
    if isinstance(data_iterator, PlanAhead):
        data_iterator.close()
    return iteration, iters_run, time.time() - train_t0


def _setup_and_train(args, ctx, train_dataset_provider, model_provider, forward_step_func,
                     plan_ahead_provider=None):
    import numpy as np
    import random
    import torch
    import torch.distributed as dist

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(args.seed)

    model = model_provider().to(ctx.device)
    optimizer = build_optimizer(args, model)
    opt_param_scheduler = build_opt_param_scheduler(args, optimizer)
    n_params = sum(p.numel() for p in model.parameters())

    iteration, consumed, history = 0, 0, []
    if args.load:
        loaded = checkpointing.load_checkpoint(args, ctx, model, optimizer, opt_param_scheduler)
        if loaded is None:
            log(f"{LOG_PREFIX} WARNING: no checkpoint in {args.load}; starting from scratch", ctx)
        else:
            iteration, consumed, history = loaded
            log(f"{LOG_PREFIX} resumed from {args.load} at iteration {iteration} "
                f"(consumed samples {consumed})", ctx)

    dataset = train_dataset_provider(args.train_iters * args.global_batch_size)
    log(f"{LOG_PREFIX} model: {n_params / 1e6:.2f}M parameters (this rank) | layers "
        f"{args.num_layers} hidden {args.hidden_size} heads {args.num_attention_heads} "
        f"groups {args.num_query_groups} seq {args.seq_length} vocab {data.PADDED_VOCAB_SIZE}"
        f" | world {ctx.world} = TP {args.tensor_model_parallel_size} x CP "
        f"{args.context_parallel_size} x DP {args.data_parallel_size} | backend {ctx.backend} "
        f"| micro batch {args.micro_batch_size} global batch {args.global_batch_size} | "
        f"train samples {len(dataset)} | data {', '.join(args.data_prefixes)}", ctx)

    iteration, iters_run, train_time = train(args, ctx, model, optimizer, opt_param_scheduler,
                                             dataset, forward_step_func, iteration, consumed,
                                             history, plan_ahead_provider)
    if ctx.rank == 0:
        run_dir = args.run_dir or args.save or os.path.join(
            args.runs_dir, f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        png = write_curve(run_dir, history, args)
        first = history[0][1] if history else float("nan")
        last = history[-1][1] if history else float("nan")
        k = min(10, len(history))
        last_avg = sum(h[1] for h in history[-k:]) / max(1, k)
        tokens_per_iter = args.global_batch_size * args.seq_length
        log(f"{LOG_PREFIX} summary: iterations={iteration} run_here={iters_run} "
            f"first_loss={first:.6f} last_loss={last:.6f} last{k}_avg={last_avg:.6f} "
            f"train_s={train_time:.1f} total_s={time.time() - ctx.t0:.1f} "
            f"tokens_per_s={iters_run * tokens_per_iter / max(train_time, 1e-9):.0f} "
            f"world={ctx.world} tp={args.tensor_model_parallel_size} "
            f"cp={args.context_parallel_size} dp={args.data_parallel_size} png={png or '-'}")
    dist.barrier()


def parse_and_validate_args(argv=None, args_defaults=None):
    """Parse, validate and check the data on this rank; exits (2 for flags, 1 for data) on error.

    Runs before any process group exists: every rank reaches the same verdict alone.
    """
    parser = arguments.build_parser()
    # Non-flag settings the entry script owns (Megatron's args_defaults): where the embedded
    # dataset and the run folders go.
    parser.set_defaults(**{"data_cache_dir": "data_cache", "runs_dir": "runs", **(args_defaults or {})})
    args = parser.parse_args(argv)
    rank, world, _, _ = arguments.world_from_env()
    try:
        arguments.validate_args(args, world)
    except UsageError as exc:
        parser.error(str(exc))  # exit 2, the message on stderr
    try:
        arguments.resolve_data_paths(args, rank)
    except data.DataPathError as exc:
        sys.stderr.write(f"{LOG_PREFIX} rank {rank}: error: {exc}\n")
        sys.stderr.flush()
        if world > 1:
            # torchrun tears the whole group down at the first failed rank; give the
            # other ranks (which run this same check) a moment to report it too.
            time.sleep(2)
        sys.exit(1)
    return args


def pretrain(train_dataset_provider, model_provider, forward_step_func, argv=None,
             args_defaults=None, plan_ahead_provider=None) -> int:
    """Parse and check the flags, start the process groups, train; returns the exit code.

    A failure after the process groups exist ends this process at once with exit 1
    (``os._exit``): the other ranks are torn down by the launcher instead of waiting in
    a collective for a rank that will never arrive.
    """
    t0 = time.time()
    die_with_launcher()
    args = parse_and_validate_args(argv, args_defaults)
    set_args(args)
    ctx = initialize_distributed(args, t0)
    try:
        import torch
        log(f"{LOG_PREFIX} torch {torch.__version__} threads {torch.get_num_threads()} | "
            f"MASTER_ADDR {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} | "
            f"cp knobs: attn_backend={args.cp_attn_backend_canonical} "
            f"kv_exchange={args.cp_kv_exchange_canonical} layout={args.cp_layout_canonical} "
            f"strict={args.cp_attn_backend_strict}", ctx)
        _setup_and_train(args, ctx, train_dataset_provider, model_provider, forward_step_func,
                         plan_ahead_provider)
    except BaseException as exc:
        from megatron_ext.blockdiag_cp import BlockDiagCPError
        if isinstance(exc, (BlockDiagCPError, checkpointing.CheckpointError)):
            # a configuration problem, the same on every rank: the message says it all
            sys.stderr.write(f"{LOG_PREFIX} rank {ctx.rank}: error: {exc}\n")
        else:
            sys.stderr.write(f"{LOG_PREFIX} rank {ctx.rank}: failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)
    shutdown_distributed()
    return 0
