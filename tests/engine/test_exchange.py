"""``exchange.NeededTransport``'s send buffers: K and V of the rows a step sends, fused once per layer
call where the local rows go out more than about once over; a run of the source's rows (a2a / halo's
whole shards, or any run the step's ``PairRuns`` names; every ring piece) planar, as two views."""

import pytest
import torch

from megatron_ext.blockdiag_cp.exchange import NeededTransport, Pieces, RingTransport, WholeNeededTransport, fused_rows


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


class _PostedHome(WholeNeededTransport):
    """The band transport with its batches kept instead of posted: the pieces ``post_into`` would send."""

    def post_into(self, sends, receives, received, *rest):
        self.posted = list(sends)


def test_a_batched_groups_gradient_goes_home_in_the_order_its_calls_wrote_it():
    """Rank 0 of 3, one band group in one batch: 3 rows arrive from rank 2, then 2 from rank 1, and the bands
    read them in another order. ``gradient_buffer``'s buffer, written where ``gradient_places`` puts each band
    row (as the calls write it), is the gradient in arrival order: it goes home as it is, no op; a gradient
    in the bands' order is gathered into that order first (one op), the same pieces either way."""
    from megatron_ext.blockdiag_cp.exchange import GroupMessages, WholeDelivery
    from megatron_ext.blockdiag_cp.merge import gather, set_rows
    from megatron_ext.testing.op_counter import OpCounter

    band_rows = torch.tensor([4, 0, 2, 1, 3])  # arrival row -> its band row
    place = torch.empty_like(band_rows)
    place[band_rows] = torch.arange(5)  # band row -> its arrival row
    m = GroupMessages(send_rows=torch.tensor([0, 1, 2]), sends=((1, 1, 0, 2), (2, 2, 2, 1)),
                      receives=((1, 2, 0, 3), (2, 1, 3, 2)), band_rows=band_rows, place=place, sent=3, received=5,
                      one_batch=True)
    counts = torch.tensor([[0, 2, 1], [2, 0, 0], [3, 0, 0]])
    k, v = torch.randn(10, 1, 2, 3), torch.randn(10, 1, 2, 5)
    transport = _PostedHome(k, v, 0, 3, None, {}, "", [None, torch.arange(2), torch.tensor([2])], counts,
                            WholeDelivery(groups=(((1, 0), (2, 0)),), pieces=Pieces(rows=4), messages=(m,)))
    band = torch.randn(5, 1, 16)  # the group's gradient in the bands' order
    arrival = gather(band, band_rows)
    assert transport.gradient_places((1, 0)) is place
    buffer = transport.gradient_buffer((1, 0), band)
    set_rows(buffer, place, band)
    assert torch.equal(buffer, arrival)
    for grad, ops in ((buffer, 0), (band, 1)):
        counter = OpCounter()
        with counter, counter.region("home"):
            transport.send_gradient((1, 0), grad, k.new_empty((0, 1, 16)))
        assert counter.counts["home"].launching == ops
        assert [peer for _, peer in transport.posted] == [2, 1]
        assert torch.equal(torch.cat([t for t, _ in transport.posted]), arrival)


def test_fused_rows_of_an_index_is_one_gather_and_of_no_row_no_op():
    """A hierarchical route's stage 1 gathers its rows straight from k and v (rows repeat where a row goes to
    several ranks), and a rank whose stage 1 sends nothing builds its empty buffer without an op."""
    from megatron_ext.testing.op_counter import OpCounter

    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(6, 1, 2, 3, generator=g), torch.randn(6, 1, 2, 5, generator=g)
    for rows, ops in ((torch.tensor([4, 1, 1, 5]), 1), (torch.empty(0, dtype=torch.long), 0)):
        counter = OpCounter()
        with counter, counter.region("send"):
            got = fused_rows(k, v, rows)
        assert counter.counts["send"].launching == ops
        want = torch.cat([k[rows], v[rows]], dim=-1).flatten(2)  # [n, b, Hkv * (Dk + Dv)], head by head
        assert got.shape == (rows.numel(), 1, 16) and torch.equal(got, want)


class _Recorded(NeededTransport):
    """Needed transport whose posts are recorded, not sent: (sends, source, receive shape [n, b, F], planar)."""

    def post(self, sends, recv_from, recv_shape, *rest, planar=False):
        return sends, recv_from, tuple(recv_shape), planar


def _planar_transport(dv=4):
    L, cp = 8, 3
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(L, 2, 2, 4, generator=g), torch.randn(L, 2, 2, dv, generator=g)
    counts = torch.tensor([[0, 8, 3], [5, 0, 0], [8, 0, 0]])  # rank 0: its whole shard to 1; all of 2's comes
    send_index = [None, None, torch.tensor([1, 4, 6])]
    return NeededTransport.__new__(_Recorded), (k, v, 0, cp, Pieces(rows=4), None, {}, "", send_index, counts)


def _whole_shards():
    """The ``PairRuns`` of ``_planar_transport``'s rank 0: it sends 1 its whole shard (a run from row 0) and
    receives 2's whole shard; the rows for 2, and 1's for it, are no run."""
    from megatron_ext.blockdiag_cp.plan import PairRuns

    return PairRuns((None, 0, None), (False, False, True))


def test_a_whole_shard_travels_planar_as_its_k_and_v_rows():
    """A source that sends its whole shard sends each piece's K rows and V rows as they lie (views of k and
    v: no copy, two messages), and its destination receives them into one [2, n, b, Hkv * D] buffer; both
    read it off the step's ``PairRuns``. Other pairs keep one fused message, and so does every pair where K
    and V differ in width (MLA) or no ``PairRuns`` is given."""
    t, args = _planar_transport()
    t.__init__(*args, runs=_whole_shards())
    k, v = args[0], args[1]
    sends, src, shape, planar = t.start((1, 0))  # to 1 (its whole shard), from 2 (2's whole shard)
    assert src == 2 and planar and shape == (4, 2, 16)  # post lands it as [2, 4, 2, 8]
    (k_rows, dst_k), (v_rows, dst_v) = sends
    assert dst_k == dst_v == 1 and k_rows.shape == v_rows.shape == (4, 2, 8)
    assert k_rows.data_ptr() == k.data_ptr() and v_rows.data_ptr() == v.data_ptr()  # views
    assert torch.equal(k_rows, k[:4].reshape(4, 2, 8)) and torch.equal(v_rows, v[:4].reshape(4, 2, 8))
    sends, src, shape, planar = t.start((2, 0))  # to 2 (three rows gathered), from 1 (5 of its rows)
    assert src == 1 and not planar and shape == (4, 2, 16)
    (fused, dst), = sends
    assert dst == 2 and torch.equal(fused, fused_rows(k, v, torch.tensor([1, 4, 6])))
    assert not t._fuse_once  # a run costs nothing: fusing every row first would
    assert t.gradients_planar((1, 0)) == (True, True) and t.gradients_planar((2, 0)) == (False, False)
    for dv, on in ((6, True), (4, False)):
        t, args = _planar_transport(dv)
        t.__init__(*args, runs=_whole_shards() if on else None)
        sends, _, shape, planar = t.start((1, 0))
        assert not planar and len(sends) == 1 and shape == (4, 2, 8 + 2 * dv)


def test_a_run_of_a_shard_travels_planar_where_both_ends_read_it_so():
    """With the step's ``PairRuns``, a pair that moves a run of its source's rows (here rows 2..4 of 8 to
    rank 2, and rank 1's rows for us) travels planar as a whole shard does: views of that run of k and v,
    and a planar receive; scattered rows stay one fused, gathered message."""
    from megatron_ext.blockdiag_cp.plan import PairRuns

    t, (k, v, *rest) = _planar_transport()
    counts = torch.tensor([[0, 3, 3], [5, 0, 0], [8, 0, 0]])
    rest[-2:] = [[None, torch.tensor([1, 4, 6]), torch.tensor([2, 3, 4])], counts]
    t.__init__(k, v, *rest, runs=PairRuns((None, None, 2), (False, True, False)))
    sends, src, shape, planar = t.start((2, 0))  # to 2 (rows 2..4, a run), from 1 (a run of its rows)
    assert src == 1 and planar and shape == (4, 2, 16)
    (k_rows, dst_k), (v_rows, dst_v) = sends
    assert dst_k == dst_v == 2 and k_rows.shape == v_rows.shape == (3, 2, 8)
    assert k_rows.data_ptr() == k[2].data_ptr() and v_rows.data_ptr() == v[2].data_ptr()  # views of the run
    assert torch.equal(k_rows, k[2:5].reshape(3, 2, 8)) and torch.equal(v_rows, v[2:5].reshape(3, 2, 8))
    assert t.sent_rows((2, 0)) == (slice(2, 5), 3)
    sends, src, shape, planar = t.start((1, 0))  # to 1 (scattered), from 2 (not a run)
    assert src == 2 and not planar
    (fused, dst), = sends
    assert dst == 1 and torch.equal(fused, fused_rows(k, v, torch.tensor([1, 4, 6])))
    assert t.gradients_planar((2, 0)) == (True, True) and t.gradients_planar((1, 0)) == (False, False)
    t.__init__(k, v, *rest, runs=None)
    assert not t.start((2, 0))[3] and len(t.start((2, 0))[0]) == 1  # no PairRuns: fused


class _RecordedRing(RingTransport):
    def post(self, sends, recv_from, recv_shape, *rest, planar=False):
        return sends, recv_from, tuple(recv_shape), planar


def test_a_ring_piece_travels_planar_and_is_forwarded_as_it_came():
    """Every ring piece is a run of a whole shard: the own piece goes as views of K and V, a received one
    is forwarded as its two halves, each lands in a [2, n, b, F / 2] buffer; fused where K and V differ in
    width."""
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(8, 1, 2, 4, generator=g), torch.randn(8, 1, 2, 4, generator=g)
    ring = _RecordedRing(k, v, 1, 3, 4, None, {}, "", None, planar=True)
    sends, src, shape, planar = ring.start((1, 1))
    assert src == 0 and planar and shape == (4, 1, 16)  # post lands it as [2, 4, 1, 8]
    assert [(t.data_ptr(), dst) for t, dst in sends] == [(k[4].data_ptr(), 2), (v[4].data_ptr(), 2)]
    came = torch.randn(2, 4, 1, 8, generator=g)
    ring.received(came)
    sends, _, _, _ = ring.start((2, 1))
    assert [(t.data_ptr(), dst) for t, dst in sends] == [(came[0].data_ptr(), 2), (came[1].data_ptr(), 2)]
    assert ring.gradients_planar((2, 1)) == (True, True)
    mla = _RecordedRing(k, torch.randn(8, 1, 2, 6, generator=g), 1, 3, 4, None, {}, "", None, planar=True)
    (send, _), = mla.start((1, 0))[0]
    assert not mla.planar and send.shape == (4, 1, 20)


def test_a_ring_step_goes_once_the_piece_it_forwards_landed():
    """``RingTransport.can_start``: its own pieces (round 1) go any time, step (i, j) only once (i - 1, j)
    landed and nothing landed after it (it forwards the last piece received); posting earlier is refused."""
    k, v = torch.randn(8, 1, 2, 4), torch.randn(8, 1, 2, 4)
    ring = _RecordedRing(k, v, 1, 3, 4, None, {}, "", None, planar=True)
    assert ring.can_start((1, 0)) and ring.can_start((1, 1)) and not ring.can_start((2, 0))
    with pytest.raises(RuntimeError, match=r"ring step \(2, 0\) posted before step \(1, 0\) landed"):
        ring.start((2, 0))
    ring.start((1, 0))
    ring.start((1, 1))
    first, second = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8)
    ring.received(first)  # (1, 0)'s piece
    assert ring.can_start((2, 0)) and not ring.can_start((2, 1))
    sends, _, _, _ = ring.start((2, 0))
    assert [t.data_ptr() for t, _ in sends] == [first[0].data_ptr(), first[1].data_ptr()]
    ring.received(second)  # (1, 1)'s
    assert ring.can_start((2, 1)) and not ring.can_start((2, 0))
    sends, _, _, _ = ring.start((2, 1))
    assert [t.data_ptr() for t, _ in sends] == [second[0].data_ptr(), second[1].data_ptr()]
