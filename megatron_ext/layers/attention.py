"""BlockDiagCPAttention: megatron-core core attention for packed documents under CP."""

import contextlib
import dataclasses
import math
from typing import Any, Dict, Optional, Tuple

from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from .. import parallel_state as ps
from ..blockdiag_cp import BlockDiagCPError, WindowMix, blockdiag_cp_attention
from ..megatron_lm import config_field, megatron_lm_flag
from ..blockdiag_cp.resolve import resolve_step_state

from . import megatron_knobs

# Causal within each document is what the plan computes; Megatron's padding_causal (THD, SFT)
# is the same here, padding being positions outside every document.
SUPPORTED_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


@dataclasses.dataclass(frozen=True)
class ConfigRule:
    """What BlockDiagCPAttention does with one TransformerConfig field.

    ``allowed`` empty: honoured (used, or it cannot change the result), ``how`` says which.
    Otherwise only these values are accepted and any other is refused at construction with
    an error naming the field, its Megatron-LM flag (``megatron_lm.MEGATRON_LM_FLAGS``) and
    ``how`` (why, and what to do).
    """

    how: str
    allowed: Tuple[Any, ...] = ()

    @property
    def honoured(self) -> bool:
        return not self.allowed


def _honoured(how: str) -> ConfigRule:
    return ConfigRule(how)


def _refused_unless(*allowed, why: str) -> ConfigRule:
    return ConfigRule(why, tuple(allowed))


# Every TransformerConfig field megatron-core's DotProductAttention and TEDotProductAttention read
# (tests/layers/test_layer_config.py walks their source and fails on a field missing here), and the
# Megatron attention fields the layer maps to its knobs. To lift a refusal, make it honoured.
CORE_ATTENTION_CONFIG: Dict[str, ConfigRule] = {
    "num_attention_heads": _honoured("query heads, split over the TP group"),
    "num_query_groups": _honoured("K/V heads (GQA), split over the TP group"),
    "kv_channels": _honoured("the head dim (k_channels / v_channels override it, as megatron's MLA "
                             "passes them)"),
    "tensor_model_parallel_size": _honoured("heads per partition come from the TP group"),
    "context_parallel_size": _honoured("checked against the CP group at construction and per call"),
    "sequence_parallel": _honoured("as megatron's and TE's core attention: attention dropout runs in the "
                                   "model-parallel RNG fork unless sequence parallel"),
    "attention_dropout": _honoured("dropout inside the kernel, drawn in megatron's model-parallel RNG "
                                   "fork (each TP rank's heads drop independently)"),
    "apply_query_key_layer_scaling": _honoured("divides and re-multiplies the scores by layer_number: "
                                               "the net softmax scale is unchanged (our softmax is fp32)"),
    "attention_softmax_in_fp32": _honoured("our kernels always take the softmax in fp32"),
    "masked_softmax_fusion": _honoured("a fusion choice of megatron's own softmax; no effect here"),
    "fp16": _honoured("the kernels run in q/k/v's dtype"),
    "bf16": _honoured("the kernels run in q/k/v's dtype"),
    "params_dtype": _honoured("the softmax offset's dtype, as megatron's"),
    "init_method": _honoured("initializes the learnable softmax offset, as megatron's"),
    "perform_initialization": _honoured("whether the learnable softmax offset is initialized, as megatron's"),
    "attention_backend": _honoured("mapped to our attention backend (flash -> flash, fused -> te, "
                                   "unfused -> dense, auto -> ours); local is refused (megatron_knobs)"),
    "cp_comm_type": _honoured("mapped to our K/V exchange (p2p -> halo, a2a -> ulysses, allgather -> "
                              "allgather, a2a+p2p -> two-dimensional: ulysses_size u of "
                              "hierarchical_context_parallel_sizes [u, r], halo between the groups); a "
                              "per-layer list naming several is refused (megatron_knobs)"),
    "softmax_type": _honoured("vanilla; off-by-one and learnable attention sinks: megatron's "
                              "softmax_offset (name, shape, init, TP sharding) as one more logit in every "
                              "row's denominator, applied once per row after the chunks' lse merge"),
    "window_size": _honoured("sliding window (left, 0) within each document; the plan moves only the "
                             "keys inside the windows (a right reach other than 0 is refused at "
                             "construction)"),
    "window_attn_skip_freq": _honoured("which layers are windowed, as megatron's is_layer_window_attention"),
    "qk_clip": _refused_unless(
        False, why="QK-clip needs the max pre-softmax logit per head, which our kernels do not return "
                   "(megatron's clip_qk() would find no current_max_attn_logits)"),
    "log_max_attention_logit": _refused_unless(
        False, why="the max attention logit per head is not computed by our kernels"),
    "batch_invariant_mode": _refused_unless(
        False, why="our kernels (and the K/V exchange) are not batch invariant"),
    "deterministic_mode": _refused_unless(
        False, why="the K/V exchange's backward (index_add over received rows) and the TE/flash "
                   "backward kernels are not bitwise deterministic on GPUs"),
    "fp8_dot_product_attention": _refused_unless(
        False, why="our kernels compute attention in q/k/v's dtype, never fp8"),
}

_MISSING = object()


def check_core_attention_config(config) -> None:
    """Refuse, naming the field and its Megatron-LM flag, every config value BlockDiagCPAttention
    would ignore or cannot compute.

    Fields an installed megatron-core does not have are skipped.
    """
    for field, rule in CORE_ATTENTION_CONFIG.items():
        if rule.honoured:
            continue
        value = getattr(config, field, _MISSING)
        if value is _MISSING or value in rule.allowed:
            continue
        flag = megatron_lm_flag(field)
        fix = (f"drop {flag} (TransformerConfig.{field}={rule.allowed[0]!r})" if flag
               else f"set TransformerConfig.{field}={rule.allowed[0]!r}")
        raise BlockDiagCPError(
            f"{config_field(field, value)} is not supported by BlockDiagCPAttention: {rule.how}; "
            f"{fix}, or use megatron's own core attention without CP")
    if getattr(config, "softmax_type", "vanilla") not in SOFTMAX_TYPES:
        raise BlockDiagCPError(f"{config_field('softmax_type', config.softmax_type)} is not one of "
                               f"{SOFTMAX_TYPES}")
    _check_window_config(getattr(config, "window_size", None))


def _check_window_config(window) -> None:
    """A sliding window must be causal (right reach 0): refused at construction, not at the first step."""
    from ..blockdiag_cp.attention_op import window_from

    _, error = window_from(window)
    if error:
        raise BlockDiagCPError(f"{config_field('window_size', window)}: {error}; give --window-size L 0 "
                               "(window_size=(L, 0))")


SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def layer_window_size(config, layer_number: int):
    """The window this layer uses: config.window_size where window_attn_skip_freq makes it windowed.

    megatron-core's own rule (``is_layer_window_attention``): no window_size -> none; no skip
    frequency -> every layer; an int N -> every layer but each N-th (1-based); a list -> its 0/1.
    """
    window, skip = getattr(config, "window_size", None), getattr(config, "window_attn_skip_freq", None)
    try:
        from megatron.core.transformer.utils import is_layer_window_attention
    except ImportError:  # older megatron-core: the same rule, spelled here
        is_layer_window_attention = None
    if is_layer_window_attention is not None:
        return window if is_layer_window_attention(window, skip, layer_number) else None
    if not window:
        return None
    if skip is None:
        return window
    if isinstance(skip, int):
        return window if layer_number % skip != 0 else None
    return window if skip[layer_number - 1] else None


def window_mix_from_config(config) -> WindowMix:
    """A megatron TransformerConfig's layers (``window_size``, ``window_attn_skip_freq``, ``num_layers``)
    as the planner prices them, by megatron's own rule for which layers are windowed
    (``layer_window_size``)."""
    layers = int(getattr(config, "num_layers", 0) or 0)
    if layers < 1:
        raise ValueError(f"window_mix_from_config: the config has num_layers={layers!r}")
    return WindowMix.from_layers([layer_window_size(config, n) for n in range(1, layers + 1)])


def _model_windows(config):
    """The config's layers' windows as the planner takes them (``cost.WindowMix``); None (planned as
    full attention) when the config gives no layer count or a window the op refuses: the layer's
    own call raises the error that names it (a non-causal window_size, say)."""
    if not getattr(config, "window_size", None):
        return WindowMix()
    if not int(getattr(config, "num_layers", 0) or 0):
        return None
    try:
        return window_mix_from_config(config)
    except ValueError:
        return None


class BlockDiagCPAttention(MegatronModule):
    """Per-document causal core attention; with CP > 1 it exchanges K/V over the CP group.

    Drop-in for megatron-core's ``DotProductAttention``: same constructor, same
    forward, query [sq, b, np, hn] -> output [sq, b, np * hn] (THD: [t, np, hn] ->
    [t, np * hn]). The step state is resolved per microbatch, in this order: ours
    in ``packed_seq_params.blockdiag_state``; one built from THD ``packed_seq_params``;
    one derived from Megatron's per-document causal ``attention_mask``; the state
    published by ``blockdiag_cp_step``. Self-attention with a causal mask type only.

    At construction: every config field megatron's core attentions read is honoured or
    refused (``CORE_ATTENTION_CONFIG``); ``k_channels`` / ``v_channels`` (what megatron's MLA
    passes) set the q/k and v head dims, which may differ; ``window_size`` /
    ``window_attn_skip_freq`` give this layer's sliding window; ``softmax_type`` makes
    megatron's ``softmax_offset`` (attention sinks); Megatron's ``attention_backend`` /
    ``cp_comm_type`` set our knobs (``megatron_knobs``). Attention dropout runs inside
    megatron's model-parallel RNG fork, as megatron's own.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ):
        super().__init__(config=config)
        self.config = config
        self.layer_number = max(1, layer_number)
        check_core_attention_config(config)
        self._check_mask_type(attn_mask_type)
        if attention_type != "self":
            raise BlockDiagCPError(
                f"BlockDiagCPAttention is self-attention only (attention_type={attention_type!r}); "
                "use megatron's own core attention for cross attention")
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type
        # Megatron's --attention-backend / --cp-comm-type (and, under Megatron-LM, our --cp-* flags)
        # set the process-wide knobs now, so cp_varlen_runtime_config() reports them once built.
        megatron_knobs.apply_megatron_knobs(config, cp_comm_type)
        self.k_channels, self.v_channels = k_channels, v_channels

        tp_size = pg_collection.tp.size() if pg_collection is not None and hasattr(pg_collection, "tp") \
            else ps.get_tp_world_size()
        self.tp_group = pg_collection.tp if pg_collection is not None and hasattr(pg_collection, "tp") \
            else ps.get_tp_group()
        self.cp_group = pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp") \
            else None
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.hidden_size_per_attention_head = k_channels if k_channels is not None else divide(
            config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        # query-key layer scaling divides the scores by layer_number and multiplies them back
        # inside the fp32 softmax (megatron's FusedScaleMaskSoftmax): the net scale is unchanged,
        # and our kernels always take the softmax in fp32.
        if softmax_scale is None:
            softmax_scale = getattr(config, "softmax_scale", None)
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head)
                              if softmax_scale is None else softmax_scale)
        self.attention_dropout_p = config.attention_dropout if attention_dropout is None \
            else attention_dropout
        self.window_size = layer_window_size(config, self.layer_number)
        # Every layer's window (the model's mix): a state derived from this batch records it.
        self.model_windows = _model_windows(config)
        self._make_softmax_offset()
        self._check_cp_size()

    def _make_softmax_offset(self) -> None:
        """megatron's ``softmax_offset``: the same name, shape [heads per TP rank], dtype and init.

        vanilla: None; off-by-one: a zero tensor (no parameter, not in the state dict);
        learnable: a parameter, ``config.init_method`` when ``perform_initialization``.
        """
        import torch

        kind = getattr(self.config, "softmax_type", "vanilla")
        shape = (self.num_attention_heads_per_partition,)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        dtype = self.config.params_dtype
        if kind == "vanilla":
            self.softmax_offset = None
        elif kind == "off-by-one":
            self.softmax_offset = torch.zeros(shape, device=device, dtype=dtype)
        else:
            self.register_parameter("softmax_offset", torch.nn.Parameter(torch.empty(shape, device=device,
                                                                                    dtype=dtype)))
            if self.config.perform_initialization:
                self.softmax_offset = self.config.init_method(self.softmax_offset)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The learnable softmax offset sharded over TP on dim 0, as megatron's core attention."""
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return DotProductAttention.sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def _group(self):
        return self.cp_group if self.cp_group is not None else ps.get_cp_group()

    def _check_cp_size(self) -> None:
        group = self._group()
        size = ps.group_size(group)
        if group is None and self.config.context_parallel_size > 1:
            ps.require_cp_group()  # raises: CP asked for, no process group
        if group is not None and size != self.config.context_parallel_size:
            raise BlockDiagCPError(
                f"{config_field('context_parallel_size', self.config.context_parallel_size)} but the "
                f"CP process group has {size} ranks; initialize parallel_state with "
                f"context_parallel_size={self.config.context_parallel_size} or fix the config")

    @staticmethod
    def _check_mask_type(attn_mask_type) -> None:
        if attn_mask_type is not None and attn_mask_type not in SUPPORTED_MASK_TYPES:
            raise BlockDiagCPError(
                f"BlockDiagCPAttention computes causal attention within each document; "
                f"attn_mask_type={attn_mask_type} is not supported (supported: "
                f"{', '.join(t.name for t in SUPPORTED_MASK_TYPES)}). Bidirectional (no_mask, padding) "
                "and arbitrary masks need megatron's own core attention")

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise BlockDiagCPError("attention_bias is not supported by BlockDiagCPAttention")
        self._check_mask_type(attn_mask_type)
        group = self._group()
        self._check_cp_size()
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:  # megatron squeezed the batch dim: [t, h, d] -> [t, 1, h, d]
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        state = resolve_step_state(packed_seq_params, attention_mask, cp_group=group,
                                   local_tokens=query.shape[0], batch=query.shape[1], device=query.device,
                                   windows=self.model_windows)
        if state is not None and state.cp > 1:
            self._check_state_group(state, group)
            self._check_mla_layout(state)
        dropout_p = self.attention_dropout_p if self.training else 0.0
        # The op draws its dropout seed from the device's default generator (and replays it in
        # backward and recompute); inside megatron's fork that generator holds this TP rank's
        # model-parallel state, so each TP rank's heads drop independently.
        with self._dropout_rng(dropout_p, query.device):
            out = blockdiag_cp_attention(query, key, value, softmax_scale=self.softmax_scale,
                                         dropout_p=dropout_p, state=state, cp_group=group,
                                         window_size=self.window_size, softmax_offset=self.softmax_offset)
        sq, b, np_, hn = out.shape
        if thd:
            return out.reshape(sq, np_ * hn)  # [t, np * hn]; megatron adds the batch dim back
        return out.reshape(sq, b, np_ * hn)  # [sq, b, np * hn]

    def _dropout_rng(self, dropout_p: float, device):
        """Megatron's model-parallel RNG fork, where megatron's core attentions take it.

        Only with dropout, when the tracker is initialized, not under sequence parallelism, and on
        CUDA (megatron's tracker holds CUDA generator states). That is both of megatron's: its
        DotProductAttention forks only ``if not config.sequence_parallel``; TEDotProductAttention
        hands TE ``sequence_parallel=config.sequence_parallel`` and the tracker when initialized,
        and TE's DotProductAttention forks around dropout unless ``sequence_parallel`` or no
        tracker. Under sequence parallelism the default generator, which megatron seeds alike on
        every TP rank, draws the mask (tests/layers/test_layer_config.py runs megatron's own layer beside).
        """
        if dropout_p == 0.0 or self.config.sequence_parallel or not rng_tracker_applies(device):
            return contextlib.nullcontext()
        from megatron.core import tensor_parallel

        return tensor_parallel.get_cuda_rng_tracker().fork()

    def _check_mla_layout(self, state) -> None:
        # megatron's MLA applies its RoPE inside attention, slicing positions as megatron's data path
        # cuts the batch (zigzag, or TE's THD partition): any other layout would rotate by wrong positions.
        if self.k_channels is not None and self.v_channels is not None and state.layout.name not in ("zigzag",
                                                                                                     "thd"):
            raise BlockDiagCPError(
                f"multi-latent attention with the {state.layout.name!r} layout: megatron's MLA rotates q/k "
                "by positions sliced zigzag inside its attention, so under CP it needs layout 'zigzag' "
                "(or THD batches); shard the batch with layout='zigzag'")

    @staticmethod
    def _check_state_group(state, group) -> None:
        import torch.distributed as dist

        if group is None or dist.get_process_group_ranks(state.group) != dist.get_process_group_ranks(group):
            theirs = "no group" if group is None else dist.get_process_group_ranks(group)
            raise BlockDiagCPError(
                f"the step state was built for CP ranks {dist.get_process_group_ranks(state.group)} "
                f"but this layer's CP group is {theirs}; build the state with this model's CP group "
                "(shard_batch(..., cp_group=parallel_state.get_context_parallel_group()))")


def tracker_device(device) -> bool:
    """Whether megatron's RNG tracker holds generator states for ``device`` (CUDA's only)."""
    return device.type == "cuda"


def rng_tracker_applies(device) -> bool:
    """Whether megatron's model-parallel RNG state is set up, for ``device``."""
    from megatron.core.tensor_parallel import random

    tracker = random.get_cuda_rng_tracker()
    return (tracker_device(device) and tracker.is_initialized()
            and random._MODEL_PARALLEL_RNG_TRACKER_NAME in tracker.get_states())
