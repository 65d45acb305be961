"""Megatron-LM's own ``pretrain_gpt.py`` with BlockDiagCPAttention: our flags and its checks.

Megatron-LM picks the layer with ``--spec megatron_ext.layers blockdiag_cp_gpt_layer_spec``
and needs nothing else: at model build the layer reads Megatron's ``--attention-backend`` and
``--cp-comm-type`` (see ``megatron_ext.layers.megatron_knobs``) and, through
``configure_from_args``, the Megatron-LM flags that never reach the ``TransformerConfig``.

Our own knobs need the one line Megatron-LM offers for extra flags::

    args = parse_and_validate_args(extra_args_provider=megatron_ext.megatron_lm.extra_args_provider,
                                   args_defaults={'tokenizer_type': 'GPT2BPETokenizer'})

which adds ``--cp-attn-backend --cp-kv-exchange --cp-layout --cp-kv-backward
--cp-ulysses-size --cp-relayout --cp-attn-backend-strict --cp-cost-model``. Bad values exit at parse time (argparse, code 2)
on every rank. Nothing else is to call: the model build applies them (``configure_from_args``
is public for scripts that want the check earlier).

What ``configure_from_args`` refuses, on every rank at model build (before any step), each
with an error naming the flags:

- document masking that would not reach every layer: ``--reset-attention-mask`` on the
  mask path with pipeline middle stages (PP >= 3, or PP = 2 with virtual stages: Megatron-LM's
  ``get_batch`` gives them no mask), or with ``--no-create-attention-mask-in-dataloader``;
  at CP > 1 the same without ``--reset-attention-mask`` (the layer has no documents there).
  The THD path, ``--dataloader-inter-document-masking``, delivers ``cu_seqlens`` to every
  stage and is the one to use;
- ``--cp-layout`` other than the layout Megatron-LM's data path cut (zigzag; TE's per-document
  ``thd`` for ``--sft``), ``--cp-cost-model`` other than auto (it steers the balanced layout,
  which Megatron-LM's data path cannot use), ``--hybrid-context-parallel``;
- ours and Megatron's flags naming different kernels or exchanges (in ``megatron_knobs``).

This module imports neither torch nor megatron at import time (the pretrain script shares
``add_blockdiag_cp_arguments`` and must exit on a bad flag in well under a second).
"""

import argparse
import sys
from typing import Callable, Dict, Optional, Tuple

from .blockdiag_cp import state as knobs

# Megatron-LM's flags that drive our knobs; "given" means on the command line (their defaults,
# auto and p2p, give way to ours).
MEGATRON_KNOB_FLAGS = ("--attention-backend", "--cp-comm-type")

# The Megatron-LM command-line flag of each TransformerConfig field our refusals name (None: the
# field has no flag, a config-only setting), read off Megatron-LM's parser (main branch,
# megatron-core 0.20: most flags are generated from TransformerConfig's fields, dashes for
# underscores). tests/megatron_lm/test_megatron_lm.py checks every entry against that parser: the flag exists
# and stores into MEGATRON_LM_ARG (or the field's own name), and a None field has no flag.
MEGATRON_LM_FLAGS = {
    "qk_clip": "--qk-clip",
    "log_max_attention_logit": "--log-max-attention-logit",
    "batch_invariant_mode": "--batch-invariant-mode",
    "deterministic_mode": "--deterministic-mode",
    "fp8_dot_product_attention": None,
    "attention_backend": "--attention-backend",
    "cp_comm_type": "--cp-comm-type",
    "context_parallel_size": "--context-parallel-size",
    "hierarchical_context_parallel_sizes": "--hierarchical-context-parallel-sizes",
    "softmax_type": "--softmax-type",
    "window_size": "--window-size",
    "experimental_attention_variant": "--experimental-attention-variant",
    "heterogeneous_block_specs": "--heterogeneous-layers-config-path",
    "mtp_num_layers": "--mtp-num-layers",
    "transformer_impl": "--transformer-impl",
    "use_kitchen_attention": "--use-kitchen-attention",
    "qk_layernorm": "--qk-layernorm",
    "qk_l2_norm": "--qk-l2-norm",
    "multi_latent_attention": "--multi-latent-attention",
    "moe_grouped_gemm": "--moe-grouped-gemm",
    "normalization": "--normalization",
    "use_te_activation_func": "--use-te-activation-func",
    "mla_down_proj_fusion": "--mla-down-proj-fusion",
    "use_grouped_gemm_for_dense_mlp": "--use-grouped-gemm-for-dense-mlp",
}
# Fields Megatron-LM sets from a differently named argument (the flag's argparse dest).
# (use_kitchen is not listed: Megatron-LM adds its kitchen flags only where kitchen imports.)
MEGATRON_LM_ARG = {"heterogeneous_block_specs": "heterogeneous_layers_config_path"}

_UNSET = object()

# Knob -> (value, the flag that set it, e.g. ``--cp-kv-exchange a2a``) for the values our flags pinned:
# the layer's Megatron values must agree with them.
_PINNED: Dict[str, Tuple[str, str]] = {}
# Megatron flags given on the command line of a Megatron-LM run ({"--cp-comm-type", ...}).
_MEGATRON_GIVEN: set = set()


def megatron_lm_flag(field: str) -> Optional[str]:
    """The Megatron-LM flag that sets ``TransformerConfig.<field>``, None where there is none."""
    return MEGATRON_LM_FLAGS.get(field)


def _as_typed(value) -> str:
    """A config value as it is written after its flag: ``a2a+p2p``, ``5 3`` for a pair, a name for an enum."""
    if isinstance(value, (list, tuple)):
        return " ".join(_as_typed(v) for v in value)
    return str(getattr(value, "name", value))


def config_field(field: str, value=_UNSET) -> str:
    """``TransformerConfig.cp_comm_type='a2a+p2p' (--cp-comm-type a2a+p2p)``: the field as a config user
    sets it and the flag as a Megatron-LM user typed it (a switch alone: ``(--qk-clip)``;
    ``(no Megatron-LM flag: ...)`` for config-only fields; fields not in MEGATRON_LM_FLAGS: the field)."""
    shown = getattr(value, "name", None) if hasattr(value, "name") and not isinstance(value, str) else None
    named = f"TransformerConfig.{field}" + ("" if value is _UNSET else f"={shown or repr(value)}")
    if field not in MEGATRON_LM_FLAGS:
        return named
    flag = MEGATRON_LM_FLAGS[field]
    if not flag:
        return f"{named} (no Megatron-LM flag: a config-only setting)"
    if value is not _UNSET and not isinstance(value, bool) and value is not None:
        flag = f"{flag} {_as_typed(value)}"
    return f"{named} ({flag})"


def _checked(normalize: Callable[[str], str]) -> Callable[[str], Optional[str]]:
    """argparse type: the canonical value, None for the default words; a bad value exits 2."""
    def parse(value: str) -> Optional[str]:
        if str(value).strip().lower() in ("", "auto", "default"):
            return None
        try:
            return normalize(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = normalize.__name__.replace("normalize_", "")  # argparse names it in errors
    return parse


def add_blockdiag_cp_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Our CP knobs as flags (one definition for Megatron-LM and for our pretrain script)."""
    g = parser.add_argument_group("block-diagonal CP attention (megatron_ext)")
    g.add_argument("--cp-attn-backend", default=None, type=_checked(knobs.normalize_attn_backend),
                   help="te | flash | dense, or a synonym (transformer_engine, flash_attn, sdpa...); "
                        "default: the engine's default with its fallbacks (under Megatron-LM: "
                        "--attention-backend's)")
    g.add_argument("--cp-kv-exchange", default=None, type=_checked(knobs.normalize_kv_exchange),
                   help="allgather | halo | a2a | hierarchical | ulysses, or a synonym; default: the engine's "
                        "default (under Megatron-LM: --cp-comm-type's, p2p -> halo, a2a -> ulysses); with "
                        "--cp-ulysses-size: the exchange between the Ulysses groups")
    g.add_argument("--cp-ulysses-size", default=None, type=_checked(knobs.normalize_ulysses_size),
                   help="two-dimensional CP: Ulysses (head-parallel) inside groups of this many consecutive "
                        "CP ranks (one node's), --cp-kv-exchange between the groups; default 1 (one "
                        "dimension; under Megatron-LM: --hierarchical-context-parallel-sizes' first with "
                        "--cp-comm-type a2a+p2p)")
    g.add_argument("--cp-layout", default=None, type=_checked(knobs.normalize_layout),
                   help="contiguous | zigzag | balanced, or a synonym; default: the engine's default "
                        "(under Megatron-LM the data path fixes it: zigzag, thd for --sft)")
    g.add_argument("--cp-kv-backward", default=None, type=_checked(knobs.normalize_kv_backward),
                   help="refetch | save | auto: backward exchanges the remote K/V again (memory "
                        "O(S/cp)) or keeps what forward received; default auto (save within a "
                        "memory budget)")
    g.add_argument("--cp-relayout", default=None, type=_checked(knobs.normalize_relayout),
                   help="none | balanced: balanced moves q/k/v from the batch's layout (zigzag, or TE's "
                        "per-document thd for --sft) to the balanced one for the attention and the output "
                        "back, so short documents stay whole on one rank; default none")
    g.add_argument("--cp-attn-backend-strict", action="store_true",
                   help="a backend/exchange fallback is an error instead of a logged downgrade")
    g.add_argument("--cp-cost-model", default="auto", choices=["auto", "nvlink", "ib"],
                   help="the topology the balanced layout's cost model assumes, with this model's heads "
                        "and head dim: auto = NVLink when the CP group sits on one node, two levels "
                        "(NVLink inside a node, InfiniBand between nodes, CP ranks per node from "
                        "LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE) when it spans nodes; nvlink / ib = "
                        "that one link for the whole group")
    return parser


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``parse_and_validate_args(extra_args_provider=...)``: adds our ``--cp-*`` flags."""
    return add_blockdiag_cp_arguments(parser)


def pin(knob: str, value: str, source: str) -> None:
    """Record that the user set ``knob`` (by ``source``, e.g. ``--cp-kv-exchange a2a``)."""
    _PINNED[knob] = (value, source)


def pinned(knob: str) -> Optional[Tuple[str, str]]:
    """(value, source) of ``knob`` where our flags pinned it, else None."""
    return _PINNED.get(knob)


def megatron_flag_given(flag: str) -> bool:
    """Whether this Megatron-LM run's command line gave Megatron's ``flag`` (e.g. ``--cp-comm-type``)."""
    return flag in _MEGATRON_GIVEN


def reset_pins(megatron_given=()) -> None:
    """Forget the pinned knobs (a new Megatron-LM argument set replaces them)."""
    _PINNED.clear()
    _MEGATRON_GIVEN.clear()
    _MEGATRON_GIVEN.update(megatron_given)


def _given_on_command_line(flags, argv=None):
    argv = sys.argv[1:] if argv is None else argv
    return {f for f in flags if any(a == f or a.startswith(f + "=") for a in argv)}


def _refuse(message: str):
    from .blockdiag_cp import BlockDiagCPError

    raise BlockDiagCPError(message)


def data_path_of(args) -> str:
    """Which of Megatron-LM's data paths reaches the layer: 'sft', 'thd' or 'mask'."""
    if getattr(args, "sft", False):
        return "sft"
    if getattr(args, "dataloader_inter_document_masking", False):
        return "thd"
    return "mask"


def _has_middle_stages(args) -> bool:
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    return pp * vp > 2


def check_data_path(args) -> None:
    """Refuse data paths on which some layer would get no documents (see the module docstring)."""
    path = data_path_of(args)
    cp = getattr(args, "context_parallel_size", 1) or 1
    if getattr(args, "hybrid_context_parallel", False):
        _refuse("--hybrid-context-parallel (per-sample CP groups) is not supported by "
                "BlockDiagCPAttention; drop it (our exchanges already move only the K/V each rank needs)")
    if path != "mask":
        return
    reset = bool(getattr(args, "reset_attention_mask", False))
    mask = bool(getattr(args, "create_attention_mask_in_dataloader", True))
    thd_hint = ("use --dataloader-inter-document-masking: it gives every layer the documents as THD "
                "cu_seqlens, on every pipeline stage")
    if _has_middle_stages(args) and (reset or cp > 1):
        pp = args.pipeline_model_parallel_size
        vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
        what = "--reset-attention-mask" if reset else f"--context-parallel-size {cp}"
        _refuse(f"{what} on the attention-mask path with pipeline middle stages "
                f"(--pipeline-model-parallel-size {pp}"
                f"{f', {vp} virtual stages' if vp else ''}): Megatron-LM's get_batch gives middle stages "
                "no attention mask, so their layers would " +
                ("attend across documents" if reset and cp == 1 else "have no documents") +
                f"; {thd_hint}")
    if not mask and (reset or cp > 1):
        what = "--reset-attention-mask" if reset else f"--context-parallel-size {cp}"
        _refuse(f"{what} with --no-create-attention-mask-in-dataloader: the layer gets neither the mask "
                "nor cu_seqlens, so it cannot find the documents; drop "
                f"--no-create-attention-mask-in-dataloader (the mask path) or {thd_hint}")


def configure_from_args(args) -> dict:
    """Apply our flags from Megatron-LM's parsed ``args`` and refuse what cannot run; the knobs in force.

    Idempotent; called by every BlockDiagCPAttention built under Megatron-LM. Megatron's own
    ``--attention-backend`` / ``--cp-comm-type`` are merged by the layer (megatron_knobs).
    """
    check_data_path(args)
    path = data_path_of(args)
    layout = getattr(args, "cp_layout", None)
    expected = "thd" if path == "sft" and (args.context_parallel_size or 1) > 1 else "zigzag"
    if layout is not None and layout != expected:
        _refuse(f"--cp-layout {layout}: Megatron-LM's get_batch_on_this_cp_rank cuts the batch before the "
                f"layer sees it ({expected} on this data path, "
                f"{'--sft' if path == 'sft' else '--dataloader-inter-document-masking' if path == 'thd' else 'the mask path'}"
                "), so no other layout can apply; drop --cp-layout (other layouts: megatron_ext's "
                "scripts/pretrain_gpt.py)")
    cost_model = getattr(args, "cp_cost_model", "auto")
    if cost_model not in (None, "auto"):
        _refuse(f"--cp-cost-model {cost_model} steers the balanced layout, which Megatron-LM's data path "
                "cannot use (its batch arrives cut zigzag); drop --cp-cost-model")
    reset_pins(_given_on_command_line(MEGATRON_KNOB_FLAGS))
    ours = {"attn_backend": getattr(args, "cp_attn_backend", None),
            "kv_exchange": getattr(args, "cp_kv_exchange", None),
            "ulysses_size": getattr(args, "cp_ulysses_size", None)}
    for knob, value in ours.items():
        if value is not None:
            pin(knob, value, f"--cp-{knob.replace('_', '-')} {value}")
    current = knobs.cp_varlen_runtime_config()
    knobs.configure_cp_varlen(ours["attn_backend"] or current["attn_backend"],
                              ours["kv_exchange"] or current["kv_exchange"])
    if ours["ulysses_size"] is not None:
        knobs.configure_cp_ulysses_size(ours["ulysses_size"])
    if hasattr(args, "cp_kv_backward"):  # our flags are present: they are the authority
        knobs.configure_cp_kv_backward(args.cp_kv_backward)
        knobs.configure_cp_relayout(getattr(args, "cp_relayout", None))
        knobs.configure_cp_strict(bool(args.cp_attn_backend_strict))
    return dict(knobs.cp_varlen_runtime_config(), **knobs.cp_kv_backward_runtime_config(),
                **knobs.cp_relayout_runtime_config(),
                **knobs.cp_strict_runtime_config())
