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
