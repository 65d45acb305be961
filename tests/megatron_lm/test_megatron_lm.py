"""Megatron-LM's own ``pretrain_gpt.py``, unchanged, with ``--spec megatron_ext.layers
blockdiag_cp_gpt_layer_spec``, against a single-process reference (issue 17, item 5).

``megatron_ext.testing.megatron_lm`` runs, on CPU processes (gloo) with only CUDA calls patched
(its ``CUDA_PATCHES``), Megatron-LM's ``parse_and_validate_args``, both builder routes, its
mock dataset (or ``GPTDataset`` over megatron-written documents), ``get_batch``, ``forward_step``,
``loss_func`` and backward through megatron-core's schedules, at CP = 2 (and PP = 2 with virtual
stages), and compares the loss and every gradient with one process running megatron's own
``DotProductAttention`` on the same samples and weights.

Needs a Megatron-LM checkout (``MEGATRON_LM_PATH``; ``.ci/run`` sets it to the snapshot it ships
with) and a Python that runs it: Python >= 3.12 with megatron-core >= 0.19 installed (for its
compiled dataset helpers) -- this interpreter under ``make test-compat``, ``.venv-compat`` under
``make test``, or ``MEGATRON_LM_PYTHON``. The checkout is copied (never written to).

``MEGATRON_LM_RESULTS=FILE`` keeps the driver's JSON (per scenario: loss and gradient errors
against the reference, per route; the knobs and step reports): docs/user_guide/megatron_lm.md's numbers
are read from it.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TOL = 1e-5  # fp32; what the runs show is ~5e-8 (loss) and ~5e-7 (gradients)


def _runner():
    """(python, None) able to run the checkout, or (None, why not)."""
    explicit = os.environ.get("MEGATRON_LM_PYTHON")
    if explicit:
        return explicit, None
    if sys.version_info >= (3, 12):
        return sys.executable, None
    compat = REPO / ".venv-compat" / "bin" / "python"
    if compat.exists():
        return str(compat), None
    return None, (f"Megatron-LM's main branch needs Python >= 3.12 (this is {sys.version.split()[0]}) "
                  "with megatron-core >= 0.19 for its compiled dataset helpers: run make test-compat, "
                  "or build .venv-compat (make .venv-compat/.installed), or set MEGATRON_LM_PYTHON")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    source = os.environ.get("MEGATRON_LM_PATH")
    if not source:
        pytest.skip("MEGATRON_LM_PATH is not set: point it at a Megatron-LM checkout (pretrain_gpt.py, "
                    "megatron/core, megatron/training); .ci/run sets it when the snapshot is present")
    source = pathlib.Path(source)
    if not (source / "pretrain_gpt.py").exists():
        pytest.skip(f"MEGATRON_LM_PATH={source} holds no pretrain_gpt.py")
    python, why = _runner()
    if python is None:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("megatron_lm")
    checkout = root / "checkout"
    shutil.copytree(source, checkout)
    for path in checkout.rglob("*"):  # the source may be read-only; the copy gets the helpers .so
        path.chmod(path.stat().st_mode | 0o200)
    out = root / "results.json"
    env = dict(os.environ, PYTHONPATH=f"{checkout}{os.pathsep}{REPO}", CUDA_DEVICE_MAX_CONNECTIONS="1",
               NO_VCS_VERSION="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([python, "-m", "megatron_ext.testing.megatron_lm", "--checkout", str(checkout),
                           "--out", str(out)], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=600)
    if not out.exists():
        pytest.fail(f"the Megatron-LM driver wrote no results (exit {proc.returncode}):\n"
                    f"{proc.stderr[-4000:]}")
    keep = os.environ.get("MEGATRON_LM_RESULTS")
    if keep:
        shutil.copy(out, keep)
    data = json.loads(out.read_text())
    data["_log"] = proc.stderr[-2000:]
    return data


def _numbers(scenario):
    assert not scenario.get("errors"), (scenario.get("errors"), scenario.get("traceback", "")[-3000:])
    for route in ("legacy", "builder"):
        r = scenario["routes"][route]
        assert r["missing_params"] == [] and r["extra_params"] == [], (route, r)
        assert r["params_compared"] > 0
        assert r["loss_rel_err"] < TOL, (route, r)
        assert r["max_grad_rel_err"] < TOL, (route, r)
    # Both routes ran the same weights on the same samples.
    assert scenario["routes"]["legacy"]["loss_sum"] == pytest.approx(scenario["routes"]["builder"]["loss_sum"])
    for route, layers in scenario["layers"].items():
        assert layers and all(layer["ours"] for layer in layers), (route, layers)
        assert all(layer["layer_class"] == "BlockDiagCPTransformerLayer" for layer in layers), layers


def _refused(scenario, needle, world):
    errors = scenario.get("errors")
    assert errors, f"expected a refusal containing {needle!r}, the scenario ran: {scenario.get('routes')}"
    assert len(errors) == 1 and needle in errors[0], errors
    assert scenario["error_ranks"] == list(range(world)), scenario["error_ranks"]  # every rank


def test_mask_path_both_routes_match_the_reference(results):
    s = results["scenarios"]["mask"]
    _numbers(s)
    # The reference is megatron's own core attention with the mask its dataset built.
    assert all(layer["core_attention"] == "DotProductAttention" for layer in s["reference_layers"]["legacy"])
    # Without document masking the reference is far off: the comparison sees the documents.
    assert s["control_grad_rel_diff"] > 0.05, s["control_grad_rel_diff"]
    state = s["states"][0]
    assert state["layout"] == "zigzag" and state["cp"] == 2, state
    # Megatron's --cp-comm-type default p2p -> our halo exchange; --attention-backend auto -> ours.
    assert s["knobs"][0] == {"attn_backend": "te", "kv_exchange": "halo", "kv_backward": "auto",
                             "strict": False, "ulysses_size": 1}
    assert state["kv_exchange_requested"] == "halo" and state["attn_backend"] == "dense"  # CPU fallback


def test_inter_document_masking_thd_path_matches_the_reference(results):
    s = results["scenarios"]["thd"]
    _numbers(s)
    assert s["control_grad_rel_diff"] > 0.05, s["control_grad_rel_diff"]
    assert s["states"][0]["layout"] == "zigzag"  # megatron's per-sequence cut of the THD pack


def test_qk_layernorm_rmsnorm_rope(results):
    s = results["scenarios"]["qk_layernorm"]
    _numbers(s)
    for route, layers in s["layers"].items():
        assert all(l["q_layernorm"] == "RMSNorm" and l["k_layernorm"] == "RMSNorm" for l in layers), layers


def test_moe_with_layer_frequency(results):
    s = results["scenarios"]["moe"]
    _numbers(s)
    for route, layers in s["layers"].items():
        assert [l["mlp"] for l in layers] == ["MLP", "MoELayer"], (route, layers)  # --moe-layer-freq [0,1]
    assert [l["mlp"] for l in s["reference_layers"]["legacy"]] == ["MLP", "MoELayer"]


def test_pipeline_with_virtual_stages_thd_path(results):
    s = results["scenarios"]["pp_vp_thd"]
    _numbers(s)
    assert s["layout"] == {"cp": 2, "pp": 2, "vp": 2}
    # Every parameter of the 4 layers (on 2 stages x 2 chunks) was compared with the reference's.
    assert s["routes"]["legacy"]["params_compared"] == s["routes"]["legacy"]["reference_params"]
    layers = sorted(l["layer"] for l in s["layers"]["legacy"])
    assert layers == [1, 3], layers  # rank 0 holds virtual chunks 0 and 2 of 4 one-layer chunks


def test_pipeline_with_virtual_stages_mask_path_refused(results):
    s = results["scenarios"]["pp_vp_mask"]
    _refused(s, "pipeline middle stages", 4)
    assert "--dataloader-inter-document-masking" in s["errors"][0]


def test_megatron_flags_drive_our_knobs(results):
    s = results["scenarios"]["megatron_flags"]  # --attention-backend unfused --cp-comm-type a2a
    _numbers(s)
    # Megatron's a2a is head-parallel CP (Ulysses): ours, with the model's 4 heads split over cp 2.
    assert all(k["attn_backend"] == "dense" and k["kv_exchange"] == "ulysses" for k in s["knobs"]), s["knobs"]
    state = s["states"][0]
    assert (state["attn_backend_requested"], state["kv_exchange"]) == ("dense", "ulysses"), state


def test_our_flags_through_extra_args_provider(results):
    s = results["scenarios"]["our_flags"]
    _numbers(s)
    assert s["extra_args_provider"]
    assert all(k == {"attn_backend": "dense", "kv_exchange": "allgather", "kv_backward": "refetch",
                     "strict": True, "ulysses_size": 1} for k in s["knobs"]), s["knobs"]
    state = s["states"][0]
    assert (state["kv_exchange"], state["kv_backward"], state["strict"]) == ("allgather", "refetch", True)


def test_relayout_flag_attends_the_thd_batch_balanced(results):
    s = results["scenarios"]["thd_relayout"]
    _numbers(s)
    for states in s["states_by_rank"]:
        assert states and all(st["layout"] == "zigzag" and st["attended_layout"] == "balanced"
                              and st["relayout"] == "balanced" and st["kv_exchange"] == "a2a" for st in states), states


def test_our_flags_need_the_extra_args_provider(results):
    _refused(results["scenarios"]["our_flags_unknown_without_provider"],
             "unrecognized arguments: --cp-kv-exchange a2a", 2)


def test_ours_and_megatrons_disagreeing_is_refused(results):
    s = results["scenarios"]["conflict"]
    _refused(s, "disagree", 2)
    assert "--cp-kv-exchange a2a" in s["errors"][0] and "--cp-comm-type allgather" in s["errors"][0]


@pytest.mark.parametrize("scenario", ["a2a_p2p", "a2a_p2p_thd"])
def test_a2a_p2p_runs_two_dimensional_cp(results, scenario):
    # --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 at CP = 4, mask and THD paths: Ulysses
    # inside groups of 2 CP ranks, Megatron's p2p (our halo, a2a where halo does not apply) between the 2.
    s = results["scenarios"][scenario]
    _numbers(s)
    assert all(k["ulysses_size"] == 2 and k["kv_exchange"] == "halo" for k in s["knobs"]), s["knobs"]
    for rank, states in enumerate(s["states_by_rank"]):
        assert states and all(st["kv_exchange"] == "ulysses" and st["ulysses_size"] == 2 and st["ring_cp"] == 2
                              and st["ring_rank"] == rank // 2 and st["ring_kv_exchange"] in ("halo", "a2a")
                              for st in states), states


def test_a2a_p2p_with_three_levels_refused(results):
    s = results["scenarios"]["a2a_p2p_three_levels"]
    _refused(s, "--cp-comm-type a2a+p2p", 2)
    assert "--hierarchical-context-parallel-sizes) = [u, r]" in s["errors"][0], s["errors"]


def test_attention_backend_local_never_runs_without_our_layer(results):
    # Megatron-LM's own validate_args refuses it first, at parse time, with any --spec but local; our
    # layer and spec refuse it too where no such check runs (test_layer_config.py).
    s = results["scenarios"]["attention_backend_local"]
    _refused(s, "--attention-backend local is only supported with --spec local", 2)
    assert s["errors"][0].startswith("AssertionError"), s["errors"]  # validate_args' assert, not ours


def test_qk_clip_refused_by_megatron_lm_before_our_layer(results):
    # Without TE >= 2.9 Megatron-LM's validate_args stops --qk-clip at parse time; with it, our layer
    # refuses it at model build naming --qk-clip (test_layer_config.py).
    _refused(results["scenarios"]["qk_clip"], "--qk-clip is only supported with TE >= 2.9.0", 2)


def test_refusals_name_megatron_lms_own_flags(results):
    # Every flag our refusals name for a TransformerConfig field is an option of Megatron-LM's own
    # parser that stores into that field's argument; a field listed without a flag has none there.
    from megatron_ext.megatron_lm import MEGATRON_LM_ARG, MEGATRON_LM_FLAGS

    parsed = results["megatron_lm_flags"]
    assert set(parsed) == set(MEGATRON_LM_FLAGS), sorted(set(MEGATRON_LM_FLAGS) ^ set(parsed))
    for field, flag in MEGATRON_LM_FLAGS.items():
        assert parsed[field]["dest"] == MEGATRON_LM_ARG.get(field, field), (field, parsed[field])
        if flag is None:
            assert parsed[field]["options"] == [], (field, parsed[field])
        else:
            assert flag in parsed[field]["options"], (field, flag, parsed[field])


def test_moe_under_pipeline_numbers_layers_globally(results):
    s = results["scenarios"]["moe_pp"]  # PP = 2 x CP = 2, 4 layers, --moe-layer-freq [0,1,1,0]
    _numbers(s)
    assert s["layout"] == {"cp": 2, "pp": 2, "vp": None}
    assert s["routes"]["legacy"]["params_compared"] == s["routes"]["legacy"]["reference_params"]
    expected = {1: "MLP", 2: "MoELayer", 3: "MoELayer", 4: "MLP"}  # by global layer number
    seen = {}
    for rank_layers in s["layers_by_rank"]:
        for route, layers in rank_layers.items():
            for layer in layers:
                assert layer["mlp"] == expected[layer["layer"]], (route, layer)
                seen[layer["layer"]] = layer["mlp"]
    assert seen == expected, seen  # both stages were built and described
    assert [l["mlp"] for l in s["reference_layers"]["legacy"]] == list(expected.values())


def test_hierarchical_exchange_across_two_nodes(results):
    # CP = 4 as 2 nodes x 2 ranks (LOCAL_WORLD_SIZE=2): our two-level exchange runs as asked, on every
    # rank, and matches megatron's own attention.
    s = results["scenarios"]["hierarchical"]
    _numbers(s)
    assert s["layout"]["cp"] == 4
    assert all(k["kv_exchange"] == "hierarchical" for k in s["knobs"]), s["knobs"]
    for states in s["states_by_rank"]:
        assert states and all((st["kv_exchange"], st["kv_exchange_reason"]) == ("hierarchical", "as requested")
                              for st in states), states


def test_hierarchical_exchange_on_one_node_falls_back_with_the_reason(results):
    s = results["scenarios"]["hierarchical_one_node"]  # CP = 2, both ranks on one node
    assert not s.get("errors"), (s.get("errors"), s.get("traceback", "")[-3000:])
    assert all(k["kv_exchange"] == "hierarchical" for k in s["knobs"]), s["knobs"]  # what was asked
    for states in s["states_by_rank"]:
        assert states and all(st["kv_exchange_requested"] == "hierarchical" and st["kv_exchange"] == "a2a"
                              and st["kv_exchange_reason"] ==
                              "hierarchical not applicable: all 2 CP ranks sit on one node"
                              for st in states), states


def test_strict_flag_takes_effect(results):
    _refused(results["scenarios"]["strict_fallback"], "strict mode: attention backend 'te'", 2)


def test_mla_builds_megatrons_mla_layer_and_trains_a_step(results):
    # megatron's MLA layer (q/k head dim 8 + 4, v head dim 8) with our core attention, one step at CP = 2
    # on the mask path. Megatron's local core attention takes no MLA head dims, so there is no reference
    # here: tests/layers/test_gpt_variants.py compares an MLA GPTModel at CP = 2 with an independent one.
    s = results["scenarios"]["mla"]
    assert not s.get("errors"), (s.get("errors"), s.get("traceback", "")[-3000:])
    for route in ("legacy", "builder"):
        assert all(layer["self_attention"] == "MLASelfAttention" and layer["ours"] for layer in s["layers"][route])
    assert set(s["loss_sums"]) == {"legacy", "builder"}
    assert all(0 < v < float("inf") for v in s["loss_sums"].values()), s["loss_sums"]


def test_no_attention_mask_in_dataloader_refused(results):
    s = results["scenarios"]["no_mask_in_dataloader"]
    _refused(s, "--no-create-attention-mask-in-dataloader", 2)
    assert "--dataloader-inter-document-masking" in s["errors"][0]
