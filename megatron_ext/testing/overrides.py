"""Test hooks of the engine, as context managers that restore what they change.

The engine's kernel table, its availability answers and its library lookups
(``megatron_ext.blockdiag_cp.kernels``) are not part of the public face; tests,
benchmarks and the GPU check's dry run reach them only here:

    with override_availability("te", False, "te is not installed on this rank"), \\
            override_kernel("dense", failing_dense):
        ...

Every hook is process-local, so inside a gloo WorkerPool each rank sets its own
(a worker function enters the context on the ranks it chooses); nothing leaks into
the next task because every context restores the previous value on exit.
"""

import contextlib
import logging
from typing import Optional

ENGINE_LOGGER = "megatron_ext.blockdiag_cp"


def _kernels():
    from megatron_ext.blockdiag_cp import kernels

    return kernels


@contextlib.contextmanager
def _set(table: dict, key, value):
    missing = object()
    saved = table.get(key, missing)
    table[key] = value
    try:
        yield
    finally:
        if saved is missing:
            table.pop(key, None)
        else:
            table[key] = saved


def override_kernel(backend: str, kernel):
    """The engine calls ``kernel`` (a ``kernels.Kernel``: forward/backward with the lse) for ``backend``."""
    return _set(_kernels()._KERNEL_OVERRIDES, backend, kernel)


def override_availability(backend: str, ok: Optional[bool] = True, reason: Optional[str] = None, *,
                          any_device: bool = True, any_call: bool = False):
    """``backend`` reports itself installed (``ok``) or not, with ``reason``, inside the block.

    ok=None keeps the real import check (e.g. to find a library put in place by
    ``override_library``). any_device: the static check skips the CUDA requirement (what
    a CUDA machine with or without the library would answer); False keeps "needs CUDA".
    any_call: the per-call check accepts CPU and fp32/fp64 tensors (a CPU double stands
    behind the backend); False keeps the real dtype/device check.
    """
    kernels = _kernels()
    if reason is None:
        reason = f"{backend} {'installed' if ok or ok is None else 'not installed'} (test override)"
    override = kernels.AvailabilityOverride(
        installed=None if ok is None else (bool(ok), reason), any_device=any_device, any_call=any_call,
        reason=reason)
    return _set(kernels._AVAILABILITY_OVERRIDES, backend, override)


@contextlib.contextmanager
def override_library(name: str, module):
    """The engine's lazy import of ``name`` returns ``module`` (None: "not importable") inside the block.

    Names the engine looks up: ``flash_attn``, ``flash_attn.flash_attn_interface``,
    ``torch.nn.attention.varlen``, ``torch.ops.aten.flash`` (torch's flash ops),
    ``transformer_engine``, ``transformer_engine.pytorch``,
    ``transformer_engine.pytorch.cpp_extensions.fused_attn``, ``transformer_engine_torch``.
    """
    with _set(_kernels()._LIBRARY_OVERRIDES, name, module):
        yield


@contextlib.contextmanager
def override_libraries(modules: dict):
    """``override_library`` for several names at once ({name: module})."""
    with contextlib.ExitStack() as stack:
        for name, module in modules.items():
            stack.enter_context(override_library(name, module))
        yield


@contextlib.contextmanager
def captured_engine_logs(level: int = logging.DEBUG):
    """Records of the engine's logger at ``level`` and above; its log-once memory starts and ends empty."""
    from megatron_ext.blockdiag_cp import backend

    records = []
    handler = logging.Handler(level)
    handler.emit = records.append
    logger = logging.getLogger(ENGINE_LOGGER)
    old_level = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    backend._LOGGED.clear()
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        backend._LOGGED.clear()
