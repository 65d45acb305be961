"""Head groups: q, k and v moved to where they are attended, the attention, and the output moved
back, pipelined over groups of heads (``ulysses``: sequence shards to head shards and back;
``relayout``: the batch's layout to the balanced one and back).

    G = 3 groups of this rank's query heads (K / V split alike, or moved whole ahead of them):

        posted:     in 0   in 1           in 2                      one group ahead of the one attended
        attended:          [ group 0 ]    [ group 1 ]   [ group 2 ]
        posted:                       out 0         out 1        out 2   each output home once attended

    backward: the output gradient's groups in, one ahead; each group differentiated as it lands and
    its dq (and dK / dV) posted home; K / V moved whole are differentiated by every group and go
    home after the last.

Heads do not mix in attention, so a group is its heads' whole attention: no merge. Only the first
group's move in and the last one's move out wait on the link; the others travel while a group is
attended. Each group's call is the engine's streamed op (``streamed.streamed_forward`` /
``streamed_backward``) run inside this module's Function on a ``streamed.HeldCall``, its saved
tensors kept through the Function's own ``save_for_backward``. One group is the unpipelined op.

A route (``ulysses.HeadShards``, ``relayout.RowMoves``) posts the moves: ``to(x, groups, g)`` the rows
of group g's heads of x [L, b, H, D] to the attended side, ``back(y, into, groups, g)`` group g's
attended rows home into ``into``'s heads of group g; each returns a ``Posted`` whose ``wait`` places
what landed.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .exchange import exposed_wait
from .streamed import HeldCall, streamed_backward, streamed_forward

# At most this many groups where a group's call is the single-rank op (ulysses in one dimension): each
# group adds a kernel call and a move per tensor (their launches, the collectives' latency), and 1 / G of
# the moved bytes stays exposed; four hide three quarters of them.
MAX_HEAD_GROUPS = 4
# Where a group's call exchanges K / V itself (a re-laid call, a ring level), its host work (the steps'
# transfers, gathers and merges: milliseconds a call at 128k / cp 8 with long documents) is paid once
# per group: two.
MAX_HEAD_GROUPS_EXCHANGING = 2


@dataclass(frozen=True)
class HeadGroups:
    """How the heads a rank attends split: ``count`` groups of ``q_heads`` query heads. K / V split alike,
    ``kv_heads`` per group; or (``kv_whole``: the rank has fewer K / V heads than groups, and its
    attention needs no K / V exchange) they move whole ahead of the groups, ``kv_heads`` all of them,
    and each group reads the one its query heads share (two groups a head)."""

    count: int
    q_heads: int
    kv_heads: int
    kv_whole: bool

    def exposed_share(self) -> float:
        """Of the head rows a layer moves (q, k and v in, the output home; backward their gradients the same
        way), the share no group's attention can hide: the first group's move in (K / V moved whole with it)
        and the last one's move home."""
        q = self.q_heads * self.count
        kv = self.kv_heads * (1 if self.kv_whole else self.count)
        first_in = self.q_heads + 2 * (kv if self.kv_whole else self.kv_heads)
        return (first_in + self.q_heads) / (2 * q + 2 * kv)

    def kv_of(self, g: int) -> slice:
        """The K / V heads group g attends: its own, or the one of the whole its query heads share."""
        if not self.kv_whole:
            return slice(g * self.kv_heads, (g + 1) * self.kv_heads)
        head = g * self.kv_heads // self.count
        return slice(head, head + 1)


def head_groups(q_heads: int, kv_heads: int, kv_whole_allowed: bool, most: int = MAX_HEAD_GROUPS) -> HeadGroups:
    """The most groups, at most ``most``, that split the rank's ``q_heads`` evenly with every group's query
    heads on K / V heads of their own: K / V split alike (``kv_heads`` a multiple of the count), or, where
    ``kv_whole_allowed``, whole with two groups in each K / V head (the count twice ``kv_heads``): each
    head's gradient is then the sum of two, in its dtype (one rounding, as ``streamed``'s dq of two
    writers); more would sum in float32, whose traffic costs more than the groups hide."""
    for count in range(min(most, q_heads), 1, -1):
        if q_heads % count:
            continue
        if kv_heads % count == 0:
            return HeadGroups(count, q_heads // count, kv_heads // count, False)
        if kv_whole_allowed and count == 2 * kv_heads:
            return HeadGroups(count, q_heads // count, kv_heads, True)
    return HeadGroups(1, q_heads, kv_heads, False)


def head_groups_for(q_heads: int, kv_heads: int, exchanging: bool) -> HeadGroups:
    """The groups a call takes for the rank's heads: one that exchanges K / V itself (a ring level, a re-laid
    call) splits K / V with at most ``MAX_HEAD_GROUPS_EXCHANGING`` groups; the single-rank call takes up to
    ``MAX_HEAD_GROUPS``, K / V moved whole where it has fewer K / V heads than that."""
    return head_groups(q_heads, kv_heads, kv_whole_allowed=not exchanging,
                       most=MAX_HEAD_GROUPS_EXCHANGING if exchanging else MAX_HEAD_GROUPS)


class Posted:
    """A posted move: ``wait`` waits for it (the wait timed into ``stats[key]``, ``exchange.exposed_wait``) and
    returns ``finish`` of the received buffer (the rows placed). The send buffer lives until then."""

    def __init__(self, work, sent: torch.Tensor, received: torch.Tensor, finish: Callable, stats: Dict, key: str):
        self._work, self._sent, self._received, self._finish = work, sent, received, finish
        self._stats, self._key = stats, key

    @classmethod
    def all_to_all(cls, sent: torch.Tensor, group, finish: Callable, stats: Dict, key: str,
                   send_counts: Optional[List[int]] = None, recv_counts: Optional[List[int]] = None) -> "Posted":
        """``sent``'s rows to every rank of ``group`` by one ``all_to_all_single`` (``send_counts`` rows each,
        ``recv_counts`` in, or equal blocks), as many rows coming back."""
        received = torch.empty_like(sent)
        work = dist.all_to_all_single(received, sent, recv_counts, send_counts, group=group, async_op=True)
        return cls(work, sent, received, finish, stats, key)

    def wait(self):
        with exposed_wait(self._stats, self._key, self._received.device):
            self._work.wait()
        self._sent = None
        return self._finish(self._received)


def _add_figures(totals: Dict, stats: Dict, backward: bool) -> None:
    """Add one group call's figures (``stats``: its state's, of forward or backward) into ``totals``: numbers
    add up, CUDA event lists join, anything else is the last call's."""
    for key, value in stats.items():
        if key.startswith("backward_") != backward:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "window":
            totals[key] = totals.get(key, 0) + value
        elif isinstance(value, list):
            totals[key] = totals.get(key, []) + value
        else:
            totals[key] = value


class _HeadGroupPipeline(torch.autograd.Function):
    """Forward: each group's q / k / v moved in one group ahead, attended as it lands, its output moved
    back. Backward: each group's output gradient moved in one ahead, differentiated as it lands, its dq (dK,
    dV) moved back; K / V moved whole go back summed over the groups after the last."""

    @staticmethod
    def forward(ctx, route, groups: HeadGroups, inner, backend, scale, dropout_p, window, q, k, v, sink):
        count = groups.count
        if groups.kv_whole:
            whole = [route.to(k, 1, 0), route.to(v, 1, 0)]
        posted: List = [None] * count

        def post_in(g):
            posted[g] = [route.to(q, count, g)] + ([] if groups.kv_whole else [route.to(k, count, g),
                                                                                route.to(v, count, g)])

        post_in(0)
        if groups.kv_whole:
            k_h, v_h = (move.wait() for move in whole)  # [P, b, Hkv, D]
        out = q.new_empty(q.shape[:3] + v.shape[3:])  # [L, b, Hq, Dv]
        held, home, totals = [], [], {}
        for g in range(count):
            if g + 1 < count:
                post_in(g + 1)  # travels while group g is attended
            landed = [move.wait() for move in posted[g]]
            posted[g] = None
            q_g = landed[0]  # [P, b, Hq / G, D]
            k_g, v_g = landed[1:] if not groups.kv_whole else (k_h[:, :, groups.kv_of(g)], v_h[:, :, groups.kv_of(g)])
            call = HeldCall(sink is not None and ctx.needs_input_grad[10])
            sink_g = None if sink is None else sink.detach()[g * groups.q_heads:(g + 1) * groups.q_heads]
            out_g = streamed_forward(call, q_g, k_g, v_g, sink_g, inner, backend, scale, dropout_p, window)
            _add_figures(totals, inner.comm_stats, backward=False)
            home.append(route.back(out_g, out, count, g))
            held.append(call)
            del q_g, k_g, v_g, out_g, landed
        for move in home:
            move.wait()
        inner.comm_stats.update(totals)  # the layer call's figures: every group's
        ctx.route, ctx.groups, ctx.inner = route, groups, inner
        ctx.sizes = [len(call.saved_tensors) for call in held]
        ctx.save_for_backward(*(t for call in held for t in call.saved_tensors))
        for call in held:
            call.saved_tensors = ()  # kept by ctx from here: freed with its graph
        ctx.held = held
        ctx.shapes = (q.shape, k.shape, v.shape, k.dtype, None if sink is None else sink.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        route, groups, inner, held = ctx.route, ctx.groups, ctx.inner, ctx.held
        q_shape, k_shape, v_shape, k_dtype, sink_dtype = ctx.shapes
        saved, at = ctx.saved_tensors, 0
        for call, size in zip(held, ctx.sizes):
            call.saved_tensors, at = saved[at:at + size], at + size
        count = groups.count
        need_q, need_k, need_v, need_sink = ctx.needs_input_grad[7:11]
        dout = dout.contiguous()
        dq = dout.new_empty(q_shape) if need_q else None
        dk = dout.new_empty(k_shape, dtype=k_dtype) if need_k else None
        dv = dout.new_empty(v_shape, dtype=k_dtype) if need_v else None
        d_sink = torch.zeros(count * groups.q_heads, dtype=sink_dtype, device=dout.device) if need_sink else None
        posted: List = [None] * count
        whole: List = [None, None]  # K / V moved whole: their gradients, [P, b, Hkv, D] each
        home, totals = [], {}

        def post_in(g):
            posted[g] = route.to(dout, count, g, backward=True)

        post_in(0)
        for g in range(count):
            if g + 1 < count:
                post_in(g + 1)
            dout_g = posted[g].wait()  # [P, b, Hq / G, Dv]
            posted[g] = None
            call = held[g]
            dq_g, dk_g, dv_g, d_sink_g = streamed_backward(call, dout_g)[:4]
            _add_figures(totals, inner.comm_stats, backward=True)
            call.saved_tensors = ()
            if need_q:
                home.append(route.back(dq_g, dq, count, g, backward=True))
            if d_sink is not None and d_sink_g is not None:
                d_sink[g * groups.q_heads:(g + 1) * groups.q_heads] = d_sink_g
            if not groups.kv_whole:
                home += [route.back(grad, into, count, g, backward=True)
                         for grad, into in ((dk_g, dk), (dv_g, dv)) if into is not None]
            else:  # two groups read each K / V head: the first writes its gradient, the second adds to it
                for i, grad in enumerate((dk_g, dv_g)):
                    if groups.kv_heads == 1 and g == 0:
                        whole[i] = grad
                        continue
                    if whole[i] is None:
                        whole[i] = grad.new_empty(grad.shape[:2] + (groups.kv_heads,) + grad.shape[3:])
                    head = whole[i][:, :, groups.kv_of(g)]
                    head.add_(grad) if g % 2 else head.copy_(grad)
            del dq_g, dk_g, dv_g, dout_g
        if groups.kv_whole:
            home += [route.back(grad, into, 1, 0, backward=True) for grad, into in zip(whole, (dk, dv))
                     if into is not None]
        for move in home:
            move.wait()
        inner.comm_stats.update(totals)
        return (None,) * 7 + (dq, dk, dv, d_sink)


def head_group_attention(route, groups: HeadGroups, inner, q, k, v, sink: Optional[torch.Tensor], backend: str,
                         scale: float, dropout_p: float, window: Optional[int]) -> torch.Tensor:
    """q: [L, b, Hq, Dqk], k: [L, b, Hkv, Dqk], v: [L, b, Hkv, Dv] where the batch lays them out ->
    [L, b, Hq, Dv] there, attended by ``inner`` (a state) where ``route`` moves them, in ``groups``.
    ``sink``: the attended heads' sink logits ([the rank's query heads]), or None."""
    return _HeadGroupPipeline.apply(route, groups, inner, backend, scale, dropout_p, window, q, k, v, sink)


__all__ = ["HeadGroups", "head_groups", "head_groups_for", "head_group_attention", "Posted", "MAX_HEAD_GROUPS",
           "MAX_HEAD_GROUPS_EXCHANGING"]
