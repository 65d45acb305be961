"""One CP rank's real plan in one process: the streamed op at any cp, K/V handed over on the device.

``run_rank`` builds rank r's state under torch's fake process group (its collectives leave each
tensor as this rank made it, so every agreement reads as if the peers agreed: they would hold
the same doc ids and knobs) and gives it a ``Loopback``: the chunks rank r would receive are cut
from the whole K/V on r's device before the layer runs (``prepare``); a step gathers its send
buffer as it would and posts nothing: the ready chunk is handed over, and each K/V gradient that
would come home is zeros (the other ranks are not computed). So one device runs a rank's kernel
calls, merges, send gathers and host work at cp 8 in one process (the GPU check): out and dq are
rank r's exactly; dK/dV are its own share only.

With ``relayout="balanced"`` the rows' all-to-alls and the balanced layout's own exchange post
through the fake group, which moves nothing: what arrives is whatever the receive buffers held. The
calls, ops and times are still rank r's (the kernels do not look at the values); out and the
gradients are not (``values`` in the result says which).

    python -m megatron_ext.testing.loopback --cp 8 --rank 3 --S 131072 --mix single
"""

import argparse
import json
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..blockdiag_cp.exchange import NeededTransport, Pieces, RingTransport, WholeNeededTransport, fused_width


class _Ready:
    """A transfer that has landed: ``wait`` returns its tensor (None: nothing moves)."""

    def __init__(self, tensor: Optional[torch.Tensor]):
        self._tensor = tensor

    def wait(self) -> Optional[torch.Tensor]:
        return self._tensor


class _Handover:
    """The transports' own steps (the send buffers they gather, which gradients go home), each transfer
    handed over instead of posted: the chunk rank r receives at the step, zeros for the gradients."""

    def __init__(self, chunks: Dict, zeros: torch.Tensor):
        self.chunks, self.zeros = chunks, zeros
        self._step = None  # the step whose chunk the next post hands over; None: a gradient coming home

    def start(self, step):
        self._step = step
        return super().start(step)

    def send_gradient(self, step, grad_chunk, like):
        self._step = None
        return super().send_gradient(step, grad_chunk, like)

    def post(self, sends, recv_from, recv_shape, *rest, planar: bool = False):
        for tensor, _ in sends:  # what post would send: made contiguous, then dropped (no peer)
            if tensor is not None:
                tensor.contiguous()
        if self._step is not None:  # nothing comes where the step receives nothing (the ring's unposted hops)
            return _Ready(None if recv_from is None else self.chunks.get(("planar", self._step) if planar
                                                                        else self._step))
        rows = recv_shape[0] if recv_from is not None else 0  # [n, b, F], planar or not
        if not rows:
            return _Ready(None)
        back = self.zeros[:rows]  # planar: the same zeros as [2, rows, b, F / 2]
        return _Ready(back.view(2, rows, back.shape[1], -1) if planar else back)


class _NeededHandover(_Handover, NeededTransport):
    def __init__(self, chunks, zeros, *args, **kwargs):
        NeededTransport.__init__(self, *args, **kwargs)
        _Handover.__init__(self, chunks, zeros)


class _WholeHandover(_Handover, WholeNeededTransport):
    """Each band group handed over as it would land: a batch as one buffer of its pieces source by source in
    rank order, pair by pair each piece; then put in the bands' order as the real transport does."""

    def __init__(self, chunks, zeros, *args):
        WholeNeededTransport.__init__(self, *args)
        _Handover.__init__(self, chunks, zeros)

    def start_piece(self, piece):
        self._step = piece
        return NeededTransport.start(self, piece)

    def receive_buffer(self, shape, like):
        if self._step is not None:  # a group's fetch in one batch: its pieces, cut beforehand
            return self.chunks[("group", self._step[1])]
        return self.zeros[:shape[0]]  # gradients coming home

    def post_into(self, sends, receives, received, *rest):
        for tensor, _ in sends:  # what post_into would send: made contiguous, then dropped (no peer)
            if tensor is not None:
                tensor.contiguous()
        return _Ready(received)

    def post_all_to_all(self, sent, send_counts, received, *rest):
        sent.contiguous()  # what the all-to-all would send, then dropped (no peer)
        return _Ready(received)


class _RingHandover(_Handover, RingTransport):
    def __init__(self, chunks, zeros, *args, **kwargs):
        RingTransport.__init__(self, *args, **kwargs)
        _Handover.__init__(self, chunks, zeros)


class Loopback:
    """``state.loopback``: rank r's transports over chunks cut beforehand from the whole K/V."""

    def __init__(self, state, k_full: torch.Tensor, v_full: torch.Tensor):
        self.state, self.k_full, self.v_full = state, k_full, v_full
        self._chunks: Dict = {}
        self._zeros: Dict = {}  # (shape, dtype, device) -> the gradients coming home, allocated once

    def _positions(self, kind: str, plan, pieces: Pieces, step) -> torch.Tensor:
        """Global positions of the chunk rank r receives at ``step`` (round i, piece j, cut by ``pieces``)."""
        i, j = step
        state = self.state
        src = (state.rank - i) % state.cp
        if kind == "ring":  # the rows of the piece that travel
            return state.layout.rank_positions(src)[state.ring_reach(plan.window).rows(src, j)]
        whole = plan.exchange.recv_positions[src]  # the needed rows arrive ascending
        first, n = pieces.span(whole.numel(), j)
        return whole[first:first + n]

    def prepare(self, kind: str, window: Optional[int] = None) -> Dict:
        """Every chunk of the step plan (kind, window), fused [n, b, Hkv * (Dk + Dv)] on the K/V's device;
        under ("planar", step) also planar [2, n, b, Hkv * D] where its source sends a run of its rows."""
        key = (kind, window)
        if key not in self._chunks:
            plan = self.state.plan_for(window)
            chunks = {}
            pieces, posts = self.state.stream_pieces(kind, window)
            state = self.state
            for at in posts:
                pos = self._positions(kind, plan, pieces, at).to(self.k_full.device)
                if pos.numel():
                    k, v = self.k_full.index_select(0, pos), self.v_full.index_select(0, pos)
                    chunks[at] = torch.cat([k, v], dim=-1).reshape(k.shape[0], k.shape[1], -1)
                    # the ring's pieces are of whole shards; a2a / halo's where the source sends a run of its rows
                    run = kind == "ring" or (not state.needed_whole(window)
                                             and state.pair_runs(window).received_run[(state.rank - at[0]) % state.cp])
                    if run and k.shape[-2:] == v.shape[-2:]:
                        chunks[("planar", at)] = torch.stack([k, v]).reshape(2, k.shape[0], k.shape[1], -1)
            if kind == "needed" and self.state.needed_whole(window):  # the band mode: one buffer a group
                delivery = self.state.whole_delivery_on(self.k_full.device, window)
                for g, m in enumerate(delivery.messages):
                    landing = [(i, g) for i, *_ in m.receives]  # the group's pieces in the order they land
                    group = [chunks.pop(at) for at in landing if at in chunks] if m.one_batch else []
                    if group:
                        chunks[("group", g)] = torch.cat(group)
            self._chunks[key] = chunks
        return self._chunks[key]

    def transport(self, kind: str, k, v, state, plan, stats: Dict, prefix: str):
        """What ``streamed`` asks its transport for, with the chunks handed over."""
        chunks = self.prepare(kind, plan.window)
        rows = state.local_len
        if kind == "needed" and state.needed_whole(plan.window):  # a group's gradients may exceed the shard
            rows = max([rows] + [m.sent for m in state.whole_delivery_on(k.device, plan.window).messages])
        shape = (rows, k.shape[1], fused_width(k, v))
        zeros = self._zeros.get((shape, k.dtype, k.device))
        if zeros is None:  # once, not per layer call: the loopback's own work stays out of what it times
            zeros = self._zeros[(shape, k.dtype, k.device)] = torch.zeros(shape, dtype=k.dtype, device=k.device)
        chunk_rows = plan.stream[kind].chunk_rows
        if kind == "ring":
            return _RingHandover(chunks, zeros, k, v, state.rank, state.cp, chunk_rows, state.group, stats,
                                 prefix, state.ring_gradients(plan.window), planar=True,
                                 reach=state.ring_reach(plan.window))
        if state.needed_whole(plan.window):
            return _WholeHandover(chunks, zeros, k, v, state.rank, state.cp, state.group, stats, prefix,
                                  state.send_indices_on(k.device, plan.window), plan.exchange.counts,
                                  state.whole_delivery_on(k.device, plan.window))
        return _NeededHandover(chunks, zeros, k, v, state.rank, state.cp, Pieces(rows=chunk_rows), state.group, stats,
                               prefix,
                               state.send_indices_on(k.device, plan.window), plan.exchange.counts,
                               runs=state.pair_runs(plan.window))


def padded(state, x: torch.Tensor) -> torch.Tensor:
    """x [S, ...] zero-padded to the state's padded length (global positions index it)."""
    if x.shape[0] == state.padded_len:
        return x
    return torch.cat([x, x.new_zeros((state.padded_len - x.shape[0],) + tuple(x.shape[1:]))])


def fake_group(rank: int, cp: int, meta: bool = False) -> None:
    """This process as rank ``rank`` of ``cp`` in torch's fake process group (no peers, no transfers);
    ``meta``: for tensors on the meta device too (CPU ones then go through it as well)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("loopback: torch.distributed is already initialized in this process; run a rank's "
                           "loopback in a process of its own")
    dist.init_process_group("cpu:fake,meta:fake" if meta else "fake", store=FakeStore(), rank=rank, world_size=cp)


def loopback_state(ids: torch.Tensor, rank: int, cp: int, q, k, v, **build):
    """(rank r's state with its ``Loopback``, r's q, k, v) from the whole q/k/v [S, b, h, d].

    Rank r of one node of cp GPUs unless ``LOCAL_WORLD_SIZE`` says otherwise: without it every rank
    would count as a node of its own, and ``balanced`` (and relayout's target) would be searched for
    an InfiniBand group, another cut than the one-node run it stands for."""
    import os

    import megatron_ext.blockdiag_cp as bdcp

    os.environ.setdefault("LOCAL_WORLD_SIZE", str(cp))  # this process is the loopback's own
    fake_group(rank, cp)
    state = bdcp.BlockDiagCPState.build(ids, **build)
    state.loopback = Loopback(state, padded(state, k), padded(state, v))
    return state, state.shard(q), state.shard(k), state.shard(v)


class KernelTimer:
    """``kernel`` (a ``kernels.Kernel``) with each call timed: CUDA events around it on a device (the
    kernel's own device time, whatever the host does meanwhile), the host clock on CPU. ``take()``:
    (forward s, backward s) summed since the last take."""

    def __init__(self, kernel, device: torch.device):
        from ..blockdiag_cp.kernels import Kernel

        self.kernel, self.device = kernel, device
        self._pending: Dict[str, list] = {"forward": [], "backward": []}
        self.timed = Kernel(self._wrap("forward"), self._wrap("backward"))

    def _wrap(self, phase: str):
        def call(*args, **kwargs):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                got = getattr(self.kernel, phase)(*args, **kwargs)
                end.record()
                self._pending[phase].append((start, end))
            else:
                t0 = time.perf_counter()
                got = getattr(self.kernel, phase)(*args, **kwargs)
                self._pending[phase].append(time.perf_counter() - t0)
            return got

        return call

    def take(self) -> Tuple[float, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        sums = []
        for phase in ("forward", "backward"):
            got = self._pending[phase]
            sums.append(sum(s.elapsed_time(e) / 1e3 for s, e in got) if self.device.type == "cuda" else sum(got))
            self._pending[phase] = []
        return sums[0], sums[1]


def run_rank(ids, rank: int, cp: int, heads=(32, 8), head_dim: int = 128, layers: int = 3, device="cpu",
             dtype=torch.bfloat16, reps: int = 3, **build) -> Dict:
    """Rank r's layer calls (forward + backward) through the loopback: kernel calls, and per step of ``reps``
    the wall time (CUDA-synchronized on a device) and host thread time of its first layer call
    (``first_*``: agreement and the step's device tables) and of its second, a steady one (``fwd_bwd_ms``,
    ``host_ms``), and the kernel calls' own time in a third (``kernel_fwd_ms``, ``kernel_bwd_ms``:
    ``KernelTimer``), medians over the steps."""
    from .op_counter import layer_calls

    device = torch.device(device)
    hq, hkv = heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(ids.shape[-1], 1, h, head_dim, generator=g).to(dtype).to(device) for h in (hq, hkv, hkv))
    state, ql, kl, vl = loopback_state(ids, rank, cp, q, k, v, device=device, **build)
    try:
        counts = layer_calls(state, ql, kl, vl, layers=layers)
        relaid = state.relaid is not None
        for kind in () if relaid else ("ring", "needed"):
            state.loopback.prepare(kind)
        import megatron_ext.blockdiag_cp as bdcp

        upstream = torch.ones_like(ql[..., :1]).expand(ql.shape[:3] + (vl.shape[-1],))

        def layer() -> None:
            leaves = [t.detach().requires_grad_() for t in (ql, kl, vl)]
            bdcp.blockdiag_cp_attention(*leaves).backward(upstream)

        def timed() -> Tuple[float, float]:  # (wall s, host thread s) of one layer call, forward + backward
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0, h0 = time.perf_counter(), time.thread_time()
            layer()
            host = time.thread_time() - h0  # the host's own time issuing the layer (a device runs behind)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - t0, host

        from ..blockdiag_cp.kernels import kernel_for
        from .overrides import override_kernel

        timer = KernelTimer(kernel_for(state.attn_backend), device)
        first: List[Tuple[float, float]] = []
        steady: List[Tuple[float, float]] = []
        kernel: List[Tuple[float, float]] = []
        for _ in range(reps):
            with bdcp.blockdiag_cp_step(state):
                first.append(timed())  # a step's first call agrees and builds the step's device tables
                steady.append(timed())  # what every later layer of the step costs (the gpu_model prices it)
                with override_kernel(state.attn_backend, timer.timed):  # a third call: its kernels alone
                    layer()
                kernel.append(timer.take())
        fwd, bwd = counts[1]
        return {"rank": rank, "cp": cp, "kv_exchange": state.kv_exchange, "layout": state.layout.name,
                "relayout": "balanced" if relaid else "none", "values": "timing only" if relaid else "rank r's",
                "cost_model": state.report().get("cost_model"),
                "attn_backend": state.attn_backend, "kv_backward": state.kv_backward, "local_len": state.local_len,
                "kernel_calls": [fwd.kernel_calls, bwd.kernel_calls], "launching": [fwd.launching, bwd.launching],
                "syncs": [fwd.syncs, bwd.syncs], "timed": "steady",
                "fwd_bwd_ms": _median(t for t, _ in steady) * 1e3, "host_ms": _median(h for _, h in steady) * 1e3,
                "first_fwd_bwd_ms": _median(t for t, _ in first) * 1e3,
                "first_host_ms": _median(h for _, h in first) * 1e3,
                "kernel_fwd_ms": _median(f for f, _ in kernel) * 1e3, "kernel_bwd_ms": _median(b for _, b in kernel) * 1e3}
    finally:
        dist.destroy_process_group()


def _median(xs) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main(argv=None) -> int:
    from .mixes import make_doc_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--S", type=int, default=16384)
    p.add_argument("--mix", default="single")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--exchange", default="a2a")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--heads", type=int, nargs=2, default=(32, 8))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ids", default=None, help="a torch.save'd [S] tensor of doc ids (instead of --mix)")
    p.add_argument("--relayout", default="none", help="'balanced': attend in the balanced layout (timing only)")
    args = p.parse_args(argv)
    ids = make_doc_ids(args.mix, args.S) if args.ids is None else torch.load(args.ids)
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    print(json.dumps(run_rank(ids, args.rank, args.cp, heads=tuple(args.heads), head_dim=args.head_dim,
                              device=args.device, dtype=dtype, layout=args.layout, kv_exchange=args.exchange,
                              relayout=args.relayout, attn_backend="dense" if args.device == "cpu" else None)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
