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

Shaped like Megatron-LM's pretrain_gpt.py: this file holds the providers (model,
dataset, batch, forward step, loss); ``megatron_ext.training`` holds the flags, the
process groups, the loop, checkpoints and logs (``--help`` lists the flags).
"""

import contextlib
import functools
import pathlib
import sys
import warnings

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run from a clone without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")

from megatron_ext.training import get_args, pretrain  # noqa: E402  (no torch import yet)
from megatron_ext.training.data import EOD, PADDED_VOCAB_SIZE, ByteTokenizer, build_gpt_dataset  # noqa: E402


def model_provider(pre_process=True, post_process=True):
    """megatron-core's GPTModel with megatron's GPT layer spec, core attention swapped for ours."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.layers import get_gpt_layer_spec_with_blockdiag_cp, use_blockdiag_rope

    args = get_args()
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
        window_size=None if args.window_size is None else tuple(args.window_size),
        window_attn_skip_freq=args.window_attn_skip_freq,
        # fp32 master weights; on GPU the compute runs under bf16 autocast (forward_step)
        params_dtype=torch.float32,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
        # the fused kernels below are CUDA-only; megatron's unfused paths run everywhere
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    model = GPTModel(
        config=config,
        # megatron-core's GPT layer spec (TE modules when TE imports) with BlockDiagCPAttention
        transformer_layer_spec=get_gpt_layer_spec_with_blockdiag_cp(),
        vocab_size=PADDED_VOCAB_SIZE,
        max_sequence_length=args.seq_length,
        pre_process=pre_process,
        post_process=post_process,
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
    return model


def train_dataset_provider(num_samples):
    """megatron-core's GPTDataset (or a blend) over the --data-path prefixes, no attention mask."""
    args = get_args()
    return build_gpt_dataset(args.data_prefixes, ByteTokenizer(), args.seq_length, num_samples,
                             args.seed, args.data_cache_path, weights=args.data_weights)


@functools.lru_cache(maxsize=1)
def cp_cost_model():
    """The balanced layout's cost model: this model's attention dims over --cp-cost-model's topology.

    auto: NVLink when the CP group sits on one node; two levels (NVLink inside a node, InfiniBand
    between nodes, the group's CP ranks per node from the launch) when it spans nodes, pricing the
    exchange the run uses: a node's remote keys cross IB once only with --cp-kv-exchange hierarchical.
    """
    from megatron_ext import parallel_state as ps
    from megatron_ext.blockdiag_cp import CostModel

    args = get_args()
    tp = args.tensor_model_parallel_size
    dims = dict(heads=args.num_attention_heads // tp, kv_heads=args.num_query_groups // tp,
                head_dim=args.hidden_size // args.num_attention_heads, dtype_bytes=2 if args.bf16 else 4)
    link = args.cp_cost_model
    if link == "auto":
        per_node = ps.cp_ranks_per_node() if ps.get_cp_world_size() > 1 and ps.cp_spans_nodes() else 0
        if per_node:
            hierarchical = args.cp_kv_exchange_canonical == "hierarchical" and per_node > 1
            return CostModel.two_level(per_node, **dims, hierarchical=hierarchical)
        link = "ib" if ps.get_cp_world_size() > 1 and ps.cp_spans_nodes() else "nvlink"
    return CostModel.preset(link, **dims)


@functools.lru_cache(maxsize=1)
def model_windows():
    """Every layer's sliding window (--window-size, --window-attn-skip-freq) as the CP planner prices
    them: ``balanced`` counts the windowed work and keys of that mix of layers."""
    import types

    from megatron_ext.blockdiag_cp import WindowMix
    from megatron_ext.layers.attention import window_mix_from_config

    args = get_args()
    if args.window_size is None:
        return WindowMix()
    return window_mix_from_config(types.SimpleNamespace(
        num_layers=args.num_layers, window_size=tuple(args.window_size), window_attn_skip_freq=args.window_attn_skip_freq))


def plan_ahead_provider(batch):
    """The CP layout + plan of a micro batch, built one step ahead on the loop's planning thread."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext import parallel_state as ps
    from megatron_ext.blockdiag_cp.plan import chunk_kind

    args = get_args()
    cp = ps.get_cp_world_size()
    exchange = args.cp_kv_exchange_canonical
    if args.cp_ulysses_size_canonical > 1 or exchange == "planned":
        return None  # two dimensions, or a choice among them, are planned at the build (prepare_plan plans one)
    if args.cp_relayout_canonical == "balanced" and args.cp_layout_canonical != "balanced":
        return None  # the exchange is planned on the balanced layout the build moves the rows to
    return bdcp.prepare_plan(
        bdcp.doc_ids_from_eod(batch["tokens"].cpu(), EOD), cp, ps.get_cp_rank(),
        layout=args.cp_layout_canonical, cost_model=cp_cost_model(),
        kinds=(chunk_kind(exchange) if cp > 1 else "needed",), kv_exchange=exchange, windows=model_windows(),
        # the hierarchical exchange's node routes are planned ahead too
        ranks_per_node=ps.cp_ranks_per_node() if exchange == "hierarchical" and cp > 1 else None)


def get_batch(data_iterator):
    """The next micro batch, cut to this CP rank's tokens, the step state, and the plan timing.

    Megatron's get_batch_on_this_cp_rank slices zigzag; shard_batch slices by the
    --cp-layout and plans the K/V exchange from the documents (found from EOD tokens),
    or takes the plan the loop built one step ahead (then only the agreement runs here).
    """
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.training.plan_ahead import PREPARED_KEY, TIMING_KEY

    args = get_args()
    batch = dict(next(data_iterator))  # full sequences [b, S]: tokens, labels, loss_mask, position_ids
    prepared, timing = batch.pop(PREPARED_KEY, None), batch.pop(TIMING_KEY, None)
    local, state = bdcp.shard_batch(
        batch, cp_group=None, layout=args.cp_layout_canonical, eod_token=EOD,
        attn_backend=args.cp_attn_backend_canonical, kv_exchange=args.cp_kv_exchange_canonical,
        strict=args.cp_attn_backend_strict, cost_model=cp_cost_model(), prepared=prepared,
        kv_backward=args.cp_kv_backward_canonical, windows=model_windows(),
        ulysses_size=args.cp_ulysses_size_canonical, relayout=args.cp_relayout_canonical)
    return local, state, timing


def loss_func(loss_mask, state, timing, output_tensor):
    """Megatron's per-token loss: (sum of this rank's token losses, their count, the CP report)."""
    losses = output_tensor.float()  # [b, s_local]
    loss_mask = loss_mask.float()
    report = state.report()
    if timing is not None:
        report.update(plan_seconds=timing.seconds, plan_hidden_seconds=timing.hidden)
    return (losses * loss_mask).sum(), loss_mask.sum(), report


@contextlib.contextmanager
def forward_step(data_iterator, model):
    """Forward one micro batch; yields (output_tensor, loss_func). Backward runs inside.

    Megatron's forward_step returns instead of yielding; here the CP step context
    (``blockdiag_cp_step``) must stay open through backward, where the ranks exchange
    K/V gradients and agree on kernel failures.
    """
    import megatron_ext.blockdiag_cp as bdcp
    import torch
    from megatron_ext.layers import packed_seq_params_for

    local, state, timing = get_batch(data_iterator)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if get_args().bf16 \
        else contextlib.nullcontext()
    with bdcp.blockdiag_cp_step(state):
        with autocast:
            output_tensor = model(local["tokens"], local["position_ids"], None,
                                  labels=local["labels"],
                                  packed_seq_params=packed_seq_params_for(state))
        yield output_tensor, functools.partial(loss_func, local["loss_mask"], state, timing)


if __name__ == "__main__":
    sys.exit(pretrain(train_dataset_provider, model_provider, forward_step,
                      plan_ahead_provider=plan_ahead_provider,
                      args_defaults={"data_cache_dir": str(REPO_ROOT / "data_cache"),
                                     "runs_dir": str(REPO_ROOT / "runs")}))
