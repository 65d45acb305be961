"""GPTModels that use a sliding window, attention sinks or MLA, one step at CP = 2 on gloo.

Each: our core attention in megatron-core's own layer spec for the config; loss and every
parameter gradient (summed over the CP ranks, the learnable ``softmax_offset`` included)
equal the same weights on one process with the independent reference core attention
(``megatron_ext.testing.gpt``), which honours the same config fields.
"""

import pytest

from megatron_ext.testing import pool_fixture
from megatron_ext.testing import gpt as H

TOL = 1e-5
S = 64


def variant_step(cfg_kwargs, layouts, exchanges):
    import torch

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.layers import get_gpt_layer_spec_with_blockdiag_cp

    mpu = H.ensure_mpu(tp=1, cp=2)
    group = mpu.get_context_parallel_group()
    torch.manual_seed(0)
    model = H.gpt_model(H.config(cp=2, **cfg_kwargs), get_gpt_layer_spec_with_blockdiag_cp(use_te=False), S)
    with torch.no_grad():  # a learnable sink drawn away from its zero init, so a wrong gradient shows
        for name, p in model.named_parameters():
            if name.endswith("softmax_offset"):
                p.copy_(torch.randn(p.shape) * 2)
    ref = H.reference_model(cfg_kwargs, S)
    ref.load_state_dict(model.state_dict())
    batch = H.make_batch(S, 1, seed=11)
    ref_loss, ref_grads = H.reference_loss_and_grads(ref, batch, bdcp.doc_ids_from_eod(batch["tokens"], H.EOD))
    out = {}
    for layout in layouts:
        for exchange in exchanges:
            loss_err, grad_err, _ = H.cp_step_errors(model, batch, group, layout, exchange, ref_loss, ref_grads)
            out[(layout, exchange)] = (loss_err, grad_err)
    names = sorted(n for n in ref_grads if "softmax_offset" in n)
    return out, names


pool2 = pool_fixture(2)

VARIANTS = {
    # layer 1 windowed, layer 2 whole documents (megatron: every 2nd layer skips the window)
    "window": dict(window_size=(5, 0), window_attn_skip_freq=2),
    "window_every_layer": dict(window_size=(2, 0)),
    "off_by_one": dict(softmax_type="off-by-one"),
    "learnable_sink": dict(softmax_type="learnable"),
    "learnable_sink_window": dict(softmax_type="learnable", window_size=(7, 0)),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_gpt_variant_one_step_equals_reference(pool2, name):
    results = pool2.run(variant_step, VARIANTS[name], ("contiguous", "zigzag", "balanced"), ("allgather", "a2a"))
    for per_rank, sinks in results:
        if "learnable" in name:
            assert sinks == ["decoder.layers.0.self_attention.core_attention.softmax_offset",
                             "decoder.layers.1.self_attention.core_attention.softmax_offset"], sinks
        for key, (loss_err, grad_err) in per_rank.items():
            assert loss_err < TOL and grad_err < TOL, (name, key, loss_err, grad_err)


MLA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, multi_latent_attention=True,
           q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
           rope_type="rope", normalization="RMSNorm")


def mla_step(exchanges):
    """An MLA GPTModel (megatron's MLA layer spec through blockdiag_cp_gpt_layer_spec) at CP = 2."""
    import torch

    import megatron_ext.blockdiag_cp as bdcp
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_ext.layers import blockdiag_cp_gpt_layer_spec
    from megatron_ext.layers.specs import torch_norms

    def model(cp, spec):
        cfg = MLATransformerConfig(context_parallel_size=cp, use_cpu_initialization=True,
                                   params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                                   bias_dropout_fusion=False, masked_softmax_fusion=False,
                                   gradient_accumulation_fusion=False, apply_rope_fusion=False, **MLA)
        torch.manual_seed(1)
        return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=H.VOCAB, max_sequence_length=S,
                        position_embedding_type="none", share_embeddings_and_output_weights=False)

    with H.cuda_calls_on_cpu():  # megatron's MLA RoPE asks torch.cuda.current_device() at construction
        # The reference first, on a CP group of one (megatron's MLA RoPE slices by the CP group it sees).
        H.ensure_mpu(tp=1, cp=1)
        ref_spec = torch_norms(gpt_layer_specs.get_gpt_layer_local_spec(multi_latent_attention=True,
                                                                         normalization="RMSNorm"))
        ref_spec.submodules.self_attention.submodules.core_attention = H.make_reference_core_attention()
        try:
            ref = model(1, ref_spec)
        except TypeError as exc:  # 0.16: isinstance(self.linear_proj, TELinear) with TELinear None
            if "isinstance() arg 2" in str(exc):
                return {"skip": f"this megatron-core's MultiLatentAttention needs TransformerEngine ({exc})"}
            raise
        batch = H.make_batch(S, 1, seed=11)
        ref_loss, ref_grads = H.reference_loss_and_grads(ref, batch, bdcp.doc_ids_from_eod(batch["tokens"], H.EOD))
        mpu = H.ensure_mpu(tp=1, cp=2)
        ours = model(2, blockdiag_cp_gpt_layer_spec)
        ours.load_state_dict(ref.state_dict())
        group = mpu.get_context_parallel_group()
        out = {}
        for exchange in exchanges:
            # No packed_seq_params: megatron's MLA would read any as a THD batch; the step context carries
            # the state to the layers.
            loss_err, grad_err, _ = H.cp_step_errors(ours, batch, group, "zigzag", exchange, ref_loss, ref_grads,
                                                     carry_state=False)
            out[exchange] = (loss_err, grad_err)
        attention = ours.decoder.layers[0].self_attention.core_attention
        out["dims"] = (attention.k_channels, attention.v_channels)
        # MLA rotates inside its attention by zigzag-sliced positions: another layout is refused, on
        # every rank, before any K/V moves.
        try:
            H.cp_step_errors(ours, batch, group, "contiguous", "a2a", ref_loss, ref_grads, carry_state=False)
            out["refusal"] = None
        except bdcp.BlockDiagCPError as exc:
            out["refusal"] = str(exc)
    return out


@pytest.mark.timeout(600)
def test_mla_gpt_at_cp2_equals_reference(pool2):
    results = pool2.run(mla_step, ("allgather", "halo", "a2a"))
    if "skip" in results[0]:
        pytest.skip(results[0]["skip"])
    for out in results:
        assert out.pop("dims") == (12, 6)  # q/k head dim 8 + 4 (RoPE part), v head dim 6
        refusal = out.pop("refusal")
        assert refusal is not None and "'contiguous' layout" in refusal and "layout='zigzag'" in refusal, refusal
        for exchange, (loss_err, grad_err) in out.items():
            assert loss_err < TOL and grad_err < TOL, (exchange, loss_err, grad_err)


def softmax_offset_under_tp():
    """Our learnable sink at TP = 2: megatron's shard of the heads, and its sharded checkpoint entry."""
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.layers import BlockDiagCPAttention

    H.ensure_mpu(tp=2, cp=1)
    cfg = H.config(cp=1, tp=2, softmax_type="learnable")
    torch.manual_seed(3)
    ours = BlockDiagCPAttention(cfg, 1, AttnMaskType.causal, "self")
    with H.cuda_calls_on_cpu():
        torch.manual_seed(3)
        theirs = DotProductAttention(cfg, 1, AttnMaskType.causal, "self")

    mpu = H.ensure_mpu(tp=2, cp=1)
    metadata = {"dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}

    def entry(module):
        sharded = module.sharded_state_dict(prefix="core_attention.", metadata=metadata)[
            "core_attention.softmax_offset"]
        return sharded.key, tuple(sharded.global_shape), tuple(sharded.global_offset), tuple(sharded.data.shape)

    return {"shape": tuple(ours.softmax_offset.shape), "same_init": bool(torch.equal(ours.softmax_offset,
                                                                                      theirs.softmax_offset)),
            "ours": entry(ours), "theirs": entry(theirs)}


@pytest.mark.timeout(120)
def test_softmax_offset_is_sharded_over_tp_as_megatrons(pool2):
    for rank, out in enumerate(pool2.run(softmax_offset_under_tp)):
        assert out["shape"] == (2,), out  # 4 heads over TP = 2
        assert out["same_init"], out
        assert out["ours"] == out["theirs"], out
        assert out["ours"][1:3] == ((4,), (2 * rank,)), out  # this rank's heads of the global [4]
