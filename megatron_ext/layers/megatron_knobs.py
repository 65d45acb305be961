"""Megatron's own attention flags drive our knobs, at model build.

A Megatron user already says which attention kernel and which CP exchange they want:
``TransformerConfig.attention_backend`` (``--attention-backend``) and ``cp_comm_type``
(``--cp-comm-type``). ``BlockDiagCPAttention`` reads them when it is built and sets the
process-wide knobs of ``megatron_ext.blockdiag_cp.state`` from them, so that after the
model is built ``cp_varlen_runtime_config()`` reports the knobs in force:

==========================  ==================================================
Megatron's value            our knob
==========================  ==================================================
attention_backend flash     attn_backend ``flash``
attention_backend fused     attn_backend ``te`` (TE's fused attention)
attention_backend unfused   attn_backend ``dense`` (unfused math)
attention_backend auto      our default (te -> flash -> dense)
attention_backend local     refused: it swaps our core attention for megatron's
cp_comm_type allgather      kv_exchange ``allgather`` (also ``all_gather``)
cp_comm_type a2a            kv_exchange ``ulysses`` (Megatron's a2a: heads scattered over the CP group,
                            DeepSpeed-Ulysses); ours that moves only the needed rows is ``a2a``
cp_comm_type p2p            kv_exchange ``halo`` (the closest: neighbour p2p)
cp_comm_type a2a+p2p        two-dimensional CP: ulysses_size ``u`` of ``hierarchical_context_parallel_sizes
                            [u, r]`` (``--hierarchical-context-parallel-sizes u r``; Ulysses inside groups of
                            u consecutive CP ranks) and kv_exchange ``halo`` between the r groups (p2p's)
==========================  ==================================================

Ours win where the user set them (``--cp-attn-backend`` / ``--cp-kv-exchange`` through
``megatron_ext.megatron_lm.extra_args_provider``, or ``configure_cp_varlen`` in Python):
when Megatron's value was given too and maps to something else, the build is refused
with an error naming both. Megatron's ``auto`` and its ``--cp-comm-type`` default ``p2p``
count as given only when the flag is on the command line.

Under Megatron-LM (its parsed arguments are set), the flags that never reach the
``TransformerConfig`` (ours, ``--reset-attention-mask``, the pipeline layout of the
data path) are checked by ``megatron_ext.megatron_lm.configure_from_args`` at the same
moment: every rank builds the model, so every rank refuses alike before any step.
"""

import sys
from typing import Dict, Optional, Tuple

from ..blockdiag_cp import BlockDiagCPError
from ..blockdiag_cp import state as knobs
from .. import megatron_lm
from ..megatron_lm import config_field

ATTENTION_BACKEND_TO_OURS: Dict[str, Optional[str]] = {
    "flash": "flash", "fused": "te", "unfused": "dense", "auto": None}
CP_COMM_TYPE_TO_OURS: Dict[str, str] = {"p2p": "halo", "a2a": "ulysses", "allgather": "allgather",
                                        "all_gather": "allgather", "a2a+p2p": "halo"}

# Knob -> the value this module last set from Megatron's config (replaced on the next build).
_APPLIED: Dict[str, str] = {}


def megatron_lm_args():
    """Megatron-LM's parsed arguments when this process runs under Megatron-LM, else None.

    Read from ``megatron.training.global_vars`` only if Megatron-LM already imported it:
    megatron-core users (and this package) never import megatron.training.
    """
    module = sys.modules.get("megatron.training.global_vars")
    return getattr(module, "_GLOBAL_ARGS", None) if module is not None else None


def attention_backend_name(config) -> str:
    value = getattr(config, "attention_backend", None)
    if value is None:
        return "auto"
    return getattr(value, "name", str(value)).split(".")[-1].lower()


def layer_cp_comm_type(config, cp_comm_type) -> Optional[str]:
    """The layer's cp_comm_type; a per-layer list is honoured when it names one exchange (ours is per
    process: one step state, one exchange for every layer) and refused, layer by layer, otherwise."""
    listed = getattr(config, "cp_comm_type", None)
    if isinstance(listed, (list, tuple)):
        distinct = list(dict.fromkeys(str(v) for v in listed))  # in layer order
        if len(distinct) > 1:
            layers = {v: [str(i + 1) for i, w in enumerate(listed) if str(w) == v] for v in distinct}
            per_layer = "; ".join(f"layer{'s' if len(n) > 1 else ''} {', '.join(n)}: {v}" for v, n in layers.items())
            raise BlockDiagCPError(
                f"{config_field('cp_comm_type', list(listed))} gives layers different "
                f"CP exchanges ({per_layer}); BlockDiagCPAttention runs one exchange for every layer of a "
                "process (one step state per micro batch), so every layer but those of the first value is "
                "refused: give one --cp-comm-type (or --cp-kv-exchange)")
        if cp_comm_type is None and distinct:
            cp_comm_type = distinct[0]
    elif cp_comm_type is None:
        cp_comm_type = listed
    return None if cp_comm_type is None else str(cp_comm_type).strip().lower()


def megatron_knob_values(config, cp_comm_type) -> Dict[str, Tuple[Optional[str], str, bool]]:
    """knob -> (our value or None, Megatron's flag as the user wrote it, given explicitly?)."""
    backend = attention_backend_name(config)
    if backend == "local":
        raise BlockDiagCPError(
            f"{config_field('attention_backend', 'local')} replaces the core "
            "attention with megatron's own DotProductAttention, so BlockDiagCPAttention would not run: "
            "drop --attention-backend local (use flash | fused | unfused | auto to pick our kernel)")
    if backend not in ATTENTION_BACKEND_TO_OURS:
        raise BlockDiagCPError(
            f"{config_field('attention_backend', backend)} has no counterpart in "
            f"BlockDiagCPAttention; use one of {sorted(ATTENTION_BACKEND_TO_OURS)} or --cp-attn-backend")
    exchange = layer_cp_comm_type(config, cp_comm_type)
    if exchange is not None and exchange not in CP_COMM_TYPE_TO_OURS:
        raise BlockDiagCPError(
            f"{config_field('cp_comm_type', exchange)} is not supported by "
            f"BlockDiagCPAttention; use p2p | a2a | allgather | a2a+p2p, or --cp-kv-exchange")
    ulysses_size = _two_dim_size(config) if exchange == "a2a+p2p" else None
    sizes = getattr(config, "hierarchical_context_parallel_sizes", None)
    return {
        "ulysses_size": (ulysses_size, f"--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes "
                                       f"{' '.join(str(x) for x in sizes or ())}", ulysses_size is not None),
        "attn_backend": (ATTENTION_BACKEND_TO_OURS[backend], f"--attention-backend {backend}",
                         backend != "auto" or megatron_lm.megatron_flag_given("--attention-backend")),
        "kv_exchange": (None if exchange is None else CP_COMM_TYPE_TO_OURS[exchange],
                        f"--cp-comm-type {exchange}",
                        exchange not in (None, "p2p") or megatron_lm.megatron_flag_given("--cp-comm-type")),
    }


def _two_dim_size(config) -> int:
    """Megatron's a2a+p2p: the Ulysses size u of hierarchical_context_parallel_sizes [u, r] (u * r = cp)."""
    sizes = getattr(config, "hierarchical_context_parallel_sizes", None)
    cp = getattr(config, "context_parallel_size", 1) or 1
    if not sizes or len(sizes) != 2 or sizes[0] * sizes[1] != cp or min(sizes) < 1:
        raise BlockDiagCPError(
            f"{config_field('cp_comm_type', 'a2a+p2p')} is two-dimensional CP: Ulysses inside groups of u "
            f"consecutive CP ranks, p2p between the r groups, so it needs "
            f"{config_field('hierarchical_context_parallel_sizes')} = [u, r] with u * r = "
            f"context_parallel_size ({cp}); got {list(sizes) if sizes else sizes}")
    return int(sizes[0])


_OUR_FLAG = {"attn_backend": "--cp-attn-backend", "kv_exchange": "--cp-kv-exchange", "ulysses_size": "--cp-ulysses-size"}
_DEFAULT = {"attn_backend": knobs.ATTN_BACKEND_DEFAULT, "kv_exchange": knobs.KV_EXCHANGE_DEFAULT,
            "ulysses_size": knobs.ULYSSES_SIZE_DEFAULT}
_CONFIGURE = {"attn_backend": "configure_cp_varlen", "kv_exchange": "configure_cp_varlen",
              "ulysses_size": "configure_cp_ulysses_size"}


def _current() -> Dict[str, str]:
    return dict(knobs.cp_varlen_runtime_config(), **knobs.cp_ulysses_size_runtime_config())


def apply_megatron_knobs(config, cp_comm_type=None) -> Dict[str, str]:
    """Set our knobs from Megatron's config (and Megatron-LM's arguments); refuse conflicts.

    Returns the knobs in force (``cp_varlen_runtime_config()`` and the Ulysses size). Raises BlockDiagCPError,
    naming the flags, for Megatron values we cannot honour and for ours and Megatron's
    disagreeing.
    """
    args = megatron_lm_args()
    if args is not None:
        megatron_lm.configure_from_args(args)  # only under Megatron-LM: its flags beyond the config
    megatron = megatron_knob_values(config, cp_comm_type)
    current = _current()
    target = dict(current)
    pinned_now = set()
    for knob, (mapped, megatron_flag, given) in megatron.items():
        pinned = megatron_lm.pinned(knob)
        if pinned is None and current[knob] != _DEFAULT[knob] and current[knob] != _APPLIED.get(knob):
            pinned = (current[knob], f"{_CONFIGURE[knob]}({knob}={current[knob]!r})")
        if pinned is not None:
            pinned_now.add(knob)
            if given and mapped is not None and mapped != pinned[0]:
                raise BlockDiagCPError(
                    f"{pinned[1]} (ours: {knob} {pinned[0]!r}) and {megatron_flag} (Megatron's: maps to "
                    f"{mapped!r}) disagree; give one of them, or the same choice in both "
                    f"({_OUR_FLAG[knob]} {mapped} or drop {megatron_flag.split()[0]})")
            target[knob] = pinned[0]
        elif mapped is not None:
            target[knob] = mapped
        elif current[knob] == _APPLIED.get(knob):
            target[knob] = _DEFAULT[knob]  # an earlier model's Megatron value no longer applies
    if target != current:
        knobs.configure_cp_varlen(target["attn_backend"], target["kv_exchange"])
        knobs.configure_cp_ulysses_size(target["ulysses_size"])
    for knob, (mapped, _, _) in megatron.items():  # remember what Megatron's values set, only that
        if knob in pinned_now:
            continue
        if mapped is not None:
            _APPLIED[knob] = mapped
        else:
            _APPLIED.pop(knob, None)
    return _current()
