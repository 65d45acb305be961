"""Runtime knobs and activation-checkpoint-safe state for block-diagonal CP.

A dependency-free leaf: nothing here imports torch or the rest of the project, so
any consumer (the kernel-side ``configure_cp_varlen`` entry point, a policy-side
config parser, the pretrain script's flag validation) derives the accepted values
from the same tables and can never disagree on synonyms or defaults.

Knob values are cleaned (strip, lower case, '-' -> '_') and looked up in a
synonym table; ``None``, ``""``, ``"auto"`` and ``"default"`` mean the default.
The configured knobs live in plain module globals holding canonical strings
(``_CP_ATTN_BACKEND``, ``_CP_KV_EXCHANGE``, ``_CP_LAYOUT``): readers look them up
at call time (``state._CP_ATTN_BACKEND``), never bind them by ``from ... import``.

The one intended difference from the upstream module this documents: the default
attention backend is ``te`` (TransformerEngine fused attention, the Megatron
default), falling back te -> flash -> dense; the layout knob is ours.
"""

import threading
from typing import Any, Dict, Tuple

# ---------------------------------------------------------------------------
# Knob tables (dict order is the fallback order: te -> flash -> dense)
# ---------------------------------------------------------------------------

ATTN_BACKEND_DEFAULT = "te"
ATTN_BACKEND_SYNONYMS: Dict[str, Tuple[str, ...]] = {
    "te": ("te", "transformer_engine", "transformerengine"),
    "flash": ("flash", "flash_attn", "flash_attention", "flash_attention_2", "fa2"),
    "dense": ("dense", "sdpa", "torch_sdpa"),
}
ATTN_BACKEND_VALUES: Tuple[str, ...] = tuple(ATTN_BACKEND_SYNONYMS)

KV_EXCHANGE_DEFAULT = "allgather"
KV_EXCHANGE_SYNONYMS: Dict[str, Tuple[str, ...]] = {
    "allgather": ("allgather", "all_gather"),
    "halo": ("halo", "neighbor", "needed", "needed_only"),
    "a2a": ("a2a", "a2av", "all_to_all", "alltoall", "needed_a2a"),
    # Ours: the needed rows through two-level routes (a node's remote rows cross nodes once).
    "hierarchical": ("hierarchical", "hier", "two_level", "node_aware"),
    # Ours: head-parallel CP (DeepSpeed-Ulysses): q/k/v to head shards and the output back by
    # all-to-all, no K/V exchange.
    "ulysses": ("ulysses", "heads", "head_parallel", "a2a_heads", "deepspeed_ulysses"),
    # Ours: each step takes the exchange (and two-dimensional split) of least modeled time for its
    # documents (megatron_ext.blockdiag_cp.cost_options), decided from the global tables.
    "planned": ("planned", "cheapest", "least_time", "by_cost"),
}
KV_EXCHANGE_VALUES: Tuple[str, ...] = tuple(KV_EXCHANGE_SYNONYMS)

LAYOUT_DEFAULT = "zigzag"
LAYOUT_SYNONYMS: Dict[str, Tuple[str, ...]] = {
    "contiguous": ("contiguous", "sequential", "contig", "block"),
    "zigzag": ("zigzag", "zig_zag", "megatron", "load_balanced_zigzag"),
    "balanced": ("balanced", "load_balanced", "doc_balanced", "document_balanced"),
    "thd": ("thd", "te_thd", "dual_chunk_swap", "per_document", "per_document_zigzag"),
}
LAYOUT_VALUES: Tuple[str, ...] = tuple(LAYOUT_SYNONYMS)

# How a THD batch was cut across the CP ranks (Megatron's two partitions); "auto" decides from
# cu_seqlens_q_padded (see megatron_ext.blockdiag_cp.resolve). Ours, beside the documented knobs.
THD_PARTITION_DEFAULT = "auto"
THD_PARTITION_SYNONYMS: Dict[str, Tuple[str, ...]] = {
    "per_document": ("per_document", "document", "te", "dual_chunk_swap", "thd"),
    "per_sequence": ("per_sequence", "sequence", "zigzag", "pack", "inter_document_masking"),
}
THD_PARTITION_VALUES: Tuple[str, ...] = (THD_PARTITION_DEFAULT,) + tuple(THD_PARTITION_SYNONYMS)

# Whether backward refetches the remote K/V it attends to (memory O(S/cp)) or keeps what forward
# received (one exchange fewer, memory O(keys needed)); "auto" lets the step choose under a memory
# budget (see megatron_ext.blockdiag_cp.step). Ours, beside the documented knobs.
KV_BACKWARD_DEFAULT = "auto"
KV_BACKWARD_SYNONYMS: Dict[str, Tuple[str, ...]] = {
    "refetch": ("refetch", "recompute", "refetch_kv", "stream"),
    "save": ("save", "save_kv", "keep", "store"),
}
KV_BACKWARD_VALUES: Tuple[str, ...] = (KV_BACKWARD_DEFAULT,) + tuple(KV_BACKWARD_SYNONYMS)

# Whether a step's rows move to another layout for the attention and back: "none" attends in the
# batch's layout; "balanced" moves q/k/v to the balanced layout (short documents whole on one rank)
# by one all-to-all-v each and the output back (see megatron_ext.blockdiag_cp.relayout). Ours,
# beside the documented knobs.
RELAYOUT_DEFAULT = "none"
RELAYOUT_SYNONYMS: Dict[str, Tuple[str, ...]] = {
    "none": ("none", "off", "no", "false", "keep"),
    "balanced": ("balanced", "on", "yes", "true", "to_balanced", "relayout"),
}
RELAYOUT_VALUES: Tuple[str, ...] = tuple(RELAYOUT_SYNONYMS)

# Two-dimensional CP: Ulysses (head-parallel) inside groups of this many consecutive CP ranks, the
# kv exchange between the groups (see megatron_ext.blockdiag_cp.ulysses). 1: one dimension. Ours,
# beside the documented knobs (Megatron's --hierarchical-context-parallel-sizes u r with a2a+p2p).
ULYSSES_SIZE_DEFAULT = 1

_DEFAULT_WORDS = ("", "auto", "default")

_ATTN_BACKEND_REVERSE: Dict[str, str] = {
    syn: canon for canon, syns in ATTN_BACKEND_SYNONYMS.items() for syn in syns}
_KV_EXCHANGE_REVERSE: Dict[str, str] = {
    syn: canon for canon, syns in KV_EXCHANGE_SYNONYMS.items() for syn in syns}
_LAYOUT_REVERSE: Dict[str, str] = {syn: canon for canon, syns in LAYOUT_SYNONYMS.items() for syn in syns}
_THD_PARTITION_REVERSE: Dict[str, str] = {
    syn: canon for canon, syns in THD_PARTITION_SYNONYMS.items() for syn in syns}
_KV_BACKWARD_REVERSE: Dict[str, str] = {
    syn: canon for canon, syns in KV_BACKWARD_SYNONYMS.items() for syn in syns}
_RELAYOUT_REVERSE: Dict[str, str] = {syn: canon for canon, syns in RELAYOUT_SYNONYMS.items() for syn in syns}


def _clean(value: Any) -> str:
    """Canonical spelling of a knob value: stripped, lower case, '-' -> '_'."""
    return str(value).strip().lower().replace("-", "_")


def _normalize(value: Any, reverse: Dict[str, str], default: str, knob: str) -> str:
    if value is None:
        return default
    accepted = ", ".join(sorted(reverse))
    if not isinstance(value, str):
        raise ValueError(f"{knob} must be a string, got {value!r} ({type(value).__name__}); "
                         f"accepted values: {accepted} (or None/'auto'/'default' for {default!r})")
    cleaned = _clean(value)
    if cleaned in _DEFAULT_WORDS:
        return default
    if cleaned not in reverse:
        raise ValueError(f"unknown {knob} {value!r}; accepted values: {accepted} "
                         f"(or None/'auto'/'default' for {default!r})")
    return reverse[cleaned]


def normalize_attn_backend(value: Any) -> str:
    """Canonicalize an attention-backend knob to one of ``ATTN_BACKEND_VALUES`` (None/''/auto/default: te)."""
    # The documented module's tests match the words "attention backend" in this error.
    return _normalize(value, _ATTN_BACKEND_REVERSE, ATTN_BACKEND_DEFAULT, "attention backend (attn_backend)")


def normalize_kv_exchange(value: Any) -> str:
    """Canonicalize a KV-exchange knob to one of ``KV_EXCHANGE_VALUES`` (None/''/auto/default: allgather)."""
    return _normalize(value, _KV_EXCHANGE_REVERSE, KV_EXCHANGE_DEFAULT, "kv_exchange")


def normalize_layout(value: Any) -> str:
    """Canonicalize a layout knob to one of ``LAYOUT_VALUES`` (None/''/auto/default: zigzag)."""
    return _normalize(value, _LAYOUT_REVERSE, LAYOUT_DEFAULT, "layout")


def normalize_thd_partition(value: Any) -> str:
    """Canonicalize the THD partition knob: 'auto', 'per_document' (TE's) or 'per_sequence'."""
    return _normalize(value, _THD_PARTITION_REVERSE, THD_PARTITION_DEFAULT, "thd_partition")


def normalize_kv_backward(value: Any) -> str:
    """Canonicalize the K/V-in-backward knob: 'auto' (default), 'refetch' or 'save'."""
    return _normalize(value, _KV_BACKWARD_REVERSE, KV_BACKWARD_DEFAULT, "kv_backward")


def normalize_relayout(value: Any) -> str:
    """Canonicalize the relayout knob: 'none' (default) or 'balanced'."""
    return _normalize(value, _RELAYOUT_REVERSE, RELAYOUT_DEFAULT, "relayout")


def normalize_ulysses_size(value: Any) -> int:
    """The Ulysses group size: a positive int (None/''/auto/default: 1, one-dimensional CP)."""
    if value is None or (isinstance(value, str) and _clean(value) in _DEFAULT_WORDS):
        return ULYSSES_SIZE_DEFAULT
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit() \
            or int(value) < 1:
        raise ValueError(f"ulysses_size must be a positive integer (the CP ranks of one head-parallel group; "
                         f"1: one-dimensional CP), got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------
# Thread-shared holder
# ---------------------------------------------------------------------------


class _ThreadSharedVar:
    """A ``contextvars.ContextVar``-style get/set/reset holder visible ACROSS threads.

    Activation recompute runs the forward again inside backward, on autograd's
    worker thread, where a ContextVar set on the main thread reads its default
    (None) and would silently drop the CP state mid-recompute. Training steps are
    sequential, so one shared slot with token-based restore (nesting unwinds
    correctly) is safe; backward only ever reads it. Two threads running steps on
    one process at once are not supported (``BlockDiagCPState.build`` refuses it).
    """

    def __init__(self):
        self._value = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        """Return the current value (None when unset)."""
        return self._value

    def set(self, value: Any) -> Any:
        """Set the value; returns a token (the previous value) for :meth:`reset`."""
        with self._lock:
            previous, self._value = self._value, value
        return previous

    def reset(self, token: Any) -> None:
        """Restore the value captured by a previous :meth:`set`."""
        with self._lock:
            self._value = token

    def __repr__(self) -> str:
        return f"_ThreadSharedVar(value={self._value!r})"


# ---------------------------------------------------------------------------
# Configured knobs, fire counter and the published step state
# ---------------------------------------------------------------------------

_CP_ATTN_BACKEND = ATTN_BACKEND_DEFAULT
_CP_KV_EXCHANGE = KV_EXCHANGE_DEFAULT
_CP_LAYOUT = LAYOUT_DEFAULT
_CP_THD_PARTITION = THD_PARTITION_DEFAULT
_CP_KV_BACKWARD = KV_BACKWARD_DEFAULT
_CP_ULYSSES_SIZE = ULYSSES_SIZE_DEFAULT
_CP_RELAYOUT = RELAYOUT_DEFAULT
# Whether a backend or exchange fallback is an error (raised on every rank) for the states the
# layer builds itself (Megatron's mask and THD paths); shard_batch takes strict= per step.
_CP_STRICT = False
# A plain one-element list, as documented (``_CP_ATTN_FIRE_COUNT[0] += 1`` works);
# our own increments take the lock so concurrent recomputes never lose a count.
_CP_ATTN_FIRE_COUNT: list = [0]
_FIRE_COUNT_LOCK = threading.Lock()
# The BlockDiagCPState published by ``blockdiag_cp_step`` (None outside a step).
_CP_BLOCKDIAG_STATE = _ThreadSharedVar()


def configure_cp_varlen(attn_backend: str = ATTN_BACKEND_DEFAULT,
                        kv_exchange: str = KV_EXCHANGE_DEFAULT) -> None:
    """Configure the block-diagonal CP attention path from parsed runtime config.

    Both values are validated before either changes; called with no arguments it
    restores the defaults (te, allgather).
    """
    global _CP_ATTN_BACKEND, _CP_KV_EXCHANGE
    backend = normalize_attn_backend(attn_backend)
    exchange = normalize_kv_exchange(kv_exchange)
    _CP_ATTN_BACKEND, _CP_KV_EXCHANGE = backend, exchange


def cp_varlen_runtime_config() -> Dict[str, str]:
    """Return the currently configured settings: {"attn_backend": ..., "kv_exchange": ...}."""
    return {"attn_backend": _CP_ATTN_BACKEND, "kv_exchange": _CP_KV_EXCHANGE}


def configure_cp_layout(layout: str = LAYOUT_DEFAULT) -> None:
    """Configure the CP layout (who owns which positions); no argument restores zigzag."""
    global _CP_LAYOUT
    _CP_LAYOUT = normalize_layout(layout)


def cp_layout_runtime_config() -> Dict[str, str]:
    """Return the currently configured layout: {"layout": ...}."""
    return {"layout": _CP_LAYOUT}


def configure_cp_thd_partition(partition: str = THD_PARTITION_DEFAULT) -> None:
    """How THD batches were cut across CP ranks: 'per_document' (TE), 'per_sequence', or 'auto'."""
    global _CP_THD_PARTITION
    _CP_THD_PARTITION = normalize_thd_partition(partition)


def configure_cp_kv_backward(kv_backward: str = KV_BACKWARD_DEFAULT) -> None:
    """Backward's remote K/V: 'refetch' (exchange again), 'save' (keep forward's), 'auto' (default)."""
    global _CP_KV_BACKWARD
    _CP_KV_BACKWARD = normalize_kv_backward(kv_backward)


def cp_kv_backward_runtime_config() -> Dict[str, str]:
    """Return the configured K/V-in-backward mode: {"kv_backward": ...}."""
    return {"kv_backward": _CP_KV_BACKWARD}


def configure_cp_ulysses_size(ulysses_size: Any = ULYSSES_SIZE_DEFAULT) -> None:
    """Two-dimensional CP: Ulysses inside groups of ``ulysses_size`` consecutive CP ranks, the kv exchange
    between the groups; no argument (or 1) restores one-dimensional CP."""
    global _CP_ULYSSES_SIZE
    _CP_ULYSSES_SIZE = normalize_ulysses_size(ulysses_size)


def cp_ulysses_size_runtime_config() -> Dict[str, int]:
    """Return the configured Ulysses group size: {"ulysses_size": ...}."""
    return {"ulysses_size": _CP_ULYSSES_SIZE}


def configure_cp_relayout(relayout: str = RELAYOUT_DEFAULT) -> None:
    """Attend in another layout: 'balanced' moves q/k/v there and the output back; no argument (or
    'none') attends in the batch's own layout."""
    global _CP_RELAYOUT
    _CP_RELAYOUT = normalize_relayout(relayout)


def cp_relayout_runtime_config() -> Dict[str, str]:
    """Return the configured relayout: {"relayout": ...}."""
    return {"relayout": _CP_RELAYOUT}


def configure_cp_strict(strict: bool = False) -> None:
    """Strict mode for the states built from Megatron's mask / THD batches: a fallback raises."""
    global _CP_STRICT
    if not isinstance(strict, bool):
        raise ValueError(f"strict must be True or False, got {strict!r} ({type(strict).__name__})")
    _CP_STRICT = strict


def cp_strict_runtime_config() -> Dict[str, bool]:
    """Return the configured strict mode: {"strict": ...}."""
    return {"strict": _CP_STRICT}


def cp_attn_fire_count() -> int:
    """Number of block-diagonal CP attention calls (recompute included) since the last reset."""
    return _CP_ATTN_FIRE_COUNT[0]


def reset_cp_attn_fire_count() -> None:
    """Zero the CP-attention fire counter (call before each forward)."""
    with _FIRE_COUNT_LOCK:
        _CP_ATTN_FIRE_COUNT[0] = 0


def count_cp_attn_fire() -> None:
    with _FIRE_COUNT_LOCK:
        _CP_ATTN_FIRE_COUNT[0] += 1


def current_blockdiag_state() -> Any:
    """The step state published by ``blockdiag_cp_step`` (None outside a step)."""
    return _CP_BLOCKDIAG_STATE.get()
