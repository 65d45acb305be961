"""The seed module megatron_ext.blockdiag_cp.state, name for name and rule for rule.

The list of documented names lives here (the documentation itself is not part of
the repo); the one intended difference from the documented module is the ``te``
default. Our own layout knob sits beside the documented pair.
"""

import threading

import pytest

from megatron_ext.blockdiag_cp import state as st

# Every name the module's documentation lists (classes, functions, data).
DOCUMENTED_NAMES = (
    "_ThreadSharedVar", "_clean", "configure_cp_varlen", "cp_attn_fire_count",
    "cp_varlen_runtime_config", "normalize_attn_backend", "normalize_kv_exchange",
    "reset_cp_attn_fire_count", "ATTN_BACKEND_DEFAULT", "ATTN_BACKEND_SYNONYMS", "ATTN_BACKEND_VALUES",
    "KV_EXCHANGE_DEFAULT", "KV_EXCHANGE_SYNONYMS", "KV_EXCHANGE_VALUES", "_ATTN_BACKEND_REVERSE",
    "_CP_ATTN_BACKEND", "_CP_ATTN_FIRE_COUNT", "_CP_BLOCKDIAG_STATE", "_CP_KV_EXCHANGE",
    "_KV_EXCHANGE_REVERSE",
)


@pytest.fixture(autouse=True)
def _restore_knobs():
    varlen, layout = st.cp_varlen_runtime_config(), st.cp_layout_runtime_config()
    yield
    st.configure_cp_varlen(**varlen)
    st.configure_cp_layout(**layout)


def test_every_documented_name_exists():
    missing = [name for name in DOCUMENTED_NAMES if not hasattr(st, name)]
    assert not missing, missing
    assert isinstance(st._ThreadSharedVar, type)
    for name in ("_clean", "configure_cp_varlen", "cp_attn_fire_count", "cp_varlen_runtime_config",
                 "normalize_attn_backend", "normalize_kv_exchange", "reset_cp_attn_fire_count"):
        assert callable(getattr(st, name)), name
    assert isinstance(st._CP_BLOCKDIAG_STATE, st._ThreadSharedVar)


def test_tables_and_defaults():
    assert st.ATTN_BACKEND_DEFAULT == "te"  # the intended change (upstream: flash)
    assert st.KV_EXCHANGE_DEFAULT == "allgather"
    assert st.ATTN_BACKEND_VALUES == tuple(st.ATTN_BACKEND_SYNONYMS) == ("te", "flash", "dense")
    assert st.KV_EXCHANGE_VALUES == tuple(st.KV_EXCHANGE_SYNONYMS) == ("allgather", "halo", "a2a", "hierarchical",
                                                                     "ulysses", "planned")
    assert set(st.ATTN_BACKEND_SYNONYMS["flash"]) == {
        "flash", "flash_attn", "flash_attention", "flash_attention_2", "fa2"}
    assert set(st.ATTN_BACKEND_SYNONYMS["te"]) == {"te", "transformer_engine", "transformerengine"}
    assert set(st.ATTN_BACKEND_SYNONYMS["dense"]) == {"dense", "sdpa", "torch_sdpa"}
    assert set(st.KV_EXCHANGE_SYNONYMS["allgather"]) == {"allgather", "all_gather"}
    assert set(st.KV_EXCHANGE_SYNONYMS["halo"]) == {"halo", "neighbor", "needed", "needed_only"}
    assert set(st.KV_EXCHANGE_SYNONYMS["a2a"]) == {"a2a", "a2av", "all_to_all", "alltoall", "needed_a2a"}
    assert st._ATTN_BACKEND_REVERSE == {s: c for c, syns in st.ATTN_BACKEND_SYNONYMS.items() for s in syns}
    assert st._KV_EXCHANGE_REVERSE == {s: c for c, syns in st.KV_EXCHANGE_SYNONYMS.items() for s in syns}


def test_configured_knobs_hold_canonical_strings():
    assert st._CP_ATTN_BACKEND == "te" and st._CP_KV_EXCHANGE == "allgather"
    st.configure_cp_varlen("Flash-Attention-2", "needed-a2a")
    assert st._CP_ATTN_BACKEND == "flash" and st._CP_KV_EXCHANGE == "a2a"
    assert isinstance(st._CP_ATTN_BACKEND, str) and isinstance(st._CP_KV_EXCHANGE, str)


@pytest.mark.parametrize("raw,expected", [
    ("FA2", "flash"), (" Flash-Attention-2 ", "flash"), ("Transformer-Engine", "te"),
    ("torch-sdpa", "dense"), (None, "te"), ("", "te"), ("auto", "te"), ("DEFAULT", "te"),
])
def test_normalize_attn_backend(raw, expected):
    assert st.normalize_attn_backend(raw) == expected


@pytest.mark.parametrize("raw,expected", [
    ("All-Gather", "allgather"), ("needed-only", "halo"), ("Neighbor", "halo"),
    ("all-to-all", "a2a"), ("needed_a2a", "a2a"), (None, "allgather"), ("auto", "allgather"),
])
def test_normalize_kv_exchange(raw, expected):
    assert st.normalize_kv_exchange(raw) == expected


@pytest.mark.parametrize("raw,expected", [
    ("sequential", "contiguous"), ("Megatron", "zigzag"), ("load-balanced", "balanced"),
    ("doc_balanced", "balanced"), (None, st.LAYOUT_DEFAULT),
])
def test_normalize_layout(raw, expected):
    assert st.normalize_layout(raw) == expected


def test_clean():
    assert st._clean("  Flash-Attn ") == "flash_attn"


@pytest.mark.parametrize("fn,bad,knob", [(st.normalize_attn_backend, "cudnn", "attn_backend"),
                                         (st.normalize_kv_exchange, "ring", "kv_exchange"),
                                         (st.normalize_layout, "random", "layout")])
def test_unknown_values_name_the_knob_and_the_accepted_ones(fn, bad, knob):
    with pytest.raises(ValueError, match=knob) as err:
        fn(bad)
    assert repr(bad) in str(err.value) and "accepted values" in str(err.value)


@pytest.mark.parametrize("fn,values", [(st.normalize_attn_backend, st.ATTN_BACKEND_VALUES),
                                       (st.normalize_kv_exchange, st.KV_EXCHANGE_VALUES),
                                       (st.normalize_layout, st.LAYOUT_VALUES)])
@pytest.mark.parametrize("bad", [3, 2.5, ["flash"]])
def test_non_string_values_list_the_accepted_ones(fn, values, bad):
    with pytest.raises(ValueError, match="accepted values") as err:
        fn(bad)
    assert all(v in str(err.value) for v in values)


def test_attn_backend_error_says_attention_backend():
    # The documented module's own tests match these words (issue 17, item 6).
    for bad in ("bogus", 7):
        with pytest.raises(ValueError, match="attention backend") as err:
            st.normalize_attn_backend(bad)
        assert "accepted values" in str(err.value)
    with pytest.raises(ValueError, match="attention backend"):
        st.configure_cp_varlen("cudnn", "a2a")


def test_strict_knob_beside_the_documented_pair():
    assert st.cp_strict_runtime_config() == {"strict": False}
    try:
        st.configure_cp_strict(True)
        assert st._CP_STRICT is True and st.cp_strict_runtime_config() == {"strict": True}
        st.configure_cp_varlen()  # the varlen pair does not touch it
        assert st._CP_STRICT is True
        with pytest.raises(ValueError, match="strict must be True or False"):
            st.configure_cp_strict("yes")
        assert st._CP_STRICT is True
    finally:
        st.configure_cp_strict()
    assert st._CP_STRICT is False


def test_kv_exchange_error_names_kv_exchange():
    # The upstream unit test matches this word.
    with pytest.raises(ValueError, match="kv_exchange"):
        st.normalize_kv_exchange("bogus")
    with pytest.raises(ValueError, match="kv_exchange"):
        st.normalize_kv_exchange(7)


def test_configure_returns_none_validates_both_first_and_restores_defaults():
    assert st.configure_cp_varlen("fa2", "a2av") is None
    assert st.cp_varlen_runtime_config() == {"attn_backend": "flash", "kv_exchange": "a2a"}
    st.configure_cp_varlen(kv_exchange="neighbor")  # attn_backend left out: its default
    assert st.cp_varlen_runtime_config() == {"attn_backend": "te", "kv_exchange": "halo"}
    st.configure_cp_varlen("sdpa", "a2a")
    with pytest.raises(ValueError, match="accepted values"):
        st.configure_cp_varlen("flash", "bogus")  # second value bad: the first must not change
    assert st.cp_varlen_runtime_config() == {"attn_backend": "dense", "kv_exchange": "a2a"}
    st.configure_cp_varlen()
    assert st.cp_varlen_runtime_config() == {"attn_backend": "te", "kv_exchange": "allgather"}


def test_runtime_config_has_exactly_the_documented_keys():
    assert set(st.cp_varlen_runtime_config()) == {"attn_backend", "kv_exchange"}
    assert st.cp_layout_runtime_config() == {"layout": st.LAYOUT_DEFAULT}


def test_layout_knob_beside_the_documented_pair():
    assert st.configure_cp_layout("load-balanced") is None
    assert st.cp_layout_runtime_config() == {"layout": "balanced"} and st._CP_LAYOUT == "balanced"
    st.configure_cp_varlen()  # the varlen pair does not touch the layout
    assert st.cp_layout_runtime_config() == {"layout": "balanced"}
    with pytest.raises(ValueError, match="layout"):
        st.configure_cp_layout("spiral")
    assert st._CP_LAYOUT == "balanced"
    st.configure_cp_layout()
    assert st._CP_LAYOUT == "zigzag"


def test_thread_shared_var_takes_no_arguments_and_is_visible_across_threads():
    var = st._ThreadSharedVar()
    assert var.get() is None
    outer = var.set("main")
    assert outer is None  # the token is the previous value
    seen = []
    worker = threading.Thread(target=lambda: seen.append(var.get()))
    worker.start()
    worker.join()
    assert seen == ["main"]  # a ContextVar would read None here
    inner = var.set("nested")
    assert inner == "main" and var.get() == "nested"
    var.reset(inner)
    assert var.get() == "main"
    var.reset(outer)
    assert var.get() is None


def test_value_set_in_one_thread_is_read_in_another():
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("token", st._CP_BLOCKDIAG_STATE.set("S")))
    t.start()
    t.join()
    assert st._CP_BLOCKDIAG_STATE.get() == "S"
    st._CP_BLOCKDIAG_STATE.reset(box["token"])
    assert st._CP_BLOCKDIAG_STATE.get() is None


def test_fire_count_is_a_documented_list_cell():
    st.reset_cp_attn_fire_count()
    assert st._CP_ATTN_FIRE_COUNT == [0]
    st._CP_ATTN_FIRE_COUNT[0] += 1  # what upstream code and tests do
    assert st.cp_attn_fire_count() == 1
    st._CP_ATTN_FIRE_COUNT[0] = 0
    assert st.cp_attn_fire_count() == 0


def test_our_increments_are_thread_safe():
    st.reset_cp_attn_fire_count()
    threads = [threading.Thread(target=lambda: [st.count_cp_attn_fire() for _ in range(2000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert st.cp_attn_fire_count() == 8000
    st.reset_cp_attn_fire_count()
    assert st.cp_attn_fire_count() == 0


def test_state_module_is_dependency_free():
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(st))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"threading", "typing"}, imported


@pytest.mark.parametrize("module", ["megatron_ext.blockdiag_cp.state", "megatron_ext.megatron_lm"])
def test_importing_the_knobs_through_the_package_imports_no_torch(module):
    # The flag parsers (megatron_lm's --cp-* flags, training.arguments) check values with these
    # before torch is imported; the engine package resolves its torch-needing names on first use.
    import os
    import pathlib
    import subprocess
    import sys

    repo = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
