"""What a layer call of the streamed op asks of a device: launching ops, kernel calls, transfers, host syncs.

``OpCounter`` is a ``TorchDispatchMode`` that sorts every aten op reaching it into one
labelled region (``with counter.region(label):``); ``layer_calls`` runs a few layers of
one step and counts each layer's forward and backward on its own. The counts depend
only on the plan and the shapes, so on CPU they are deterministic (tests pin them).

The rules, per region:

- ``launching``: aten ops that would launch a device kernel: every op that is neither
  a view or metadata op (an op whose schema returns an alias of an input, plus the
  ``VIEW_OPS`` below) nor an allocation. ``allocations``: ``ALLOCATION_OPS`` (empty
  buffers: the caching allocator launches nothing), counted apart.
- ``kernel_calls``: calls of the engine's attention kernel (``kernels.kernel_for``,
  forward or backward, whatever the backend). The ops the kernel runs inside are not
  counted: on a device it is one varlen kernel, however the CPU stand-in computes it.
- transfers: each ``isend`` / ``irecv`` posted through ``dist.batch_isend_irecv`` is one
  send / receive, each non-empty split of ``dist.all_to_all_single`` one send or one
  receive, with their bytes; ``posts`` counts the calls (a batch of messages each); ``collectives`` counts the other collectives (the agreement's
  all-reduce). Ops inside these calls are not counted.
- ``syncs``: ops whose output size or value depends on tensor data, which on a device
  wait for the stream: ``SYNC_OPS`` (``nonzero``, ``_local_scalar_dense`` for ``.item()`` /
  ``int()`` / ``bool()``, ``masked_select``, ``unique``, ``equal``), indexing or index_put with
  a boolean index, ``repeat_interleave`` without ``output_size``, and a copy to the CPU of
  a tensor on another device. On CPU every tensor counts, host tables included (on a
  device those would be host reads, not syncs; the op should not read them per call
  either). ``Tensor.tolist()`` of a CPU tensor never reaches the dispatcher and is not seen.

Ops outside any region are not recorded.

``OpCounter(log=True)`` also keeps each region's ``events`` in order, for a replay that
prices them (``scripts/bench/gpu_model.py``): ``OpEvent`` per launching op (its input and
output tensors as (shape, dtype) pairs), ``KernelEvent`` per kernel call (its segments'
query and key lengths), ``PostEvent`` per posted batch of transfers (bytes and peer of
each) and ``WaitEvent`` when the op first waits on a request of that batch. The counts
are the same with or without the log.
"""

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .overrides import override_kernel

_aten = torch.ops.aten

# Views and metadata: no kernel (besides the ops whose schema says they alias an input).
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "as_strided", "_reshape_alias", "reshape", "t", "transpose", "permute", "expand",
    "split", "split_with_sizes", "unbind", "chunk", "slice", "select", "narrow", "unsqueeze", "squeeze",
    "detach", "alias", "lift_fresh", "view_as", "flatten", "unflatten", "movedim", "diagonal",
})
ALLOCATION_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
SYNC_OPS = frozenset({
    "nonzero", "_local_scalar_dense", "masked_select", "unique", "unique_dim", "unique_consecutive",
    "_unique", "_unique2", "equal",
})
_BOOL_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
_KERNEL_BACKENDS = ("te", "flash", "dense")
_P2P_NAMES = {"isend": "send", "irecv": "receive"}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


TensorSpec = Tuple[Tuple[int, ...], torch.dtype]  # (shape, dtype) of one tensor an op read or wrote


@dataclass(frozen=True)
class OpEvent:
    """A launching op: what it read and what it wrote (tensors only, in argument order)."""

    name: str
    inputs: Tuple[TensorSpec, ...]
    outputs: Tuple[TensorSpec, ...]


@dataclass(frozen=True)
class KernelEvent:
    """One kernel call: forward or backward, its segments and the tensors it was handed."""

    backward: bool
    q_lens: Tuple[int, ...]
    k_lens: Tuple[int, ...]
    causal: bool
    window: Optional[int]
    inputs: Tuple[TensorSpec, ...]


@dataclass(frozen=True)
class PostEvent:
    """One posted batch of transfers: (sent, bytes, peer global rank) per message."""

    post: int  # this counter's running number of the batch, for its WaitEvent
    messages: Tuple[Tuple[bool, int, int], ...]


@dataclass(frozen=True)
class WaitEvent:
    post: int


def _specs(values) -> Tuple[TensorSpec, ...]:
    out = []
    for x in values:
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), x.dtype))
        elif isinstance(x, (list, tuple)):
            out += _specs(x)
    return tuple(out)


@dataclass
class Counts:
    """One region's figures (see the module docstring for what each counts)."""

    launching: int = 0
    views: int = 0
    allocations: int = 0
    kernel_calls: int = 0
    sends: int = 0
    receives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    posts: int = 0
    collectives: int = 0
    syncs: int = 0
    ops: Counter = field(default_factory=Counter)  # launching ops by name
    sync_ops: Counter = field(default_factory=Counter)
    events: List = field(default_factory=list)  # with OpCounter(log=True): Op/Kernel/Post/WaitEvent in order

    def add_transfer(self, sent: bool, messages: int, nbytes: int) -> None:
        if sent:
            self.sends += messages
            self.bytes_sent += nbytes
        else:
            self.receives += messages
            self.bytes_received += nbytes

    def summary(self) -> Dict[str, int]:
        """The pinned figures: kernel calls, launching ops, transfers (sends + receives) and syncs."""
        return {"kernel_calls": self.kernel_calls, "launching": self.launching,
                "transfers": self.sends + self.receives, "syncs": self.syncs}


def _op_name(func) -> str:
    return func.overloadpacket.__name__


def _is_view(func) -> bool:
    # An op returning an alias of an input ("Tensor(a)") only reinterprets its storage.
    return _op_name(func) in VIEW_OPS or any(r.alias_info is not None and not r.alias_info.is_write
                                             for r in func._schema.returns)


def _has_bool(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _is_sync(func, args, kwargs) -> bool:
    name = _op_name(func)
    if name in SYNC_OPS:
        return True
    if name in _BOOL_INDEX_OPS:
        return _has_bool(args[1] if len(args) > 1 else kwargs.get("indices"))
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0])
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name == "_to_copy":
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"
    if name == "copy_":
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


class OpCounter(TorchDispatchMode):
    """Per-region ``Counts`` of the aten ops, kernel calls and transfers inside ``with counter:``."""

    def __init__(self, log: bool = False):
        super().__init__()
        self.log = log
        self._posts = 0
        self.counts: Dict[Hashable, Counts] = {}
        self._label: Optional[Hashable] = None
        self._paused = 0  # inside a kernel or a transfer: its own ops are not ours
        self._stack: Optional[contextlib.ExitStack] = None

    @contextlib.contextmanager
    def region(self, label: Hashable):
        """Record into ``counts[label]`` inside the block (regions do not nest)."""
        previous, self._label = self._label, label
        self.counts.setdefault(label, Counts())
        try:
            yield self.counts[label]
        finally:
            self._label = previous

    def _current(self) -> Optional[Counts]:
        return None if self._label is None or self._paused else self.counts[self._label]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counts = self._current()
        if counts is not None:
            name = _op_name(func)
            if _is_sync(func, args, kwargs):
                counts.syncs += 1
                counts.sync_ops[name] += 1
            if name in ALLOCATION_OPS:
                counts.allocations += 1
            elif _is_view(func):
                counts.views += 1
            else:
                counts.launching += 1
                counts.ops[name] += 1
                if self.log:
                    result = func(*args, **kwargs)
                    # an out= tensor is what the op writes (its result), not one it reads
                    read = list(args) + [value for key, value in kwargs.items() if key != "out"]
                    counts.events.append(OpEvent(name, _specs(read),
                                                 _specs(result if isinstance(result, (list, tuple)) else [result])))
                    return result
        return func(*args, **kwargs)

    # -- kernels and transfers: wrapped while the counter is entered ----------------------------

    @contextlib.contextmanager
    def _paused_for(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _recording(self, real, record):
        """``real`` that first hands the current region's ``Counts`` and its arguments to ``record``;
        the ops ``real`` runs itself are not counted."""
        def call(*args, **kwargs):
            counts = self._current()
            if counts is not None:
                record(counts, *args, **kwargs)
            with self._paused_for():
                return real(*args, **kwargs)
        return call

    def _counted_kernel(self, kernel):
        from megatron_ext.blockdiag_cp.kernels import Kernel

        def record_as(backward: bool):
            def record(counts, *args, **kwargs):
                counts.kernel_calls += 1
                if self.log:
                    seg = args[7] if backward else args[3]  # the Segments argument of either signature
                    counts.events.append(KernelEvent(backward, tuple(seg.q_lens), tuple(seg.k_lens), seg.causal,
                                                     seg.window, _specs(args)))
            return record

        return Kernel(self._recording(kernel.forward, record_as(False)),
                      self._recording(kernel.backward, record_as(True)))

    def _logged_post(self, counts, messages, requests):
        """Record the batch and hand back its requests, each logging the batch's first wait."""
        if not self.log or counts is None:
            return requests
        self._posts += 1
        post = self._posts
        counts.events.append(PostEvent(post, tuple(messages)))
        waited = []

        class _Request:
            def __init__(self, real):
                self._real = real

            def wait(inner, *args, **kwargs):
                current = self._current()
                if not waited and current is not None:
                    waited.append(True)
                    current.events.append(WaitEvent(post))
                return inner._real.wait(*args, **kwargs)

            def __getattr__(inner, name):
                return getattr(inner._real, name)

        if requests is None:  # a blocking collective (no async_op): it has finished when the call returns
            counts.events.append(WaitEvent(post))
            return None
        if isinstance(requests, list):
            return [_Request(r) for r in requests]
        return _Request(requests)

    def _batch_isend_irecv(self, real):
        def record(counts, ops, *args, **kwargs):
            counts.posts += 1
            for op in ops:
                counts.add_transfer(_P2P_NAMES[op.op.__name__] == "send", 1, _nbytes(op.tensor))

        def call(ops, *args, **kwargs):
            counts = self._current()
            messages = [(_P2P_NAMES[op.op.__name__] == "send", _nbytes(op.tensor), op.peer) for op in ops]
            return self._logged_post(counts, messages, self._recording(real, record)(ops, *args, **kwargs))
        return call

    def _all_to_all_single(self, real):
        def messages_of(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
            """(sent, bytes, peer global rank) per non-empty split to or from another rank (the own block is
            a local copy, not a transfer)."""
            group = kwargs.get("group", args[0] if args else None)
            world = dist.get_world_size(group)
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
            me = dist.get_rank(group)
            out = []
            for splits, tensor, sent in ((input_split_sizes, input, True), (output_split_sizes, output, False)):
                row = _nbytes(tensor[:1]) if tensor.shape[0] else 0
                out += [(sent, n * row, ranks[i])
                        for i, n in enumerate(splits or [tensor.shape[0] // world] * world) if n and i != me]
            return out

        def record(counts, *args, **kwargs):
            counts.posts += 1
            for sent, nbytes, _ in messages_of(*args, **kwargs):
                counts.add_transfer(sent, 1, nbytes)

        def call(*args, **kwargs):
            counts = self._current()
            messages = messages_of(*args, **kwargs) if counts is not None and self.log else []
            return self._logged_post(counts, messages, self._recording(real, record)(*args, **kwargs))
        return call

    def _collective(self, real):
        def record(counts, *args, **kwargs):
            counts.collectives += 1
        return self._recording(real, record)

    def __enter__(self):
        from megatron_ext.blockdiag_cp import kernels

        stack = contextlib.ExitStack()
        for backend in _KERNEL_BACKENDS:
            stack.enter_context(override_kernel(backend, self._counted_kernel(kernels.kernel_for(backend))))
        patches = {"batch_isend_irecv": self._batch_isend_irecv, "all_to_all_single": self._all_to_all_single}
        patches.update({name: self._collective for name in ("all_reduce", "all_gather", "all_gather_into_tensor",
                                                            "broadcast", "barrier")})
        for name, wrap in patches.items():
            real = getattr(dist, name)
            setattr(dist, name, wrap(real))
            stack.callback(setattr, dist, name, real)
        self._stack = stack
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            stack, self._stack = self._stack, None
            stack.close()


def layer_calls(state, q, k, v, layers: int = 3, **attention_kwargs) -> List[Tuple[Counts, Counts]]:
    """(forward, backward) ``Counts`` of ``layers`` attention calls of one step on ``state``.

    Each layer attends fresh leaves of the same local q, k, v [local_len, b, h, d]; the
    forwards run in order, then the backwards in reverse (as a model's), each handed its
    upstream gradient directly so that only the op's own backward is counted.
    """
    import megatron_ext.blockdiag_cp as bdcp

    counter = OpCounter()
    outs = []
    with bdcp.blockdiag_cp_step(state), counter:
        for layer in range(layers):
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            with counter.region(("forward", layer)):
                out = bdcp.blockdiag_cp_attention(*inputs, **attention_kwargs)
            outs.append(out)
        upstream = torch.ones_like(outs[0])
        for layer in reversed(range(layers)):
            with counter.region(("backward", layer)):
                torch.autograd.backward(outs[layer], upstream)
    return [(counter.counts[("forward", i)], counter.counts[("backward", i)]) for i in range(layers)]


__all__ = ["OpCounter", "Counts", "layer_calls", "VIEW_OPS", "ALLOCATION_OPS", "SYNC_OPS", "OpEvent", "KernelEvent",
           "PostEvent", "WaitEvent"]
