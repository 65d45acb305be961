"""Megatron's own data paths, no shard_batch, no step context: the layer spec is the only change.

- ``--spec megatron_ext.layers blockdiag_cp_gpt_layer_spec`` resolved exactly as Megatron-LM does;
  batches from megatron's ``_get_ltor_masks_and_position_ids(reset_attention_mask=True,
  reset_position_ids=True)``, cut by megatron's ``get_batch_on_this_cp_rank``;
- THD ``PackedSeqParams`` partitioned by megatron's ``get_thd_batch_on_this_cp_rank`` (its
  TransformerEngine index kernel replaced by our pure-torch ``thd_partitioned_indices``);
- a pipeline-style schedule (forward 1, forward 2, backward 2, backward 1) with selective
  recompute of core attention, backward outside any step context.

Each: loss and every parameter gradient (summed over CP) against one process running the
same weights with an independent dense per-document reference attention.
"""

import pytest
import torch

import megatron_ext.testing.gpt as H
from megatron_ext.testing import pool_fixture

TOL = 1e-5
S = 48  # a multiple of 2 * cp for cp = 1, 2, 3, 4


pool1 = pool_fixture(1)  # GPTModel needs megatron's parallel state, so CP = 1 runs in a 1-rank group


pool2 = pool_fixture(2)


pool3 = pool_fixture(3)


pool4 = pool_fixture(4)


def _spec_model(cp, seed=1, **kw):
    from megatron.core.transformer.spec_utils import import_module

    spec = import_module(("megatron_ext.layers", "blockdiag_cp_gpt_layer_spec"))  # as Megatron-LM's --spec
    return H.gpt_model(H.config(cp=cp, **kw), spec, S, seed)


def megatron_masked_batch(b, seed):
    """b rows with different documents: tokens, labels, loss mask, mask, positions from megatron."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    raw = H.make_batch(S, b, seed)
    masks, positions = [], []
    for row in raw["tokens"]:
        mask, _, pos = _get_ltor_masks_and_position_ids(row, H.EOD, True, True, False, True)
        masks.append(mask)
        positions.append(pos)
    return dict(raw, attention_mask=torch.stack(masks), position_ids=torch.stack(positions))


def reference_grads(ref, batch, doc_ids):
    H._REF["doc_ids"] = doc_ids
    losses = ref(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss = (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    ref.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def compare(model, loss, group, ref_loss, ref_grads):
    import torch.distributed as dist

    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = H.cp_reduced_grads(model, group)
    return H.rel(total, ref_loss), max(H.rel(grads[n], ref_grads[n]) for n in ref_grads)


def step_errors(model, local, total_tokens, exchange, group, ref_loss, ref_grads,
                attention_mask=None, packed_seq_params=None):
    """One forward+backward of this rank's micro batch (dense kernel, ``exchange``) vs the reference."""
    import megatron_ext.blockdiag_cp as bdcp

    bdcp.configure_cp_varlen("dense", exchange)
    try:
        model.zero_grad()
        losses = model(local["tokens"], local["position_ids"], attention_mask, labels=local["labels"],
                       packed_seq_params=packed_seq_params)
        loss = (losses * local["loss_mask"]).sum() / total_tokens
        loss.backward()
    finally:
        bdcp.configure_cp_varlen()
    return compare(model, loss, group, ref_loss, ref_grads)


# ---------------------------------------------------------------------------
# --spec with megatron's masks
# ---------------------------------------------------------------------------


def mask_path_matches_reference(cp, exchanges):
    import megatron_ext.blockdiag_cp as bdcp

    group = H.ensure_mpu(tp=1, cp=cp).get_context_parallel_group()
    model = _spec_model(cp)
    ref = H.reference_model({}, S)
    ref.load_state_dict(model.state_dict())
    batch = megatron_masked_batch(b=2, seed=21)
    ref_loss, ref_grads = reference_grads(ref, batch, bdcp.doc_ids_from_eod(batch["tokens"], H.EOD))
    out = {}
    for exchange in exchanges:
        local = H.megatron_batch_on_this_cp_rank(dict(batch), group)
        out[exchange] = step_errors(model, local, batch["loss_mask"].sum(), exchange, group, ref_loss,
                                    ref_grads, attention_mask=local["attention_mask"])
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pool_name", ["pool2", "pool3"])
def test_spec_with_megatron_masks_and_cp_slicing(request, pool_name):
    cp = int(pool_name[-1])
    # ulysses splits H.config's 4 query heads: where cp divides them
    results = request.getfixturevalue(pool_name).run(mask_path_matches_reference, cp, [
        "allgather", "a2a", "halo"] + (["ulysses"] if 4 % cp == 0 else []))
    for per_rank in results:
        for exchange, (loss_err, grad_err) in per_rank.items():
            assert loss_err < TOL and grad_err < TOL, (cp, exchange, loss_err, grad_err)


@pytest.mark.timeout(300)
def test_spec_is_a_module_spec_and_cp1_mask_takes_the_per_document_path(pool1):
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.layers import BlockDiagCPAttention

    spec = import_module(("megatron_ext.layers", "blockdiag_cp_gpt_layer_spec"))
    assert isinstance(spec, ModuleSpec)
    assert spec.submodules.self_attention.submodules.core_attention is BlockDiagCPAttention
    (out,) = pool1.run(mask_path_matches_reference, 1, ["allgather"])
    loss_err, grad_err = out["allgather"]
    assert loss_err < TOL and grad_err < TOL
    # CP = 1 mask mode plans documents (no O(S^2) masked attention): the state is cached on the mask.
    batch = megatron_masked_batch(b=2, seed=3)
    state = bdcp.resolve_step_state(None, batch["attention_mask"], batch=2)
    assert state.cp == 1 and state.rows == 2
    assert torch.equal(state.doc_ids, bdcp.doc_ids_from_eod(batch["tokens"], H.EOD))
    assert bdcp.resolve_step_state(None, batch["attention_mask"], batch=2) is state


@pytest.mark.parametrize("case", ["not_causal", "holes", "float"])
def test_masks_that_are_not_per_document_causal_are_refused(case):
    import megatron_ext.blockdiag_cp as bdcp

    mask = megatron_masked_batch(b=1, seed=4)["attention_mask"].clone()
    if case == "not_causal":
        mask[0, 0, 5, 9] = False  # a query sees a later key
        needle = "not per-document causal"
    elif case == "holes":
        mask[0, 0, 20, 18] = True  # a hole inside the visible run
        needle = "not per-document causal"
    else:
        mask = mask.float()
        needle = "must be a bool tensor"
    with pytest.raises(bdcp.BlockDiagCPError, match=needle):
        bdcp.resolve_step_state(None, mask)


def mask_errors_on_every_rank(case):
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing import catch

    mpu = H.ensure_mpu(tp=1, cp=2)
    group = mpu.get_context_parallel_group()
    rank = dist.get_rank()
    local = H.megatron_batch_on_this_cp_rank(
        megatron_masked_batch(b=1, seed=5 + (rank if case == "differs" else 0)), group)
    mask = local["attention_mask"]
    if case == "bad_on_rank0" and rank == 0:
        mask = mask.clone()
        mask[0, 0, 3, :] = True  # a row that sees nothing
    err = catch(lambda: bdcp.resolve_step_state(None, mask, cp_group=group))
    explicit = catch(lambda: bdcp.BlockDiagCPState.from_source(
        bdcp.resolve.MegatronMaskSource(local["attention_mask"], 2, rank), cp_group=group, layout="balanced"))
    dist.barrier()
    return err, explicit


@pytest.mark.timeout(120)
def test_mask_errors_raise_on_every_rank(pool2):
    for err, explicit in pool2.run(mask_errors_on_every_rank, "bad_on_rank0"):
        assert err is not None and err[0] == "BlockDiagCPError" and "per-document causal" in err[1], err
        assert explicit is not None and "already sliced 'zigzag'" in explicit[1], explicit
    for err, _ in pool2.run(mask_errors_on_every_rank, "differs"):
        assert err is not None and "do not form one per-document causal mask" in err[1], err


# ---------------------------------------------------------------------------
# THD packed sequences, partitioned as TransformerEngine does
# ---------------------------------------------------------------------------

THD_LENGTHS = (7, 1, 12, 3, 9)  # odd lengths, a length-1 document


def thd_batch(cp, seed):
    """A packed [1, T] batch: each document padded to a multiple of 2 * cp (as SFT/Bridge pack)."""
    g = torch.Generator().manual_seed(seed)
    multiple = 2 * cp if cp > 1 else 1
    padded = [-(-n // multiple) * multiple for n in THD_LENGTHS]
    cu = torch.tensor([0] + list(torch.tensor(THD_LENGTHS).cumsum(0)), dtype=torch.int32)
    cu_padded = torch.tensor([0] + list(torch.tensor(padded).cumsum(0)), dtype=torch.int32)
    T = int(cu_padded[-1])
    tokens = torch.zeros(1, T, dtype=torch.long)
    labels = torch.zeros(1, T, dtype=torch.long)
    loss_mask = torch.zeros(1, T)
    positions = torch.zeros(1, T, dtype=torch.long)
    doc_ids = torch.zeros(1, T, dtype=torch.long)
    for i, n in enumerate(THD_LENGTHS):
        a = int(cu_padded[i])
        seq = torch.randint(4, H.VOCAB, (n + 1,), generator=g)
        tokens[0, a:a + n], labels[0, a:a + n] = seq[:-1], seq[1:]
        loss_mask[0, a:a + n] = 1
        positions[0, a:a + n] = torch.arange(n)
        doc_ids[0, a:a + n] = i + 1
    batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": positions}
    return batch, cu, cu_padded, doc_ids


def megatron_thd_slice(batch, cu, cu_padded, cp, rank, group):
    """This rank's THD batch and PackedSeqParams, cut by the installed megatron-core's own code, with
    TE's index kernel (``tex.thd_get_partitioned_indices``, CUDA) replaced by our pure-torch one."""
    import megatron.core.utils as mcore_utils

    import megatron_ext.blockdiag_cp as bdcp

    te_double = type("tex", (), {"thd_get_partitioned_indices": staticmethod(bdcp.thd_partitioned_indices)})
    saved = (getattr(mcore_utils, "tex", None), mcore_utils.is_te_min_version)
    mcore_utils.tex, mcore_utils.is_te_min_version = te_double, (lambda *a, **k: True)
    try:
        return _megatron_thd_slice(mcore_utils, batch, cu, cu_padded, cp, rank, group)
    finally:
        mcore_utils.tex, mcore_utils.is_te_min_version = saved


def _megatron_thd_slice(mcore_utils, batch, cu, cu_padded, cp, rank, group):
    from megatron.core.packed_seq_params import PackedSeqParams

    max_seqlen = int(cu_padded.diff().max())
    if hasattr(mcore_utils, "get_thd_batch_on_this_cp_rank"):  # megatron-core 0.16
        return mcore_utils.get_thd_batch_on_this_cp_rank(
            dict(batch), cu, cu_padded, torch.tensor([max_seqlen]), cp_size=cp, cp_rank=rank)
    # megatron-core 0.19: get_batch_on_this_cp_rank's per-document balancing (TE's partition)
    local = H.megatron_batch_on_this_cp_rank(
        dict(batch, cu_seqlens=cu.view(1, -1), cu_seqlens_padded=cu_padded.view(1, -1)), group)
    return local, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                  cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                                  max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def thd_path_matches_reference(cp, exchanges, sft_form=False):
    import torch.distributed as dist

    group = H.ensure_mpu(tp=1, cp=cp).get_context_parallel_group()
    batch, cu, cu_padded, doc_ids = thd_batch(cp, seed=31)
    T = batch["tokens"].shape[1]
    from megatron.core.transformer.spec_utils import import_module

    model = H.gpt_model(H.config(cp=cp), import_module(("megatron_ext.layers", "blockdiag_cp_gpt_layer_spec")), T)
    ref = H.reference_model({}, T)
    ref.load_state_dict(model.state_dict())
    ref_loss, ref_grads = reference_grads(ref, batch, doc_ids)
    local, params = megatron_thd_slice(batch, cu, cu_padded, cp, dist.get_rank(group), group)
    if sft_form:
        # Megatron-LM's SFT forward_step: cu_seqlens_q = cu_seqlens_kv = cu_seqlens_padded (its TODO).
        from megatron.core.packed_seq_params import PackedSeqParams

        padded = params.cu_seqlens_q_padded
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=padded, cu_seqlens_kv=padded,
                                 cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                                 max_seqlen_q=params.max_seqlen_q, max_seqlen_kv=params.max_seqlen_kv)
    out = {}
    for exchange in exchanges:
        out[exchange] = step_errors(model, local, batch["loss_mask"].sum(), exchange, group, ref_loss,
                                    ref_grads, packed_seq_params=params) + (
            params._blockdiag_cp_state[1].layout.name,)
    return out


@pytest.mark.timeout(300)
def test_thd_at_cp1(pool1):
    (out,) = pool1.run(thd_path_matches_reference, 1, ["allgather"])
    loss_err, grad_err, layout = out["allgather"]
    assert loss_err < TOL and grad_err < TOL, (loss_err, grad_err)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pool_name", ["pool2", "pool4"])
def test_thd_per_document_partition_with_cp(request, pool_name):
    cp = int(pool_name[-1])
    results = request.getfixturevalue(pool_name).run(thd_path_matches_reference, cp,
                                                     ["allgather", "a2a", "halo", "ulysses"])
    for per_rank in results:
        for exchange, (loss_err, grad_err, layout) in per_rank.items():
            assert layout == "thd", layout
            assert loss_err < TOL and grad_err < TOL, (cp, exchange, loss_err, grad_err)


@pytest.mark.timeout(300)
def test_thd_sft_form_cu_seqlens_q_equal_to_padded(pool2):
    """Megatron-LM's SFT path passes cu_seqlens_q = cu_seqlens_padded: documents are the padded
    extents, padding at each one's end, so every real token (the loss) is exact."""
    for per_rank in pool2.run(thd_path_matches_reference, 2, ["allgather", "a2a"], True):
        for exchange, (loss_err, grad_err, layout) in per_rank.items():
            assert layout == "thd", layout
            assert loss_err < TOL and grad_err < TOL, (exchange, loss_err, grad_err)


def thd_attention_errors(cp, cu, cu_padded, doc_ids, params=None, seed=0, exchange="a2a"):
    """Megatron's THD core-attention call on this rank's share vs the fp64 reference on the whole pack:
    (positions the state holds == TE's partition, output error, largest q/k/v gradient error), each
    relative to the reference's largest value.

    The share is cut by megatron's ``get_thd_batch_on_this_cp_rank`` (TE's index kernel replaced by
    ``thd_partitioned_indices``); ``params``: the PackedSeqParams to pass (default: the ones megatron
    made for this batch).
    """
    import torch.distributed as dist
    from megatron.core.transformer.enums import AttnMaskType

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.layers import BlockDiagCPAttention
    from megatron_ext.testing import reference_attention

    group = H.ensure_mpu(tp=1, cp=cp).get_context_parallel_group()
    layer = BlockDiagCPAttention(H.config(cp=cp), 1, AttnMaskType.causal, "self")
    T = int(cu_padded[-1])
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, 1, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    grad_out = torch.randn(T, 1, 4, 8, generator=g, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*full, doc_ids)  # [T, 1, 4, 8]
    ref.backward(grad_out)
    # megatron-core 0.19 slices only its sequence keys (tokens, labels, loss_mask, position_ids):
    # the share is read off the positions it hands this rank, and q/k/v/grad are cut at them.
    batch = {"tokens": torch.zeros(1, T, dtype=torch.long), "position_ids": torch.arange(T).view(1, T)}
    local, megatron_params = megatron_thd_slice(batch, cu, cu_padded, cp, dist.get_rank(group), group)
    params = megatron_params if params is None else params
    mine = local["position_ids"][0]  # [t] the global positions TE's partition gave this rank
    ours = [t[mine, 0].clone().requires_grad_() for t in (q, k, v)]  # [t, h, d] as megatron squeezes
    bdcp.configure_cp_varlen("dense", exchange)
    try:
        out = layer(*ours, None, packed_seq_params=params)  # [t, h * d]
    finally:
        bdcp.configure_cp_varlen()
    out.backward(grad_out[mine, 0].reshape(out.shape))
    state = params._blockdiag_cp_state[1]

    def err(got, want):  # relative to the whole pack's largest value: a rank may hold only rows whose
        # exact gradient is 0 (a document's first query sees one key), where a per-rank scale is noise
        return float((got - want[mine, 0].reshape(got.shape)).abs().max() / want.abs().max())

    return (torch.equal(state.local_positions, mine), err(out.detach(), ref.detach()),
            max(err(ours[i].grad, full[i].grad) for i in range(3)))


def thd_empty_documents(cp, names, exchange):
    from megatron_ext.testing.cases import thd_case

    return {name: thd_attention_errors(cp, *thd_case(name, cp), seed=i, exchange=exchange)
            for i, name in enumerate(names)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pool_name", ["pool2", "pool3"])
def test_thd_empty_documents_match_te_partition_and_reference(request, pool_name):
    """Issue 32's packs with an empty document (a padded extent of its own) or an empty trailing
    padding sequence, and more: the state holds TE's partition, attention matches the reference."""
    from megatron_ext.testing.cases import THD_EMPTY_DOCUMENT_CASES

    cp = int(pool_name[-1])
    pool = request.getfixturevalue(pool_name)
    for exchange in ("allgather", "a2a") + (("ulysses",) if cp == 2 else ()):  # ulysses: 4 query heads
        for per_rank in pool.run(thd_empty_documents, cp, list(THD_EMPTY_DOCUMENT_CASES), exchange):
            for name, (same_positions, out_err, grad_err) in per_rank.items():
                assert same_positions, (cp, exchange, name)
                assert out_err < 1e-12 and grad_err < 1e-12, (cp, exchange, name, out_err, grad_err)


def thd_reused_params():
    """One PackedSeqParams object carried over micro batches, as static-buffer loaders do: new cu_seqlens
    written in place (copy_, and .data, which the version counter does not see), then new tensors
    assigned to its fields. Per micro batch: (errors as thd_attention_errors, states built so far)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_ext.blockdiag_cp import resolve
    from megatron_ext.testing.cases import thd_doc_ids

    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    first = (i32(0, 5, 7, 13), i32(0, 8, 12, 20))  # cp = 2, 20 tokens, three documents
    second = (i32(0, 3, 7, 14), i32(0, 4, 12, 20))  # the same shapes: written in place
    third = (i32(0, 9, 10), i32(0, 12, 20))  # two documents: new tensors
    fourth = (i32(0, 3, 12), i32(0, 4, 20))
    cu, padded = (t.clone() for t in first)
    # As megatron's get_thd_batch_on_this_cp_rank builds it: q and kv share the tensors.
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                             cu_seqlens_kv_padded=padded, max_seqlen_q=12, max_seqlen_kv=12)
    builds = []

    class CountingSource(resolve.ThdSource):
        def __init__(self, *args, **kwargs):
            builds.append(1)
            super().__init__(*args, **kwargs)

    def step(batch, seed):
        return thd_attention_errors(2, *batch, thd_doc_ids(*batch), params=params, seed=seed), len(builds)

    real_source, resolve.ThdSource = resolve.ThdSource, CountingSource
    try:
        out = {"first": step(first, 0), "first_again": step(first, 1)}
        params.cu_seqlens_q.copy_(second[0])
        params.cu_seqlens_q_padded.copy_(second[1])
        out["copy_"] = step(second, 2)
        out["copy_again"] = step(second, 3)
        params.cu_seqlens_q = params.cu_seqlens_kv = third[0].clone()
        params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = third[1].clone()
        out["assigned"] = step(third, 4)
        params.cu_seqlens_q.data.copy_(fourth[0])
        params.cu_seqlens_q_padded.data.copy_(fourth[1])
        out["data_write"] = step(fourth, 5)
    finally:
        resolve.ThdSource = real_source
    return out


@pytest.mark.timeout(300)
def test_reused_thd_params_rebuild_when_their_cu_seqlens_change(pool2):
    """A params object whose cu_seqlens change (in place or reassigned) gets a new state; an unchanged
    one keeps its state (no new build)."""
    want_builds = {"first": 1, "first_again": 1, "copy_": 2, "copy_again": 2, "assigned": 3, "data_write": 4}
    for out in pool2.run(thd_reused_params):
        for case, ((same_positions, out_err, grad_err), builds) in out.items():
            assert same_positions, case
            assert out_err < 1e-12 and grad_err < 1e-12, (case, out_err, grad_err)
            assert builds == want_builds[case], (case, builds)


# ---------------------------------------------------------------------------
# A pipeline-style schedule: backward later, outside any step context
# ---------------------------------------------------------------------------


def _raise_in_backward(*args, **kwargs):
    raise RuntimeError("injected failure in the kernel's backward")


def _fails_in_backward():
    """The dense kernel, with a backward that breaks."""
    from megatron_ext.blockdiag_cp import kernels

    return kernels.Kernel(kernels.dense_forward, _raise_in_backward)


def schedule_forward_later_backward():
    """forward 1, forward 2, backward 2, backward 1 (recompute of core attention in each)."""
    import contextlib

    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing import catch, override_kernel

    group = H.ensure_mpu(tp=1, cp=2).get_context_parallel_group()
    bdcp.configure_cp_varlen("dense", "a2a")
    with H.cpu_tensor_parallel_checkpoint():
        model = _spec_model(2, recompute_granularity="selective", recompute_modules=["core_attn"])
        model.train()
        ref = H.reference_model({}, S)
        ref.load_state_dict(model.state_dict())
        batches = [megatron_masked_batch(b=1, seed=s) for s in (41, 42, 43, 44)]
        refs = [reference_grads(ref, bt, bdcp.doc_ids_from_eod(bt["tokens"], H.EOD)) for bt in batches[:2]]

        def forward(bt):
            local = H.megatron_batch_on_this_cp_rank(dict(bt), group)
            losses = model(local["tokens"], local["position_ids"], local["attention_mask"],
                           labels=local["labels"])
            return (losses * local["loss_mask"]).sum() / bt["loss_mask"].sum()

        bdcp.reset_cp_attn_fire_count()
        model.zero_grad()
        first, second = forward(batches[0]), forward(batches[1])  # no step context anywhere
        second.backward()
        grads_2 = H.cp_reduced_grads(model, group)
        model.zero_grad()
        first.backward()
        grads_1 = H.cp_reduced_grads(model, group)
        fires = bdcp.cp_attn_fire_count()
        errors = (max(H.rel(grads_1[n], refs[0][1][n]) for n in grads_1),
                  max(H.rel(grads_2[n], refs[1][1][n]) for n in grads_2))

        # A kernel failure in a backward that runs later (rank 0 only): no error there, then the
        # next microbatch's build raises it on every rank.
        third = forward(batches[2])
        broken = override_kernel("dense", _fails_in_backward()) if dist.get_rank() == 0 \
            else contextlib.nullcontext()
        with broken:
            silent = catch(third.backward)
        raised = catch(lambda: forward(batches[3]))
        after = catch(lambda: forward(batches[3]))  # raised once; the next step runs again
        dist.barrier()
    bdcp.configure_cp_varlen()
    return errors, fires, silent, raised, after


@pytest.mark.timeout(300)
def test_schedule_backward_outside_any_step_and_failures_raised_at_next_build(pool2):
    for rank, ((err_1, err_2), fires, silent, raised, after) in enumerate(
            pool2.run(schedule_forward_later_backward)):
        assert err_1 < TOL and err_2 < TOL, (err_1, err_2)
        assert fires == 8, fires  # 2 microbatches x 2 layers x (forward + recompute)
        assert silent is None
        assert raised is not None and raised[0] == "BlockDiagCPError", raised
        assert "kernel failed" in raised[1] and "raised at this step's build" in raised[1], raised
        if rank == 0:  # the rank whose kernel broke names the cause
            assert "injected failure in the kernel's backward" in raised[1], raised
        assert after is None


# ---------------------------------------------------------------------------
# megatron-core 0.19: GPTDataset(inter_document_masking=True), cut per sequence
# ---------------------------------------------------------------------------


def _has_inter_document_masking():
    import dataclasses

    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return any(f.name == "inter_document_masking" for f in dataclasses.fields(GPTDatasetConfig))


def inter_document_masking_matches_reference(tmp_dir, cp, exchange):
    import pathlib

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.spec_utils import import_module
    from megatron.core.utils import flatten_batch_for_packed_sequences

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.training import data

    group = H.ensure_mpu(tp=1, cp=cp).get_context_parallel_group()
    prefix = str(pathlib.Path(tmp_dir) / "docs")
    data.ensure_megatron_helpers(pathlib.Path(tmp_dir))
    tokenizer = data.ByteTokenizer()
    config = GPTDatasetConfig(
        random_seed=7, sequence_length=S, blend=([prefix], None), split="100,0,0",
        path_to_cache=str(pathlib.Path(tmp_dir) / "cache"), tokenizer=tokenizer,
        reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=False,
        create_attention_mask=False, inter_document_masking=True, context_parallel_size=cp)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [4, 0, 0], lambda: True, config).build()
    samples = [train[i] for i in range(2)]
    batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}
    batch = flatten_batch_for_packed_sequences(batch)  # [1, 2 * S], one cu_seqlens
    cu = batch["cu_seqlens"].squeeze(0).to(torch.int32)
    full = {k: batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids")}
    full["tokens"], full["labels"] = full["tokens"] % H.VOCAB, full["labels"] % H.VOCAB  # bytes -> tiny vocab
    T = full["tokens"].shape[1]
    doc_ids = bdcp.doc_ids_from_cu_seqlens(cu, T).unsqueeze(0)

    model = H.gpt_model(H.config(cp=cp),
                        import_module(("megatron_ext.layers", "blockdiag_cp_gpt_layer_spec")), T)
    ref = H.reference_model({}, T)
    ref.load_state_dict(model.state_dict())
    ref_loss, ref_grads = reference_grads(ref, full, doc_ids)
    local = H.megatron_batch_on_this_cp_rank(dict(full, cu_seqlens=batch["cu_seqlens"]), group,
                                             use_per_sequence_balancing=True)
    # As Megatron-LM's forward_step builds it for inter-document masking (no padded cu_seqlens).
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=int(cu.diff().max()), max_seqlen_kv=int(cu.diff().max()))
    return step_errors(model, local, full["loss_mask"].sum(), exchange, group, ref_loss, ref_grads,
                       packed_seq_params=params) + (params._blockdiag_cp_state[1].layout.name,)


@pytest.mark.timeout(300)
def test_megatron_019_inter_document_masking_per_sequence_cut(pool2, tmp_path):
    if not pool2.run(_has_inter_document_masking)[0]:
        pytest.skip("megatron-core < 0.19 has no GPTDatasetConfig.inter_document_masking "
                    "(make test-compat runs this on megatron-core 0.19)")
    from megatron_ext.training import data

    texts = tmp_path / "texts"
    texts.mkdir()
    for i, n in enumerate((5, 17, 30, 3, 41, 12, 9, 26, 60, 8)):
        (texts / f"doc{i}.txt").write_text("".join(chr(97 + (i * 7 + j) % 26) for j in range(n)))
    data.write_indexed_dataset(sorted(texts.iterdir()), str(tmp_path / "docs"), progress=False)
    for exchange in ("allgather", "a2a"):
        for loss_err, grad_err, layout in pool2.run(inter_document_masking_matches_reference,
                                                    str(tmp_path), 2, exchange):
            assert layout == "zigzag", layout
            assert loss_err < TOL and grad_err < TOL, (exchange, loss_err, grad_err)


@pytest.mark.parametrize("cp,rank", [(1, 0), (2, 1), (3, 0)])
def test_mask_row_check_equals_a_brute_force_check(monkeypatch, cp, rank):
    """The blockwise check finds exactly the rows a row-by-row comparison finds, on random edits."""
    from megatron_ext.blockdiag_cp import resolve
    from megatron_ext.testing.reference import doc_mask

    monkeypatch.setattr(resolve, "_MASK_ROW_BLOCK", 5)  # many blocks, documents straddling them
    S = 60
    g = torch.Generator().manual_seed(cp * 10 + rank)
    positions = resolve._zigzag_rows(S, cp, rank)
    for trial in range(60):
        lengths = torch.randint(1, 14, (S,), generator=g)
        ids = torch.repeat_interleave(torch.arange(1, S + 1), lengths)[:S]
        mask = (~doc_mask(ids))[:, positions].clone()  # [1, rows, S]
        for _ in range(trial % 4):  # 0 to 3 random flips
            r = int(torch.randint(0, positions.numel(), (1,), generator=g))
            c = int(torch.randint(0, S, (1,), generator=g))
            mask[0, r, c] = ~mask[0, r, c]
        starts = mask.view(torch.uint8).argmin(-1)
        keys = torch.arange(S)
        expected = (keys < starts[0, :, None]) | (keys > positions[:, None])
        brute = torch.nonzero((mask[0] != expected).any(-1)).flatten().tolist()
        found = resolve._first_non_document_row(mask, starts, positions)
        assert (found[1] if found else None) == (brute[0] if brute else None), (trial, found, brute)


def thd_bad_inputs():
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp.resolve import state_from_thd
    from megatron_ext.testing import catch

    group = dist.group.WORLD

    def params(cu, padded=None):
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)

    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    out = {
        "int64": catch(lambda: state_from_thd(params(torch.tensor([0, 8, 16])), 8, group)),
        "2d": catch(lambda: state_from_thd(params(i32(0, 8, 16).view(1, -1)), 8, group)),
        "decreasing": catch(lambda: state_from_thd(params(i32(0, 9, 8, 16)), 8, group)),
        "short_extent": catch(lambda: state_from_thd(params(i32(0, 5, 16), i32(0, 4, 16)), 8, group)),
        "tokens": catch(lambda: state_from_thd(params(i32(0, 3, 10), i32(0, 4, 12)), 5, group)),
        "not_multiple": catch(lambda: state_from_thd(params(i32(0, 3, 9), i32(0, 6, 12)), 6, group)),
        "kv_differs": catch(lambda: state_from_thd(
            PackedSeqParams(qkv_format="thd", cu_seqlens_q=i32(0, 4, 8), cu_seqlens_kv=i32(0, 2, 8)), 4,
            group)),
        "kv_padded_differs": catch(lambda: state_from_thd(
            PackedSeqParams(qkv_format="thd", cu_seqlens_q=i32(0, 3, 7), cu_seqlens_kv=i32(0, 3, 7),
                            cu_seqlens_q_padded=i32(0, 4, 8), cu_seqlens_kv_padded=i32(0, 8, 8)), 4,
            group)),
    }
    # The same doc ids on both ranks, other padded extents (rank 1: the empty document's padding
    # given to the first one): the layouts would differ.
    padded = i32(0, 8, 12, 20) if dist.get_rank() == 0 else i32(0, 12, 12, 20)
    out["extents_differ"] = catch(lambda: state_from_thd(params(i32(0, 5, 5, 11), padded), 10, group))
    # The same values in other tensors are fine (TE's callers often pass copies).
    same = state_from_thd(PackedSeqParams(qkv_format="thd", cu_seqlens_q=i32(0, 4, 8),
                                          cu_seqlens_kv=i32(0, 4, 8)), 4, group)
    out["kv_copy_layout"] = same.layout.name
    bdcp.configure_cp_thd_partition("per_document")
    try:
        out["knob_not_multiple"] = catch(lambda: state_from_thd(params(i32(0, 6, 12)), 6, group))
    finally:
        bdcp.configure_cp_thd_partition()
    bdcp.configure_cp_thd_partition("per_sequence")
    try:  # the explicit knob settles the ambiguous case
        state = state_from_thd(params(i32(0, 3, 9), i32(0, 6, 12)), 6, group)
        out["knob_per_sequence"] = state.layout.name
    finally:
        bdcp.configure_cp_thd_partition()
    dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_bad_thd_input_raises_on_every_rank(pool2):
    needles = {"int64": "1-D int32", "2d": "1-D int32", "decreasing": "decreases",
               "short_extent": "does not hold", "tokens": "this rank holds 5 tokens",
               "not_multiple": "configure_cp_thd_partition('per_sequence')",
               "knob_not_multiple": "not a multiple of 2 * cp = 4",
               "kv_differs": "cu_seqlens_kv = [0, 2, 8] differs from cu_seqlens_q = [0, 4, 8]",
               "kv_padded_differs": "cu_seqlens_kv_padded = [0, 8, 8] differs from cu_seqlens_q_padded",
               "extents_differ": "cu_seqlens_q_padded differs across the CP ranks"}
    for out in pool2.run(thd_bad_inputs):
        for case, needle in needles.items():
            assert out[case] is not None and out[case][0] == "BlockDiagCPError", (case, out[case])
            assert needle in out[case][1], (case, out[case][1])
        assert out["knob_per_sequence"] == "zigzag"
        assert out["kv_copy_layout"] == "zigzag"  # no padded cu_seqlens: the per-sequence cut
