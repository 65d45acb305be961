"""TP x CP, layer-level errors, and RoPE positions under every layout."""

import pytest
import torch
import torch.distributed as dist

from megatron_ext.testing import WorkerPool, catch as _catch, pool_fixture
from megatron_ext.testing import gpt as H

S = 64


def tp2_cp2_loss():
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.layers import get_gpt_layer_spec_with_blockdiag_cp

    mpu = H.ensure_mpu(tp=2, cp=2)
    group = mpu.get_context_parallel_group()
    model = H.gpt_model(H.config(cp=2, tp=2), get_gpt_layer_spec_with_blockdiag_cp(use_te=False), S)
    # The reference has the same TP sharding (same seed, same TP rank) and no CP.
    ref = H.reference_model({"tp": 2}, S)
    ref.load_state_dict(model.state_dict())
    batch = H.make_batch(S, 1, seed=5)
    ref_loss, _ = H.reference_loss_and_grads(ref, batch, bdcp.doc_ids_from_eod(batch["tokens"], H.EOD))
    out = {}
    for layout, exchange in (("zigzag", "allgather"), ("balanced", "a2a"), ("contiguous", "halo")):
        local, state = bdcp.shard_batch(batch, cp_group=group, layout=layout, eod_token=H.EOD,
                                        attn_backend="dense", kv_exchange=exchange)
        with bdcp.blockdiag_cp_step(state):
            loss = H.cp_loss(model, local, state, batch["loss_mask"].sum())
            loss.backward()
        dist.all_reduce(loss.detach(), group=group)
        out[layout] = H.rel(loss.detach(), ref_loss)
    return out


@pytest.mark.timeout(300)
def test_tp2_cp2_gives_reference_loss():
    pool = WorkerPool(4)
    try:
        for per_rank in pool.run(tp2_cp2_loss):
            assert max(per_rank.values()) < 1e-5, per_rank
    finally:
        pool.close()


pool2 = pool_fixture(2)


def layer_errors():
    import megatron_ext.blockdiag_cp as bdcp
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.layers import BlockDiagCPAttention, packed_seq_params_for

    mpu = H.ensure_mpu(tp=1, cp=2)
    group = mpu.get_context_parallel_group()
    out = {}
    out["config_cp"] = _catch(lambda: BlockDiagCPAttention(H.config(cp=1), 1, AttnMaskType.causal, "self"))
    attn = BlockDiagCPAttention(H.config(cp=2), 1, AttnMaskType.causal, "self")
    q = torch.randn(S // 2, 1, 4, 8)
    kv = torch.randn(S // 2, 1, 2, 8)
    out["no_state"] = _catch(lambda: attn(q, kv, kv, None))
    doc_ids = torch.ones(S, dtype=torch.long)
    short = bdcp.BlockDiagCPState.build(doc_ids[: S // 2], cp_group=group, attn_backend="dense")
    with bdcp.blockdiag_cp_step(short):
        out["seq_len"] = _catch(lambda: attn(q, kv, kv, None))
    # A state built on another CP group (here: a single-rank group) is refused.
    singles = [dist.new_group([r]) for r in range(2)]  # new_group is collective: all create all
    single = bdcp.BlockDiagCPState.build(doc_ids, cp_group=singles[dist.get_rank()], attn_backend="dense")
    out["group"] = _catch(lambda: attn(torch.randn(S, 1, 4, 8), torch.randn(S, 1, 2, 8),
                                       torch.randn(S, 1, 2, 8), None,
                                       packed_seq_params=packed_seq_params_for(single)))
    dist.barrier()
    return out


@pytest.mark.timeout(300)
def test_layer_errors_are_clear(pool2):
    for out in pool2.run(layer_errors):
        assert "context_parallel_size=1 (--context-parallel-size 1)" in out["config_cp"][1], out["config_cp"]
        assert "2 ranks" in out["config_cp"][1]
        assert "no step state" in out["no_state"][1]
        assert "local_len=16" in out["seq_len"][1]
        assert out["group"] is not None and "CP group" in out["group"][1]


def rope_positions_every_layout():
    """The positions each rank rotates by are the global ones of its tokens."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.layers import BlockDiagRotaryEmbedding, rope_positions

    mpu = H.ensure_mpu(tp=1, cp=2)
    group = mpu.get_context_parallel_group()
    batch = H.make_batch(S, 1, seed=9)
    doc_ids = bdcp.doc_ids_from_eod(batch["tokens"], H.EOD)[0]
    rope = BlockDiagRotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    full = rope.get_emb(S)  # [S, 1, 1, 8] computed without CP
    out = {}
    for layout in ("contiguous", "zigzag", "balanced"):
        local, state = bdcp.shard_batch(batch, cp_group=group, layout=layout, eod_token=H.EOD,
                                        attn_backend="dense")
        gathered = [torch.empty_like(state.local_positions) for _ in range(2)]
        dist.all_gather(gathered, state.local_positions, group=group)
        with bdcp.blockdiag_cp_step(state):
            emb = rope(S)
        starts = torch.tensor([max(i for i in range(p + 1) if i == 0 or doc_ids[i] != doc_ids[i - 1])
                               for p in range(S)])
        reset = rope_positions(state, reset_position_ids=True)
        out[layout] = (
            sorted(torch.cat(gathered).tolist()) == list(range(S)),
            bool(torch.equal(local["position_ids"][0], state.local_positions)),
            bool(torch.allclose(emb, full[state.local_positions])),
            bool(torch.equal(reset, state.local_positions - starts[state.local_positions])),
        )
    return out


@pytest.mark.timeout(300)
def test_rope_and_learned_positions_follow_every_layout(pool2):
    for out in pool2.run(rope_positions_every_layout):
        for layout, checks in out.items():
            assert all(checks), (layout, checks)


def zigzag_matches_megatron():
    """Our zigzag layout is megatron-core's get_batch_on_this_cp_rank slicing."""
    import megatron_ext.blockdiag_cp as bdcp

    mpu = H.ensure_mpu(tp=1, cp=2)
    tokens = torch.arange(S).unsqueeze(0)
    theirs = H.megatron_batch_on_this_cp_rank({"tokens": tokens.clone()},
                                              mpu.get_context_parallel_group())["tokens"]
    local, _ = bdcp.shard_batch({"tokens": tokens}, cp_group=mpu.get_context_parallel_group(),
                                layout="zigzag", attn_backend="dense")
    return bool(torch.equal(theirs, local["tokens"]))


@pytest.mark.timeout(120)
def test_zigzag_is_megatrons_layout(pool2):
    assert all(pool2.run(zigzag_matches_megatron))
