"""The seed module megatron_ext.blockdiag_cp.state: every name and rule."""

import threading

import pytest

from megatron_ext.blockdiag_cp import state as st


@pytest.fixture(autouse=True)
def _restore_knobs():
    before = st.cp_varlen_runtime_config()
    yield
    st.configure_cp_varlen(**before)


def test_tables_and_defaults():
    assert st.ATTN_BACKEND_DEFAULT == "te"
    assert st.KV_EXCHANGE_DEFAULT == "allgather"
    assert st.ATTN_BACKEND_VALUES == ("te", "flash", "dense")
    assert set(st.KV_EXCHANGE_VALUES) == {"allgather", "halo", "a2a"}
    assert set(st.ATTN_BACKEND_SYNONYMS["flash"]) == {
        "flash", "flash_attn", "flash_attention", "flash_attention_2", "fa2"}
    assert set(st.ATTN_BACKEND_SYNONYMS["te"]) == {"te", "transformer_engine", "transformerengine"}
    assert set(st.ATTN_BACKEND_SYNONYMS["dense"]) == {"dense", "sdpa", "torch_sdpa"}
    assert set(st.KV_EXCHANGE_SYNONYMS["allgather"]) == {"allgather", "all_gather"}
    assert set(st.KV_EXCHANGE_SYNONYMS["halo"]) == {"halo", "neighbor", "needed", "needed_only"}
    assert set(st.KV_EXCHANGE_SYNONYMS["a2a"]) == {"a2a", "a2av", "all_to_all", "alltoall", "needed_a2a"}
    for canonical, aliases in st.ATTN_BACKEND_SYNONYMS.items():
        assert all(st._ATTN_BACKEND_REVERSE[a] == canonical for a in aliases)
    for canonical, aliases in st.KV_EXCHANGE_SYNONYMS.items():
        assert all(st._KV_EXCHANGE_REVERSE[a] == canonical for a in aliases)
    assert len(st._ATTN_BACKEND_REVERSE) == sum(map(len, st.ATTN_BACKEND_SYNONYMS.values()))


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


@pytest.mark.parametrize("fn,bad", [(st.normalize_attn_backend, "cudnn"),
                                    (st.normalize_kv_exchange, "ring"),
                                    (st.normalize_layout, "random")])
def test_unknown_values_name_the_accepted_ones(fn, bad):
    with pytest.raises(ValueError) as err:
        fn(bad)
    assert repr(bad) in str(err.value) and "accepted values" in str(err.value)


def test_configure_positional_keyword_and_atomic_validation():
    assert st.configure_cp_varlen("fa2", "a2av")["attn_backend"] == "flash"
    assert st.cp_varlen_runtime_config()["kv_exchange"] == "a2a"
    st.configure_cp_varlen(kv_exchange="neighbor")
    assert st.cp_varlen_runtime_config() == {"attn_backend": "flash", "kv_exchange": "halo",
                                             "layout": st.cp_varlen_runtime_config()["layout"]}
    with pytest.raises(ValueError, match="accepted values"):
        st.configure_cp_varlen("sdpa", "bogus")  # second value bad: first must not change
    assert st.cp_varlen_runtime_config()["attn_backend"] == "flash"
    st.configure_cp_varlen(None, "default")
    assert st.cp_varlen_runtime_config()["attn_backend"] == "te"
    assert st.cp_varlen_runtime_config()["kv_exchange"] == "allgather"
    assert st._CP_ATTN_BACKEND.get() == "te" and st._CP_KV_EXCHANGE.get() == "allgather"


def test_thread_shared_var_visible_across_threads_and_token_restore():
    var = st._ThreadSharedVar("t", default="d")
    assert var.get() == "d" and var.get("x") == "x"
    outer = var.set("main")
    seen = []
    worker = threading.Thread(target=lambda: seen.append(var.get()))
    worker.start()
    worker.join()
    assert seen == ["main"]  # a ContextVar would read the default here
    inner = var.set("nested")
    assert var.get() == "nested"
    var.reset(inner)
    assert var.get() == "main"
    var.reset(outer)
    assert var.get() == "d"
    other = st._ThreadSharedVar("other")
    with pytest.raises(ValueError):
        other.reset(var.set("v"))


def test_value_set_in_one_thread_is_read_in_another():
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("token", st._CP_BLOCKDIAG_STATE.set("S")))
    t.start()
    t.join()
    assert st._CP_BLOCKDIAG_STATE.get() == "S"
    assert st.current_blockdiag_state() == "S"
    st._CP_BLOCKDIAG_STATE.reset(box["token"])
    assert st._CP_BLOCKDIAG_STATE.get() is None


def test_fire_counter_is_thread_safe():
    st.reset_cp_attn_fire_count()
    threads = [threading.Thread(target=lambda: [st._CP_ATTN_FIRE_COUNT.increment() for _ in range(500)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert st.cp_attn_fire_count() == 2000
    st.reset_cp_attn_fire_count()
    assert st.cp_attn_fire_count() == 0


def test_state_module_is_dependency_free():
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(st))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"threading", "typing"}, imported
