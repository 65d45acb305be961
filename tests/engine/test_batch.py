"""Single-process rules: doc ids from EOD / cu_seqlens, shard_batch, CP = 1 with a state, layouts."""

import pytest
import torch

import megatron_ext.blockdiag_cp as bdcp
from megatron_ext.blockdiag_cp.layouts import build_layout, padded_length, position_work
from megatron_ext.testing import reference_attention


def test_doc_ids_from_eod_eod_belongs_to_the_document_it_ends():
    tokens = torch.tensor([[5, 9, 0, 7, 0, 0, 8]])
    assert bdcp.doc_ids_from_eod(tokens, 0).tolist() == [[1, 1, 1, 2, 2, 3, 4]]


def test_doc_ids_from_cu_seqlens():
    assert bdcp.doc_ids_from_cu_seqlens([0, 2, 5], total_len=7).tolist() == [1, 1, 2, 2, 2, 0, 0]
    with pytest.raises(ValueError, match="non-decreasing"):
        bdcp.doc_ids_from_cu_seqlens([0, 3, 2])


def test_shard_batch_single_process_pads_and_masks():
    tokens = torch.arange(10).view(1, 10)
    out, state = bdcp.shard_batch({"tokens": tokens, "labels": tokens + 1}, eod_token=4,
                                  attn_backend="dense")
    assert state.cp == 1 and state.padded_len == 10 and out["tokens"].tolist() == tokens.tolist()
    assert out["position_ids"].tolist() == [list(range(10))]
    with pytest.raises(ValueError, match="length 3"):
        bdcp.shard_batch({"tokens": tokens, "doc_ids": torch.ones(3, dtype=torch.long)})


def test_cp1_state_applies_the_document_rule():
    doc_ids = torch.tensor([1] * 5 + [2] * 7 + [0] * 3 + [3] * 4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(19, 2, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    state = bdcp.BlockDiagCPState.build(doc_ids, attn_backend="dense")
    with bdcp.blockdiag_cp_step(state):
        out = bdcp.blockdiag_cp_attention(q, k, v)
    assert torch.allclose(out, reference_attention(q, k, v, doc_ids), atol=1e-12)
    assert state.report()["attn_backend"] == "dense" and state.report()["kv_exchange_reason"]


def test_no_state_cp1_is_plain_causal():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(9, 1, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out = bdcp.blockdiag_cp_attention(q, k, v)
    assert torch.allclose(out, reference_attention(q, k, v, torch.ones(9, dtype=torch.long)))


@pytest.mark.parametrize("name", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_layouts_partition_the_sequence_equally(name, cp):
    lengths = torch.randint(1, 200, (60,), generator=torch.Generator().manual_seed(cp))
    ids = torch.repeat_interleave(torch.arange(1, 61), lengths)
    P = padded_length(ids.numel(), name, cp)
    ids = torch.nn.functional.pad(ids, (0, P - ids.numel())).unsqueeze(0)
    lay = build_layout(name, ids, cp)
    assert lay.positions.shape == (cp, P // cp)
    assert sorted(lay.positions.flatten().tolist()) == list(range(P))
    assert all(bool((row[1:] > row[:-1]).all()) for row in lay.positions)
    if name == "balanced":
        work = position_work(ids)[lay.positions].sum(1).double()
        assert float(work.max() / work.mean()) <= 1.05


def test_dense_path_honours_attention_dropout():
    doc_ids = torch.tensor([1] * 12 + [2] * 20)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(32, 1, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    state = bdcp.BlockDiagCPState.build(doc_ids, attn_backend="dense")
    with bdcp.blockdiag_cp_step(state):
        clean = bdcp.blockdiag_cp_attention(q, k, v)
        torch.manual_seed(0)
        dropped = bdcp.blockdiag_cp_attention(q, k, v, dropout_p=0.5)
        torch.manual_seed(0)
        again = bdcp.blockdiag_cp_attention(q, k, v, dropout_p=0.5)
        mean = sum(bdcp.blockdiag_cp_attention(q, k, v, dropout_p=0.5) for _ in range(100)) / 100
    assert not torch.allclose(dropped, clean) and torch.equal(dropped, again)
    # Inverted dropout keeps the expectation: the average over many draws nears the clean output.
    assert float((mean - clean).abs().max()) < 0.35 * float(clean.abs().max())
    assert torch.allclose(clean, reference_attention(q, k, v, doc_ids))


def test_layer_with_cp_config_and_no_process_group_says_how_to_fix():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.layers import BlockDiagCPAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                            context_parallel_size=2, use_cpu_initialization=True)
    with pytest.raises(RuntimeError, match="no process group exists"):
        BlockDiagCPAttention(cfg, 1, AttnMaskType.causal, "self")


def test_rope_positions_reset_per_row():
    from megatron_ext.layers import BlockDiagRotaryEmbedding, rope_positions

    doc_ids = torch.tensor([[1, 1, 1, 2, 2, 3], [1, 2, 2, 2, 2, 2]])
    state = bdcp.BlockDiagCPState.build(doc_ids, attn_backend="dense")
    assert rope_positions(state, reset_position_ids=True).tolist() == [
        [0, 0], [1, 0], [2, 1], [0, 2], [1, 3], [0, 4]]
    rope = BlockDiagRotaryEmbedding(kv_channels=4, rotary_percent=1.0, use_cpu_initialization=True)
    rope.reset_position_ids = True
    table = rope.get_emb(6)
    with bdcp.blockdiag_cp_step(state):
        emb = rope(6)
    assert emb.shape == (6, 2, 1, 4)
    assert torch.equal(emb[4, 0, 0], table[1, 0, 0]) and torch.equal(emb[4, 1, 0], table[3, 0, 0])
