"""One state resolver for every consumer, and the documents of Megatron's own data paths.

``resolve_step_state`` is the only reader of the published holder. Precedence:

1. the microbatch's own state: ours in ``packed_seq_params.blockdiag_state``, or
   one built from THD ``packed_seq_params`` (cached on that object);
2. one derived from Megatron's attention mask (cached per mask tensor);
3. the state ``blockdiag_cp_step`` published.

Both derived states are built once per microbatch (the first layer's forward)
and reused by every other layer and by recompute in backward.

Megatron's mask (``_get_ltor_masks_and_position_ids``, True = masked out),
rows cut zigzag by ``get_batch_on_this_cp_rank``, keys full::

    rank r holds rows of chunks r and 2cp-1-r        keys: all S
    row p sees exactly [start(p), p]  ->  start(p) = its first visible key

Each rank finds its rows' starts, one all-gather shares them, and the starts
give the documents (a document begins where start(p) == p).

THD (``qkv_format="thd"``): documents from ``cu_seqlens_q`` (real lengths) and
``cu_seqlens_q_padded`` (padded extents; the gap is padding). Two partitions
reach a THD layer with CP:

- per document (TransformerEngine's ``thd_get_partitioned_indices``; SFT,
  Megatron-Bridge, megatron-core's per-document balancing): every padded extent
  a multiple of 2cp, cut in 2cp chunks, rank r holds chunks r and 2cp-1-r of
  every document -> layout ``thd``, cut along the padded extents themselves (an
  empty document's padding is an extent of its own, as TE's partition has it);
- per sequence (megatron-core 0.19 inter-document masking,
  ``use_per_sequence_balancing=True``): the whole pack cut zigzag -> layout
  ``zigzag``.

Keys come from the same documents (self-attention): ``cu_seqlens_kv`` (and
``cu_seqlens_kv_padded``) different from the query ones are refused, where
TransformerEngine would read them for the keys. Megatron-LM's SFT path passes
``cu_seqlens_q = cu_seqlens_q_padded`` (an upstream TODO): the documents are then the
padded extents, each with its padding at its end; causal attention never lets a real
token see the padding after it, so every real token's output is exact, and the
padding rows (loss-masked) compute finite values nothing reads.

Megatron-LM builds the per-sequence case without ``cu_seqlens_q_padded`` (its
GPTDataset makes none) and the per-document case with it, extents padded to
2cp; ``auto`` follows that. Padded extents that are not multiples of 2cp are
ambiguous (a per-sequence cut, or a per-document batch padded wrongly): they
need the explicit knob (``configure_cp_thd_partition``).
"""

import threading
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import parallel_state as ps
from . import state as knobs
from .agreement import BlockDiagCPError, doc_ids_fingerprint, group_ranks
from .step import BlockDiagCPState, DocumentSource, ReplicatedDocIds


def _zigzag_rows(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the rows megatron's get_batch_on_this_cp_rank gives ``rank``."""
    if cp == 1:
        return torch.arange(seq_len)
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


# ---------------------------------------------------------------------------
# Megatron's attention mask
# ---------------------------------------------------------------------------

class MegatronMaskSource(DocumentSource):
    """Documents from a per-document causal mask [b or 1, 1, local rows, S], True = masked out."""

    layout = "zigzag"
    description = "Megatron's attention mask (rows already sliced zigzag by get_batch_on_this_cp_rank)"
    errors = {
        1: "attention_mask must be a bool tensor [b or 1, 1, local rows, S] (True = masked out, as "
           "megatron builds it); got {detail}",
        2: "attention_mask rows do not match CP: {detail}; with CP each rank holds S / cp query rows "
           "(megatron's get_batch_on_this_cp_rank slices them zigzag) and S must be a multiple of 2 * cp",
        3: "attention_mask is not per-document causal: {detail}. BlockDiagCPAttention supports masks in "
           "which every query sees exactly the keys from its document's start to itself (megatron's "
           "_get_ltor_masks_and_position_ids, with or without reset_attention_mask); for any other mask "
           "use megatron's own attention without CP",
        4: "attention_mask batch ({detail}) must be 1 or the micro batch size",
    }
    must_agree = {
        "same_seq_len": "attention_mask differs across the CP ranks (key length S); every CP rank must "
                        "get the same micro batch, sliced by get_batch_on_this_cp_rank",
        "same_mask_batch": "attention_mask differs across the CP ranks (batch dimension); every CP rank "
                           "must get the same micro batch",
    }

    def __init__(self, mask: torch.Tensor, cp: int, rank: int, batch: Optional[int] = None):
        self.mask, self.cp, self.rank, self.batch = mask, cp, rank, batch
        self.starts: Optional[torch.Tensor] = None  # [B, local rows] first visible key of each row

    def local_facts(self):
        code, detail = self._check()
        mask = self.mask
        good_shape = isinstance(mask, torch.Tensor) and mask.dim() == 4
        facts = {"input_error": code,
                 "same_seq_len": mask.shape[-1] if good_shape else -1,
                 "same_mask_batch": mask.shape[0] if good_shape else -1}
        return facts, detail

    def _check(self):
        mask, cp = self.mask, self.cp
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4 \
                or mask.shape[1] != 1:
            what = (f"{mask.dtype} of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor)
                    else type(mask).__name__)
            return 1, what
        B, _, rows, S = mask.shape
        if self.batch is not None and B not in (1, self.batch):
            return 4, f"{B} vs micro batch {self.batch}"
        if (cp > 1 and S % (2 * cp) != 0) or rows * cp != S:
            return 2, f"{rows} rows on this rank, S = {S}, cp = {cp}"
        positions = _zigzag_rows(S, cp, self.rank)  # [rows], runs of consecutive positions
        # First visible key of each row (argmin finds the first False); then the exact check.
        starts = mask.view(torch.uint8)[:, 0].argmin(dim=-1)  # [B, rows]
        bad_row = _first_non_document_row(mask[:, 0], starts, positions)
        if bad_row is not None:
            row_b, row = bad_row
            p = int(positions[row])
            seen = torch.nonzero(~mask[row_b, 0, row]).flatten().tolist()
            shown = seen if len(seen) <= 8 else seen[:4] + ["..."] + seen[-3:]
            return 3, (f"batch row {row_b}, query position {p} sees keys {shown}, expected one "
                       f"contiguous run ending at {p}")
        self.starts = starts.to("cpu", torch.int64)
        return 0, ""

    def doc_ids(self, group, cp, rank):
        B, rows = self.starts.shape
        S = rows * cp
        if cp > 1:
            nccl = dist.get_backend(group) == "nccl"
            local = self.starts.reshape(-1)
            local = local.cuda() if nccl else local
            gathered = local.new_empty(cp * local.numel())
            dist.all_gather_into_tensor(gathered, local, group=group)  # sizes agreed in the build
            per_rank = gathered.cpu().view(cp, B, rows)
            starts = torch.empty(B, S, dtype=torch.int64)
            for r in range(cp):
                starts[:, _zigzag_rows(S, cp, r)] = per_rank[r]
        else:
            starts = self.starts
        # Every rank checks the same gathered starts, so every rank raises alike.
        pos = torch.arange(S)
        ok = (starts <= pos) & (starts[:, :1] == 0)
        ok[:, 1:] &= (starts[:, 1:] == pos[1:]) | (starts[:, 1:] == starts[:, :-1])
        if not bool(ok.all()):
            row, p = [int(x) for x in torch.nonzero(~ok)[0]]
            raise BlockDiagCPError(
                f"the attention masks of the CP ranks do not form one per-document causal mask (batch "
                f"row {row}, position {p} starts its document at {int(starts[row, p])}); every CP rank "
                "must hold its zigzag rows of the same micro batch (megatron's get_batch_on_this_cp_rank)")
        return torch.cumsum((starts == pos).to(torch.int64), dim=-1)  # [B, S], 1-based


def _first_non_document_row(mask: torch.Tensor, starts: torch.Tensor, positions: torch.Tensor):
    """(batch row, local row) of the first row that does not see exactly [start, p], or None.

    mask [B, rows, S] (True = masked out), starts [B, rows] each row's first visible key,
    positions [rows] ascending in runs of consecutive positions. Exact, and about one
    pass of ``all()`` over the mask: per block of rows [a, b), the keys past b must all
    be masked, the diagonal block [a, b) is compared with the causal pattern, and the
    keys before a must be masked except for the rows whose document began before a
    (a prefix of the block when the mask is valid), compared exactly.
    """
    B, rows, S = mask.shape
    device = mask.device
    keys = torch.arange(S, device=device)
    breaks = (torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist()
    for run_a, run_b in zip([0] + breaks, breaks + [rows]):
        for i in range(run_a, run_b, _MASK_ROW_BLOCK):
            j = min(run_b, i + _MASK_ROW_BLOCK)
            a, b = int(positions[i]), int(positions[j - 1]) + 1  # the block's key range
            p = positions[i:j].to(device)
            for bi in range(B):
                m, f = mask[bi, i:j], starts[bi, i:j]
                diag = (keys[a:b] < f[:, None]) | (keys[a:b] > p[:, None])
                ok = bool(m[:, b:].all()) and torch.equal(m[:, a:b], diag)
                straddle = int((f < a).sum())
                if ok and straddle:
                    ok = bool((f[:straddle] < a).all()) and torch.equal(
                        m[:straddle, :a], keys[:a] < f[:straddle, None])
                ok = ok and bool(m[straddle:, :a].all())
                if not ok:  # find the row (error path only: the plain exact comparison)
                    expected = (keys < f[:, None]) | (keys > p[:, None])
                    row = int(torch.nonzero((m != expected).any(-1))[0])
                    return bi, i + row
    return None


_MASK_ROW_BLOCK = 1024

# ---------------------------------------------------------------------------
# THD packed sequences
# ---------------------------------------------------------------------------


class ThdSource(ReplicatedDocIds):
    """Documents from THD cu_seqlens (global, identical on every CP rank) and this rank's token count."""

    description = "a THD batch (partitioned by Megatron before attention)"
    errors = dict(ReplicatedDocIds.errors)
    errors.update({
        11: "THD cu_seqlens: {detail}; cu_seqlens_q (and cu_seqlens_q_padded) must be 1-D int32, start "
            "at 0 and be non-decreasing, with every padded extent at least its document's length",
        12: "THD token count: {detail}",
        13: "THD partition: {detail}",
        14: "THD keys: {detail}; BlockDiagCPAttention is self-attention over one set of documents and "
            "reads cu_seqlens_q (and cu_seqlens_q_padded) for queries and keys alike, so "
            "cu_seqlens_kv (and cu_seqlens_kv_padded) must equal them (or be None)",
    })
    must_agree = dict(ReplicatedDocIds.must_agree)
    must_agree["same_thd_partition"] = ("THD batches were partitioned differently across the CP ranks "
                                        "(per-document vs per-sequence); set configure_cp_thd_partition "
                                        "alike on every rank")
    must_agree["same_thd_extents"] = ("THD cu_seqlens_q_padded differs across the CP ranks (the same "
                                      "documents, other padded extents); every CP rank must get the same "
                                      "packed micro batch and its cu_seqlens")

    def __init__(self, packed_seq_params, local_tokens: int, cp: int, partition: str):
        super().__init__(None)
        self.params, self.local_tokens, self.cp, self.partition_knob = \
            packed_seq_params, local_tokens, cp, partition
        self.partition: Optional[str] = None

    def local_facts(self):
        code, detail = self._thd_check()
        if code:
            return {"input_error": code, "same_rows": 0, "same_seq_len": 0, "same_doc_hash": 0,
                    "same_thd_partition": 0, "same_thd_extents": 0}, detail
        facts, detail = super().local_facts()
        facts["same_thd_partition"] = 1 if self.partition == "per_document" else 2
        # The layout cuts these extents, which the doc ids alone do not give (an empty document's).
        facts["same_thd_extents"] = (0 if self.cu_seqlens_padded is None
                                     else doc_ids_fingerprint(self.cu_seqlens_padded.unsqueeze(0)))
        return facts, detail

    def _thd_check(self):
        p, cp = self.params, self.cp
        cu_q = p.cu_seqlens_q
        cu_padded = getattr(p, "cu_seqlens_q_padded", None)
        for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_q_padded", cu_padded)):
            if cu is None and name == "cu_seqlens_q_padded":
                continue
            if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32 or cu.numel() < 2:
                what = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else repr(cu)
                return 11, f"{name} is {what}"
        q = cu_q.to("cpu", torch.int64)
        padded = q if cu_padded is None else cu_padded.to("cpu", torch.int64)
        for kv_name, q_name, mine in (("cu_seqlens_kv", "cu_seqlens_q", q),
                                      ("cu_seqlens_kv_padded", "cu_seqlens_q_padded",
                                       None if cu_padded is None else padded)):
            theirs = getattr(p, kv_name, None)
            if theirs is None or theirs is getattr(p, q_name, None):
                continue
            if not isinstance(theirs, torch.Tensor) or mine is None \
                    or not torch.equal(theirs.to("cpu", torch.int64), mine):
                shown = _short(theirs.to("cpu", torch.int64)) if isinstance(theirs, torch.Tensor) \
                    else repr(theirs)
                return 14, (f"{kv_name} = {shown} differs from {q_name} = "
                            f"{_short(mine) if mine is not None else None}")
        for name, cu in (("cu_seqlens_q", q), ("cu_seqlens_q_padded", padded)):
            if int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
                return 11, f"{name} = {_short(cu)} does not start at 0 or decreases"
        if padded.numel() != q.numel() or bool((padded.diff() < q.diff()).any()):
            return 11, (f"cu_seqlens_q_padded {_short(padded)} does not hold cu_seqlens_q {_short(q)} "
                        "(one extent per document, each at least the document's length)")
        total = self.local_tokens * cp
        if total != int(padded[-1]):
            return 12, (f"this rank holds {self.local_tokens} tokens, so the pack has {total} over cp={cp}, "
                        f"but the padded documents end at {int(padded[-1])}; q/k/v must hold exactly this "
                        "rank's share of the padded pack")
        extents = padded.diff()
        multiple = bool((extents % (2 * cp) == 0).all()) if cp > 1 else True
        knob = self.partition_knob
        if cp == 1:
            self.partition = "per_document"
        elif knob == "per_document" or (knob == "auto" and cu_padded is not None):
            if not multiple:
                bad = int(torch.nonzero(extents % (2 * cp)).flatten()[0])
                hint = ("" if knob == "per_document" else
                        "; if the batch was cut zigzag over the whole pack (megatron-core inter-document "
                        "masking, use_per_sequence_balancing=True), set "
                        "configure_cp_thd_partition('per_sequence')")
                return 13, (f"document {bad} (0-based; {int(q[bad + 1] - q[bad])} tokens, padded positions "
                            f"{int(padded[bad])}..{int(padded[bad + 1]) - 1}) has padded extent "
                            f"{int(extents[bad])}, not a multiple of 2 * cp = {2 * cp}: TransformerEngine's "
                            f"per-document partition needs every document padded to a multiple of 2 * cp, an "
                            f"empty one too (or to 0){hint}")
            self.partition = "per_document"
        else:
            if total % (2 * cp):
                return 13, (f"a per-sequence (zigzag) cut needs the pack length {total} to be a multiple "
                            f"of 2 * cp = {2 * cp}")
            self.partition = "per_sequence"
        self.layout = "thd" if self.partition == "per_document" and cp > 1 else "zigzag"
        # TE's partition cut the padded extents as given: the layout takes them, not the doc ids
        # (an empty document's padding is an extent of its own, not the previous one's padding).
        self.cu_seqlens_padded = padded if self.layout == "thd" else None
        lengths = q.diff()
        ids = torch.zeros(total, dtype=torch.int64)
        doc = torch.repeat_interleave(torch.arange(1, lengths.numel() + 1), lengths)
        within = torch.arange(doc.numel()) - torch.repeat_interleave(q[:-1], lengths)
        ids[torch.repeat_interleave(padded[:-1], lengths) + within] = doc
        self.raw = ids
        return 0, ""


def _short(cu: torch.Tensor) -> str:
    values = cu.tolist()
    return str(values) if len(values) <= 8 else f"[{values[0]}, {values[1]}, ..., {values[-1]}] ({len(values)})"


# ---------------------------------------------------------------------------
# The resolver and its per-microbatch caches
# ---------------------------------------------------------------------------


def _knob_key(group):
    return (group_ranks(group), knobs._CP_ATTN_BACKEND, knobs._CP_KV_EXCHANGE, knobs._CP_LAYOUT,
            knobs._CP_THD_PARTITION, knobs._CP_KV_BACKWARD, knobs._CP_ULYSSES_SIZE, knobs._CP_RELAYOUT,
            knobs._CP_STRICT)


class _MaskStateCache:
    """Mask tensor -> the state derived from it, for the life of that mask.

    Keyed by the mask's memory (data pointer, shape, strides, version counter)
    while a weak reference shows the mask is alive, so its memory cannot have
    been reused: recompute sees a detached alias of the same mask (reentrant
    checkpoint detaches its inputs) and still hits; an in-place edit bumps the
    version and misses. Entries die with their masks.
    """

    def __init__(self):
        self._entries: List[tuple] = []
        self._lock = threading.Lock()

    @staticmethod
    def _key(mask: torch.Tensor, group, windows=None) -> tuple:
        return (mask.data_ptr(), tuple(mask.shape), mask.stride(), mask._version, str(mask.device),
                _knob_key(group), windows)

    def get(self, mask, group, windows=None) -> Optional[BlockDiagCPState]:
        key = self._key(mask, group, windows)
        with self._lock:
            self._entries = [e for e in self._entries if e[0]() is not None]
            for ref, entry_key, state in self._entries:
                if entry_key == key:
                    return state
        return None

    def put(self, mask, group, state, windows=None) -> None:
        with self._lock:
            self._entries.append((weakref.ref(mask), self._key(mask, group, windows), state))


_MASK_STATES = _MaskStateCache()


def state_from_mask(attention_mask: torch.Tensor, group, batch: Optional[int] = None,
                    device=None, windows=None) -> BlockDiagCPState:
    """The step state of a micro batch given by Megatron's per-document causal mask (cached);
    ``windows``: the model's sliding windows (``cost.WindowMix``), recorded on the state."""
    state = _MASK_STATES.get(attention_mask, group, windows)
    if state is None:
        cp, rank = ps.group_size(group), ps.group_rank(group)
        state = BlockDiagCPState.from_source(MegatronMaskSource(attention_mask, cp, rank, batch),
                                             cp_group=group, device=device, strict=knobs._CP_STRICT,
                                             windows=windows)
        _MASK_STATES.put(attention_mask, group, state, windows)
    return state


# The cu_seqlens fields a THD state is built from (ThdSource._thd_check reads all four).
_THD_CU_FIELDS = ("cu_seqlens_q", "cu_seqlens_q_padded", "cu_seqlens_kv", "cu_seqlens_kv_padded")


def _thd_inputs(packed_seq_params) -> tuple:
    """What a THD state is built from: per cu_seqlens field (value, version, data pointer, shape, host copy).

    The cache entry holds the field's object itself and compares it with ``is``: a reassigned field
    misses, and a freed tensor's reused id cannot fake a hit. ``copy_`` and every other torch write
    bump the version counter. A host tensor's values are kept and compared as well (cheap), which
    also catches writes the counter does not see (``.data``, numpy views); a device tensor's are
    not read, as that would synchronize with the device on every layer's call.
    """
    inputs = []
    for name in _THD_CU_FIELDS:
        value = getattr(packed_seq_params, name, None)
        if isinstance(value, torch.Tensor):
            host = value.detach().clone() if value.device.type == "cpu" else None
            inputs.append((value, value._version, value.data_ptr(), tuple(value.shape), host))
        else:
            inputs.append((value, None, None, None, None))
    return tuple(inputs)


def _thd_inputs_unchanged(built: tuple, packed_seq_params) -> bool:
    """Whether ``packed_seq_params`` still holds the cu_seqlens ``built`` (``_thd_inputs``) recorded."""
    for name, (value, version, pointer, shape, host) in zip(_THD_CU_FIELDS, built):
        now = getattr(packed_seq_params, name, None)
        if now is not value:
            return False
        if isinstance(now, torch.Tensor):
            if (now._version, now.data_ptr(), tuple(now.shape)) != (version, pointer, shape):
                return False
            if host is not None and not torch.equal(host, now):
                return False
    return True


def state_from_thd(packed_seq_params, local_tokens: int, group, device=None, windows=None) -> BlockDiagCPState:
    """The step state of a THD micro batch, cached on its packed_seq_params while its cu_seqlens are
    the ones it was built from (``_thd_inputs``): new values written in place or new tensors assigned
    to the same params object build a new state."""
    group = getattr(packed_seq_params, "cp_group", None) or group
    key = (_knob_key(group), local_tokens, windows)
    cached = getattr(packed_seq_params, "_blockdiag_cp_state", None)
    if cached is not None and cached[0] == key and _thd_inputs_unchanged(cached[2], packed_seq_params):
        return cached[1]
    inputs = _thd_inputs(packed_seq_params)  # before the build reads them
    source = ThdSource(packed_seq_params, local_tokens, ps.group_size(group), knobs._CP_THD_PARTITION)
    state = BlockDiagCPState.from_source(source, cp_group=group, device=device, strict=knobs._CP_STRICT,
                                         windows=windows)
    packed_seq_params._blockdiag_cp_state = (key, state, inputs)
    return state


def resolve_step_state(packed_seq_params=None, attention_mask=None, *, cp_group=None,
                       local_tokens: Optional[int] = None, batch: Optional[int] = None,
                       device=None, windows=None) -> Optional[BlockDiagCPState]:
    """The state this microbatch's consumer uses: its own > mask-derived > published (or None).

    ``windows``: the model's sliding windows (``cost.WindowMix``) for a state derived here (mask,
    THD); those layouts are fixed (zigzag, THD's), so the windows are recorded, not priced."""
    own = getattr(packed_seq_params, "blockdiag_state", None)
    if own is not None:
        return own
    group = ps.get_cp_group() if cp_group is None else cp_group
    if packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd":
        if local_tokens is None:
            raise BlockDiagCPError("THD packed_seq_params need the local token count (q.shape[0])")
        return state_from_thd(packed_seq_params, local_tokens, group, device=device, windows=windows)
    if attention_mask is not None:
        return state_from_mask(attention_mask, group, batch=batch, device=device, windows=windows)
    return knobs.current_blockdiag_state()
