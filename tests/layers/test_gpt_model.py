"""A megatron-core GPTModel with BlockDiagCPAttention, trained one step with CP on gloo.

Loss and every parameter gradient (summed over CP ranks) equal the same weights run
on one process with an independent per-document reference attention.
"""

import threading

import pytest

from megatron_ext.testing import pool_fixture
from megatron_ext.testing import gpt as H

TOL = 1e-5
S = 64


def _cp_model(cp, tp=1, **kw):
    from megatron_ext.layers import get_gpt_layer_spec_with_blockdiag_cp

    return H.gpt_model(H.config(cp=cp, tp=tp, **kw), get_gpt_layer_spec_with_blockdiag_cp(use_te=False), S)


def one_step_matches_reference(layouts, exchanges, b=1):
    import megatron_ext.blockdiag_cp as bdcp

    mpu = H.ensure_mpu(tp=1, cp=2)
    group = mpu.get_context_parallel_group()
    model = _cp_model(cp=2)
    ref = H.reference_model({}, S)
    ref.load_state_dict(model.state_dict())
    batch = H.make_batch(S, b, seed=11)
    ref_loss, ref_grads = H.reference_loss_and_grads(
        ref, batch, bdcp.doc_ids_from_eod(batch["tokens"], H.EOD))
    out = {}
    for layout in layouts:
        for exchange in exchanges:
            loss_err, grad_err, state = H.cp_step_errors(model, batch, group, layout, exchange,
                                                         ref_loss, ref_grads)
            out[(layout, exchange)] = (loss_err, grad_err, state.report()["kv_exchange"])
    return out


pool2 = pool_fixture(2)


@pytest.mark.timeout(600)
def test_gpt_one_step_every_layout_and_exchange(pool2):
    results = pool2.run(one_step_matches_reference, ("contiguous", "zigzag", "balanced"),
                        ("allgather", "halo", "a2a", "ulysses"))
    for per_rank in results:
        for key, (loss_err, grad_err, _) in per_rank.items():
            assert loss_err < TOL and grad_err < TOL, (key, loss_err, grad_err)


@pytest.mark.timeout(300)
def test_gpt_batch_of_two_rows(pool2):
    for per_rank in pool2.run(one_step_matches_reference, ("zigzag",), ("a2a",), 2):
        for key, (loss_err, grad_err, _) in per_rank.items():
            assert loss_err < TOL and grad_err < TOL, (key, loss_err, grad_err)


def recompute_cases(exchanges=("a2a", "halo")):
    """Thread-backward and interleaved-microbatch recompute, each against the reference (``exchanges``:
    the kv exchange of each)."""
    import megatron_ext.blockdiag_cp as bdcp

    mpu = H.ensure_mpu(tp=1, cp=2)
    group = mpu.get_context_parallel_group()
    with H.cpu_tensor_parallel_checkpoint():
        model = _cp_model(cp=2, recompute_granularity="selective", recompute_modules=["core_attn"])
        model.train()
        ref = H.reference_model({}, S)
        ref.load_state_dict(model.state_dict())
        out = {}

        # 1. backward (with recompute) on a thread other than the one that published the state
        batch = H.make_batch(S, 1, seed=21)
        ref_loss, ref_grads = H.reference_loss_and_grads(
            ref, batch, bdcp.doc_ids_from_eod(batch["tokens"], H.EOD))
        local, state = bdcp.shard_batch(batch, cp_group=group, layout="balanced", eod_token=H.EOD,
                                        attn_backend="dense", kv_exchange=exchanges[0])
        model.zero_grad()
        bdcp.reset_cp_attn_fire_count()
        with bdcp.blockdiag_cp_step(state):
            loss = H.cp_loss(model, local, state, batch["loss_mask"].sum())
            worker = threading.Thread(target=loss.backward)
            worker.start()
            worker.join()
        fires = bdcp.cp_attn_fire_count()
        grads = H.cp_reduced_grads(model, group)
        out["thread"] = (max(H.rel(grads[n], ref_grads[n]) for n in ref_grads), fires)

        # 2. forward A, forward B, backward A (recompute, outside any step), backward B
        batches = [H.make_batch(S, 1, seed=s) for s in (31, 32)]
        refs = [H.reference_loss_and_grads(ref, bt, bdcp.doc_ids_from_eod(bt["tokens"], H.EOD))
                for bt in batches]
        losses = []
        model.zero_grad()
        for bt in batches:
            local, state = bdcp.shard_batch(bt, cp_group=group, layout="contiguous", eod_token=H.EOD,
                                            attn_backend="dense", kv_exchange=exchanges[1])
            with bdcp.blockdiag_cp_step(state):
                losses.append(H.cp_loss(model, local, state, bt["loss_mask"].sum()))
        losses[0].backward()
        grads_a = H.cp_reduced_grads(model, group)
        model.zero_grad()
        losses[1].backward()
        grads_b = H.cp_reduced_grads(model, group)
        out["interleaved"] = (max(H.rel(grads_a[n], refs[0][1][n]) for n in grads_a),
                              max(H.rel(grads_b[n], refs[1][1][n]) for n in grads_b))
        return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("exchanges", [("a2a", "halo"), ("ulysses", "ulysses")], ids=["needed", "ulysses"])
def test_recompute_on_another_thread_and_interleaved_microbatches(pool2, exchanges):
    for per_rank in pool2.run(recompute_cases, exchanges):
        grad_err, fires = per_rank["thread"]
        assert grad_err < TOL
        assert fires == 4, "2 layers x (forward + recompute) must each fire once"
        assert max(per_rank["interleaved"]) < TOL, per_rank["interleaved"]


def rope_model_matches_reference(layouts):
    """GPTModel with RoPE under CP: each layout rotates tokens by their global positions."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.layers import get_gpt_layer_spec_with_blockdiag_cp, use_blockdiag_rope

    mpu = H.ensure_mpu(tp=1, cp=2)
    group = mpu.get_context_parallel_group()
    model = use_blockdiag_rope(H.gpt_model(H.config(cp=2), get_gpt_layer_spec_with_blockdiag_cp(use_te=False),
                                           S, position_embedding_type="rope"))
    # The reference runs outside any step: the same embedding class gives the plain (cp=1) table.
    ref = use_blockdiag_rope(H.reference_model({}, S, position_embedding_type="rope"))
    ref.load_state_dict(model.state_dict())
    batch = H.make_batch(S, 1, seed=41)
    ref_loss, ref_grads = H.reference_loss_and_grads(ref, batch, bdcp.doc_ids_from_eod(batch["tokens"], H.EOD))
    return {layout: H.cp_step_errors(model, batch, group, layout, "a2a", ref_loss, ref_grads)[:2]
            for layout in layouts}


@pytest.mark.timeout(300)
def test_rope_gpt_every_layout(pool2):
    for per_rank in pool2.run(rope_model_matches_reference, ("contiguous", "zigzag", "balanced")):
        for layout, (loss_err, grad_err) in per_rank.items():
            assert loss_err < TOL and grad_err < TOL, (layout, loss_err, grad_err)
