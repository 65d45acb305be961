"""The engine's public face: ``megatron_ext.blockdiag_cp.__all__`` is exactly what users call."""

import megatron_ext.blockdiag_cp as bdcp

# The intended user list, written out here (not derived from the package) so that adding or
# dropping a public name is a visible change to this test.
USER_NAMES = {
    "shard_batch", "blockdiag_cp_step", "doc_ids_from_eod", "doc_ids_from_cu_seqlens",
    "resolve_step_state",
    "BlockDiagCPState", "BlockDiagCPError", "blockdiag_cp_attention",
    "configure_cp_varlen", "cp_varlen_runtime_config", "configure_cp_layout", "cp_layout_runtime_config",
    "configure_cp_thd_partition", "normalize_attn_backend", "normalize_kv_exchange", "normalize_layout",
    "configure_cp_kv_backward", "cp_kv_backward_runtime_config", "normalize_kv_backward",
    "configure_cp_strict", "cp_strict_runtime_config",
    "configure_cp_ulysses_size", "cp_ulysses_size_runtime_config",
    "configure_cp_relayout", "cp_relayout_runtime_config", "normalize_relayout",
    "CostModel", "default_cost_model", "WindowMix", "PreparedPlan", "prepare_plan", "plan_summary",
    "thd_partitioned_indices",
    "cp_attn_fire_count", "reset_cp_attn_fire_count",
}
TEST_HOOKS = {"KERNELS", "KERNEL_INSTALLED", "override_kernel", "override_availability",
              "override_library", "kernels", "runtime", "state"}


def test_all_is_exactly_the_user_list():
    assert len(bdcp.__all__) == len(set(bdcp.__all__)), "duplicate names in __all__"
    assert set(bdcp.__all__) == USER_NAMES, (
        f"missing: {sorted(USER_NAMES - set(bdcp.__all__))}, extra: {sorted(set(bdcp.__all__) - USER_NAMES)}")


def test_every_public_name_resolves_to_a_callable():
    for name in bdcp.__all__:
        obj = getattr(bdcp, name)  # AttributeError names the missing one
        assert callable(obj), name
    namespace = {}
    exec("from megatron_ext.blockdiag_cp import *", namespace)
    assert set(namespace) - {"__builtins__"} == USER_NAMES


def test_test_hooks_are_not_public():
    from megatron_ext.blockdiag_cp import kernels

    assert not TEST_HOOKS & set(bdcp.__all__)
    # The old module-level registries are gone; the hooks live behind megatron_ext.testing.
    assert not hasattr(kernels, "KERNELS") and not hasattr(kernels, "KERNEL_INSTALLED")


def test_testing_overrides_restore_the_engine():
    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.testing import override_availability, override_kernel, override_library

    fake = kernels.Kernel(lambda *args: None, lambda *args: None)

    real_dense = kernels.kernel_for("dense")
    real_flash = kernels.static_availability("flash", "cpu")
    assert real_flash[0] is False and "needs CUDA" in real_flash[1]  # this machine has no GPU
    with override_kernel("dense", fake), override_availability("flash", False, "hidden on this rank"):
        assert kernels.kernel_for("dense") is fake
        assert kernels.static_availability("flash", "cpu") == (False, "hidden on this rank")
        with override_availability("flash", True, "a double", any_call=True):
            assert kernels.static_availability("flash", "cpu") == (True, "a double")
        assert kernels.installed("flash") == (False, "hidden on this rank")  # the outer one is back
    with override_library("transformer_engine.pytorch", None):
        assert kernels.installed("te")[0] is False
    assert kernels.kernel_for("dense") is real_dense
    assert kernels.static_availability("flash", "cpu") == real_flash


def _engine_imports():
    """{module: the engine modules it imports}, read from the sources (function-local imports included):
    ``blockdiag_cp/x.py`` is ``x``, ``layouts/balanced/y.py`` is ``layouts.balanced.y``, a package its
    ``__init__``'s name."""
    import ast
    import pathlib

    root = pathlib.Path(bdcp.__file__).parent
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        names[path] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    modules = set(names.values())
    graph = {}
    for path, name in names.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            up = node.level - 1  # packages above this module's
            if up > len(package):
                continue  # above the engine (``from .. import parallel_state``)
            target = ".".join(package[:len(package) - up] + ([node.module] if node.module else []))
            for alias in node.names:  # ``from . import kernels`` names a module, ``from .x import y`` a name
                sub = f"{target}.{alias.name}" if target else alias.name
                hit = sub if sub in modules else target
                if hit in modules and hit != name:
                    found.add(hit)
        graph[name] = found
    return graph


def test_engine_modules_import_in_layers_without_a_cycle():
    """No engine module imports, even inside a function, one that imports it back (directly or through
    others): every module can be read knowing only the ones below it. The package's own ``__init__``
    (which names everything for its lazy ``__getattr__``) is left out."""
    graph = {m: {t for t in ts if t != ""} for m, ts in _engine_imports().items() if m != ""}
    assert {"streamed", "attention_op", "step", "merge", "ulysses", "relayout", "head_groups"} <= graph.keys()
    # the graph is really read
    assert "head_groups" in graph["ulysses"] and "head_groups" in graph["relayout"] and "streamed" in graph["head_groups"]
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for t in sorted(graph.get(m, ())):
            visit(t)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
