"""gpu_model suite: the streamed op's own op sequence, replayed on a modeled H200 (every GPU time modeled).

Each rank of a gloo group runs the real engine on CPU (``BlockDiagCPState.build``, the op's forward
and backward, three layer calls of one step) at small head dims (GQA: Hq 4, Hkv 1; MHA: Hq 2, Hkv 2;
head dim 8; bf16, the dtype the GPU would see, so fp32 accumulators stay fp32) with a null kernel
(outputs of the right shape and dtype, nothing computed; dk / dv of a received chunk's K and V halves
come back as one buffer's halves, as te and flash-attn give them), under ``OpCounter(log=True)``: every
launching op with its tensors' shapes and dtypes, every kernel call with its segments' query and key
lengths, every posted batch of transfers (bytes, peer) and the first wait on it. The replay
(``price``) scales each tensor to the model's dims (Llama-3-8B attention: Hq 32, Hkv 8, D 128, bf16;
MHA: 32 / 32 / 128) and walks the events in order on ``H200`` (the constants below, also in
bench/README.md):

- host: each launching op, kernel call and posted batch costs ``launch_s`` of host time, issued in
  order; the device cannot start an op before the host issued it;
- device stream, in order: an op takes its scaled bytes over ``hbm_bytes_per_s`` (what it reads and
  writes: ``_op_bytes``); a kernel call max(FLOPs / ``kernel_flops``, its bytes / HBM), FLOPs = 4 ·
  query-key pairs of its segments (causal and window as the call's ``Segments`` say) · Hq · D, and
  ``backward_factor`` times that in backward;
- transfers: a batch starts when the stream reaches it (its buffers are written) and its link is free,
  and takes the larger of its sent and received bytes over the link (NVLink inside a node, IB across),
  one queue per link class; the stream waits for it where the op waits (``WaitEvent``). Peers are
  assumed to post at the same time as this rank (each rank is replayed on its own).

modeled = the later of the stream's and the host's end. Per case, the busiest rank's figures of a
steady layer call (the second of a step; the third is the same) are reported with the host time the
CPU measured for it: each rank alone, one after another in one process as rank r of torch's fake
process group (``alone_host``: the same plan, ops and posts, nothing sent), thread CPU time of a
steady call without the counter (whose per-op Python is not the op's), the slowest rank; the null
kernel keeps the kernel out of it, and it includes the CPU running the small-dim ops. The same
calls timed in the shared run (every rank at once on the cores, which inflates each other's thread
time) are kept beside it. Then the ideal
(the documents' causal query-key pairs under the window, total / cp, at the kernel rate) and the
layout's roofline: max(ideal, the busiest rank's needed K/V bytes (the plan's exchange counts x
2 · Hkv · D · 2 bytes, the larger of received and sent per link class) at link rate). Beside it the
busiest rank's own roofline: max(the most pairs the layout hands one rank (``attended_pairs``: its
positions' pairs, in the layout it attends in) at the kernel rate, the same link term); modeled over
it is what the op adds to its layout, the layout's imbalance left out. Topology:
``allgather``, ``a2a``, ``halo`` on one node of cp GPUs (NVLink); ``hierarchical`` on 2 nodes of
cp / 2 (LOCAL_WORLD_SIZE = cp / 2), so its cross-node messages and roofline bytes go over IB.

Each call is priced a second time with the kernel an H200 measured (``measured_kernel``: the
forward rate and the backward / forward time of torch's flash kernels in the committed
bench/gpu_check_h200.jsonl timing rows, every other constant as above): the ``*_measured_kernel``
fields, and a roofline whose ideal uses that rate.
"""

import contextlib
import json
import math
import os
import statistics
import time
import unittest.mock
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

LAYOUTS = ("contiguous", "zigzag", "balanced", "thd")
EXCHANGES = ("a2a", "halo", "allgather", "hierarchical")
MIXES = ("short", "lognormal", "heavy", "single")
LAYERS = 3  # a step's first call agrees and builds device tables; the 2nd and 3rd are steady


@dataclass(frozen=True)
class H200:
    """Modeled device: the constants every modeled time of this suite uses."""

    launch_s: float = 7.5e-6  # host time to issue one launching op, kernel call or transfer batch
    kernel_flops: float = 450e12  # varlen attention forward, FLOP/s (bf16)
    backward_factor: float = 2.5  # a backward kernel call takes this times its forward's time
    hbm_bytes_per_s: float = 3.3e12  # every elementwise, gathering or scattering op
    nvlink_bytes_per_s: float = 400e9  # per GPU, per direction
    ib_bytes_per_s: float = 50e9  # per GPU, per direction


GPU_CHECK_ROWS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "bench", "gpu_check_h200.jsonl")


def measured_kernel(path: str = GPU_CHECK_ROWS, base: Optional[H200] = None) -> Optional[H200]:
    """``base`` (default ``H200()``) with the kernel a GPU measured: ``kernel_flops`` the median forward
    rate over every rank of the gpu_check ``timing`` rows (4 · query-key pairs · Hq · D per forward ms,
    flash), ``backward_factor`` the median of (fwd + bwd ms - fwd ms) / fwd ms. None without such rows."""
    if not os.path.exists(path):
        return None
    base = base or H200()
    rates, factors = [], []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            kernel = row.get("kernels", {}).get("flash") if row.get("check") == "timing" else None
            if not kernel or row.get("dry_run"):
                continue
            for pairs, fwd, both in zip(row["pairs_per_rank"], kernel["fwd_ms_per_rank"],
                                        kernel["fwd_bwd_ms_per_rank"]):
                if fwd > 0:
                    rates.append(4.0 * pairs * row["heads"][0] * row["head_dim"] / (fwd * 1e-3))
                    factors.append((both - fwd) / fwd)
    if not rates:
        return None
    return H200(**{**asdict(base), "kernel_flops": statistics.median(rates),
                   "backward_factor": statistics.median(factors)})


@dataclass(frozen=True)
class Dims:
    """Attention head dims; ``run`` the small ones the CPU runs, ``target`` the model's."""

    name: str
    hq: int
    hkv: int
    d: int
    dtype_bytes: int = 2


MODELS = {"gqa": Dims("llama3_8b", 32, 8, 128), "mha": Dims("mha_32", 32, 32, 128),
          "gqa_heads": Dims("llama3_8b", 32, 8, 128)}
# Same Hq / Hkv as the model. ``gqa_heads``: the model's own head counts (head dim 8), for ulysses and
# relayout, whose head groups (``head_groups``; and ulysses' split of the heads over cp, its K/V repeats)
# must be the model's.
RUN_DIMS = {"gqa": Dims("run_gqa", 4, 1, 8), "mha": Dims("run_mha", 2, 2, 8),
            "gqa_heads": Dims("run_gqa_heads", 32, 8, 8)}


@dataclass(frozen=True)
class Case:
    S: int
    cp: int
    mix: str
    layout: str
    exchange: str
    window: Optional[int]
    model: str  # key of MODELS
    relayout: str = "none"  # "balanced": the batch's rows attended in the balanced layout (``relayout``)
    kv_backward: str = "refetch"  # the knob as built; "auto": what it resolves to (suite gpu_model_kv)


def doc_ids(mix: str, S: int, layout: str = "zigzag", cp: int = 1) -> torch.Tensor:
    """The scale suite's mix (seed 0), or ``single``: one document of S tokens. ``thd`` needs every
    document's extent a multiple of 2 * cp (THD's padded cu_seqlens): each document is cut down to one
    (at least 2 * cp tokens) and the tokens left over end the sequence as padding (id 0)."""
    from scale_mixes import scale_doc_lengths

    lengths = [S] if mix == "single" else scale_doc_lengths(mix, S)
    if layout == "thd":
        unit = 2 * cp
        lengths = [max(unit, n - n % unit) for n in lengths]
        while sum(lengths) > S:  # the floor of 2 * cp tokens can overshoot: drop the last documents
            lengths.pop()
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    return torch.nn.functional.pad(ids, (0, S - ids.numel()))


# -- pricing --------------------------------------------------------------------------------------


def tensor_bytes(spec, run: Dims, target: Dims) -> float:
    """Bytes of a recorded (shape, dtype) at the model's dims: a floating tensor whose last dim is a
    multiple of the run's head dim is [rows, heads, dim]-like (scaled by the heads and the dim), any
    other floating one [rows, heads]-like (lse: by the heads); integer and bool tensors (indices,
    masks) keep their size. The run keeps the model's Hq / Hkv ratio, so one head factor serves
    q- and K/V-shaped tensors alike."""
    shape, dtype = spec
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not dtype.is_floating_point:
        return float(n)
    heads = target.hq / run.hq
    if shape and shape[-1] % run.d == 0:
        return n * heads * target.d / run.d
    return n * heads


_GATHER = frozenset({"index_select", "index", "gather"})
_SCATTER = {"index_copy_": 2, "index_copy": 2, "index_add_": 3, "index_add": 3, "index_put_": 2, "index_put": 2}
_WRITE_ONLY = frozenset({"zero_", "fill_", "zeros", "zeros_like", "full", "full_like", "new_zeros", "new_full",
                         "ones", "ones_like", "arange", "scalar_tensor"})


def _op_bytes(event, run: Dims, target: Dims) -> float:
    """HBM bytes an op reads and writes: a gather reads the rows it writes (not its whole source), a
    scatter reads its source and writes (index_add: also reads) that many destination rows, a fill
    writes its output, a copy reads its source and writes its destination, a row sum its sources and its
    target rows once; the rest read every input and
    write every output (an in-place op's output is its input: read and written)."""
    size = [tensor_bytes(s, run, target) for s in event.inputs]
    out = [tensor_bytes(s, run, target) for s in event.outputs]
    small = sum(b for s, b in zip(event.inputs, size) if not s[1].is_floating_point)  # indices
    if event.name in _GATHER:
        return 2 * sum(out) + small
    if event.name in _SCATTER:
        src = max((b for s, b in zip(event.inputs[1:], size[1:]) if s[1].is_floating_point), default=0.0)
        return _SCATTER[event.name] * src + small
    if event.name in _WRITE_ONLY:
        return sum(out)
    if event.name == "copy_":  # reads its source, writes its destination (a cast: the two dtypes' bytes)
        return size[0] + size[1] if len(size) > 1 else 2 * sum(out)
    if event.name == "cat":
        return 2 * sum(out)
    if event.name in ("copy_rows_", "add_rows_"):
        # (dst, src) and the index tensors given (source, target: n rows each): n rows of src read, of dst
        # written (add_rows_: also read), each in its own dtype
        floats, rows_of = _moved_rows(event, size, of=1)
        return rows_of(floats[1]) + rows_of(floats[0]) * (2 if event.name == "add_rows_" else 1) + small
    if event.name == "sum_rows_":
        # (dst, src, source, offsets, target): the n source rows read, each of the m target rows of dst read
        # and written once
        (dst, src), n, m = event.inputs[:2], event.inputs[2][0][0], event.inputs[4][0][0]
        return size[1] * n / max(1, src[0][0]) + 2 * size[0] * m / max(1, dst[0][0]) + small
    if event.name == "gather_kv_rows_":  # (dst, k, v, index): dst's rows written, as many of k and v read
        return 2 * size[0] + small
    if event.name == "merge_rows_":
        # (acc_out, acc_lse, out, lse, [dst_out, dst_lse]) and the index tensors given (source, target,
        # dst_target: n rows each): n rows of out / lse read, of acc read and written (with a destination:
        # read there, written in it)
        floats, rows_of = _moved_rows(event, size, of=2)
        moved = rows_of(*floats[2:4]) + rows_of(*floats[:2]) * (2 if len(floats) == 4 else 1)
        return moved + rows_of(*floats[4:6]) + small
    return sum(size) + sum(out)


def _moved_rows(event, size, of: int):
    """A row op's floating tensors ((spec, bytes at the model's dims), in argument order) and
    ``rows_of(*tensors)``: the bytes of the n rows it moves of each, n the length of its index tensors (each
    n long) or, where it has none, the rows of floating tensor ``of``."""
    floats = [(s, b) for s, b in zip(event.inputs, size) if s[1].is_floating_point]
    index = [s for s in event.inputs if not s[1].is_floating_point]
    n = index[0][0][0] if index else floats[of][0][0][0]

    def rows_of(*tensors):
        return sum(b * n / max(1, s[0][0]) for s, b in tensors)

    return floats, rows_of


def segment_pairs(q_lens: Sequence[int], k_lens: Sequence[int], causal: bool, window: Optional[int]) -> int:
    """Query-key pairs a varlen call attends (``kernels.Segments``: causal on square blocks, else every
    key precedes every query; the window hides keys j < i + (nk - nq) - window of query i)."""
    total = 0
    for nq, nk in zip(q_lens, k_lens):
        if not nq or not nk:
            continue
        i = torch.arange(nq, dtype=torch.long)
        hi = i if causal else torch.full_like(i, nk - 1)
        lo = torch.zeros_like(i) if window is None else (i + (nk - nq) - window).clamp(min=0)
        total += int((hi - lo + 1).clamp(min=0).sum())
    return total


FLASH_TILE = (128, 64)  # query x key rows of a flash-attention-2 forward tile at head dim 128 (sm80 / sm90)


def segment_tiles(q_lens: Sequence[int], k_lens: Sequence[int], causal: bool, window: Optional[int],
                  tile: Tuple[int, int] = FLASH_TILE) -> int:
    """Query-key pairs a tiled kernel computes: per segment, every ``tile`` (query block x key block)
    holding at least one visible pair (``segment_pairs``' rule), counted whole."""
    bm, bn = tile
    total = 0
    for nq, nk in zip(q_lens, k_lens):
        if not nq or not nk:
            continue
        first = torch.arange(0, nq, bm, dtype=torch.long)  # each query block's first and last row
        last = (first + bm - 1).clamp(max=nq - 1)
        hi = last if causal else torch.full_like(last, nk - 1)
        lo = torch.zeros_like(first) if window is None else (first + (nk - nq) - window).clamp(min=0)
        total += int(((hi // bn) - (lo // bn) + 1).clamp(min=0).sum()) * bm * bn
    return total


def tiles_over_pairs(events) -> float:
    """``segment_tiles`` over ``segment_pairs`` summed over the kernel calls among ``events`` (0: none)."""
    from megatron_ext.testing.op_counter import KernelEvent

    calls = [e for e in events if isinstance(e, KernelEvent)]
    pairs = sum(segment_pairs(e.q_lens, e.k_lens, e.causal, e.window) for e in calls)
    return sum(segment_tiles(e.q_lens, e.k_lens, e.causal, e.window) for e in calls) / pairs if pairs else 0.0


def document_pairs(ids: torch.Tensor, window: Optional[int]) -> int:
    """Causal query-key pairs of every document under the window (padding, id 0, attends nothing)."""
    _, lengths = torch.unique_consecutive(ids, return_counts=True)
    docs = torch.unique_consecutive(ids)
    total = 0
    for n in lengths[docs != 0].tolist():
        if window is None or window + 1 >= n:
            total += n * (n + 1) // 2
        else:  # the first window + 1 queries see all earlier keys, the rest window + 1 keys
            w = window + 1
            total += w * (w + 1) // 2 + (n - w) * w
    return total


def position_pairs(ids: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """[S] causal query-key pairs of each position's query: the keys of its document at or before it,
    under the window (padding, id 0: none). Summed, ``document_pairs``."""
    from megatron_ext.blockdiag_cp.layouts import document_starts

    seen = torch.arange(ids.numel()) - document_starts(ids) + 1
    if window is not None:
        seen = seen.clamp(max=window + 1)
    return torch.where(ids != 0, seen, 0)


def attended_pairs(state, window: Optional[int]) -> float:
    """The query-key pairs this rank's kernel calls must cover, counted from the layout it attends in
    (relaid: the balanced layout its rows moved to; ulysses: every position on cp-th of the heads), not
    from the calls: the work its layout hands it."""
    if state.kv_exchange == "ulysses":
        return float(position_pairs(state.doc_ids[0], window).sum()) / state.cp
    attending = state.relaid.state if state.relaid is not None else state
    pairs = position_pairs(attending.doc_ids[0], window)
    return float(pairs[attending.layout.rank_positions(attending.rank)].sum())


def _kernel_seconds(event, run: Dims, target: Dims, hw: H200) -> Tuple[float, float]:
    """(seconds, FLOPs) of one kernel call at the model's dims (the query heads it was handed, scaled:
    ulysses' head shards hold Hq / cp of them)."""
    pairs = segment_pairs(event.q_lens, event.k_lens, event.causal, event.window)
    tensors = [s for s in event.inputs if isinstance(s, tuple) and s[1].is_floating_point]
    q_shape = tensors[1 if event.backward else 0][0]  # [Nq, H, D]
    heads = target.hq * q_shape[-2] / run.hq if len(q_shape) == 3 else target.hq
    flops = 4.0 * pairs * heads * target.d
    io = sum(tensor_bytes(s, run, target) for s in event.inputs)
    if event.backward:  # dout, q, k, v, out, lse in; dq, dk, dv out
        io += sum(tensor_bytes(s, run, target) for s in tensors[1:4])
        return max(hw.backward_factor * flops / hw.kernel_flops, io / hw.hbm_bytes_per_s), flops * hw.backward_factor
    q = tensors[0]  # out [Nq, Hq, Dv] (Dv = D here) and lse [Nq, Hq] fp32
    io += tensor_bytes(q, run, target) + tensor_bytes(((q[0][0], q[0][1]), torch.float32), run, target)
    return max(flops / hw.kernel_flops, io / hw.hbm_bytes_per_s), flops


def price(events, run: Dims, target: Dims, hw: H200, node_of) -> Dict[str, float]:
    """Modeled seconds of one rank's layer call (the module docstring's rules); ``node_of(rank)``:
    the node of a global rank, for the link class (this rank is ``node_of(None)``'s node)."""
    from megatron_ext.testing.op_counter import KernelEvent, OpEvent, PostEvent, WaitEvent

    host = stream = 0.0
    links = {"nvlink": 0.0, "ib": 0.0}
    done: Dict[int, float] = {}
    out = {"kernel_s": 0.0, "elementwise_s": 0.0, "link_s": 0.0, "launch_s": 0.0, "flops": 0.0,
           "elementwise_bytes": 0.0, "link_bytes": 0.0}
    me = node_of(None)
    for e in events:
        if isinstance(e, (OpEvent, KernelEvent)):
            host += hw.launch_s
            if isinstance(e, KernelEvent):
                dur, flops = _kernel_seconds(e, run, target, hw)
                out["kernel_s"] += dur
                out["flops"] += flops
            else:
                nbytes = _op_bytes(e, run, target)
                dur = nbytes / hw.hbm_bytes_per_s
                out["elementwise_s"] += dur
                out["elementwise_bytes"] += nbytes
            stream = max(stream, host) + dur
        elif isinstance(e, PostEvent):
            host += hw.launch_s
            ready, end = max(stream, host), max(stream, host)
            for link, bw in (("nvlink", hw.nvlink_bytes_per_s), ("ib", hw.ib_bytes_per_s)):
                on = [(sent, b * _scale_message(run, target)) for sent, b, peer in e.messages
                      if (node_of(peer) == me) == (link == "nvlink")]
                nbytes = max(sum(b for s, b in on if s), sum(b for s, b in on if not s))
                if nbytes:
                    start = max(ready, links[link])
                    links[link] = start + nbytes / bw
                    end = max(end, links[link])
                    out["link_s"] += nbytes / bw
                    out["link_bytes"] += nbytes
            done[e.post] = end
        elif isinstance(e, WaitEvent):
            stream = max(stream, done.get(e.post, stream))
    out["launch_s"] = host
    out["modeled_s"] = max(stream, host)
    return out


def _scale_message(run: Dims, target: Dims) -> float:
    # Every message carries K/V rows or their gradients ([n, b, Hkv * (Dk + Dv)] in the input dtype).
    return (target.hkv * target.d) / (run.hkv * run.d)


def needed_seconds(counts: torch.Tensor, node_of, row_bytes: float, hw: H200) -> float:
    """The busiest rank's needed K/V at link rate: ``counts[src, dst]`` positions, per rank and link
    class the larger of received and sent, the classes in parallel."""
    cp = counts.shape[0]
    worst = 0.0
    for r in range(cp):
        t = 0.0
        for same, bw in ((True, hw.nvlink_bytes_per_s), (False, hw.ib_bytes_per_s)):
            peers = [p for p in range(cp) if p != r and (node_of(p) == node_of(r)) == same]
            recv = sum(int(counts[p, r]) for p in peers)
            sent = sum(int(counts[r, p]) for p in peers)
            t = max(t, max(recv, sent) * row_bytes / bw)
        worst = max(worst, t)
    return worst


# -- the run, on every rank -----------------------------------------------------------------------


def _null_kernel():
    from megatron_ext.blockdiag_cp import kernels

    def forward(q, k, v, seg, scale, dropout_p, seed):
        return (torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device),
                torch.zeros(q.shape[:-1], dtype=kernels.lse_dtype(q.dtype), device=q.device), None)

    def backward(dout, q, k, v, out, lse, aux, seg, scale, dropout_p):
        if kernels.kv_halves(k, v):  # as te (thd_th2d) and flash-attn: dk / dv as one buffer's halves
            return (torch.zeros_like(q),) + kernels.new_kv_halves(k, torch.zeros)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    return kernels.Kernel(forward, backward)


def timed_layers(q, k, v, layers: int, region=lambda label: contextlib.nullcontext(), **attention_kwargs
                 ) -> Dict[Tuple[str, int], Tuple[float, float]]:
    """``layers`` layer calls of the step in force, forward then backward, each inside ``region((phase,
    layer))``: (phase, layer) -> (thread s, wall s)."""
    import megatron_ext.blockdiag_cp as bdcp

    times, outs = {}, []
    for layer in range(layers):
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        with region(("forward", layer)):
            t, w = time.thread_time(), time.perf_counter()
            out = bdcp.blockdiag_cp_attention(*inputs, **attention_kwargs)
            times[("forward", layer)] = (time.thread_time() - t, time.perf_counter() - w)
        outs.append(out)
    upstream = torch.ones_like(outs[0])
    for layer in reversed(range(layers)):
        with region(("backward", layer)):
            t, w = time.thread_time(), time.perf_counter()
            torch.autograd.backward(outs[layer], upstream)
            times[("backward", layer)] = (time.thread_time() - t, time.perf_counter() - w)
    return times


def record_layers(state, q, k, v, layers: int = LAYERS, **attention_kwargs):
    """``layer_calls``' loop under ``OpCounter(log=True)``, then the same ``layers`` calls again in the
    same step without it, timed: per layer ((forward Counts, thread s, wall s), (backward ...)).

    The counter is a dispatch mode: its Python runs on every aten op (views included), which would be
    host time the op itself does not spend, so the timed calls run outside it. By then the step's
    device tables are built, so every timed call is a steady one."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing.op_counter import OpCounter

    counter = OpCounter(log=True)
    with bdcp.blockdiag_cp_step(state):
        with counter:
            timed_layers(q, k, v, layers, counter.region, **attention_kwargs)
        times = timed_layers(q, k, v, layers, **attention_kwargs)
    return [tuple((counter.counts[(p, i)], *times[(p, i)]) for p in ("forward", "backward"))
            for i in range(layers)]


def replay_inputs(ids: torch.Tensor, layout: str, exchange: str, window: Optional[int], model: str,
                  relayout: str = "none", kv_backward: str = "refetch"):
    """This rank's state as the replay builds it (dense, refetch unless the case says, the case's knobs)
    and its local q, k, v [L, 1, h, d] at the run dims (bf16, seeded by the rank): (state, (q, k, v))."""
    import megatron_ext.blockdiag_cp as bdcp

    run = RUN_DIMS[model]
    state = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange=exchange, attn_backend="dense",
                                        kv_backward=kv_backward, windows=window, relayout=relayout)
    g = torch.Generator().manual_seed(state.rank)
    return state, tuple(torch.randn(state.local_len, 1, h, run.d, generator=g).to(torch.bfloat16)
                        for h in (run.hq, run.hkv, run.hkv))


def replay_rank(ids: torch.Tensor, layout: str, exchange: str, window: Optional[int], model: str,
                hw: Optional[Dict] = None, layers: int = LAYERS, hw_measured: Optional[Dict] = None,
                relayout: str = "none", kv_backward: str = "refetch") -> Dict:
    """On every rank: build the step, run ``layers`` calls with the null kernel, price each call
    (``hw``: ``asdict(H200(...))``, plain values so the worker unpickles it before importing us), and
    again on ``hw_measured`` where given (``modeled_s_measured_kernel``). ``relayout`` "balanced": the
    all-to-alls that move q/k/v and the output are transfers like the others; the roofline stays the
    batch layout's (its plan's counts)."""
    from megatron_ext.testing.overrides import override_kernel

    run, target = RUN_DIMS[model], MODELS[model]
    hw = H200(**(hw or {}))
    measured = H200(**hw_measured) if hw_measured else None
    t0 = time.perf_counter()
    state, (q, k, v) = replay_inputs(ids, layout, exchange, window, model, relayout, kv_backward)
    build_s = time.perf_counter() - t0
    if state.kv_exchange != exchange:
        return {"refused": f"resolved to {state.kv_exchange}: {state.kv_exchange_reason}"}
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", state.cp))
    rank = torch.distributed.get_rank()

    def node_of(peer):
        return (rank if peer is None else peer) // per_node

    kwargs = {} if window is None else {"window_size": (window, 0)}
    with override_kernel("dense", _null_kernel()):
        per_layer = record_layers(state, q, k, v, layers, **kwargs)
    calls = []
    for fwd, bwd in per_layer:
        calls.append({phase: {**c.summary(), "sends": c.sends, "receives": c.receives,
                              "bytes_sent": c.bytes_sent, "bytes_received": c.bytes_received,
                              "host_thread_s": thread, "host_wall_s": wall, "ops": dict(c.ops),
                              "tiles_over_pairs": tiles_over_pairs(c.events),
                              **price(c.events, run, target, hw, node_of),
                              **({} if measured is None else
                                 {"modeled_s_measured_kernel": price(c.events, run, target, measured,
                                                                     node_of)["modeled_s"]})}
                      for phase, (c, thread, wall) in zip(("forward", "backward"), (fwd, bwd))})
    counts = state.plan_for(window).exchange.counts.clone()  # [cp, cp] positions src -> dst, global
    return {"calls": calls, "counts": counts, "per_node": per_node, "local_len": state.local_len,
            "build_s": build_s, "attended_pairs": attended_pairs(state, window), "kv_backward": state.kv_backward}


# (mix, layout, ranks) of the loopback: this suite's documents (``doc_ids``); their
# loopback twins (``loopback_twin``) model the same ranks. Rank 0 and the gpu_model rows'
# busiest rank (thd: 7, balanced on the heavy-tailed mix: 3).
LOOPBACK_CASES = (("single", "zigzag", (0, 7)), ("short", "zigzag", (0, 7)), ("short", "thd", (0, 7)),
                  ("heavy", "balanced", (0, 3)),
                  # the same thd pack attended in the balanced layout (timing only: the fake group moves
                  # no rows, so out is not rank r's; the calls and times are)
                  ("short", "thd", (0, 7), "balanced"))


def loopback_twin(mix: str, layout: str, rank: int, S: int, cp: int, hw: Optional[Dict] = None,
                  hw_measured: Optional[Dict] = None, relayout: str = "none") -> Dict:
    """The gpu_check loopback's rank (``testing.loopback``: rank r's real plan in one process, chunks
    handed over, no link) with the null kernel at the GQA run dims, its steady layer call priced with the
    link free: what the loopback on a GPU measures, modeled. In a process of its own (torch's fake
    process group)."""
    from megatron_ext.testing.loopback import loopback_state
    from megatron_ext.testing.overrides import override_kernel

    run, target = RUN_DIMS["gqa"], MODELS["gqa"]
    free = {"nvlink_bytes_per_s": math.inf, "ib_bytes_per_s": math.inf}
    priced = {"": H200(**{**(hw or {}), **free})}
    if hw_measured:
        priced["_measured_kernel"] = H200(**{**hw_measured, **free})
    ids = doc_ids(mix, S, layout, cp)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, 1, h, run.d, generator=g).to(torch.bfloat16) for h in (run.hq, run.hkv, run.hkv))
    state, ql, kl, vl = loopback_state(ids, rank, cp, q, k, v, layout=layout, kv_exchange="a2a",
                                       attn_backend="dense", relayout=relayout)  # kv_backward: auto, as the loopback's
    try:
        with override_kernel("dense", _null_kernel()):
            fwd, bwd = record_layers(state, ql, kl, vl, layers=2)[1]
    finally:
        torch.distributed.destroy_process_group()
    from megatron_ext.testing.op_counter import KernelEvent

    row = {"kv_backward": state.kv_backward, "relayout": relayout, "cost_model": state.report().get("cost_model"),
           "tiles_over_pairs": tiles_over_pairs(fwd[0].events),
           "segments_fwd": sum(len(e.q_lens) for e in fwd[0].events if isinstance(e, KernelEvent))}
    for short, (c, _, _) in (("fwd", fwd), ("bwd", bwd)):
        row[f"kernel_calls_{short}"], row[f"launching_{short}"], row[f"syncs_{short}"] = (
            c.kernel_calls, c.launching, c.syncs)
        for suffix, on in priced.items():
            p = price(c.events, run, target, on, lambda peer: 0)
            row[f"device_s_{short}{suffix}"], row[f"kernel_s_{short}{suffix}"] = p["modeled_s"], p["kernel_s"]
            if not suffix:
                row[f"host_s_{short}"], row[f"elementwise_s_{short}"] = p["launch_s"], p["elementwise_s"]
    return row


# the steady call's counts ``alone_host`` reports per rank (and its meta run must repeat)
ALONE_COUNTS = ("kernel_calls", "launching", "transfers")


def alone_host(ids: torch.Tensor, layout: str, exchange: str, window: Optional[int], model: str, cp: int,
               relayout: str = "none", env: Optional[Dict[str, str]] = None, reps: int = 5,
               kv_backward: str = "refetch") -> List[Dict]:
    """Per rank, the host thread time of a steady layer call with that rank alone on the CPU, the ranks one
    after another in this process: rank r of torch's fake process group (its collectives and transfers
    post nothing; what arrives is whatever the receive buffer held, which the null kernel never reads),
    so the op runs rank r's own plan, gathers, merges, posts and waits as in the shared run (``replay_inputs``'
    tensors and knobs, ``env`` as its pool's), the least disturbed of ``reps`` steps (``host_s_fwd``,
    ``host_s_bwd``), with the steady call's counts (``kernel_calls_*``, ``launching_*``, ``transfers_*``).
    The shared run's figure (cp processes on the cores at once) carries what they do to each other's
    caches and scheduling, which a GPU node, a host core per rank, does not. In a process of its own.

    Then the same steps on q, k, v on the meta device (``host_dispatch_s_*``): the op's Python, torch's
    dispatch and each op's shape function, without the CPU executing the ops, as a GPU's host issues them
    and the device runs them; ``dispatch_counts`` the counts that run made (the CPU run's, where the meta
    run stands for it)."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing.loopback import fake_group
    from megatron_ext.testing.op_counter import layer_calls
    from megatron_ext.testing.overrides import override_kernel

    kwargs = {} if window is None else {"window_size": (window, 0)}
    torch.set_num_threads(1)  # as each pool rank runs: one core of its own
    per_rank = []
    # LOCAL_WORLD_SIZE as the pool sets it: one node unless the case says otherwise
    with unittest.mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": str(cp), **(env or {})}):
        for rank in range(cp):
            fake_group(rank, cp, meta=True)
            mine = {}
            try:
                state, (q, k, v) = replay_inputs(ids, layout, exchange, window, model, relayout, kv_backward)
                with override_kernel("dense", _null_kernel()):
                    for device, prefix in (("cpu", "host_s"), ("meta", "host_dispatch_s")):
                        on = [t.to(device) for t in (q, k, v)]
                        # as the replay's: the 2nd call of 3, whose backward runs after the step's first
                        fwd, bwd = layer_calls(state, *on, layers=LAYERS, **kwargs)[1]
                        steady = []
                        for _ in range(reps):
                            with bdcp.blockdiag_cp_step(state):  # the first call builds the step's device tables
                                times = timed_layers(*on, LAYERS, **kwargs)
                            steady.append((times[("forward", 1)][0], times[("backward", 1)][0]))
                        counts = {f"{key}_{short}": c.summary()[key] for short, c in (("fwd", fwd), ("bwd", bwd))
                                  for key in ALONE_COUNTS}
                        mine.update({f"{prefix}_fwd": min(f for f, _ in steady),
                                     f"{prefix}_bwd": min(b for _, b in steady)})
                        if device == "cpu":
                            mine.update(counts)
                        else:
                            mine["dispatch_counts"] = counts
            finally:
                torch.distributed.destroy_process_group()
            per_rank.append(mine)
    return per_rank


def h200_loopback_rows(path: str = GPU_CHECK_ROWS) -> Dict[Tuple[str, str, int, str], Dict]:
    """(mix, layout, rank, relayout) -> the latest steady-call ``loopback_cp8`` row a GPU wrote (not a dry
    run)."""
    found: Dict[Tuple[str, str, int, str], Dict] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if (row.get("check") == "loopback_cp8" and row.get("timed") == "steady" and not row.get("dry_run")
                        and row.get("passed")):
                    found[(row["mix"], row["layout"], row["rank"], row.get("relayout", "none"))] = row
    return found


def loopback_rows(hw: H200 = H200(), log=print, S: int = 131072, cp: int = 8, cases=None,
                  gpu_rows: str = GPU_CHECK_ROWS) -> List[Dict]:
    """Suite ``gpu_model_loopback``: per gpu_check loopback case and rank, the modeled steady call (link
    free) beside what an H200 measured for it (``h200_*``, where bench/gpu_check_h200.jsonl has it)."""
    import concurrent.futures
    import multiprocessing

    if cases is None:
        cases = LOOPBACK_CASES
    measured = measured_kernel(gpu_rows, base=hw)
    gpu = h200_loopback_rows(gpu_rows)
    rows = []
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=spawn, max_tasks_per_child=1) as pool:
        jobs = [((mix, layout, rank, relaid[0] if relaid else "none"),
                 pool.submit(loopback_twin, mix, layout, rank, S, cp, asdict(hw),
                             None if measured is None else asdict(measured), relaid[0] if relaid else "none"))
                for mix, layout, ranks, *relaid in cases for rank in ranks]
        for (mix, layout, rank, relayout), job in jobs:
            row = {"suite": "gpu_model_loopback", "S": S, "cp": cp, "mix": mix, "layout": layout, "rank": rank,
                   "exchange": "a2a", "model": MODELS["gqa"].name, **job.result()}
            for suffix in ("", "_measured_kernel"):
                for what in ("device", "kernel"):
                    if f"{what}_s_fwd{suffix}" in row:
                        row[f"{what}_ms{suffix}"] = (row[f"{what}_s_fwd{suffix}"] + row[f"{what}_s_bwd{suffix}"]) * 1e3
            got = gpu.get((mix, layout, rank, relayout))
            if got is not None and "cost_model" not in got:
                # rows from before the loopback recorded its cost model: it neither gathered its sends (ops
                # the twin counts) nor ran as one node (balanced searched as one rank per node)
                row["h200_row_skipped"] = "measured by an earlier loopback (no send gathers, one rank per node)"
                got = None
            elif got is not None and got["cost_model"] != row["cost_model"]:
                row["h200_row_skipped"] = f"measured under cost model {got['cost_model']}"  # another cut
                got = None
            if got is not None:
                row.update({"h200_fwd_bwd_ms": got["fwd_bwd_ms"], "h200_host_ms": got["host_ms"],
                            "h200_kernel_ms": (got["kernel_fwd_ms"] + got["kernel_bwd_ms"]
                                               if "kernel_fwd_ms" in got else None),
                            "h200_kernel_calls": got["kernel_calls"], "h200_launching": got["launching"],
                            "h200_attn_backend": got["attn_backend"], "h200_kv_backward": got.get("kv_backward")})
                if "device_ms_measured_kernel" in row:
                    row["h200_over_modeled"] = got["fwd_bwd_ms"] / row["device_ms_measured_kernel"]
            rows.append(row)
            log(f"  gpu_model_loopback {mix}/{layout}/rank {rank}/{relayout}: modeled {row['device_ms']:.2f} ms"
                + (f", H200 {got['fwd_bwd_ms']:.2f} ms" if got else ", no H200 row"))
    return rows


# -- cases -> rows ------------------------------------------------------------------------------


def ideal_seconds(pairs: int, target: Dims, cp: int, hw: H200) -> Tuple[float, float]:
    """(forward, backward) seconds of the documents' attention FLOPs / cp at ``hw``'s kernel rate."""
    forward = 4.0 * pairs * target.hq * target.d / cp / hw.kernel_flops
    return forward, hw.backward_factor * forward


def case_row(case: Case, per_rank: List[Dict], ids: torch.Tensor, hw: H200 = H200(), layer: int = 1,
             hw_measured: Optional[H200] = None) -> Dict:
    """One JSON row: the busiest rank's (largest modeled forward + backward) figures of layer call
    ``layer``, the host time of the steady calls, the ideal and the roofline; with ``hw_measured``
    (the calls priced on it too) the same ratio on the measured kernel (``ratio_*_measured_kernel``)."""
    target = MODELS[case.model]
    suite = "gpu_model" if case.kv_backward == "refetch" else "gpu_model_kv"
    base = {"suite": suite, **asdict(case), "model": target.name, "model_key": case.model,
            "heads": target.hq, "kv_heads": target.hkv, "head_dim": target.d, "backend": "null",
            "point": f"{case.S // 1024}k / cp {case.cp}", "window": case.window or 0}
    if "refused" in per_rank[0]:
        return {**base, "refused": per_rank[0]["refused"]}
    pairs = document_pairs(ids, case.window)
    ideal_f, ideal_b = ideal_seconds(pairs, target, case.cp, hw)
    per_node = per_rank[0]["per_node"]
    row_bytes = 2 * target.hkv * target.d * target.dtype_bytes
    link = needed_seconds(per_rank[0]["counts"], lambda r: r // per_node, row_bytes, hw)
    roof_f, roof_b = max(ideal_f, link), max(ideal_b, link)
    # the busiest rank's own roofline: the work its layout hands it (the layout's imbalance included)
    own_f, own_b = ideal_seconds(max(r["attended_pairs"] for r in per_rank), target, 1, hw)
    calls = [r["calls"][layer] for r in per_rank]
    busiest = max(range(len(calls)), key=lambda r: calls[r]["forward"]["modeled_s"] + calls[r]["backward"]["modeled_s"])
    row = {**base, "busiest_rank": busiest, "local_len": per_rank[0]["local_len"], "nodes": case.cp // per_node,
           "kv_backward_resolved": per_rank[0].get("kv_backward"),
           "ideal_fwd_s": ideal_f, "ideal_bwd_s": ideal_b, "needed_link_s": link,
           "roofline_fwd_s": roof_f, "roofline_bwd_s": roof_b,
           "rank_work_fwd_s": own_f, "rank_work_bwd_s": own_b,
           "own_roofline_fwd_s": max(own_f, link), "own_roofline_bwd_s": max(own_b, link),
           "build_s": max(r["build_s"] for r in per_rank),
           "first_call_syncs": max(r["calls"][0]["forward"]["syncs"] + r["calls"][0]["backward"]["syncs"]
                                   for r in per_rank)}
    for phase, short in (("forward", "fwd"), ("backward", "bwd")):
        c = calls[busiest][phase]
        for key in ("kernel_calls", "launching", "transfers", "syncs", "bytes_sent", "bytes_received"):
            row[f"{key}_{short}"] = c[key]
        for key in ("modeled_s", "kernel_s", "elementwise_s", "link_s", "launch_s", "elementwise_bytes", "flops",
                    "tiles_over_pairs"):
            row[f"{key}_{short}"] = c[key]
        # every rank issues its own ops: the slowest rank, the less disturbed of the steady calls (the
        # cores are shared by cp processes and whatever else runs)
        steady = range(1, len(per_rank[0]["calls"]))
        for key, field in (("host_s", "host_thread_s"), ("host_wall_s", "host_wall_s")):
            row[f"{key}_{short}"] = min(max(r["calls"][i][phase][field] for r in per_rank) for i in steady)
        row[f"kernel_calls_max_{short}"] = max(cc[phase]["kernel_calls"] for cc in calls)
        row[f"modeled_max_s_{short}"] = max(cc[phase]["modeled_s"] for cc in calls)
        row[f"ratio_{short}"] = c["modeled_s"] / (roof_f if short == "fwd" else roof_b)
        row[f"own_ratio_{short}"] = c["modeled_s"] / row[f"own_roofline_{short}_s"]
        row[f"syncs_max_{short}"] = max(cc[phase]["syncs"] for cc in calls)
    row["ratio"] = (row["modeled_s_fwd"] + row["modeled_s_bwd"]) / (roof_f + roof_b)
    row["host_measured"] = "shared"  # ``with_alone_host``: "alone"
    if hw_measured is not None and "modeled_s_measured_kernel" in calls[busiest]["forward"]:
        ideal_mf, ideal_mb = ideal_seconds(pairs, target, case.cp, hw_measured)
        roofs = {"fwd": max(ideal_mf, link), "bwd": max(ideal_mb, link)}
        row["measured_kernel_tflops"] = hw_measured.kernel_flops / 1e12
        row["measured_backward_factor"] = hw_measured.backward_factor
        for phase, short in (("forward", "fwd"), ("backward", "bwd")):
            modeled = calls[busiest][phase]["modeled_s_measured_kernel"]
            row[f"roofline_{short}_s_measured_kernel"] = roofs[short]
            row[f"modeled_s_{short}_measured_kernel"] = modeled
            row[f"ratio_{short}_measured_kernel"] = modeled / roofs[short]
    return row


# (S, cp, mixes, layouts, exchanges, windows, models). Both points: every mix, layout, window and model.
# hierarchical needs two nodes of several ranks: at cp 2 a node holds one rank and the engine resolves it
# to a2a, so it runs at cp 8 only (2 x 4). At cp 8 halo falls back to a2a wherever a document straddles
# more than one boundary: those cases are rows with ``refused`` (the a2a row measures them). 128k / cp 8
# runs 8 processes sharing the CPU, 1-20 s a case.
FULL_POINTS = (
    (32768, 2, MIXES, LAYOUTS, ("a2a", "halo", "allgather"), (None, 4096), ("gqa", "mha")),
    (131072, 8, MIXES, LAYOUTS, ("a2a", "halo", "allgather", "hierarchical"), (None, 4096), ("gqa", "mha")),
    # relayout "balanced" (an 8th field): the layouts a batch arrives in, attended balanced; beside them
    # ulysses (its all-to-alls move the same kind of bytes). Both with the model's own heads.
    (32768, 2, MIXES, ("zigzag", "thd"), ("a2a",), (None,), ("gqa_heads",), "balanced"),
    (131072, 8, MIXES, ("zigzag", "thd"), ("a2a", "hierarchical"), (None,), ("gqa_heads",), "balanced"),
    # with a 4k window, which turns thd's band mode off in place (a2a, one node)
    (131072, 8, MIXES, ("zigzag", "thd"), ("a2a",), (4096,), ("gqa_heads",), "balanced"),
    (131072, 8, MIXES, ("zigzag", "thd"), ("ulysses",), (None,), ("gqa_heads",)),
    # kv_backward "auto" (a 9th field; suite gpu_model_kv): what the knob's default resolves to, beside the
    # refetch rows above (at cp 2 it keeps the received K/V: backward fetches nothing)
    (32768, 2, MIXES, LAYOUTS, ("a2a", "halo"), (None,), ("gqa", "mha"), "none", "auto"),
    (131072, 8, MIXES, ("zigzag", "balanced", "thd"), ("a2a",), (None,), ("gqa",), "none", "auto"),
    # and "save" where auto refetches but the band mode takes groups of pieces: thd at cp 8
    (131072, 8, MIXES, ("thd",), ("a2a",), (None,), ("gqa",), "none", "save"),
)
QUICK_POINTS = ((32768, 2, ("short", "single"), ("zigzag", "balanced"), ("a2a", "allgather"), (None,), ("gqa",)),)


def run(points=FULL_POINTS, hw: H200 = H200(), log=print, budget_s: Optional[float] = None) -> List[Dict]:
    """Rows of every case of ``points`` (a pool per cp, and one with 2 nodes for hierarchical)."""
    import concurrent.futures
    import multiprocessing

    rows: List[Dict] = []
    t_start = time.perf_counter()
    measured = measured_kernel(base=hw)
    # one process for the ranks-alone host times, run while the case's pool idles between cases
    alone = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        _run_points(points, hw, log, budget_s, rows, t_start, measured, alone)
    finally:
        alone.shutdown()
    return rows


def _run_points(points, hw, log, budget_s, rows, t_start, measured, alone) -> None:
    from megatron_ext.testing import WorkerPool

    for S, cp, mixes, layouts, exchanges, windows, models, *extra in points:
        relayout = extra[0] if extra else "none"
        kv_backward = extra[1] if len(extra) > 1 else "refetch"
        for hier in (False, True):
            ex_here = [e for e in exchanges if (e == "hierarchical") == hier]
            if not ex_here:
                continue
            env = {"LOCAL_WORLD_SIZE": str(max(1, cp // 2))} if hier else {}
            with WorkerPool(cp, env=env, timeout=900) as pool:
                for mix in mixes:
                    for layout in layouts:
                        ids = doc_ids(mix, S, layout, cp)
                        for exchange in ex_here:
                            for window in windows:
                                for model in models:
                                    if budget_s is not None and time.perf_counter() - t_start > budget_s:
                                        log(f"  gpu_model: budget {budget_s:.0f}s spent, later cases not run")
                                        return
                                    case = Case(S, cp, mix, layout, exchange, window, model, relayout, kv_backward)
                                    t0 = time.perf_counter()
                                    try:
                                        got = pool.run(replay_rank, ids, layout, exchange, window, model, asdict(hw),
                                                       LAYERS, None if measured is None else asdict(measured),
                                                       relayout, kv_backward)
                                        row = case_row(case, got, ids, hw, hw_measured=measured)
                                    except Exception as exc:  # noqa: BLE001 - a refused case is a row
                                        row = {**case_row(case, [{"refused": ""}], ids, hw),
                                               "refused": f"{type(exc).__name__}: {str(exc).splitlines()[-1][:200]}"}
                                    if "refused" not in row and exchange != "hierarchical":
                                        with_alone_host(row, alone.submit(alone_host, ids, layout, exchange, window,
                                                                          model, cp, relayout, env,
                                                                          kv_backward=kv_backward).result())
                                    row["case_seconds"] = time.perf_counter() - t0
                                    rows.append(row)
                                    log(f"  gpu_model {case}: {_brief(row)} ({row['case_seconds']:.1f}s)")


def with_alone_host(row: Dict, per_rank: Sequence[Dict]) -> None:
    """``host_s_*``: the slowest rank alone on the CPU (``alone_host``); the shared run's figure kept as
    ``host_shared_s_*``. ``hierarchical`` keeps the shared figure (``host_measured: "shared"``): torch's
    fake process group refuses an all-to-all whose input is empty while its output is not, which the
    two-level exchange posts. ``host_dispatch_s_*``: the slowest rank on meta tensors, where every rank's
    meta run made its CPU run's counts (``dispatch_counts``); else ``dispatch_counts_differ`` names the
    ranks, and the row has no dispatch figure."""
    differ = [rank for rank, r in enumerate(per_rank) if "dispatch_counts" in r
              and r["dispatch_counts"] != {f"{key}_{short}": r[f"{key}_{short}"] for key in ALONE_COUNTS
                                           for short in ("fwd", "bwd")}]
    dispatched = not differ and all("dispatch_counts" in r for r in per_rank)
    for short in ("fwd", "bwd"):
        row[f"host_shared_s_{short}"] = row[f"host_s_{short}"]
        row[f"host_s_{short}"] = max(r[f"host_s_{short}"] for r in per_rank)
        if dispatched:
            row[f"host_dispatch_s_{short}"] = max(r[f"host_dispatch_s_{short}"] for r in per_rank)
    if differ:
        row["dispatch_counts_differ"] = differ
    row["host_measured"] = "alone"


def _brief(row: Dict) -> str:
    if row.get("refused"):
        return f"refused: {row['refused']}"
    return (f"calls {row['kernel_calls_fwd']}/{row['kernel_calls_bwd']} ops {row['launching_fwd']}/"
            f"{row['launching_bwd']} modeled {row['modeled_s_fwd'] * 1e3:.2f}/{row['modeled_s_bwd'] * 1e3:.2f} ms "
            f"host {row['host_s_fwd'] * 1e3:.1f}/{row['host_s_bwd'] * 1e3:.1f} ms roof "
            f"{row['roofline_fwd_s'] * 1e3:.2f} ratio {row['ratio']:.2f}")


if __name__ == "__main__":  # rows to stdout; run_all.py --suites gpu_model writes them with the others
    import json
    import sys

    for r in run(QUICK_POINTS if "--quick" in sys.argv else FULL_POINTS, log=lambda m: print(m, file=sys.stderr)):
        print(json.dumps(r, default=str))
