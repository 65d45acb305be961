"""Path selection with cross-rank consensus, the step state, and blockdiag_cp_attention().

``BlockDiagCPState.build`` is the one place that talks to the other CP ranks
before the K/V collectives: a single small all-reduce carries every rank's
input-validation verdict, a checksum of its document ids and which kernels it
can run. Every rank then takes the same decisions (or raises the same error)
from the same reduced vector, so no rank can wander into a different collective.
"""

import logging
import threading
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .. import parallel_state as ps
from . import kernels
from .exchange import allgather_kv, needed_kv
from .layout import Layout, build_layout, padded_length
from .plan import StepPlan, build_plan
from .state import (
    ATTN_BACKEND_VALUES,
    _CP_ATTN_FIRE_COUNT,
    _CP_BLOCKDIAG_STATE,
    cp_varlen_runtime_config,
    normalize_attn_backend,
    normalize_kv_exchange,
    normalize_layout,
)

logger = logging.getLogger("megatron_ext.blockdiag_cp")


class BlockDiagCPError(RuntimeError):
    """Raised identically on every CP rank."""


# Input-validation verdicts, reduced with MAX across ranks (higher wins).
_DOC_IDS_ERRORS = {
    1: "doc_ids must be an integer tensor (got {detail}); build them with "
       "megatron_ext.blockdiag_cp.doc_ids_from_eod(tokens, eod_token) or pass int64 ids",
    2: "doc_ids must have shape [S] or [b, S] (got {detail})",
    3: "doc_ids must be >= 0 (0 = padding, documents 1-based); found {detail}",
    4: "doc_ids must have at least one position (got {detail})",
}
_LOGGED = set()
_LOG_LOCK = threading.Lock()


def _log_once(level: int, message: str) -> None:
    with _LOG_LOCK:
        if message in _LOGGED:
            return
        _LOGGED.add(message)
    logger.log(level, message)


def _check_doc_ids(doc_ids) -> Tuple[int, str]:
    if not isinstance(doc_ids, torch.Tensor):
        return 1, type(doc_ids).__name__
    if doc_ids.dtype in (torch.bool,) or doc_ids.is_floating_point() or doc_ids.is_complex():
        return 1, str(doc_ids.dtype)
    if doc_ids.dim() not in (1, 2):
        return 2, str(tuple(doc_ids.shape))
    if doc_ids.shape[-1] == 0:
        return 4, str(tuple(doc_ids.shape))
    if bool((doc_ids < 0).any()):
        return 3, f"min {int(doc_ids.min())}"
    return 0, ""


def _checksum(doc_ids: torch.Tensor) -> Tuple[int, int]:
    """Two cheap position-weighted sums; equal on ranks holding equal ids (int64 wraps)."""
    flat = doc_ids.reshape(-1).to(torch.int64)
    weights = torch.arange(flat.numel(), dtype=torch.int64) % 1000003 + 1
    return int((flat * weights).sum()), int((flat * flat + 7 * flat).sum()) ^ flat.numel()


class BlockDiagCPState:
    """Immutable per-step state: group, layout, doc ids, plan and the resolved knobs."""

    def __init__(self, *, group, cp: int, rank: int, layout: Layout, doc_ids: torch.Tensor,
                 seq_len: int, plan: StepPlan, attn_backend_requested: str, attn_backend: str,
                 attn_backend_reason: str, kv_exchange_requested: str, kv_exchange: str,
                 kv_exchange_reason: str, strict: bool, available: Dict[str, bool]):
        self.group = group
        self.cp = cp
        self.rank = rank
        self.layout = layout
        self.doc_ids = doc_ids  # [R, P] padded, int64
        self.seq_len = seq_len
        self.plan = plan
        self.attn_backend_requested = attn_backend_requested
        self.attn_backend = attn_backend
        self.attn_backend_reason = attn_backend_reason
        self.kv_exchange_requested = kv_exchange_requested
        self.kv_exchange = kv_exchange
        self.kv_exchange_reason = kv_exchange_reason
        self.strict = strict
        self.available = available  # backend -> every rank can run it (this step)
        self._backend_explicit = False  # build(): attn_backend was passed (fallbacks log WARNING, not INFO)
        self.comm_stats: Dict[str, int] = {}
        self.kv_row_bytes: Optional[int] = None
        self.kernel_failures: list = []
        self._dropout = 0.0
        self._device_index: Dict[tuple, tuple] = {}

    # -- public contract ---------------------------------------------------

    @classmethod
    def build(cls, doc_ids, cp_group=None, layout=None, attn_backend=None, kv_exchange=None,
              strict=False, device=None) -> "BlockDiagCPState":
        """Validate, agree across the CP group, lay out and plan one step.

        ``device`` is where the kernels will run (default: CUDA when available);
        it only decides which kernels can be considered before q is seen.
        """
        config = cp_varlen_runtime_config()
        # Unknown knobs raise here, identically on every rank, before any collective.
        layout_name = normalize_layout(config["layout"] if layout is None else layout)
        backend_req = normalize_attn_backend(config["attn_backend"] if attn_backend is None else attn_backend)
        exchange_req = normalize_kv_exchange(config["kv_exchange"] if kv_exchange is None else kv_exchange)
        group = ps.get_cp_group() if cp_group is None else cp_group
        cp = ps.group_size(group)
        rank = ps.group_rank(group)
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

        code, detail = _check_doc_ids(doc_ids)
        static = {b: kernels.static_availability(b, device) for b in ATTN_BACKEND_VALUES}
        if code == 0:
            ids = doc_ids.detach().to("cpu", torch.int64)
            ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
            sums = _checksum(ids)
            shape = tuple(ids.shape)
        else:
            ids, sums, shape = None, (0, 0), (0, 0)

        # [code, -code, sum1, -sum1, sum2, -sum2, R, -R, S, -S, unavailable flags...]
        local = [code, -code, sums[0], -sums[0], sums[1], -sums[1], shape[0], -shape[0],
                 shape[1], -shape[1]] + [0 if static[b][0] else 1 for b in ATTN_BACKEND_VALUES]
        reduced = local
        if cp > 1:
            vec = torch.tensor(local, dtype=torch.int64)
            if dist.get_backend(group) == "nccl":
                vec = vec.cuda()
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
            reduced = vec.cpu().tolist()

        if reduced[0] > 0:
            worst = reduced[0]
            if code == worst:
                raise BlockDiagCPError(_DOC_IDS_ERRORS[worst].format(detail=detail))
            raise BlockDiagCPError("invalid doc_ids on another CP rank: "
                                   + _DOC_IDS_ERRORS[worst].format(detail="see that rank's error"))
        if any(reduced[i] != -reduced[i + 1] for i in (2, 4, 6, 8)):
            raise BlockDiagCPError(
                "doc_ids differ across the CP ranks (length or content); every CP rank must pass "
                "the same full-sequence doc ids: build them from the unsharded batch, e.g. with "
                f"shard_batch() (this rank's shape {tuple(ids.shape)})")

        available = {b: reduced[10 + i] == 0 for i, b in enumerate(ATTN_BACKEND_VALUES)}
        backend, backend_reason = _resolve_backend(backend_req, available, static, explicit=attn_backend is not None)
        if strict and backend != backend_req:
            raise BlockDiagCPError(
                f"strict mode: attention backend {backend_req!r} cannot run on every CP rank "
                f"({backend_reason}); install it, pick another --cp-attn-backend, or drop strict")

        padded = padded_length(shape[1], layout_name, cp)
        ids = torch.nn.functional.pad(ids, (0, padded - shape[1]))
        lay = build_layout(layout_name, ids, cp)
        plan = build_plan(ids, lay, rank)

        exchange, exchange_reason = exchange_req, "as requested"
        if cp == 1:
            exchange_reason = "single rank: nothing to exchange"
        elif exchange_req == "halo" and not plan.exchange.halo_ok:
            exchange, exchange_reason = "a2a", "halo not applicable: " + plan.exchange.halo_reason
            if strict:
                raise BlockDiagCPError(f"strict mode: kv exchange 'halo' falls back to 'a2a' "
                                       f"({exchange_reason}); use --cp-kv-exchange a2a or drop strict")
            _log_once(logging.WARNING if kv_exchange is not None else logging.INFO,
                      f"blockdiag-cp: kv exchange halo -> a2a: {plan.exchange.halo_reason}")

        state = cls(group=group, cp=cp, rank=rank, layout=lay, doc_ids=ids, seq_len=shape[1],
                    plan=plan, attn_backend_requested=backend_req, attn_backend=backend,
                    attn_backend_reason=backend_reason, kv_exchange_requested=exchange_req,
                    kv_exchange=exchange, kv_exchange_reason=exchange_reason, strict=strict,
                    available=available)
        state._backend_explicit = attn_backend is not None
        return state

    @property
    def padded_len(self) -> int:
        return self.layout.padded_len

    @property
    def local_len(self) -> int:
        return self.layout.local_len

    @property
    def local_positions(self) -> torch.Tensor:
        return self.layout.positions[self.rank]

    @property
    def rows(self) -> int:
        return self.doc_ids.shape[0]

    def shard(self, x: torch.Tensor, seq_dim: int = 0) -> torch.Tensor:
        """Zero-pad x along seq_dim to padded_len and return this rank's tokens (local order)."""
        n = x.shape[seq_dim]
        if n not in (self.seq_len, self.padded_len):
            raise ValueError(f"shard: x has {n} positions along dim {seq_dim}, but the state was "
                             f"built for sequence length {self.seq_len} (padded {self.padded_len})")
        if n != self.padded_len:
            pad_shape = list(x.shape)
            pad_shape[seq_dim] = self.padded_len - n
            x = torch.cat([x, x.new_zeros(pad_shape)], dim=seq_dim)
        return x.index_select(seq_dim, self.local_positions.to(x.device))

    def report(self) -> Dict:
        plan = self.plan
        kind = "allgather" if self.kv_exchange == "allgather" else "sparse"
        sent_pos, recv_pos = plan.positions_moved(kind) if self.cp > 1 else (0, 0)
        work = plan.work_per_rank.to(torch.float64)
        mean = float(work.mean())
        lower = int(plan.needed_remote[self.rank])
        row = self.kv_row_bytes
        return {
            "attn_backend_requested": self.attn_backend_requested,
            "attn_backend": self.attn_backend,
            "attn_backend_reason": self.attn_backend_reason,
            "kv_exchange_requested": self.kv_exchange_requested,
            "kv_exchange": self.kv_exchange,
            "kv_exchange_reason": self.kv_exchange_reason,
            "layout": self.layout.name,
            "cp": self.cp,
            "rank": self.rank,
            "strict": self.strict,
            "seq_len": self.seq_len,
            "padded_len": self.padded_len,
            "local_len": self.local_len,
            "positions_sent": sent_pos,
            "positions_received": recv_pos,
            "lower_bound_positions": lower,
            # Bytes are those the exchange measured on its last call (None before one).
            "bytes_sent": self.comm_stats.get("bytes_sent"),
            "bytes_received": self.comm_stats.get("bytes_received"),
            "lower_bound_bytes": None if row is None else lower * row,
            "kv_row_bytes": row,
            "work_per_rank": plan.work_per_rank.tolist(),
            "work_max_over_mean": float(work.max()) / mean if mean > 0 else 1.0,
            "kernel_failures": list(self.kernel_failures),
        }

    # -- internals ---------------------------------------------------------

    def _send_index_on(self, device: torch.device) -> torch.Tensor:
        """Local rows this rank sends, grouped by destination; moved to the device once per step."""
        key = ("send", str(device))
        if key not in self._device_index:
            self._device_index[key] = torch.cat(self.plan.exchange.send_index).to(device)
        return self._device_index[key]

    def _segments_for(self, kind: str, device: torch.device):
        key = (kind, str(device))
        if key not in self._device_index:
            seg = self.plan.segments[kind]
            q_lens, k_lens = seg.lengths()
            dev = kernels.Segments(seg.cu_seqlens_q.to(device), seg.cu_seqlens_k.to(device),
                                   seg.max_seqlen_q, seg.max_seqlen_k, tuple(q_lens), tuple(k_lens))
            # None marks an identity index (every row used, in order): no gather copy needed.
            self._device_index[key] = (_non_identity(seg.q_index, self.local_len * self.rows, device),
                                       _non_identity(seg.k_index, self.local_len * self.rows, device)
                                       if kind == "sparse" else seg.k_index.to(device), dev)
        return self._device_index[key]


def _non_identity(index: torch.Tensor, rows: int, device) -> Optional[torch.Tensor]:
    if index.numel() == rows and bool((index == torch.arange(rows)).all()):
        return None
    return index.to(device)


def _gather(x: torch.Tensor, index: Optional[torch.Tensor]) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


def _resolve_backend(requested: str, available: Dict[str, bool], static: Dict[str, tuple],
                     explicit: bool) -> Tuple[str, str]:
    order = ATTN_BACKEND_VALUES[ATTN_BACKEND_VALUES.index(requested):]
    skipped = []
    for backend in order:
        if available[backend]:
            if not skipped:
                return backend, static[backend][1]
            reason = "; ".join(skipped)
            level = logging.WARNING if explicit else logging.INFO
            _log_once(level, f"blockdiag-cp: attention backend {requested} -> {backend}: {reason}")
            return backend, f"fell back to {backend}: {reason}"
        why = static[backend][1] if not static[backend][0] else "unavailable on another CP rank"
        skipped.append(f"{backend}: {why}")
    raise AssertionError("dense is always available")


# ---------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------


class _GuardedKernel(torch.autograd.Function):
    """Forward: run the kernel, recording (not raising) a failure. Backward: likewise for its grads.

    A rank whose kernel fails keeps issuing the same collectives as the others (its
    output is zeros, its gradients zero); the failure is agreed at the end of the
    step and raised on every rank by ``blockdiag_cp_step``.
    """

    @staticmethod
    def forward(ctx, q, k, v, fn, state, backend):
        ctx.state, ctx.backend = state, backend
        ctx.shapes = [(t.shape, t.dtype, t.device, t.requires_grad) for t in (q, k, v)]
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
        try:
            with torch.enable_grad():
                out = fn(*inputs)
        except Exception as exc:  # noqa: BLE001 - recorded, then raised on every rank
            _record_failure(state, backend, "forward", exc)
            ctx.graph = None
            return q.new_zeros(q.shape)
        ctx.graph = (out, inputs)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        # Zero (not None) gradients on failure keep the exchange's backward collectives running.
        zeros = [torch.zeros(s, dtype=dt, device=dev) if rg else None for s, dt, dev, rg in ctx.shapes]
        graph, ctx.graph = ctx.graph, None
        if graph is None:
            return tuple(zeros) + (None, None, None)
        out, inputs = graph
        wanted = [t for t in inputs if t.requires_grad]
        if not out.requires_grad:  # no segments on this rank (all padding): nothing to propagate
            return tuple(zeros) + (None, None, None)
        try:
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
            result = [next(grads) if t.requires_grad else None for t in inputs]
        except Exception as exc:  # noqa: BLE001
            _record_failure(ctx.state, ctx.backend, "backward", exc)
            return tuple(zeros) + (None, None, None)
        result = [z if r is None and z is not None else r for r, z in zip(result, zeros)]
        return tuple(result) + (None, None, None)


def _record_failure(state, backend: str, phase: str, exc: Exception) -> None:
    message = f"{backend} kernel failed in {phase} on CP rank {state.rank}: {type(exc).__name__}: {exc}"
    state.kernel_failures.append(message)
    logger.error("blockdiag-cp: %s", message)


def _validate_qkv(state: BlockDiagCPState, q, k, v, cp_group) -> None:
    if cp_group is not None and ps.group_size(cp_group) != state.cp:
        raise BlockDiagCPError(
            f"the CP group passed to attention has size {ps.group_size(cp_group)} but the published "
            f"state was built for cp={state.cp}; build the state with cp_group=<this layer's group>")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise BlockDiagCPError(f"q, k, v must be [s, b, h, d] (Megatron sbhd); got {tuple(q.shape)}, "
                               f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != state.local_len or k.shape[0] != state.local_len or v.shape[0] != state.local_len:
        raise BlockDiagCPError(
            f"q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} positions but the published state "
            f"expects local_len={state.local_len} (sequence {state.seq_len}, padded {state.padded_len}, "
            f"cp={state.cp}); shard the batch with this state (state.shard / shard_batch)")
    if k.shape != v.shape or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise BlockDiagCPError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree "
                               "(batch, head dim, or k vs v)")
    if q.shape[2] % k.shape[2] != 0:
        raise BlockDiagCPError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads "
                               f"({k.shape[2]}) for grouped-query attention")
    if state.rows not in (1, q.shape[1]):
        raise BlockDiagCPError(f"the state has doc ids for {state.rows} rows but the batch has "
                               f"{q.shape[1]}; pass doc_ids of shape [S] or [b, S]")


def _call_backend(state: BlockDiagCPState, q) -> str:
    backend = state.attn_backend
    while True:
        ok, reason = kernels.call_availability(backend, q, state._dropout)
        if ok:
            return backend
        # Same dtype/device/dropout on every rank, so every rank takes this branch alike.
        if state.strict:
            raise BlockDiagCPError(f"strict mode: attention backend {backend!r} cannot take this call "
                                   f"({reason}); drop strict or change dtype/dropout")
        nxt = ATTN_BACKEND_VALUES[ATTN_BACKEND_VALUES.index(backend) + 1]
        while not state.available[nxt]:
            nxt = ATTN_BACKEND_VALUES[ATTN_BACKEND_VALUES.index(nxt) + 1]
        level = logging.WARNING if state._backend_explicit else logging.INFO  # as in build()
        _log_once(level, f"blockdiag-cp: attention backend {backend} -> {nxt} for this call: {reason}")
        state.attn_backend_reason = f"fell back to {nxt}: {backend}: {reason}"
        state.attn_backend = backend = nxt


def blockdiag_cp_attention(q, k, v, softmax_scale=None, dropout_p=0.0, *, state=None, cp_group=None):
    """Per-document causal attention of this rank's queries over the CP group's keys.

    q: [local_len, b, Hq, D]; k, v: [local_len, b, Hkv, D] -> [local_len, b, Hq, D].
    ``state`` overrides the published one (pipeline schedules pass it explicitly).
    """
    _CP_ATTN_FIRE_COUNT.increment()
    state = _CP_BLOCKDIAG_STATE.get() if state is None else state
    scale = kernels.default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    if state is None:
        group = ps.get_cp_group() if cp_group is None else cp_group
        if ps.group_size(group) > 1:
            raise BlockDiagCPError(
                "block-diagonal CP attention ran with CP > 1 but no step state is published: wrap "
                "forward and backward in `with blockdiag_cp_step(state):` (state from shard_batch or "
                "BlockDiagCPState.build); refusing to attend to local keys only")
        return _single_document_causal(q, k, v, scale, dropout_p)
    _validate_qkv(state, q, k, v, cp_group)
    state._dropout = dropout_p
    backend = _call_backend(state, q)

    L, b, hq, d = q.shape
    hkv = k.shape[2]
    R = state.rows
    # Rows with their own doc ids flatten into tokens; shared ids fold the batch into heads.
    g = b // R
    q_flat = q.reshape(L * R, g * hq, d)
    state.kv_row_bytes = 2 * k[0].numel() * k.element_size()
    if state.cp == 1:
        # Nothing to exchange: gather K and V directly, skipping the fused copy.
        q_index, k_index, seg = state._segments_for("sparse", q.device)
        k_packed = _gather(k.reshape(L * R, g * hkv, d), k_index)
        v_packed = _gather(v.reshape(L * R, g * hkv, d), k_index)
    else:
        kv = torch.cat([k, v], dim=-1).view(L, b, -1)  # [L, b, Hkv * 2D]: one collective for both
        if state.kv_exchange == "allgather":
            kind = "allgather"
            buf = allgather_kv(kv, state.group, state.comm_stats)
        else:
            kind = "sparse"
            buf = needed_kv(kv, state._send_index_on(kv.device), state.plan.exchange.counts, state.rank,
                            state.group, use_p2p=state.kv_exchange == "halo", stats=state.comm_stats)
        q_index, k_index, seg = state._segments_for(kind, q.device)
        buf_flat = buf.reshape(buf.shape[0] * R, g * hkv, 2 * d)
        k_packed, v_packed = _gather(buf_flat, k_index).split(d, dim=-1)  # [Nk, g*Hkv, D]
    q_packed = _gather(q_flat, q_index)  # [Nq, g*Hq, D]

    fn = kernels.kernel_for(backend)

    def run(qp, kp, vp):
        if qp.shape[0] == 0:
            # Every query of this rank is padding: no kernel call (varlen kernels are not promised to
            # take zero segments); _GuardedKernel still returns zero grads so backward collectives run.
            return qp.new_zeros(qp.shape)
        return fn(qp, kp.contiguous(), vp.contiguous(), seg, scale, dropout_p)

    out_packed = _GuardedKernel.apply(q_packed, k_packed, v_packed, run, state, backend)
    out_packed = out_packed.to(q.dtype)
    out = out_packed if q_index is None else q_flat.new_zeros(q_flat.shape).index_copy(0, q_index, out_packed)
    return out.view(L, b, hq, d)


def _single_document_causal(q, k, v, scale, dropout_p):
    # CP = 1 without a state: the whole local sequence is one causal document.
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, is_causal=True, scale=scale, dropout_p=dropout_p,
        enable_gqa=q.shape[2] != k.shape[2])
    return out.permute(2, 0, 1, 3)


def agree_on_kernel_failures(state: BlockDiagCPState) -> None:
    """One small all-reduce at the end of a step; raises on every rank if any kernel failed."""
    failed = 1 if state.kernel_failures else 0
    if state.cp > 1:
        flag = torch.tensor([failed], dtype=torch.int64)
        if dist.get_backend(state.group) == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=state.group)
        failed = int(flag.item())
    if failed:
        mine = "; ".join(state.kernel_failures) or "this rank's kernels succeeded"
        raise BlockDiagCPError(f"an attention kernel failed on at least one CP rank during this step "
                               f"(raised on every rank; this rank: {mine}); rerun with "
                               f"--cp-attn-backend dense to isolate it")
