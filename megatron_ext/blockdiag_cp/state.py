"""Runtime knobs, the thread-shared step-state holder and the attention fire counter.

A dependency-free leaf: nothing here imports torch or the rest of the project, so
any module (and any test) can read and set the knobs without pulling in CUDA code.

Knob values are cleaned (strip, lower case, '-' -> '_') and looked up in a
synonym table; ``None``, ``""``, ``"auto"`` and ``"default"`` mean the default.
"""

import threading
from typing import Any, Dict, Optional, Tuple

# ---------------------------------------------------------------------------
# Knob tables
# ---------------------------------------------------------------------------

ATTN_BACKEND_DEFAULT = "te"
ATTN_BACKEND_SYNONYMS: Dict[str, Tuple[str, ...]] = {
    "te": ("te", "transformer_engine", "transformerengine"),
    "flash": ("flash", "flash_attn", "flash_attention", "flash_attention_2", "fa2"),
    "dense": ("dense", "sdpa", "torch_sdpa"),
}
# Fallback order: the requested backend resolves to the first available one from
# its own position onwards (te -> flash -> dense).
ATTN_BACKEND_VALUES: Tuple[str, ...] = ("te", "flash", "dense")

KV_EXCHANGE_DEFAULT = "allgather"
KV_EXCHANGE_SYNONYMS: Dict[str, Tuple[str, ...]] = {
    "allgather": ("allgather", "all_gather"),
    "halo": ("halo", "neighbor", "needed", "needed_only"),
    "a2a": ("a2a", "a2av", "all_to_all", "alltoall", "needed_a2a"),
}
KV_EXCHANGE_VALUES: Tuple[str, ...] = ("allgather", "halo", "a2a")

LAYOUT_DEFAULT = "zigzag"
LAYOUT_SYNONYMS: Dict[str, Tuple[str, ...]] = {
    "contiguous": ("contiguous", "sequential", "contig", "block"),
    "zigzag": ("zigzag", "zig_zag", "megatron", "load_balanced_zigzag"),
    "balanced": ("balanced", "load_balanced", "doc_balanced", "document_balanced"),
    "thd": ("thd", "te_thd", "dual_chunk_swap", "per_document", "per_document_zigzag"),
}
LAYOUT_VALUES: Tuple[str, ...] = ("contiguous", "zigzag", "balanced", "thd")

_DEFAULT_WORDS = ("", "auto", "default")


def _reverse(synonyms: Dict[str, Tuple[str, ...]]) -> Dict[str, str]:
    return {alias: canonical for canonical, aliases in synonyms.items() for alias in aliases}


_ATTN_BACKEND_REVERSE: Dict[str, str] = _reverse(ATTN_BACKEND_SYNONYMS)
_KV_EXCHANGE_REVERSE: Dict[str, str] = _reverse(KV_EXCHANGE_SYNONYMS)
_LAYOUT_REVERSE: Dict[str, str] = _reverse(LAYOUT_SYNONYMS)


def _clean(value: Any) -> str:
    """Canonical spelling of a knob value: stripped, lower case, '-' -> '_'."""
    return str(value).strip().lower().replace("-", "_")


def _normalize(value: Any, reverse: Dict[str, str], default: str, knob: str) -> str:
    if value is None:
        return default
    if not isinstance(value, str):
        raise ValueError(f"{knob} must be a string, got {value!r} ({type(value).__name__})")
    cleaned = _clean(value)
    if cleaned in _DEFAULT_WORDS:
        return default
    if cleaned not in reverse:
        accepted = ", ".join(sorted(reverse))
        raise ValueError(
            f"unknown {knob} {value!r}; accepted values: {accepted} "
            f"(or None/'auto'/'default' for {default!r})"
        )
    return reverse[cleaned]


def normalize_attn_backend(value: Any) -> str:
    """Canonical attention backend ('te', 'flash' or 'dense') for any accepted spelling."""
    return _normalize(value, _ATTN_BACKEND_REVERSE, ATTN_BACKEND_DEFAULT, "attention backend")


def normalize_kv_exchange(value: Any) -> str:
    """Canonical K/V exchange ('allgather', 'halo' or 'a2a') for any accepted spelling."""
    return _normalize(value, _KV_EXCHANGE_REVERSE, KV_EXCHANGE_DEFAULT, "kv exchange")


def normalize_layout(value: Any) -> str:
    """Canonical layout ('contiguous', 'zigzag' or 'balanced') for any accepted spelling."""
    return _normalize(value, _LAYOUT_REVERSE, LAYOUT_DEFAULT, "cp layout")


# ---------------------------------------------------------------------------
# Thread-shared holder
# ---------------------------------------------------------------------------

_UNSET = object()


class _ThreadSharedVar:
    """A ContextVar-like cell whose value is visible from every thread.

    Activation recompute runs the forward again inside backward, on autograd's
    worker thread, where a ``contextvars.ContextVar`` set on the main thread reads
    nothing. ``set`` returns a token; ``reset(token)`` restores the value that was
    current before that ``set`` (so nested publishes unwind correctly).
    """

    def __init__(self, name: str, default: Any = None):
        self.name = name
        self._default = default
        self._value = _UNSET
        self._lock = threading.Lock()

    def get(self, default: Any = _UNSET) -> Any:
        value = self._value
        if value is _UNSET:
            return self._default if default is _UNSET else default
        return value

    def set(self, value: Any) -> Tuple["_ThreadSharedVar", Any]:
        with self._lock:
            token = (self, self._value)
            self._value = value
        return token

    def reset(self, token: Tuple["_ThreadSharedVar", Any]) -> None:
        owner, previous = token
        if owner is not self:
            raise ValueError(f"token was created by {owner.name!r}, not {self.name!r}")
        with self._lock:
            self._value = previous

    def __repr__(self) -> str:
        return f"_ThreadSharedVar({self.name!r}, value={self.get()!r})"


class _FireCounter:
    """Thread-safe count of block-diagonal attention calls (forward and recompute)."""

    def __init__(self):
        self._count = 0
        self._lock = threading.Lock()

    def increment(self) -> int:
        with self._lock:
            self._count += 1
            return self._count

    def get(self) -> int:
        return self._count

    def reset(self) -> None:
        with self._lock:
            self._count = 0


_CP_ATTN_BACKEND = _ThreadSharedVar("cp_attn_backend", default=ATTN_BACKEND_DEFAULT)
_CP_KV_EXCHANGE = _ThreadSharedVar("cp_kv_exchange", default=KV_EXCHANGE_DEFAULT)
_CP_LAYOUT = _ThreadSharedVar("cp_layout", default=LAYOUT_DEFAULT)
_CP_ATTN_FIRE_COUNT = _FireCounter()
# The published BlockDiagCPState of the current step (None outside a step).
_CP_BLOCKDIAG_STATE = _ThreadSharedVar("cp_blockdiag_state", default=None)

_UNCHANGED = object()


def configure_cp_varlen(attn_backend: Any = _UNCHANGED, kv_exchange: Any = _UNCHANGED,
                        layout: Any = _UNCHANGED) -> Dict[str, str]:
    """Set the runtime knobs; both values are validated before either changes.

    An argument left out keeps its current value; ``None``/'auto'/'default'
    restores the default. Returns the resulting config.
    """
    new_backend = None if attn_backend is _UNCHANGED else normalize_attn_backend(attn_backend)
    new_exchange = None if kv_exchange is _UNCHANGED else normalize_kv_exchange(kv_exchange)
    new_layout = None if layout is _UNCHANGED else normalize_layout(layout)
    if new_backend is not None:
        _CP_ATTN_BACKEND.set(new_backend)
    if new_exchange is not None:
        _CP_KV_EXCHANGE.set(new_exchange)
    if new_layout is not None:
        _CP_LAYOUT.set(new_layout)
    return cp_varlen_runtime_config()


def cp_varlen_runtime_config() -> Dict[str, str]:
    """The knobs in force: {'attn_backend': ..., 'kv_exchange': ..., 'layout': ...}."""
    return {
        "attn_backend": _CP_ATTN_BACKEND.get(),
        "kv_exchange": _CP_KV_EXCHANGE.get(),
        "layout": _CP_LAYOUT.get(),
    }


def cp_attn_fire_count() -> int:
    """How many times block-diagonal attention ran (recompute included) since the last reset."""
    return _CP_ATTN_FIRE_COUNT.get()


def reset_cp_attn_fire_count() -> None:
    _CP_ATTN_FIRE_COUNT.reset()


def current_blockdiag_state(default: Optional[Any] = None) -> Optional[Any]:
    """The step state published by ``blockdiag_cp_step``, or ``default``."""
    value = _CP_BLOCKDIAG_STATE.get()
    return default if value is None else value
