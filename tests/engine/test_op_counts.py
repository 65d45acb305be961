"""What the streamed op asks of a device per layer call, counted by ``testing.op_counter``.

The counter's rules on single ops; at cp 2 (and hierarchical at cp 4 = 2 nodes x 2) no
host sync in a step's layer calls after the first, forward and backward, for every
exchange.
"""

import pytest
import torch

from megatron_ext.testing.op_counter import OpCounter


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
    from megatron_ext.testing.op_counter import layer_calls

    ids = torch.tensor([1] * 5 + [2] * 11)
    state = bdcp.BlockDiagCPState.build(ids, attn_backend="dense")
    q, k, v = (torch.randn(16, 1, 2, 4) for _ in range(3))
    (forward, backward), = layer_calls(state, q, k, v, layers=1)
    assert (forward.kernel_calls, backward.kernel_calls) == (1, 1)
    assert forward.sends == forward.receives == backward.sends == backward.receives == 0
    assert forward.launching < 30 and backward.launching < 30  # the dense kernel's own ops are not here
