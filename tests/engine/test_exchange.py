"""``exchange.NeededTransport``'s send buffers: K and V of the rows a step sends, fused once per layer
call where the local rows go out more than about once over."""

import torch

from megatron_ext.blockdiag_cp.exchange import NeededTransport, Pieces, fused_rows


def _transport(sent_to, send_index, L=10, fuse_sends=True):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(L, 2, 3, generator=g), torch.randn(L, 2, 5, generator=g)
    cp = len(sent_to)
    counts = torch.zeros(cp, cp, dtype=torch.long)
    counts[0] = torch.tensor(sent_to)
    return NeededTransport(k, v, 0, cp, Pieces(rows=4), None, {}, "", send_index, counts, fuse_sends=fuse_sends)


def test_fusing_once_where_it_moves_no_more_bytes():
    idx = torch.tensor([1, 3, 4, 6, 8, 9])
    # A step's buffer is one op moving 2 bytes per byte sent (K and V gathered into its halves, or a cat of a
    # run's views); fusing once moves 2 per local byte, then a run is a view (0) and gathered rows still 2.
    assert not _transport([0, 6, 6], [None, idx, idx])._fuse_once  # gathered: 24 < 20 + 24
    assert not _transport([0, 6, 6, 6, 6], [None, idx, idx, idx, idx])._fuse_once  # sent 2.4x over: still
    assert _transport([0, 10, 10], [None, None, None])._fuse_once  # runs: 40 > 20
    assert _transport([0, 10, 6, 10], [None, None, idx, None])._fuse_once  # 40 + 12 > 20 + 12
    assert _transport([0, 10, 0], [None, None, None])._fuse_once  # 20 = 20, a cat a piece against one
    assert not _transport([0, 9, 0], [None, None, None])._fuse_once  # 18 < 20
    assert not _transport([0, 10, 10], [None, None, None], fuse_sends=False)._fuse_once  # backward: never


def test_send_buffers_are_the_same_rows_fused_or_not():
    idx = torch.tensor([1, 3, 4, 6, 8, 9])
    for send_index in ([None, idx, None, None], [None, None, None, None]):  # runs of 20 rows > L = 10
        fused, per_step = (_transport([0, 6, 10, 10], send_index, fuse_sends=f) for f in (True, False))
        assert fused._fuse_once and not per_step._fuse_once
        for step in ((1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (3, 1)):
            rows, n = fused.sent_rows(step)
            want = fused_rows(per_step.k, per_step.v, rows)
            assert torch.equal(fused._send_buffer(rows), want) and torch.equal(per_step._send_buffer(rows), want)
            assert want.shape == (n, 2, 8), (step, want.shape)

