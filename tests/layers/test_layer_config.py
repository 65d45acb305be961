"""What BlockDiagCPAttention and the --spec do with megatron's config (issue 17 items 1, 2, 4;
issue 16 item 5), on the installed megatron-core (0.16 in make test, 0.19 in make test-compat).

- every config field megatron's DotProductAttention / TEDotProductAttention read (walked from their
  source) is in the layer's table, and each refused one is refused at construction, naming it;
- megatron's --attention-backend / --cp-comm-type drive our knobs; conflicts and the values we
  cannot honour are refused;
- the --spec attribute builds, for a config, the layers megatron-core's own spec builds (same
  modules, same state dict), ours inside; what it cannot build is refused naming the flag;
- Megatron-LM's argument checks (megatron_ext.megatron_lm) without a Megatron-LM checkout;
- attention dropout drawn where megatron's own DotProductAttention (run beside ours) draws it: in
  the model-parallel RNG fork TP ranks draw different masks, under sequence parallelism the
  default generator (alike on TP ranks, as megatron's and TE's core attention), and megatron's
  own checkpoint recomputes the same masks.
"""

import argparse
import ast
import importlib.util
import os
import pathlib
import sys
import types

import pytest
import torch

import megatron_ext.blockdiag_cp as bdcp
from megatron_ext.testing import pool_fixture
import megatron_ext.testing.gpt as H

pool1 = pool_fixture(1)
pool2 = pool_fixture(2)


@pytest.fixture(autouse=True)
def _restore_knobs():
    from megatron_ext import megatron_lm
    from megatron_ext.layers import megatron_knobs

    yield
    bdcp.configure_cp_varlen()
    bdcp.configure_cp_kv_backward()
    bdcp.configure_cp_ulysses_size()
    bdcp.configure_cp_relayout()
    bdcp.configure_cp_strict()
    megatron_lm.reset_pins()
    megatron_knobs._APPLIED.clear()


# ---------------------------------------------------------------------------
# The config walk (issue 16, item 5)
# ---------------------------------------------------------------------------


def config_fields_read(path: pathlib.Path, class_name: str) -> set:
    """Fields read as ``config.X`` / ``self.config.X`` / ``getattr(config, "X")`` inside a class."""
    tree = ast.parse(path.read_text())
    fields = set()

    def is_config(node):
        return (isinstance(node, ast.Name) and node.id == "config") or (
            isinstance(node, ast.Attribute) and node.attr == "config"
            and isinstance(node.value, ast.Name) and node.value.id == "self")

    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and cls.name == class_name:
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and is_config(node.value):
                    fields.add(node.attr)
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                      and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                      and is_config(node.args[0]) and isinstance(node.args[1], ast.Constant)):
                    fields.add(node.args[1].value)
    return fields


def _megatron_core_roots():
    roots = [("installed", pathlib.Path(importlib.util.find_spec("megatron.core").submodule_search_locations[0]))]
    checkout = os.environ.get("MEGATRON_LM_PATH")
    if checkout and (pathlib.Path(checkout) / "megatron" / "core").is_dir():
        roots.append(("Megatron-LM checkout", pathlib.Path(checkout) / "megatron" / "core"))
    return roots


@pytest.mark.parametrize("which,root", _megatron_core_roots())
def test_every_field_megatrons_core_attentions_read_is_honoured_or_refused(which, root):
    from megatron_ext.layers.attention import CORE_ATTENTION_CONFIG

    read = config_fields_read(root / "transformer" / "dot_product_attention.py", "DotProductAttention")
    read |= config_fields_read(root / "extensions" / "transformer_engine.py", "TEDotProductAttention")
    assert len(read) >= 15, read  # the walk found the classes
    missing = sorted(read - set(CORE_ATTENTION_CONFIG))
    assert not missing, f"{which}: megatron's core attention reads {missing}, which our table does not list"


# Each refused field: a value it is refused at, and the flag a Megatron-LM user typed for it (None: a
# config-only field). The flags are Megatron-LM's own: tests/megatron_lm/test_megatron_lm.py finds each in its parser.
NON_DEFAULT = {"qk_clip": (True, "--qk-clip"), "log_max_attention_logit": (True, "--log-max-attention-logit"),
               "batch_invariant_mode": (True, "--batch-invariant-mode"),
               "deterministic_mode": (True, "--deterministic-mode"), "fp8_dot_product_attention": (True, None)}


def test_each_refused_field_is_refused_at_construction_naming_it_and_its_flag():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.layers import BlockDiagCPAttention
    from megatron_ext.layers.attention import CORE_ATTENTION_CONFIG

    refused = {f for f, rule in CORE_ATTENTION_CONFIG.items() if not rule.honoured}
    assert refused == set(NON_DEFAULT), refused  # a new refusal needs a value here
    BlockDiagCPAttention(H.config(cp=1), 1, AttnMaskType.causal, "self")  # the defaults pass
    for field, (value, flag) in NON_DEFAULT.items():
        cfg = H.config(cp=1)
        setattr(cfg, field, value)
        with pytest.raises(bdcp.BlockDiagCPError) as err:
            BlockDiagCPAttention(cfg, 1, AttnMaskType.causal, "self")
        message = str(err.value)
        assert "not supported by BlockDiagCPAttention" in message, message
        if flag:  # the field, the flag as typed, and the way out in the user's terms
            assert f"TransformerConfig.{field}=True ({flag})" in message, message
            assert f"drop {flag}" in message, message
        else:
            assert f"TransformerConfig.{field}=True (no Megatron-LM flag" in message, message
            assert f"set TransformerConfig.{field}=False" in message, message


@pytest.mark.parametrize("field,value,typed", [
    ("window_size", (5, 3), "--window-size 5 3"),          # a right reach: not causal
    ("softmax_type", "sigmoid", "--softmax-type sigmoid"),
    ("attention_backend", "local", "--attention-backend local"),
    ("cp_comm_type", "a2a+p2p", "--cp-comm-type a2a+p2p"),
    ("cp_comm_type", ["p2p", "a2a"], "--cp-comm-type p2p a2a"),  # per-layer exchanges
])
def test_other_config_refusals_name_the_field_and_the_flag_as_typed(field, value, typed):
    from megatron.core.transformer.enums import AttnBackend, AttnMaskType

    from megatron_ext.layers import BlockDiagCPAttention

    cfg = H.config(cp=1)
    setattr(cfg, field, getattr(AttnBackend, value) if field == "attention_backend" else value)
    with pytest.raises(bdcp.BlockDiagCPError) as err:  # at construction, before any step
        BlockDiagCPAttention(cfg, 1, AttnMaskType.causal, "self")
    assert f"TransformerConfig.{field}=" in str(err.value) and f"({typed})" in str(err.value), str(err.value)


def test_qk_clip_leaves_no_silent_clip_qk():
    # Megatron's clip_qk() reads core_attention.current_max_attn_logits; we refuse the config instead.
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.layers import BlockDiagCPAttention

    cfg = H.config(cp=1)
    cfg.qk_clip = True
    with pytest.raises(bdcp.BlockDiagCPError, match="QK-clip needs the max pre-softmax logit"):
        BlockDiagCPAttention(cfg, 1, AttnMaskType.causal, "self")


def test_mla_keywords_and_unequal_head_dims():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.layers import BlockDiagCPAttention
    from megatron_ext.testing import reference_attention

    cfg = H.config(cp=1)  # hidden 32, 4 heads: kv_channels 8
    layer = BlockDiagCPAttention(cfg, 1, AttnMaskType.causal, "self", k_channels=12, v_channels=12)
    assert (layer.k_channels, layer.v_channels, layer.hidden_size_per_attention_head) == (12, 12, 12)
    assert layer.softmax_scale == pytest.approx(12 ** -0.5)
    q = torch.randn(6, 1, 4, 12)
    assert layer(q, q, q, None).shape == (6, 1, 48)  # [sq, b, np * hn]
    # DeepSeek-V3's shape in small: q/k head dim 12, v head dim 8, MLA's own softmax scale.
    mla = BlockDiagCPAttention(cfg, 1, AttnMaskType.causal, "self", softmax_scale=0.3, k_channels=12, v_channels=8)
    k, v = torch.randn(6, 1, 4, 12), torch.randn(6, 1, 4, 8)
    out = mla(q, k, v, None)
    assert out.shape == (6, 1, 32)
    want = reference_attention(q, k, v, torch.ones(6, dtype=torch.long), scale=0.3).reshape(6, 1, 32)
    assert torch.allclose(out, want, atol=1e-6)


def test_window_mix_from_config_follows_megatrons_layer_rule():
    from megatron_ext.layers.attention import window_mix_from_config

    cfg = types.SimpleNamespace(num_layers=8, window_size=(128, 0), window_attn_skip_freq=4)
    assert window_mix_from_config(cfg) == bdcp.WindowMix(((128, 0.75), (None, 0.25)))  # every 4th layer full
    cfg = types.SimpleNamespace(num_layers=4, window_size=(128, 0), window_attn_skip_freq=[1, 0, 0, 1])
    assert window_mix_from_config(cfg) == bdcp.WindowMix.of(128, 0.5)
    assert window_mix_from_config(types.SimpleNamespace(num_layers=3, window_size=None,
                                                        window_attn_skip_freq=None)).full_only
    with pytest.raises(ValueError, match="num_layers"):
        window_mix_from_config(types.SimpleNamespace(num_layers=0, window_size=(128, 0)))


def test_window_per_layer_follows_megatrons_rule():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import is_layer_window_attention

    from megatron_ext.layers import BlockDiagCPAttention
    from megatron_ext.testing import reference_attention

    for skip in (None, 2, 3, [1, 0, 0, 1]):
        cfg = H.config(cp=1, layers=4)
        cfg.window_size, cfg.window_attn_skip_freq = (3, 0), skip
        for number in range(1, 5):
            layer = BlockDiagCPAttention(cfg, number, AttnMaskType.causal, "self")
            windowed = is_layer_window_attention((3, 0), skip, number)
            assert layer.window_size == ((3, 0) if windowed else None), (skip, number)
    q = torch.randn(10, 1, 4, 8)
    ids = torch.ones(10, dtype=torch.long)
    layer = BlockDiagCPAttention(cfg, 1, AttnMaskType.causal, "self")  # skip [1, 0, 0, 1]: layer 1 windowed
    assert torch.allclose(layer(q, q, q, None), reference_attention(q, q, q, ids, window=3).reshape(10, 1, 32),
                          atol=1e-6)
    cfg.window_size = (3, 2)  # not causal: refused when the layer runs
    with pytest.raises(bdcp.BlockDiagCPError, match="right must be 0"):
        BlockDiagCPAttention(cfg, 1, AttnMaskType.causal, "self")(q, q, q, None)


def _megatron_dot_product_attention(cfg):
    """megatron's own DotProductAttention on CPU (its softmax_offset asks for the current CUDA device)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    with H.cuda_calls_on_cpu():
        return DotProductAttention(cfg, 1, AttnMaskType.causal, "self")


def softmax_offset_checks(kind):
    """In a one-rank pool (megatron's DotProductAttention needs parallel_state)."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.layers import BlockDiagCPAttention
    from megatron_ext.testing import reference_attention

    H.ensure_mpu(tp=1, cp=1)
    cfg = H.config(cp=1, softmax_type=kind)
    ours = BlockDiagCPAttention(cfg, 1, AttnMaskType.causal, "self")
    theirs = _megatron_dot_product_attention(cfg)
    assert ours.softmax_offset.shape == theirs.softmax_offset.shape == (4,)
    assert ours.softmax_offset.dtype == theirs.softmax_offset.dtype
    assert set(ours.state_dict()) == set(theirs.state_dict())  # learnable: {"softmax_offset"}; off-by-one: {}
    assert isinstance(ours.softmax_offset, torch.nn.Parameter) == (kind == "learnable")
    if kind == "learnable":
        with torch.no_grad():
            theirs.softmax_offset.copy_(torch.randn(4))
        ours.load_state_dict(theirs.state_dict())  # megatron's checkpoint into ours ...
        theirs.load_state_dict(ours.state_dict())  # ... and back
        assert torch.equal(ours.softmax_offset, theirs.softmax_offset)
    q = torch.randn(7, 1, 4, 8, dtype=torch.float32)
    ids = torch.ones(7, dtype=torch.long)
    out = ours(q, q, q, None)
    want = reference_attention(q, q, q, ids, sink=ours.softmax_offset.detach()).reshape(7, 1, 32)
    assert torch.allclose(out, want, atol=1e-6)
    if kind == "learnable":  # the sink's gradient flows
        out.sum().backward()
        assert ours.softmax_offset.grad is not None and bool((ours.softmax_offset.grad != 0).all())
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["off-by-one", "learnable"])
def test_softmax_offset_is_megatrons_and_checkpoints_load_both_ways(pool1, kind):
    assert pool1.run(softmax_offset_checks, kind) == [True]


# ---------------------------------------------------------------------------
# Megatron's --attention-backend / --cp-comm-type drive our knobs
# ---------------------------------------------------------------------------


def _cfg(**kw):
    from megatron.core.transformer.enums import AttnBackend

    cfg = H.config(cp=1)
    if "attention_backend" in kw:
        kw["attention_backend"] = getattr(AttnBackend, kw["attention_backend"])
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize("backend,exchange,expected", [
    ("flash", None, ("flash", "allgather")), ("fused", "p2p", ("te", "halo")),
    ("unfused", "a2a", ("dense", "ulysses")), ("auto", "allgather", ("te", "allgather")),
    ("auto", "all_gather", ("te", "allgather")), ("auto", None, ("te", "allgather")),
])
def test_megatron_values_map_to_our_knobs(backend, exchange, expected):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.layers import BlockDiagCPAttention

    BlockDiagCPAttention(_cfg(attention_backend=backend), 1, AttnMaskType.causal, "self", cp_comm_type=exchange)
    assert tuple(bdcp.cp_varlen_runtime_config().values()) == expected


def test_a_later_model_with_megatrons_defaults_restores_ours():
    from megatron_ext.layers.megatron_knobs import apply_megatron_knobs

    assert apply_megatron_knobs(_cfg(attention_backend="flash"), "a2a") == {
        "attn_backend": "flash", "kv_exchange": "ulysses", "ulysses_size": 1}
    # a2a+p2p: Ulysses inside the first level of the hierarchical sizes, p2p (our halo) between.
    assert apply_megatron_knobs(_cfg(context_parallel_size=8, hierarchical_context_parallel_sizes=[4, 2]),
                                "a2a+p2p") == {"attn_backend": "te", "kv_exchange": "halo", "ulysses_size": 4}
    assert apply_megatron_knobs(_cfg(attention_backend="auto"), None) == {
        "attn_backend": "te", "kv_exchange": "allgather", "ulysses_size": 1}


@pytest.mark.parametrize("kw,exchange,needle", [
    ({"attention_backend": "local"}, None, "--attention-backend local"),
    ({}, "a2a+p2p", "--cp-comm-type a2a+p2p"),
    ({"cp_comm_type": ["p2p", "a2a", "a2a"]}, None, "different CP exchanges (layer 1: p2p; layers 2, 3: a2a)"),
    ({"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 1, 2]}, "a2a+p2p", "= [u, r]"),
    ({"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 3]}, "a2a+p2p",
     "u * r = context_parallel_size (4); got [2, 3]"),
])
def test_megatron_values_we_cannot_honour_are_refused(kw, exchange, needle):
    from megatron_ext.layers.megatron_knobs import apply_megatron_knobs

    with pytest.raises(bdcp.BlockDiagCPError) as err:
        apply_megatron_knobs(_cfg(**kw), exchange)
    assert needle in str(err.value)


def test_ours_set_in_python_win_over_megatrons_defaults_and_refuse_its_explicit_values():
    from megatron_ext.layers.megatron_knobs import apply_megatron_knobs

    bdcp.configure_cp_varlen("dense", "a2a")
    # Megatron's defaults (auto, p2p) give way.
    assert apply_megatron_knobs(_cfg(attention_backend="auto"), "p2p") == {"attn_backend": "dense",
                                                                          "kv_exchange": "a2a", "ulysses_size": 1}
    assert apply_megatron_knobs(_cfg(attention_backend="unfused"), None)["attn_backend"] == "dense"
    # Megatron's a2a is head-parallel CP, not our needed-rows a2a: an explicit disagreement.
    with pytest.raises(bdcp.BlockDiagCPError, match=r"kv_exchange='a2a'.*--cp-comm-type a2a.*'ulysses'.*disagree"):
        apply_megatron_knobs(_cfg(), "a2a")
    with pytest.raises(bdcp.BlockDiagCPError, match=r"configure_cp_varlen\(attn_backend='dense'\).*"
                                                    r"--attention-backend flash.*disagree"):
        apply_megatron_knobs(_cfg(attention_backend="flash"), None)
    with pytest.raises(bdcp.BlockDiagCPError, match="--cp-comm-type allgather"):
        apply_megatron_knobs(_cfg(), "allgather")
    bdcp.configure_cp_varlen("dense", "halo")
    bdcp.configure_cp_ulysses_size(2)
    with pytest.raises(bdcp.BlockDiagCPError, match=r"configure_cp_ulysses_size\(ulysses_size=2\).*"
                                                    r"--hierarchical-context-parallel-sizes 4 2.*disagree"):
        apply_megatron_knobs(_cfg(context_parallel_size=8, hierarchical_context_parallel_sizes=[4, 2]), "a2a+p2p")


# ---------------------------------------------------------------------------
# Megatron-LM's arguments (megatron_ext.megatron_lm), no checkout needed
# ---------------------------------------------------------------------------


def megatron_lm_args(**kw):
    base = dict(sft=False, dataloader_inter_document_masking=False, reset_attention_mask=True,
                create_attention_mask_in_dataloader=True, context_parallel_size=2,
                pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                hybrid_context_parallel=False)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("kw,needle", [
    ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}, "pipeline middle stages"),
    ({"pipeline_model_parallel_size": 3}, "pipeline middle stages"),
    ({"pipeline_model_parallel_size": 3, "context_parallel_size": 1}, "attend across documents"),
    ({"pipeline_model_parallel_size": 3, "reset_attention_mask": False}, "--context-parallel-size 2"),
    ({"create_attention_mask_in_dataloader": False}, "--no-create-attention-mask-in-dataloader"),
    ({"create_attention_mask_in_dataloader": False, "context_parallel_size": 1,
      "reset_attention_mask": True}, "--no-create-attention-mask-in-dataloader"),
    ({"hybrid_context_parallel": True}, "--hybrid-context-parallel"),
])
def test_megatron_lm_data_paths_that_would_lose_documents_are_refused(kw, needle):
    from megatron_ext import megatron_lm

    with pytest.raises(bdcp.BlockDiagCPError) as err:
        megatron_lm.check_data_path(megatron_lm_args(**kw))
    assert needle in str(err.value)
    if "middle" in needle or "no-create" in needle:
        assert "--dataloader-inter-document-masking" in str(err.value)


@pytest.mark.parametrize("kw", [
    {"pipeline_model_parallel_size": 2},  # two stages: both first or last, both get the mask
    {"pipeline_model_parallel_size": 4, "dataloader_inter_document_masking": True},
    {"pipeline_model_parallel_size": 3, "reset_attention_mask": False, "context_parallel_size": 1},
    {"create_attention_mask_in_dataloader": False, "reset_attention_mask": False, "context_parallel_size": 1},
    {"sft": True, "pipeline_model_parallel_size": 4},
])
def test_megatron_lm_data_paths_that_keep_documents_pass(kw):
    from megatron_ext import megatron_lm

    megatron_lm.check_data_path(megatron_lm_args(**kw))


def test_extra_args_provider_parses_checks_and_pins(monkeypatch):
    from megatron_ext import megatron_lm

    parser = megatron_lm.extra_args_provider(argparse.ArgumentParser())
    args = parser.parse_args(["--cp-attn-backend", "SDPA", "--cp-kv-exchange", "needed-a2a", "--cp-layout",
                              "megatron", "--cp-kv-backward", "keep", "--cp-relayout", "on",
                              "--cp-attn-backend-strict"])
    assert (args.cp_attn_backend, args.cp_kv_exchange, args.cp_layout, args.cp_kv_backward,
            args.cp_attn_backend_strict, args.cp_cost_model) == ("dense", "a2a", "zigzag", "save", True, "auto")
    assert parser.parse_args(["--cp-attn-backend", "auto"]).cp_attn_backend is None
    assert args.cp_relayout == "balanced" and parser.parse_args([]).cp_relayout is None
    for flag in ("--cp-attn-backend", "--cp-kv-exchange", "--cp-layout", "--cp-kv-backward", "--cp-relayout"):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([flag, "bogus"])
        assert exit_info.value.code == 2
    ns = argparse.Namespace(**vars(args), **vars(megatron_lm_args()))
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    knobs = megatron_lm.configure_from_args(ns)
    assert knobs == {"attn_backend": "dense", "kv_exchange": "a2a", "kv_backward": "save", "relayout": "balanced",
                     "strict": True}
    assert megatron_lm.pinned("kv_exchange") == ("a2a", "--cp-kv-exchange a2a")
    for bad, needle in ((dict(cp_layout="balanced"), "--cp-layout balanced"),
                        (dict(cp_cost_model="ib"), "--cp-cost-model ib")):
        with pytest.raises(bdcp.BlockDiagCPError, match=needle):
            megatron_lm.configure_from_args(argparse.Namespace(**{**vars(ns), **bad}))
    sft = argparse.Namespace(**{**vars(ns), "sft": True, "cp_layout": "thd"})
    megatron_lm.configure_from_args(sft)  # TE's per-document partition is what SFT cuts


def test_the_layer_applies_megatron_lm_args_at_build(monkeypatch):
    """Under Megatron-LM (its global args set), building the layer applies our flags and checks."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext import megatron_lm
    from megatron_ext.layers import BlockDiagCPAttention

    args = megatron_lm.extra_args_provider(argparse.ArgumentParser()).parse_args(
        ["--cp-kv-exchange", "a2a", "--cp-kv-backward", "refetch"])
    args = argparse.Namespace(**vars(args), **vars(megatron_lm_args(context_parallel_size=1)))
    fake = types.ModuleType("megatron.training.global_vars")
    fake._GLOBAL_ARGS = args
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", fake)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--cp-comm-type", "allgather"])
    cfg = _cfg()
    with pytest.raises(bdcp.BlockDiagCPError, match="--cp-kv-exchange a2a .* --cp-comm-type allgather"):
        BlockDiagCPAttention(cfg, 1, AttnMaskType.causal, "self", cp_comm_type="allgather")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])  # p2p, Megatron-LM's default, gives way
    BlockDiagCPAttention(cfg, 1, AttnMaskType.causal, "self", cp_comm_type="p2p")
    assert bdcp.cp_varlen_runtime_config()["kv_exchange"] == "a2a"
    assert bdcp.cp_kv_backward_runtime_config() == {"kv_backward": "refetch"}
    args.pipeline_model_parallel_size, args.context_parallel_size = 3, 1
    with pytest.raises(bdcp.BlockDiagCPError, match="attend across documents"):
        BlockDiagCPAttention(cfg, 1, AttnMaskType.causal, "self")


# ---------------------------------------------------------------------------
# The --spec attribute honours the config
# ---------------------------------------------------------------------------


def spec_and_megatron_models(case):
    """(our module tree, megatron's) for one config, both from the same seed."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.spec_utils import import_module

    from megatron_ext.layers.specs import torch_norms

    H.ensure_mpu(tp=1, cp=1)
    ours_spec = import_module(("megatron_ext.layers", "blockdiag_cp_gpt_layer_spec"))
    if case == "qk_layernorm":
        kw = dict(qk_layernorm=True, normalization="RMSNorm")
        theirs = torch_norms(specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"))
    else:
        kw = dict(num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[0, 1], gated_linear_unit=True,
                  add_bias_linear=False)
        theirs = None
    cfg = H.config(cp=1, **kw)
    if theirs is None:
        theirs = specs.get_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                                  normalization=cfg.normalization)
    ours = H.gpt_model(cfg, ours_spec, 16, seed=3)
    megatron = H.gpt_model(cfg, theirs, 16, seed=3)

    def tree(model):
        return [(name, type(m).__name__) for name, m in model.named_modules()
                if "core_attention" not in name and type(m).__name__ != "BlockDiagCPTransformerLayer"
                and type(m).__name__ != "TransformerLayer"]

    shapes = lambda m: {k: tuple(getattr(v, "shape", ())) for k, v in m.state_dict().items()}  # noqa: E731
    attn = [type(layer.self_attention.core_attention).__name__ for layer in ours.decoder.layers]
    return tree(ours), tree(megatron), shapes(ours), shapes(megatron), attn


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["qk_layernorm", "moe"])
def test_spec_builds_megatrons_layers_for_the_config(pool1, case):
    ((ours, theirs, ours_sd, theirs_sd, attn),) = pool1.run(spec_and_megatron_models, case)
    assert ours == theirs
    assert ours_sd == theirs_sd
    assert attn == ["BlockDiagCPAttention"] * 2
    kinds = dict(ours)
    if case == "qk_layernorm":
        assert kinds["decoder.layers.0.self_attention.q_layernorm"] != "IdentityOp"
    else:
        assert (kinds["decoder.layers.0.mlp"], kinds["decoder.layers.1.mlp"]) == ("MLP", "MoELayer")


def spec_refusals():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import import_module

    from megatron_ext.layers import BlockDiagCPTransformerLayer
    from megatron_ext.layers.specs import megatron_layer_spec_for
    from megatron_ext.testing import catch

    H.ensure_mpu(tp=1, cp=1)
    out = {}
    for field, value in (("experimental_attention_variant", "gated_delta_net"), ("mtp_num_layers", 1),
                         ("heterogeneous_block_specs", True), ("transformer_impl", "inference_optimized"),
                         ("use_kitchen_attention", True)):
        cfg = H.config(cp=1)
        setattr(cfg, field, value)
        out[field] = catch(lambda: megatron_layer_spec_for(cfg, 1))
    import copy

    spec = copy.deepcopy(import_module(("megatron_ext.layers", "blockdiag_cp_gpt_layer_spec")))
    spec.submodules.self_attention.submodules.core_attention = type("DotProductAttention", (), {})
    out["replaced"] = catch(lambda: BlockDiagCPTransformerLayer(H.config(cp=1), spec.submodules, 1))
    out["mask_type"] = str(AttnMaskType.causal)
    return out


@pytest.mark.timeout(120)
def test_spec_refuses_what_it_cannot_build_naming_the_flag(pool1):
    (out,) = pool1.run(spec_refusals)
    flags = {"experimental_attention_variant": "--experimental-attention-variant gated_delta_net",
             "mtp_num_layers": "--mtp-num-layers 1", "heterogeneous_block_specs": "--heterogeneous-layers-config-path",
             "transformer_impl": "--transformer-impl inference_optimized",
             "use_kitchen_attention": "--use-kitchen-attention"}
    for field, flag in flags.items():
        assert out[field] is not None and out[field][0] == "BlockDiagCPError", (field, out[field])
        assert f"TransformerConfig.{field}=" in out[field][1] and f"({flag})" in out[field][1], (field, out[field][1])
        assert f"drop {flag.split()[0]}" in out[field][1], (field, out[field][1])
    assert out["replaced"] is not None and "core attention was replaced by DotProductAttention" in out["replaced"][1]


# ---------------------------------------------------------------------------
# Attention dropout in megatron's model-parallel RNG fork
# ---------------------------------------------------------------------------


def _dropout_draws(make_layer, tracker, q, k, v, mpu, mask=None):
    """One attention layer with dropout on this TP rank: whether both TP ranks' outputs agree on the
    SAME q/k/v (the same mask), whether the default generator was left alone, and the gradient
    difference between a plain run and megatron's checkpoint (recompute) from the same tracker state."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    layer = make_layer()
    layer.train()
    torch.manual_seed(99)
    default_before = torch.get_rng_state()
    try:
        out = layer(q, k, v, mask)
    except Exception as exc:  # noqa: BLE001 - megatron's own layer without a tracker
        return {"error": f"{type(exc).__name__}: {exc}"}
    default_untouched = torch.equal(default_before, torch.get_rng_state())
    grads = []
    for recompute in (False, True):
        states = {name: s.clone() for name, s in tracker.get_states().items()}
        torch.manual_seed(7)
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        if recompute:
            o = tensor_parallel.checkpoint(lambda a, b, c: layer(a, b, c, mask), False, qq, kk, vv)
        else:
            o = layer(qq, kk, vv, mask)
        o.square().sum().backward()
        grads.append(torch.cat([t.grad.flatten() for t in (qq, kk, vv)]))
        if states:
            tracker.set_states(states)  # the same draw for the other run
    gathered = [torch.zeros_like(out) for _ in range(2)]
    dist.all_gather(gathered, out.detach().contiguous(), group=mpu.get_tensor_model_parallel_group())
    return {"tp_ranks_equal": torch.equal(gathered[0], gathered[1]), "default_untouched": default_untouched,
            "recompute_grad_diff": float((grads[0] - grads[1]).abs().max())}


def dropout_under_tensor_parallel(case):
    """Ours and megatron's own DotProductAttention, dropout 0.5, on TP ranks 0 and 1 fed the SAME q/k/v."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    import megatron_ext.layers.attention as attention
    from megatron_ext.layers import BlockDiagCPAttention

    mpu = H.ensure_mpu(tp=2, cp=1)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    saved = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state, attention.tracker_device)
    # CPU stands in for CUDA: the tracker's states are CPU generator states (megatron's own tracker and
    # checkpoint code runs; only its CUDA generator calls are redirected).
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    attention.tracker_device = lambda device: True
    try:
        cfg = H.config(cp=1, tp=2, sequence_parallel=(case == "sequence_parallel"))
        cfg.attention_dropout = 0.5
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(12, 1, 2, 8, generator=g, requires_grad=True) for _ in range(3))
        k, v = k[:, :, :1].detach().requires_grad_(), v[:, :, :1].detach().requires_grad_()  # GQA: 2 groups / TP 2
        # megatron's layer builds its default causal mask on "cuda": hand it the same mask (True = masked).
        causal = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)[None, None]
        out = {}
        for name, cls, mask in (("ours", BlockDiagCPAttention, None), ("megatron", DotProductAttention, causal)):
            tracker.reset()
            if case != "no_tracker":
                seed = 1234 + 2718 + mpu.get_tensor_model_parallel_rank()  # megatron's per TP rank
                tracker.set_states({"model-parallel-rng": torch.Generator().manual_seed(seed).get_state()})
            with H.cuda_calls_on_cpu():  # megatron's layer takes its score buffer on the current device
                out[name] = _dropout_draws(lambda: cls(cfg, 1, AttnMaskType.causal, "self"), tracker, q, k, v,
                                           mpu, mask)
        return out
    finally:
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state, attention.tracker_device = saved
        tracker.reset()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["tracker", "no_tracker", "sequence_parallel"])
def test_attention_dropout_draws_as_megatrons_core_attention(pool2, case):
    """Attention dropout takes megatron's model-parallel RNG fork exactly where megatron's core attentions
    do: its DotProductAttention (run here) and TEDotProductAttention, which hands TE
    sequence_parallel=config.sequence_parallel and the tracker when it is initialised; TE's
    DotProductAttention forks around dropout unless sequence_parallel or no tracker."""
    for r in pool2.run(dropout_under_tensor_parallel, case):
        ours, megatron = r["ours"], r["megatron"]
        if case == "tracker":
            # Each TP rank's heads drop independently; the default generator is left alone.
            assert not ours["tp_ranks_equal"] and ours["default_untouched"], r
        else:
            # No tracker (as TE, given none), or sequence parallel (as megatron's and TE's core attention):
            # the default generator, which megatron seeds alike on every TP rank: the same mask on both.
            assert ours["tp_ranks_equal"] and not ours["default_untouched"], r
        if case == "no_tracker":
            # megatron's local DotProductAttention forks unconditionally and fails without a tracker.
            assert "model-parallel-rng" in megatron["error"], megatron
        else:
            assert (ours["tp_ranks_equal"], ours["default_untouched"]) == \
                (megatron["tp_ranks_equal"], megatron["default_untouched"]), r
            assert megatron["recompute_grad_diff"] < 1e-6, r
        # Megatron's checkpoint recomputes the same dropout mask (restoring the tracker's state).
        assert ours["recompute_grad_diff"] < 1e-6, r
