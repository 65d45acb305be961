"""Helpers for GPTModel tests on CPU/gloo: parallel-state setup, models, an independent reference.

Runs inside WorkerPool workers. The reference core attention is plain dense math
from reference.py over the FULL sequence's document ids (single process, no CP).
megatron-core is imported inside the functions, so importing this module needs none.
"""

import contextlib

import torch
import torch.distributed as dist

from .reference import reference_attention

EOD = 3
VOCAB = 64


def ensure_mpu(tp: int, cp: int):
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        if (mpu.get_tensor_model_parallel_world_size(), mpu.get_context_parallel_world_size()) == (tp, cp):
            return mpu
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    return mpu


_REF = {"doc_ids": None}


def make_reference_core_attention():
    from megatron.core.transformer.module import MegatronModule

    class ReferenceCoreAttention(MegatronModule):
        """Dense per-document causal attention over the full sequence (no CP).

        Honours what the model config asks of core attention the way megatron's own does:
        the layer's sliding window (``window_size`` where ``window_attn_skip_freq`` makes the
        layer windowed, megatron's rule re-spelled here), ``softmax_type`` with a
        ``softmax_offset`` of megatron's name and shape, MLA's ``k_channels`` / ``v_channels``
        and ``softmax_scale``.
        """

        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None,
                     k_channels=None, v_channels=None):
            super().__init__(config=config)
            window, skip = getattr(config, "window_size", None), getattr(config, "window_attn_skip_freq", None)
            windowed = bool(window) and (skip is None or (layer_number % skip != 0 if isinstance(skip, int)
                                                          else bool(skip[layer_number - 1])))
            self.window = window[0] if windowed else None
            self.scale = softmax_scale
            heads = config.num_attention_heads  # no TP in the reference
            kind = getattr(config, "softmax_type", "vanilla")
            if kind == "off-by-one":
                self.softmax_offset = torch.zeros(heads, dtype=config.params_dtype)
            elif kind == "learnable":
                self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
            else:
                self.softmax_offset = None

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            out = reference_attention(query, key, value, _REF["doc_ids"], scale=self.scale, window=self.window,
                                      sink=self.softmax_offset)
            return out.reshape(out.shape[0], out.shape[1], -1)

    return ReferenceCoreAttention


def megatron_batch_on_this_cp_rank(batch, cp_group, **options):
    """megatron-core's own ``get_batch_on_this_cp_rank`` on this rank, on every supported version.

    0.16 takes ``(batch, cp_group=None)``; 0.19 adds a required ``is_hybrid_cp`` (False here:
    plain CP) and options such as ``use_per_sequence_balancing``. The call is shaped by the
    installed function's signature; an option it does not have is an error naming the version.
    """
    import inspect

    import megatron.core
    from megatron.core.utils import get_batch_on_this_cp_rank

    params = inspect.signature(get_batch_on_this_cp_rank).parameters
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise TypeError(f"megatron-core {megatron.core.__version__}'s get_batch_on_this_cp_rank has no "
                        f"{unknown}; its parameters are {list(params)}")
    kwargs = {"cp_group": cp_group, **options}
    if "is_hybrid_cp" in params and "is_hybrid_cp" not in kwargs:
        kwargs["is_hybrid_cp"] = False
    return get_batch_on_this_cp_rank(batch, **kwargs)


def config(cp: int, tp: int = 1, layers: int = 2, hidden: int = 32, heads: int = 4, groups: int = 2,
           **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=2 * hidden, context_parallel_size=cp, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, **kw)


def gpt_model(cfg, spec, seq_len: int, seed: int = 1, position_embedding_type="learned_absolute"):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=seq_len, position_embedding_type=position_embedding_type,
                    share_embeddings_and_output_weights=False)


def reference_model(cfg_kwargs, seq_len, seed=1, **kw):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ext.layers.specs import torch_norms

    spec = torch_norms(get_gpt_layer_local_spec())
    spec.submodules.self_attention.submodules.core_attention = make_reference_core_attention()
    return gpt_model(config(cp=1, **cfg_kwargs), spec, seq_len, seed, **kw)


def make_batch(S: int, b: int, seed: int):
    """Random tokens with EOD-separated documents; the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, VOCAB, (b, S + 1), generator=g)
    eod = torch.rand(b, S + 1, generator=g) < 0.08
    tokens[eod] = EOD
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(b, S)}


def reference_loss_and_grads(ref, batch, doc_ids):
    """Mean token loss and parameter grads of the full sequence on one process."""
    _REF["doc_ids"] = doc_ids
    S = batch["tokens"].shape[1]
    pos = torch.arange(S).unsqueeze(0).expand_as(batch["tokens"])
    losses = ref(batch["tokens"], pos, None, labels=batch["labels"])
    loss = (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    ref.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def cp_loss(model, local, state, total_tokens, carry_state=True):
    """``carry_state``: pass the state in packed_seq_params (False: the step context publishes it;
    megatron's MLA reads any packed_seq_params as a THD batch)."""
    from megatron_ext.layers import packed_seq_params_for

    losses = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                   packed_seq_params=packed_seq_params_for(state) if carry_state else None)
    return (losses * local["loss_mask"]).sum() / total_tokens


def cp_step_errors(model, batch, group, layout, exchange, ref_loss, ref_grads, carry_state=True):
    """One CP step of ``model``; (loss rel. error, max grad rel. error, state) vs the reference."""
    import megatron_ext.blockdiag_cp as bdcp

    local, state = bdcp.shard_batch(batch, cp_group=group, layout=layout, eod_token=EOD,
                                    attn_backend="dense", kv_exchange=exchange)
    model.zero_grad()
    with bdcp.blockdiag_cp_step(state):
        loss = cp_loss(model, local, state, batch["loss_mask"].sum(), carry_state)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = cp_reduced_grads(model, group)
    return rel(total, ref_loss), max(rel(grads[n], ref_grads[n]) for n in ref_grads), state


def cp_reduced_grads(model, group):
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=group)
        grads[n] = g
    return grads


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@contextlib.contextmanager
def cuda_calls_on_cpu():
    """``torch.cuda.current_device()`` answers the CPU and ``Tensor.cuda()`` stays put, inside the block.

    Only CUDA calls: megatron's MLA builds its RoPE on the current CUDA device and moves its
    CP index to the GPU from pinned memory (``megatron_lm.cuda_tensors_on_cpu``'s function mode).
    """
    from .megatron_lm import cuda_tensors_on_cpu

    saved = torch.cuda.current_device, torch.Tensor.cuda
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        with cuda_tensors_on_cpu():
            yield
    finally:
        torch.cuda.current_device, torch.Tensor.cuda = saved


@contextlib.contextmanager
def cpu_tensor_parallel_checkpoint():
    """megatron's ``tensor_parallel.checkpoint`` replaced by torch's reentrant checkpoint.

    Megatron's saves and restores the CUDA RNG state; torch's recomputes inside backward
    exactly like it, on CPU. Selective recompute (``_checkpointed_attention_forward``) calls
    it through the module attribute, so the swap reaches every layer.
    """
    import torch
    from megatron.core import tensor_parallel

    def checkpoint(function, distribute_saved_activations, *args):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)

    original = tensor_parallel.checkpoint
    tensor_parallel.checkpoint = checkpoint
    try:
        yield
    finally:
        tensor_parallel.checkpoint = original
