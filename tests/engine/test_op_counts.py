"""What the streamed op asks of a device per layer call, counted by ``testing.op_counter``.

The counter's rules on single ops; at cp 2 (and hierarchical at cp 4 = 2 nodes x 2) no
host sync in a step's layer calls after the first, forward and backward, for every
exchange.
"""

import pytest
import torch

from megatron_ext.testing import pool_fixture, runs_to_doc_ids
from megatron_ext.testing.op_counter import OpCounter, layer_calls


def test_counter_sorts_views_allocations_launching_ops_and_syncs():
    x = torch.randn(10, 3)
    mask = x[:, 0] > 0
    index = torch.tensor([1, 2])
    with OpCounter() as counter:
        with counter.region("syncs"):
            x[mask]
            x.clone()[mask] = 0
            int(x.sum())
            bool(mask.any())
            torch.nonzero(mask)
            torch.repeat_interleave(index)
        with counter.region("quiet"):
            torch.repeat_interleave(index, output_size=3)
            x.index_select(0, index)
            x.view(-1), x.t(), x[1:3], x.unsqueeze(0), x.detach()
            torch.empty(3)
            x.new_zeros(3)
    syncs, quiet = counter.counts["syncs"], counter.counts["quiet"]
    assert dict(syncs.sync_ops) == {"index": 1, "index_put_": 1, "_local_scalar_dense": 2, "nonzero": 1,
                                    "repeat_interleave": 1}
    assert syncs.syncs == 6
    assert quiet.syncs == 0
    assert dict(quiet.ops) == {"repeat_interleave": 1, "index_select": 1, "new_zeros": 1}
    assert (quiet.views, quiet.allocations) == (5, 1)


def test_counter_counts_kernel_calls_not_their_ops():
    import megatron_ext.blockdiag_cp as bdcp

    ids = torch.tensor([1] * 5 + [2] * 11)
    state = bdcp.BlockDiagCPState.build(ids, attn_backend="dense")
    q, k, v = (torch.randn(16, 1, 2, 4) for _ in range(3))
    (forward, backward), = layer_calls(state, q, k, v, layers=1)
    assert (forward.kernel_calls, backward.kernel_calls) == (1, 1)
    assert forward.sends == forward.receives == backward.sends == backward.receives == 0
    assert forward.launching < 30 and backward.launching < 30  # the dense kernel's own ops are not here


# -- the engine at cp 2, and hierarchical at cp 4 = 2 nodes x 2 ---------------------------------------

pool2 = pool_fixture(2)
pool4 = pool_fixture(4, env={"LOCAL_WORLD_SIZE": "2"})


def _mix(S: int) -> torch.Tensor:
    """Eight short documents, then one long one across every shard."""
    runs = [(i + 1, 6 + (5 * i) % 11) for i in range(8)]
    return runs_to_doc_ids(runs + [(99, S - sum(n for _, n in runs))])


def count_layers(exchange, kv_backward, ids, layers=3, layout="zigzag", **attention_kwargs):
    """Per layer (forward, backward) ``Counts`` on this rank, dense kernel, fp32."""
    import megatron_ext.blockdiag_cp as bdcp

    S = ids.shape[-1]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(S, 1, h, 8, generator=g) for h in (4, 2, 2))
    state = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange=exchange, attn_backend="dense",
                                        kv_backward=kv_backward)
    assert state.kv_exchange == exchange, state.kv_exchange_reason
    return layer_calls(state, *(state.shard(t) for t in (q, k, v)), layers=layers, **attention_kwargs)


def later_syncs(exchange, kv_backward, windowed=False):
    """{(layer, phase): the sync ops} of every layer call after the first, where there are any."""
    extra = {"window_size": (9, 0), "softmax_offset": torch.zeros(4)} if windowed else {}
    per_layer = count_layers(exchange, kv_backward, _mix(128), **extra)
    return {(layer, phase): dict(c.sync_ops) for layer, calls in enumerate(per_layer) if layer
            for phase, c in zip(("forward", "backward"), calls) if c.syncs}


SYNC_CASES = [(exchange, kv_backward, False) for exchange in ("allgather", "a2a", "halo", "hierarchical")
              for kv_backward in ("refetch", "save")]
SYNC_CASES += [("a2a", "refetch", True), ("hierarchical", "refetch", True)]  # a window and sinks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("exchange,kv_backward,windowed", SYNC_CASES)
def test_no_host_sync_after_a_steps_first_layer_call(pool2, pool4, exchange, kv_backward, windowed):
    pool = pool4 if exchange == "hierarchical" else pool2
    for rank, syncs in enumerate(pool.run(later_syncs, exchange, kv_backward, windowed)):
        assert syncs == {}, (rank, syncs)
