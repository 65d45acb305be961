"""Run the engine as on a machine without megatron-core: an import blocker that spawned ranks inherit.

The engine (``megatron_ext.blockdiag_cp``) must import and run without megatron-core
(the GPU machine has torch only). ``block_megatron()`` makes ``megatron`` unimportable in
this process and sets ``BLOCK_MEGATRON_ENV`` so that modules run by WorkerPool ranks can
call ``block_megatron_if_asked()`` at import and block it there too.
"""

import importlib.util
import os
import sys

BLOCK_MEGATRON_ENV = "MEGATRON_EXT_BLOCK_MEGATRON"


class _BlockMegatron:
    """Meta-path finder that makes megatron(-core) unimportable."""

    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: {BLOCK_MEGATRON_ENV}=1)")
        return None


def block_megatron() -> None:
    os.environ[BLOCK_MEGATRON_ENV] = "1"  # inherited by spawned ranks
    if not any(isinstance(f, _BlockMegatron) for f in sys.meta_path):
        sys.meta_path.insert(0, _BlockMegatron())


def block_megatron_if_asked() -> None:
    if os.environ.get(BLOCK_MEGATRON_ENV) == "1":
        block_megatron()


def megatron_installed() -> bool:
    """Whether megatron-core is importable here (False while blocked)."""
    try:
        return importlib.util.find_spec("megatron") is not None
    except ImportError:
        return False


def megatron_modules() -> set:
    return {m for m in sys.modules if m == "megatron" or m.startswith("megatron.")}
