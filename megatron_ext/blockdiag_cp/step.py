"""The per-step state: documents, layout, plan and the knobs every CP rank agreed on.

``BlockDiagCPState.build`` is the one place a step is set up, whatever the
documents come from (a ``DocumentSource``: replicated doc ids from ``shard_batch``,
Megatron's attention mask, THD ``cu_seqlens``). It takes the source's local
facts, this process's knobs and kernel availability, and its pending kernel
failures into ONE agreement all-reduce; every rank then raises the same error or
takes the same decisions from the same reduced vector, lays out and plans the
step on the host, and never enters a K/V collective its peers skip.
"""

import logging
import re
import threading
import zlib
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import parallel_state as ps
from . import kernels
from . import state as knobs
from .agreement import (
    BUILD_GUARD,
    KIND_BUILD,
    PENDING_KERNEL_FAILURES,
    BlockDiagCPError,
    agree,
    doc_ids_fingerprint,
    group_ranks,
    kernel_failure_error,
    raised_on_every_rank,
)
from .backend import log_once, resolve_backend
from .cost import WindowMix, default_cost_model, resolve_cost_model, resolve_windows
from .exchange import GroupMessages, Pieces, RingGradients, WholeDelivery, piece_rows
from .intervals import np64, ranges_np
from .layouts import Layout, build_layout, padded_length
from .layouts.two_dim import two_dim_layouts
from .merge import MergePlan, Rows, copied_rows, device_rows
from .plan import StepPlan, build_plan, chunk_kind
from .state import (
    ATTN_BACKEND_VALUES,
    KV_BACKWARD_VALUES,
    KV_EXCHANGE_VALUES,
    LAYOUT_VALUES,
    RELAYOUT_DEFAULT,
    RELAYOUT_VALUES,
    normalize_attn_backend,
    normalize_kv_backward,
    normalize_kv_exchange,
    normalize_layout,
    normalize_relayout,
    normalize_ulysses_size,
)

# kv_backward="auto" keeps forward's received K/V for backward when the busiest rank's received
# rows are at most this multiple of its local rows (saving then at most doubles the K/V a layer
# holds between forward and backward); beyond it backward refetches, so memory stays O(S / cp).
KV_SAVE_BUDGET_LOCAL_MULTIPLE = 1.0

# a2a / halo take the needed rows in a few steps of every source and attend them by bands (the band mode,
# ``gathered``: a call or two per
# band, each query row merged once per band, not once per chunk) where the ranks receive at least this
# many chunks each on average: with fewer, attending each chunk while the next one moves is as fast or
# faster (bench gpu_model's replay, every rank alike: at 32k / cp 2, 0.5-1.5 chunks a rank, the bands
# gained at most 0.5 ms and lost up to 0.4; at 128k / cp 8 they lost 0.01-0.08 ms at 0.9-1.9 and
# gained 0.2-4.9 ms at 2.3-10.5, thd and one long document the most) ...
WHOLE_MIN_CHUNKS_PER_RANK = 2.0
# ... and where no rank receives more than this multiple of its local rows: the layer call holds them all
# by the end of forward (a group twice while it lands in the bands' order), where the streamed steps hold
# two chunks (thd and one document at cp 8: 6.5-7).
WHOLE_RECEIVED_LOCAL_MULTIPLE = 8.0
# The band mode moves each source's rows in up to this many pieces, and its step g attends piece g of every
# source: while one group is attended the next moves (and in backward, the last one's gradient goes home),
# where one step over every row would wait for all of them first and send every gradient after its calls. The
# sources' rows arrive in position order, so a group is about a quarter of the documents: a row merges
# once per band of its document's group, plus once where a piece's edge cuts its document.
BAND_GROUPS = 4
# ... each piece at least this many rows (and so fewer groups where the sources send less): a group's
# calls and posts are launches (~7.5 us each), and a smaller group hides less than that.
BAND_MIN_PIECE_ROWS = 256
# ... and at least this many times the largest document of every pair that moves rows: a piece's edge
# cuts a document, whose rows then merge once more per band (gpu_model's replay, 128k / cp 8, thd, save,
# the slowest rank's forward: the lognormal mix 2.95 ms in one step, 2.67 in two groups, 2.76 in four;
# the heavy-tailed one, whose longest document four pieces cut, 4.31 in one, 4.51 in four).
BAND_MIN_DOCS_PER_PIECE = 2
# ... except that refetch takes the groups its memory bound needs (REFETCH_GROUP_LOCAL_MULTIPLE) where no more
# than this share of any pair's rows lies in documents those pieces cut: the other rows still merge once a
# band, where streamed half-shard chunks merge every row once a chunk (gpu_model's replay, 128k / cp 8, thd,
# refetch, the busiest rank forward / backward: the lognormal mix, 0.41 of a pair's rows at most in cut
# documents, 3.16 / 7.34 ms streamed, 2.72 / 6.34 in seven groups; the heavy-tailed one, 0.42, 4.77 / 11.38
# and 4.40 / 10.40; one 128k document, every row cut, 40.5 / 100.8 ms streamed, 42.0 / 101.7 in groups).
BAND_CUT_ROWS_SHARE = 0.5

# With kv_backward="refetch", the band mode also applies where no rank receives more than this multiple of
# its local rows in one group (0: never): a layer call holds up to three groups (forward posts two ahead;
# backward holds a group, the next and two gradients), where the streamed refetch holds two chunks of half
# its rows. The groups are as many as that takes (more than BAND_GROUPS where a rank receives more), and the
# document bound (BAND_MIN_DOCS_PER_PIECE, up to BAND_CUT_ROWS_SHARE) admits the band mode only where most
# rows lie in documents short against a group. Such groups go in one batch each
# (ONE_BATCH_GROUP_LOCAL_MULTIPLE), so a group's launching ops do not grow with its sources (gpu_model's
# replay, 128k / cp 8, thd, short mix, the slowest rank of each phase: 1.39 / 3.08 ms forward / backward in
# one batch a group, against 1.67 / 3.25 pair by pair and 2.38 / 4.55 streamed; the most launching ops of a
# rank 47 / 100, against 131 / 275 and 22 / 51).
REFETCH_GROUP_LOCAL_MULTIPLE = 1.0
# A band group goes in one batch (one send gather, one placement, its calls writing the gradient in the
# order it goes home, one add of the gradients back, whatever its sources) where every rank's group is at
# most this multiple of its local rows, else pair by pair (a gather, post, placement, select and add per
# source). One batch waits for the group's
# whole send gather before its link starts and for all of it to land before its placement, which pair by pair
# overlap with the link; a small group has little of either to hide and saves a launch per source for each
# (gpu_model's replay, 128k / cp 8, thd, save, whose groups are 1.75-7 times the local rows, the slowest rank
# of each phase, one batch against pair by pair: lognormal 2.64 / 5.90 ms against 2.50 / 5.85, heavy-tailed
# 4.70 / 10.74 against 4.33 / 10.20; the short mix's groups, 1.75 times, 1.44 / 2.68 against 1.49 / 2.73).
ONE_BATCH_GROUP_LOCAL_MULTIPLE = 1.0

# Backward takes the own keys last (``BlockDiagCPState.backward_own_last``) only where the gradients the last
# step moves (the received chunk's going home, or ours coming back) have at least this many positions per
# launch (call or post) of the received chunks' steps. Going last, the own calls start once those are
# launched: small calls are launches the GPU waits on, and what the order hides is that last transfer. 750: one 7.5 us launch moves about 3 MB over NVLink
# (400e9 B/s), 750 positions of Llama-3-8B K/V (4 KiB); bench gpu_model_kv, 128k / cp 8, balanced, short
# mix: 1.01 -> 1.08 ms backward with the own keys last (101 positions back, 8 launches first).
OWN_LAST_ROWS_PER_LAUNCH = 750

# ---------------------------------------------------------------------------
# Document sources
# ---------------------------------------------------------------------------


class DocumentSource:
    """Where a step's documents come from.

    ``local_facts`` returns what this rank knows before talking to anyone:
    ``input_error`` (0 = fine; otherwise a code of ``errors``) and the facts all
    ranks must share (shapes, fingerprints). After the agreement, ``doc_ids``
    returns the [R, S] int64 full-sequence ids (it may run one collective of its
    own, identical on every rank). ``layout`` forces a layout (None: the knob's);
    ``cu_seqlens_padded`` the padded document boundaries a ``thd`` batch was cut by
    (None: the layout finds them in the doc ids).
    """

    layout: Optional[str] = None
    cu_seqlens_padded: Optional[torch.Tensor] = None
    errors: Dict[int, str] = {}
    must_agree: Dict[str, str] = {}  # fact -> the error when CP ranks disagree on it
    description = "the document source"

    def local_facts(self) -> Tuple[Dict[str, int], str]:
        raise NotImplementedError

    def doc_ids(self, group, cp: int, rank: int) -> torch.Tensor:
        raise NotImplementedError


class ReplicatedDocIds(DocumentSource):
    """Every rank holds the same full-sequence ids ([S] or [b, S], 0 = padding)."""

    errors = {
        1: "doc_ids must be an integer tensor (got {detail}); build them with "
           "megatron_ext.blockdiag_cp.doc_ids_from_eod(tokens, eod_token) or pass int64 ids",
        2: "doc_ids must have shape [S] or [b, S] (got {detail})",
        3: "doc_ids must be >= 0 (0 = padding, documents 1-based) and fit in int64; found {detail}",
        4: "doc_ids must have at least one position (got {detail})",
    }
    must_agree = {
        "same_doc_hash": "doc_ids differ across the CP ranks (content); every CP rank must pass the same "
                         "full-sequence doc ids: build them from the unsharded batch, e.g. with shard_batch()",
        "same_rows": "doc_ids differ across the CP ranks (rows); pass the same [S] or [b, S] ids on every rank",
        "same_seq_len": "doc_ids differ across the CP ranks (length); pass the same full-sequence ids on "
                        "every rank",
    }
    description = "replicated doc ids"

    def __init__(self, doc_ids):
        self.raw = doc_ids
        self.ids: Optional[torch.Tensor] = None

    def local_facts(self):
        code, detail = self._check()
        facts = {"input_error": code, "same_rows": 0, "same_seq_len": 0, "same_doc_hash": 0}
        if code == 0:
            facts.update(same_rows=self.ids.shape[0], same_seq_len=self.ids.shape[1],
                         same_doc_hash=doc_ids_fingerprint(self.ids))
        return facts, detail

    def _check(self) -> Tuple[int, str]:
        ids = self.raw
        if not isinstance(ids, torch.Tensor):
            return 1, type(ids).__name__
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            return 1, str(ids.dtype)
        if ids.dim() not in (1, 2):
            return 2, str(tuple(ids.shape))
        if ids.shape[-1] == 0:
            return 4, str(tuple(ids.shape))
        # Unsigned ids convert first: torch has no comparisons for uint64; values past 2**63 wrap negative.
        ids = ids.detach().to("cpu", torch.int64)
        if bool((ids < 0).any()):
            return 3, f"min {int(ids.min())}" + (" (an unsigned id above 2**63 - 1)"
                                                  if not self.raw.is_signed() else "")
        self.ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
        return 0, ""

    def doc_ids(self, group, cp, rank):
        return self.ids


_KNOBS = (("layout", LAYOUT_VALUES), ("kv_exchange", KV_EXCHANGE_VALUES),
          ("attn_backend", ATTN_BACKEND_VALUES), ("kv_backward", KV_BACKWARD_VALUES),
          ("relayout", RELAYOUT_VALUES), ("strict", (False, True)))


def resolve_kv_backward(requested: str, kv_exchange: str, plan: StepPlan) -> Tuple[str, str]:
    """(mode, reason) for backward's remote K/V; decided from global tables, so alike on every rank."""
    if plan.cp == 1:
        return "save", "single rank: nothing to refetch"
    if kv_exchange == "ulysses":
        return "save", "ulysses: every key is on the rank (head shards), nothing to refetch"
    if requested != "auto":
        return requested, "as requested"
    received = ((plan.cp - 1) * plan.local_len if kv_exchange == "allgather"
                else int(plan.exchange.counts.sum(0).max()))
    budget = KV_SAVE_BUDGET_LOCAL_MULTIPLE * plan.local_len
    if received <= budget:
        return "save", (f"auto: the busiest rank receives {received} K/V rows, within the save budget "
                        f"of {budget:g} ({KV_SAVE_BUDGET_LOCAL_MULTIPLE:g} x local {plan.local_len})")
    return "refetch", (f"auto: the busiest rank receives {received} K/V rows, over the save budget "
                       f"of {budget:g} ({KV_SAVE_BUDGET_LOCAL_MULTIPLE:g} x local {plan.local_len})")


# input_error_at: the error code above these bits, the complement of the rank in them.
_RANK_BITS = 24
_RANK_MASK = (1 << _RANK_BITS) - 1


def _without_detail(template: str) -> str:
    """An input error's text without its ``{detail}`` (the value only the rank that had it knows)."""
    return re.sub(r"\s*\((?:got )?\{detail\}\)|;? (?:got|found) \{detail\}|: \{detail\}", "", template)


def _refuse_build_during_another_threads_step() -> None:
    """A build from one thread while another thread's step is open would pair its all-reduce with
    that step's collectives on the peers; refused locally, before any collective. Autograd's
    worker threads (recompute in backward) run inside the open step, so they may build."""
    current = knobs.current_blockdiag_state()
    owner = getattr(current, "_published_by", None)
    if current is None or owner in (None, threading.get_ident()):
        return
    # Inside a backward pass (autograd's engine): -1 outside one.
    if getattr(torch._C, "_current_graph_task_id", lambda: -1)() != -1:
        return
    raise BlockDiagCPError(
        "BlockDiagCPState.build called from a second thread while another thread's blockdiag_cp_step is "
        "open; block-diagonal CP runs one step at a time per process (the step state is process-wide): "
        "build the next step after the open one exits, or give each thread its own process")


def _two_dim_error(u: int, cp: int, kv_exchange: Optional[str]) -> str:
    """Why ``ulysses_size`` cannot split this CP group ('' when it can); the same on every rank once agreed."""
    if cp == 1 or u == 1:
        return ""
    if cp % u:
        return (f"ulysses_size={u} does not divide the CP size {cp} (two-dimensional CP runs cp / ulysses_size "
                f"groups of ulysses_size ranks); use a ulysses_size dividing {cp}, or 1 for one dimension")
    if kv_exchange == "ulysses" and u != cp:
        return (f"kv exchange 'ulysses' is head-parallel over the whole CP group, but ulysses_size={u} < cp={cp} "
                f"asks for two dimensions; name the exchange between the groups (--cp-kv-exchange a2a | halo | "
                f"allgather | hierarchical) or drop ulysses_size")
    return ""


def _resolve_exchange(exchange_req: str, cp: int, plan: StepPlan, agreed, ranks_per_node: int, strict: bool,
                      explicit: bool) -> Tuple[str, str]:
    """(exchange, reason) among ``cp`` ranks: hierarchical needs node blocks, halo neighbours only; else a2a."""
    exchange, reason = exchange_req, "as requested"
    if exchange_req == "hierarchical" and not (agreed.agreed("ranks_per_node") and 1 < ranks_per_node < cp):
        why = {0: f"the CP group's ranks do not form equal node blocks ({ps.local_world_size()} processes per "
                  "node)", 1: "one CP rank per node: nothing to share inside a node"}.get(
            ranks_per_node, f"all {cp} CP ranks sit on one node")
        if not agreed.agreed("ranks_per_node"):
            why = "the CP ranks see different nodes (LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE differ)"
        exchange, reason = "a2a", "hierarchical not applicable: " + why
        if strict:
            raise BlockDiagCPError(f"strict mode: kv exchange 'hierarchical' falls back to 'a2a' "
                                   f"({reason}); use --cp-kv-exchange a2a or drop strict")
        log_once(logging.WARNING if explicit else logging.INFO,
                 f"blockdiag-cp: kv exchange hierarchical -> a2a: {why}")
    elif exchange_req == "halo" and not plan.exchange.halo_ok:
        exchange, reason = "a2a", "halo not applicable: " + plan.exchange.halo_reason
        if strict:
            raise BlockDiagCPError(f"strict mode: kv exchange 'halo' falls back to 'a2a' "
                                   f"({reason}); use --cp-kv-exchange a2a or drop strict")
        log_once(logging.WARNING if explicit else logging.INFO,
                 f"blockdiag-cp: kv exchange halo -> a2a: {plan.exchange.halo_reason}")
    return exchange, reason


def _planned_choice(ids: torch.Tensor, cp: int, layout: str, ranks_per_node: int, group, with_relaid: bool = False):
    """(the option of least modeled time, every option least first) for kv_exchange "planned";
    ``with_relaid`` (relayout "balanced"): the rows moved to the balanced layout are options too.

    Priced by ``cost_options.price_exchange_options`` from the replicated doc ids with the default
    model dims (``cost.DEFAULT_DIMS``) on the group's topology (``ranks_per_node`` CP ranks per node:
    one node when it is cp, one-level InfiniBand when the ranks form no equal node blocks). Every
    rank computes the same list; one more tiny agreement keeps the ranks on one option should
    floating point ever part a near tie (the earlier option in the list wins).
    """
    from .cost_options import default_options, price_exchange_options, relaid_options

    G = ranks_per_node if 0 < ranks_per_node < cp else None
    offered = default_options(cp, G) + (relaid_options(cp, G) if with_relaid else [])
    options = price_exchange_options(ids, cp, layout, gpus_per_node=G, link="ib" if ranks_per_node == 0 else "nvlink",
                                     options=offered)
    priced = [i for i, o in enumerate(options) if not o.refused]
    best = min(priced, key=lambda i: (options[i].modeled_seconds, i))
    agreed = agree({"planned_choice": best}, group, cp, kind=KIND_BUILD)
    best = agreed.min("planned_choice")
    ordered = sorted(options, key=lambda o: (bool(o.refused), o.modeled_seconds))
    return options[best], [options[best]] + [o for o in ordered if o is not options[best]]


def _planned_reason(options, resolved: str) -> str:
    """The report's reason for a planned step: the option taken and the next ones, modeled."""
    priced = [o for o in options if not o.refused][:4]
    shown = ", ".join(f"{o.name} {o.modeled_seconds * 1e3:.3g} ms" for o in priced)
    return f"planned: least modeled time of {len(options)} options ({shown}); {resolved}"


def _relayout_reason(requested: Dict, cp: int, u: int, exchange: str, relaid: bool) -> str:
    """Why this step attends in its own layout or the balanced one (the report's ``relayout_reason``)."""
    moved = f"q/k/v moved from {requested['layout']!r} to 'balanced' and the output back (all-to-all-v)"
    if requested["relayout"] == "none":
        return "not requested"
    if cp == 1:
        return "single rank: nothing to move"
    if requested["layout"] == "balanced":
        return "the batch is laid out balanced already"
    if exchange == "planned":
        return ("planned: " + moved) if relaid else "planned: an option in its own layout was modeled cheaper"
    if exchange == "ulysses" or u > 1:
        return f"kv exchange {exchange!r} (ulysses_size {u}) splits the step itself: attended in its own layout"
    return moved


class BlockDiagCPState:
    """Immutable per-step state: group, layout, doc ids, plan and the resolved knobs."""

    def __init__(self, *, group, cp: int, rank: int, layout: Layout, doc_ids: torch.Tensor,
                 seq_len: int, plan: StepPlan, attn_backend_requested: str, attn_backend: str,
                 attn_backend_reason: str, kv_exchange_requested: str, kv_exchange: str,
                 kv_exchange_reason: str, strict: bool, available: Dict[str, bool],
                 backend_explicit: bool = False, kv_backward_requested: str = "auto",
                 kv_backward: str = "save", kv_backward_reason: str = "", cost_model=None):
        self.group = group
        self.cost_model = cost_model  # the balanced layout's (None for the other layouts)
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
        self.kv_backward_requested = kv_backward_requested
        self.kv_backward = kv_backward  # "save" | "refetch": what backward does for remote K/V
        self.kv_backward_reason = kv_backward_reason
        self.strict = strict
        self.available = available  # backend -> every rank can run it (this step)
        self.backend_explicit = backend_explicit  # fallbacks log WARNING (explicit) or INFO (default)
        self.comm_stats: Dict[str, int] = {}
        self.kv_row_bytes: Optional[int] = None
        self.loopback = None  # testing.loopback.Loopback: this rank's transfers handed over in one process
        self.kernel_failures: list = []
        self.agreed_signatures: set = set()  # q/k/v signatures every CP rank agreed on (attention_op.agree_on_qkv)
        self._window_plans: Dict[int, StepPlan] = {}
        self._device_index: Dict[tuple, tuple] = {}
        self._host_routes: Dict[Optional[int], object] = {}  # window -> hierarchy.HierarchicalRoute (host)
        self.windows = WindowMix()  # the model's sliding windows the layout was built for
        # Head-parallel CP: the CP ranks of one Ulysses group (cp for kv_exchange "ulysses", 1 without),
        # that group, and with two dimensions (1 < ulysses_size < cp) the state of the ring level: the
        # engine's exchange between the groups on the head shards (``ulysses``).
        self.ulysses_size = 1
        self.ulysses_group = None
        self.ring_state: Optional["BlockDiagCPState"] = None
        # kv_exchange "planned": every option's price for this step (cost_options.ExchangeOption), least first.
        self.planned_options: Optional[list] = None
        # relayout "balanced": the balanced layout's state and this rank's row moves (``relayout.Relaid``);
        # None: the attention runs in this state's own layout.
        self.relaid = None
        self.relayout_requested = RELAYOUT_DEFAULT
        self.relayout_reason = "not requested"

    # -- public contract ---------------------------------------------------

    @classmethod
    def build(cls, doc_ids, cp_group=None, layout=None, attn_backend=None, kv_exchange=None,
              strict=False, device=None, cost_model=None, prepared=None,
              kv_backward=None, windows=None, ulysses_size=None, relayout=None) -> "BlockDiagCPState":
        """Validate, agree across the CP group, lay out and plan one step.

        ``doc_ids``: the full-sequence document ids ([S] or [b, S]), identical on
        every CP rank. ``device`` is where the kernels will run (default: CUDA
        when available); it only decides which kernels can be considered.
        ``cost_model`` steers the balanced layout (default: NVLink on one node, IB
        across nodes); ``prepared`` (``prepare_plan``'s result, built ahead of
        time) skips the host planning when it was made for these ids, rank and
        layout: only the agreement all-reduce is left on the critical path.
        ``kv_backward``: "refetch" | "save" | "auto" (None: the configured knob).
        ``windows``: the model's sliding windows (``cost.resolve_windows``: None for full
        attention, a window or Megatron's (left, 0), a ``WindowMix`` -- e.g.
        ``layers.attention.window_mix_from_config(config)`` for ``window_attn_skip_freq`` -- or per-layer windows):
        ``balanced`` prices its layouts as that mix of layers; agreed across the CP group.
        ``ulysses_size``: two-dimensional CP (None: the configured knob, 1: one dimension):
        Ulysses inside groups of that many consecutive CP ranks, ``kv_exchange`` between the
        groups on the head shards, the layout planned at cp / ulysses_size (``ulysses``).
        ``relayout``: "balanced" attends in the balanced layout, q/k/v moved there and the output
        back by all-to-all-v (``relayout``); "none" in the layout's own (None: the configured knob).
        """
        return cls.from_source(ReplicatedDocIds(doc_ids), cp_group=cp_group, layout=layout,
                               attn_backend=attn_backend, kv_exchange=kv_exchange, strict=strict,
                               device=device, cost_model=cost_model, prepared=prepared,
                               kv_backward=kv_backward, windows=windows, ulysses_size=ulysses_size,
                               relayout=relayout)

    @classmethod
    def from_source(cls, source: DocumentSource, cp_group=None, layout=None, attn_backend=None,
                    kv_exchange=None, strict=False, device=None, cost_model=None,
                    prepared=None, kv_backward=None, windows=None, ulysses_size=None,
                    relayout=None) -> "BlockDiagCPState":
        """``build`` for any ``DocumentSource`` (Megatron's mask, THD cu_seqlens, replicated ids)."""
        group = ps.get_cp_group() if cp_group is None else cp_group
        cp, rank = ps.group_size(group), ps.group_rank(group)
        _refuse_build_during_another_threads_step()
        ranks = group_ranks(group)
        BUILD_GUARD.enter(ranks)
        try:
            return cls._build(source, group, cp, rank, layout, attn_backend, kv_exchange, strict, device,
                              cost_model, prepared, kv_backward, windows, ulysses_size, relayout)
        except BlockDiagCPError as error:
            # Every error of _build follows its agreement and comes from the agreed vector or the
            # replicated inputs, so every rank raises it here alike.
            raise raised_on_every_rank(error)
        finally:
            BUILD_GUARD.exit(ranks)

    @classmethod
    def _build(cls, source, group, cp, rank, layout, attn_backend, kv_exchange, strict, device,
               cost_model, prepared, kv_backward, windows, ulysses_size, relayout):
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        source_facts, detail = source.local_facts()  # first: it may fix the layout (THD's partition)
        # The source's kind first: the sources carry different facts, so the slots after it mean the
        # same thing on every rank only when this agrees.
        facts = {"source": zlib.crc32(type(source).__name__.encode()), **source_facts}
        # Knob errors are local facts too: a bad knob on one rank must not leave the others waiting.
        requested, knob_error = {}, ""
        for knob, raw, normalize in (
                ("layout", knobs._CP_LAYOUT if layout is None else layout, normalize_layout),
                ("kv_exchange", knobs._CP_KV_EXCHANGE if kv_exchange is None else kv_exchange,
                 normalize_kv_exchange),
                ("attn_backend", knobs._CP_ATTN_BACKEND if attn_backend is None else attn_backend,
                 normalize_attn_backend),
                ("kv_backward", knobs._CP_KV_BACKWARD if kv_backward is None else kv_backward,
                 normalize_kv_backward),
                ("relayout", knobs._CP_RELAYOUT if relayout is None else relayout, normalize_relayout)):
            try:
                requested[knob] = normalize(raw)
            except ValueError as exc:
                knob_error = knob_error or str(exc)
        requested["strict"] = bool(strict)
        try:
            u = normalize_ulysses_size(knobs._CP_ULYSSES_SIZE if ulysses_size is None else ulysses_size)
        except ValueError as exc:
            u, knob_error = 1, knob_error or str(exc)
        two_dim_error = _two_dim_error(u, cp, requested.get("kv_exchange"))
        knob_error = knob_error or two_dim_error
        planned = cp > 1 and requested.get("kv_exchange") == "planned"  # chosen after the agreement
        two_dim = cp > 1 and 1 < u < cp and not two_dim_error and requested.get("kv_exchange") not in ("ulysses",
                                                                                                       "planned")
        # The ring level of two-dimensional CP: the ranks at this rank's place in every Ulysses group.
        ring_ranks = ps.ulysses_subgroup_ranks(ps.get_cp_global_ranks(group), u)[1] if two_dim else None
        try:
            mix = resolve_windows(windows)
        except ValueError as exc:
            mix, knob_error = WindowMix(), knob_error or str(exc)
        if source.layout is not None and requested.get("layout") != source.layout:
            if layout is not None:  # asked for explicitly: refuse
                knob_error = knob_error or (
                    f"layout {layout!r} cannot apply to {source.description}: the batch was already "
                    f"sliced {source.layout!r}; drop the layout argument or pass layout={source.layout!r}")
            elif "layout" in requested:  # the process-wide knob: it is for shard_batch, not this path
                log_once(logging.INFO, f"blockdiag-cp: layout knob {requested['layout']!r} does not apply "
                                       f"to {source.description}; using {source.layout!r}")
            requested["layout"] = source.layout

        static = {b: kernels.static_availability(b, device) for b in ATTN_BACKEND_VALUES}
        # The cost model decides where the balanced cuts fall. Always a fact (0 when unused): every
        # rank's vector must have the same length even when their layouts differ.
        cost_fact = 0
        # relayout "balanced" attends in the balanced layout: a 1-D sequence exchange of a batch laid out
        # otherwise (ulysses moves every row anyway; two dimensions split the step themselves); with
        # planned, the relaid options join the choice.
        relayout_allowed = (cp > 1 and requested.get("relayout") == "balanced" and requested.get("layout") != "balanced"
                            and requested.get("kv_exchange") != "ulysses"
                            and (u == 1 or requested.get("kv_exchange") == "planned"))  # planned picks its own u
        relaid = relayout_allowed and requested.get("kv_exchange") != "planned"
        balanced_cost = None
        if requested.get("layout") == "balanced" or relayout_allowed:
            try:
                # The default prices the exchange this step asks for (hierarchical routes or not).
                # Two dimensions: balanced cuts the ring level's cp / u groups.
                cost_model = default_cost_model(ring_ranks or group, kv_exchange=requested.get("kv_exchange")) \
                    if cost_model is None else resolve_cost_model(cost_model)
                cost_model.check_group(cp // u if two_dim else cp)  # a two-level model splits into whole nodes
                cost_fact = cost_model.agreement_key()  # prices, topology, hierarchy, latencies
                balanced_cost = cost_model
            except ValueError as exc:
                knob_error = knob_error or str(exc)
        facts["knob_error"] = 1 if knob_error else 0
        for knob, values in _KNOBS:
            facts[knob] = values.index(requested[knob]) if knob in requested else -1
        for b in ATTN_BACKEND_VALUES:
            facts["unavailable_" + b] = 0 if static[b][0] else 1
        facts["pending_failures"] = PENDING_KERNEL_FAILURES.count()
        facts["cost_model"] = cost_fact
        # The windows decide where the balanced cuts fall too (0 when unused, like the cost model).
        facts["windows"] = mix.agreement_key() if requested.get("layout") == "balanced" or relayout_allowed else 0
        # The hierarchical exchange routes by node: every rank must see the same nodes.
        ranks_per_node = ps.cp_ranks_per_node(ring_ranks or group) \
            if requested.get("kv_exchange") in ("hierarchical", "planned") and cp > 1 else 0
        facts["ranks_per_node"] = ranks_per_node
        facts["ulysses_size"] = u
        # Which rank to name in another rank's error: the lowest with a bad knob, the lowest with the
        # worst input error (its code above, the complement of its rank below), 0 when none.
        facts["knob_error_rank"] = rank if knob_error else cp
        code = facts["input_error"]
        facts["input_error_at"] = (code << _RANK_BITS) | (_RANK_MASK - rank) if code else 0
        # Processes per node place the ranks on nodes for the default cost model: named when it differs.
        facts["local_world_size"] = ps.local_world_size()
        agreed = agree(facts, group, cp, kind=KIND_BUILD)

        if not agreed.agreed("source"):
            raise BlockDiagCPError(
                f"the CP ranks build this step's state from different document sources (this rank: "
                f"{source.description}); every CP rank must take the same data path (the same batch kind: "
                "doc ids, Megatron's attention mask, or THD packed_seq_params)")
        if agreed.max("pending_failures") > 0:
            raise kernel_failure_error(PENDING_KERNEL_FAILURES.take(),
                                       "in an earlier forward/backward (raised at this step's build)")
        if agreed.max("knob_error"):
            raise BlockDiagCPError(knob_error or (
                f"an invalid CP knob on another CP rank (CP rank {agreed.min('knob_error_rank')}); that "
                "rank's own error names the value and the accepted ones"))
        worst_at = agreed.max("input_error_at")
        if worst_at:
            worst, first = worst_at >> _RANK_BITS, _RANK_MASK - (worst_at & _RANK_MASK)
            if facts["input_error"] == worst:
                raise BlockDiagCPError(source.errors[worst].format(detail=detail))
            raise BlockDiagCPError(
                f"invalid input on another CP rank (CP rank {first}; that rank's own error gives the value): "
                + _without_detail(source.errors[worst]))
        differ = agreed.disagreeing(knob for knob, _ in _KNOBS)
        if differ:
            described = ", ".join(
                f"{knob} ({' vs '.join(repr(v) for v in sorted({values[agreed.min(knob)], values[agreed.max(knob)]}, key=str))})"
                for knob, values in _KNOBS if knob in differ)
            raise BlockDiagCPError(
                f"CP knobs differ across the CP ranks: {described}; configure every rank alike "
                "(the same --cp-* flags / configure_cp_varlen / configure_cp_layout / "
                "configure_cp_kv_backward / shard_batch arguments)")
        if not agreed.agreed("ulysses_size"):
            raise BlockDiagCPError(
                f"ulysses_size differs across the CP ranks ({agreed.min('ulysses_size')} vs "
                f"{agreed.max('ulysses_size')}; this rank: {u}); configure every rank alike (the same "
                "--cp-ulysses-size / --hierarchical-context-parallel-sizes / configure_cp_ulysses_size)")
        if not agreed.agreed("cost_model"):
            if not agreed.agreed("local_world_size"):
                raise BlockDiagCPError(
                    f"LOCAL_WORLD_SIZE (processes per node) differs across the CP ranks "
                    f"({agreed.min('local_world_size')} vs {agreed.max('local_world_size')}; this rank: "
                    f"{facts['local_world_size']}), so the ranks place each other on different nodes and "
                    "price the balanced layout with different cost models; launch every rank with the same "
                    "processes per node (torchrun --nproc-per-node, srun --ntasks-per-node) or pass one "
                    "cost_model (--cp-cost-model) on every rank")
            raise BlockDiagCPError(
                "the balanced layout's cost model differs across the CP ranks; pass the same "
                "cost_model (or --cp-cost-model) on every rank")
        if not agreed.agreed("windows"):
            raise BlockDiagCPError(
                f"the model's sliding windows differ across the CP ranks (this rank: {mix.describe()}); the "
                "balanced layout prices them: pass the same windows (the model config's window_size / "
                "window_attn_skip_freq) on every rank")
        for fact, message in source.must_agree.items():
            if not agreed.agreed(fact):
                raise BlockDiagCPError(message)

        ids = source.doc_ids(group, cp, rank)  # [R, S]; may gather (identically on every rank)
        seq_len = ids.shape[1]
        layout_name = requested["layout"]
        host_route = None  # the hierarchical route, when it was planned ahead for these nodes
        window_plans, window_routes = {}, {}
        ring_lay = ring_plan = None
        planned_options = None
        if planned:  # the option of least modeled time for these documents, alike on every rank
            choice, planned_options = _planned_choice(ids, cp, layout_name, ranks_per_node, group,
                                                      with_relaid=relayout_allowed)
            requested["kv_exchange"], u = choice.exchange, choice.ulysses_size
            relaid = choice.relayout == "balanced"
            two_dim = 1 < u < cp
            if two_dim:
                ring_ranks = ps.ulysses_subgroup_ranks(ps.get_cp_global_ranks(group), u)[1]
                ranks_per_node = ranks_per_node // u if ranks_per_node and ranks_per_node % u == 0 else 0
        inner_lay = inner_plan = None  # relayout: the balanced layout the attention runs in, its plan
        if prepared is not None and not two_dim and not planned and not relaid and prepared.matches(ids, cp, rank, layout_name, cost_model, mix):
            ids, lay, plan = prepared.doc_ids, prepared.layout, prepared.plan
            window_plans = dict(prepared.window_plans or {})
            if prepared.route is not None and prepared.ranks_per_node == ranks_per_node:
                host_route = prepared.route
                window_routes = dict(prepared.window_routes or {})
        else:
            if prepared is not None and not relaid:  # never an error: one rank alone would raise after the agreement
                log_once(logging.WARNING, "blockdiag-cp: the prepared plan was made for other doc ids, "
                                          "group size, rank, layout or one dimension; planning in line")
            padded = padded_length(seq_len, layout_name, cp)
            ids = torch.nn.functional.pad(ids, (0, padded - seq_len))
            # Only the exchange in use is planned now; the other kind is built if ever read (ulysses
            # streams nothing: its head shards are attended with a single-rank plan, ``ulysses_on``).
            kind = chunk_kind(requested["kv_exchange"]) if cp > 1 else "needed"
            if two_dim:  # the batch's cut at cp, the exchange planned between the groups at cp / u
                lay, ring_lay = two_dim_layouts(layout_name, ids, cp, u, cost_model=cost_model, windows=mix,
                                                cu_seqlens_padded=source.cu_seqlens_padded)
                plan = build_plan(ids, lay, rank, kinds=())
                ring_plan = build_plan(ids, ring_lay, rank // u, kinds=(kind,))
            else:
                lay = build_layout(layout_name, ids, cp, cost_model=cost_model, windows=mix,
                                   cu_seqlens_padded=source.cu_seqlens_padded)
                head_parallel = cp > 1 and (requested["kv_exchange"] == "ulysses" or u == cp)
                if relaid:  # the exchange runs in the balanced layout; this one only places the rows
                    inner_lay = build_layout("balanced", ids, cp, cost_model=balanced_cost, windows=mix)
                    inner_plan = build_plan(ids, inner_lay, rank, kinds=(kind,))
                plan = build_plan(ids, lay, rank, kinds=() if head_parallel or relaid else (kind,))

        available = {b: agreed.max("unavailable_" + b) == 0 for b in ATTN_BACKEND_VALUES}
        backend_req = requested["attn_backend"]
        backend, backend_reason = resolve_backend(backend_req, available, static,
                                                  explicit=attn_backend is not None)
        if strict and backend != backend_req:
            raise BlockDiagCPError(
                f"strict mode: attention backend {backend_req!r} cannot run on every CP rank "
                f"({backend_reason}); install it, pick another --cp-attn-backend, or drop strict")

        exchange_req = "planned" if planned else requested["kv_exchange"]
        if cp == 1:
            exchange, exchange_reason = exchange_req, "single rank: nothing to exchange"
        elif u == cp and exchange_req != "ulysses":
            exchange, exchange_reason = "ulysses", f"ulysses_size = cp = {cp}: head-parallel over the whole group"
        else:  # one dimension, or the ring level of two
            exchange, exchange_reason = _resolve_exchange(
                requested["kv_exchange"], cp // u if two_dim else cp,
                ring_plan if two_dim else inner_plan if inner_plan is not None else plan, agreed,
                ranks_per_node, strict, explicit=kv_exchange is not None)
        if planned:
            exchange_reason = _planned_reason(planned_options, exchange_reason)
        common = dict(attn_backend_requested=backend_req, attn_backend=backend, attn_backend_reason=backend_reason,
                      strict=strict, available=available, backend_explicit=attn_backend is not None,
                      cost_model=cost_model if layout_name == "balanced" else None)
        ring = None
        if two_dim:
            u_group, r_group = ps.ulysses_subgroups(group, u)  # created once, by every CP rank alike
            ring_backward, ring_backward_reason = resolve_kv_backward(requested["kv_backward"], exchange, ring_plan)
            ring = cls(group=r_group, cp=cp // u, rank=rank // u, layout=ring_lay, doc_ids=ids, seq_len=seq_len,
                       plan=ring_plan, kv_exchange_requested=requested["kv_exchange"], kv_exchange=exchange,
                       kv_exchange_reason=exchange_reason, kv_backward_requested=requested["kv_backward"],
                       kv_backward=ring_backward, kv_backward_reason=ring_backward_reason, **common)
            ring.windows = mix
            exchange_reason = (f"two-dimensional: ulysses inside {cp // u} groups of {u} CP ranks, {exchange} "
                               f"between them ({exchange_reason})")
            exchange, kv_backward_mode, kv_backward_reason = "ulysses", ring_backward, ring_backward_reason
        else:
            kv_backward_mode, kv_backward_reason = resolve_kv_backward(
                requested["kv_backward"], exchange, inner_plan if inner_plan is not None else plan)
        state = cls(group=group, cp=cp, rank=rank, layout=lay, doc_ids=ids, seq_len=seq_len,
                    plan=plan, kv_exchange_requested=exchange_req, kv_exchange=exchange,
                    kv_exchange_reason=exchange_reason, kv_backward_requested=requested["kv_backward"],
                    kv_backward=kv_backward_mode, kv_backward_reason=kv_backward_reason, **common)
        state.windows = mix
        state.planned_options = planned_options
        if exchange == "ulysses" and cp > 1:
            state.ulysses_size, state.ulysses_group = (u, u_group) if two_dim else (cp, group)
        if ring is not None:
            ring.kernel_failures = state.kernel_failures  # one list: a failure is agreed at the step's end
            state.ring_state = ring
        state.relayout_requested = requested["relayout"]
        state.relayout_reason = _relayout_reason(requested, cp, u, exchange_req, relaid)
        if inner_plan is not None:
            from .relayout import Relaid

            inner = cls(group=group, cp=cp, rank=rank, layout=inner_lay, doc_ids=ids, seq_len=seq_len,
                        plan=inner_plan, kv_exchange_requested=exchange_req, kv_exchange=exchange,
                        kv_exchange_reason=exchange_reason, kv_backward_requested=requested["kv_backward"],
                        kv_backward=kv_backward_mode, kv_backward_reason=kv_backward_reason,
                        **dict(common, cost_model=balanced_cost))
            inner.windows = mix
            inner.kernel_failures = state.kernel_failures  # one list: a failure is agreed at the step's end
            state.relaid = Relaid.build(inner, lay, rank)
        state._window_plans.update(window_plans)  # planned ahead with the layout
        if host_route is not None and exchange == "hierarchical":
            state._host_routes[None] = host_route
            state._host_routes.update(window_routes)
        return state

    @property
    def padded_len(self) -> int:
        return self.layout.padded_len

    @property
    def local_len(self) -> int:
        return self.layout.local_len

    @property
    def local_positions(self) -> torch.Tensor:
        return self.layout.rank_positions(self.rank)

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
        relayout = {"relayout": self.relayout_requested, "relayout_reason": self.relayout_reason}
        if self.relaid is not None:  # the exchange ran in the balanced layout: its figures, and the moves
            stats = self.comm_stats
            moved = {key: stats.get(key) for key in (
                "relayout_bytes_sent", "relayout_bytes_received", "backward_relayout_bytes_sent",
                "backward_relayout_bytes_received")}
            inner = self.relaid.state.report()
            return {**inner, "layout": self.layout.name, "attended_layout": inner["layout"], **relayout, **moved,
                    **self._planned_report()}
        return {**self._own_report(), "attended_layout": self.layout.name, **relayout}

    def _own_report(self) -> Dict:
        # Positions and bytes of the last attention call, with its sliding window (None: whole documents).
        window = self.comm_stats.get("window")
        plan = self.plan_for(window)
        inter = {}
        if self.kv_exchange == "hierarchical":  # both stages of the node routes, and what crosses nodes
            route = self.hierarchical_route_on(torch.device("cpu"), window)
            sent_pos = sum(route.send1_counts) + sum(route.send2_counts)
            recv_pos = sum(route.recv1_counts) + sum(route.recv2_counts)
            inter = {"positions_inter_node_sent": route.inter1_send, "positions_inter_node_received": route.inter1_recv,
                     "bytes_inter_node_sent": self.comm_stats.get("bytes_inter_node_sent"),
                     "bytes_inter_node_received": self.comm_stats.get("bytes_inter_node_received")}
        elif self.cp == 1:
            sent_pos = recv_pos = 0
        elif self.kv_exchange == "ulysses":  # the group's q/k/v rows, all but its own block
            sent_pos = recv_pos = (self.ulysses_size - 1) * self.local_len
        else:
            sent_pos, recv_pos = plan.positions_moved(chunk_kind(self.kv_exchange))
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
            "kv_backward_requested": self.kv_backward_requested,
            "kv_backward": self.kv_backward,
            "kv_backward_reason": self.kv_backward_reason,
            "layout": self.layout.name,
            "window": window,
            "cost_model": None if self.cost_model is None else self.cost_model.name,
            "windows": self.windows.describe(),
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
            "ulysses_size": self.ulysses_size,
            **self._planned_report(),
            **inter,
            **self._ring_report(),
        }

    def _planned_report(self) -> Dict:
        """kv_exchange "planned": every option priced for the step, the one taken first; {} otherwise."""
        if self.planned_options is None:
            return {}
        return {"planned_options": [{"name": o.name, "modeled_seconds": o.modeled_seconds, "bytes_max": o.bytes_max,
                                     "refused": o.refused} for o in self.planned_options]}

    def _ring_report(self) -> Dict:
        """Two dimensions: the ring level's exchange, positions and bytes (the report's own count the
        Ulysses all-to-alls); {} otherwise."""
        if self.ring_state is None:
            return {}
        ring = self.ring_state.report()
        return {"ring_" + key: ring[key] for key in (
            "kv_exchange", "kv_exchange_reason", "kv_backward", "cp", "rank", "positions_sent",
            "positions_received", "bytes_sent", "bytes_received", "work_per_rank", "work_max_over_mean")}

    # -- device-side plan, cached per step -----------------------------------

    def send_index_on(self, device: torch.device) -> torch.Tensor:
        """Local rows this rank sends, grouped by destination; moved to the device once per step."""
        key = ("send", str(device))
        if key not in self._device_index:
            self._device_index[key] = torch.cat(self.plan.exchange.send_index).to(device)
        return self._device_index[key]

    def plan_for(self, window: Optional[int] = None) -> StepPlan:
        """The step's plan for a sliding window (None: the whole-document plan built with the state).

        Windowed plans are built on the first layer that asks, from the replicated ids and
        the layout, so every rank builds the same one with no communication.
        """
        if window is None:
            return self.plan
        if window not in self._window_plans:
            self._window_plans[window] = build_plan(self.doc_ids, self.layout, self.rank, kinds=(), window=window)
        return self._window_plans[window]

    def clipping_window(self, window: Optional[int]) -> Optional[int]:
        """``window``, or None where it hides no key: every document spans at most window + 1 positions, so
        each query already sees its whole document's past (padding, id 0, attends only itself and is
        zeroed either way). A layer whose window clips nothing then runs the step's own plan: the
        windowed one splits the own keys into full, banded and causal calls a window needs. From the
        replicated ids' runs (the plan's ``doc_runs``), alike on every rank; host work, once per step and
        window."""
        if window is None:
            return None
        key = ("clipping_window", window)
        if key not in self._device_index:
            longest = 0
            for starts, ends, ids in self.plan.doc_runs:  # per row of doc ids
                lengths = (ends - starts)[ids != 0]
                longest = max(longest, int(lengths.max()) if lengths.numel() else 0)
            self._device_index[key] = window if longest > window + 1 else None
        return self._device_index[key]

    def hierarchical_route_on(self, device: torch.device, window: Optional[int] = None, gathered: bool = False):
        """This rank's two-level route (``hierarchy``) for the step, on the device once per step and window.

        ``gathered``: the route the streamed op's transport runs, its received rows placed in the order
        the gathered step reads them (``gathered``), where that plan applies; else the needed-only order."""
        from .hierarchy import build_hierarchical_route

        band = self.gathered_plan(window) if gathered else None
        key = ("hier", str(device), window, band is not None)
        if key not in self._device_index:
            route = self._host_routes.get(window)  # planned ahead (prepare_plan), else now
            if route is None:
                route = self._host_routes[window] = build_hierarchical_route(
                    self.layout, self.doc_ids, self.rank, ps.cp_ranks_per_node(self.group), window=window)
            self._device_index[key] = (route if band is None else band.route(route)).to(device)
        return self._device_index[key]

    def gathered_plan(self, window: Optional[int] = None):
        """``gathered.GatheredPlan`` of the step (host, once per step), or None: the hierarchical exchange
        without a window and with one row of doc ids attends its whole received buffer by bands, and a2a /
        halo do where ``needed_whole`` says so."""
        if self.kv_exchange != "hierarchical" and not self.needed_whole(window):
            return None
        return self._gathered(window)

    def needed_whole(self, window: Optional[int] = None) -> bool:
        """Whether a2a / halo take the band mode: the needed rows in a few steps of every source (all at once,
        or in groups: ``band_pieces``), attended by bands (``gathered``, ``exchange.WholeNeededTransport``),
        instead of chunk by chunk (host, once per step and window).
        With ``kv_backward="save"``, which holds every received row from forward to backward anyway. With
        ``"refetch"`` only where ``REFETCH_GROUP_LOCAL_MULTIPLE`` is above 0 (it is not by default) and no rank
        receives more than that times its local rows in one group (``_group_rows``), so a layer call holds a
        few groups at a time and memory stays O(S / cp); elsewhere refetch streams."""
        if (self.kv_exchange not in ("a2a", "halo") or self.kv_backward not in ("save", "refetch")
                or self.cp == 1 or window is not None or self.rows != 1):
            return False
        key = ("needed_whole", window)
        if key not in self._device_index:
            whole = _whole_pays(self, window)  # from global tables: every rank decides alike
            if whole and self._gathered(window) is None:
                raise RuntimeError("blockdiag-cp: the gathered plan does not apply on this rank where the group "
                                   "takes the band mode")
            self._device_index[key] = whole
        return self._device_index[key]

    def whole_delivery_on(self, device: torch.device, window: Optional[int] = None) -> WholeDelivery:
        """What ``WholeNeededTransport`` moves in the band mode: per band step g, piece g of every pair
        (``band_pieces``; ``GroupMessages``: the rows sent, where each arrival lies in that step's band
        buffer, and whether the group goes in one batch), on the device once per step."""
        key = ("whole_delivery", str(device), window)
        if key not in self._device_index:
            plan, band = self.plan_for(window), self.gathered_plan(window)
            pieces = self.band_pieces(window)
            band_of = band.band_of()  # needed rows (source-major) -> their rows in the groups' buffers
            every_rank = _received_rows(plan.exchange.counts)  # [source, destination]
            received = every_rank[:, self.rank]  # per source
            at = np.concatenate([[0], np.cumsum(received)])  # each source's first needed row in band_of
            # one batch a group where every rank's group is small enough (from the global counts: alike on every rank)
            one_batch = _group_rows(every_rank, pieces.parts).max(1) <= ONE_BATCH_GROUP_LOCAL_MULTIPLE * self.local_len
            messages = []
            for g in range(pieces.parts):
                sent, sends = _group_sends(plan, pieces, g)
                arrivals, receives, first = [], [], 0
                for i in range(1, self.cp):  # the sources in posting order: rank - 1, rank - 2, ...
                    src = (self.rank - i) % self.cp
                    lo, n = pieces.span(int(received[src]), g)
                    if n:
                        arrivals.append(band_of[at[src] + lo:at[src] + lo + n] - band.starts[g])
                        receives.append((i, src, first, n))
                        first += n
                band_rows = np.concatenate(arrivals) if arrivals else np.zeros(0, dtype=np.int64)
                place = np.empty_like(band_rows)
                place[band_rows] = np.arange(band_rows.size)  # a permutation: every band row arrives once
                messages.append(GroupMessages(
                    device_rows(torch.from_numpy(sent), self.local_len, device), sends, tuple(receives),
                    device_rows(torch.from_numpy(band_rows), first, device),
                    device_rows(torch.from_numpy(place), first, device), int(sent.size), first, bool(one_batch[g])))
            self._device_index[key] = WholeDelivery(_band_posts(self.cp, pieces), pieces, tuple(messages))
        return self._device_index[key]

    def band_pieces(self, window: Optional[int] = None) -> Pieces:
        """How the band mode cuts each pair's rows into its groups (``_band_pieces``), once per step."""
        key = ("band_pieces", window)
        if key not in self._device_index:
            plan = self.plan_for(window)
            least = 1
            if self.kv_backward == "refetch" and REFETCH_GROUP_LOCAL_MULTIPLE > 0:  # groups within its bound
                received = _received_rows(plan.exchange.counts)
                budget = REFETCH_GROUP_LOCAL_MULTIPLE * self.local_len
                least = max(1, int(np.ceil(received.sum(0).max() / max(1.0, budget))))
                if _group_rows(received, least).max() > budget:  # the pieces round up: one group more
                    least += 1
            self._device_index[key] = _band_pieces(plan.exchange.counts, self.layout.runs, plan.doc_runs, least)
        return self._device_index[key]

    def stream_pieces(self, kind: str, window: Optional[int] = None) -> Tuple[Pieces, List[Tuple[int, int]]]:
        """(how a pair's rows are cut, the (round, piece) of each message in posting order): the streamed
        steps' chunks, or for a2a / halo in the band mode its groups (``whole_delivery_on``)."""
        if kind == "needed" and self.needed_whole(window):
            pieces = self.band_pieces(window)
            return pieces, [post for group in _band_posts(self.cp, pieces) for post in group]
        stream = self.plan_for(window).stream[kind]
        return Pieces(rows=stream.chunk_rows), [(step.round, step.piece) for step in stream.steps[1:]]

    def _gathered(self, window: Optional[int] = None):
        if window is not None or self.rows != 1:
            return None
        key = ("gathered", window)
        if key not in self._device_index:
            from .gathered import gathered_stream_plan

            plan = self.plan_for(window)
            groups = 1 if self.kv_exchange == "hierarchical" else self.band_pieces(window).parts
            self._device_index[key] = (gathered_stream_plan(plan.stream["needed"], self.layout.runs, plan.doc_runs,
                                                            plan.exchange.recv_positions, groups),)
        return self._device_index[key][0]

    def stream_plan(self, kind: str, window: Optional[int] = None):
        """The ``chunks.StreamPlan`` the streamed op walks for a chunk kind: the plan's own, or for the
        hierarchical exchange its gathered one (``gathered_plan``)."""
        band = self.gathered_plan(window) if kind == "needed" else None
        return band.stream if band is not None else self.plan_for(window).stream[kind]

    def own_padding(self, kind: str, window: Optional[int] = None) -> Optional[Tuple[int, int]]:
        """(the own step's call, the real rows n) where that call attends the local rows [0, n) causally with
        the same rows as keys and every local row past n is padding (no call writes it, so no real token:
        each attends itself), else None. Host work, once per step, kind and window."""
        key = ("own_padding", kind, window)
        if key not in self._device_index:
            steps, L, found = self.stream_plan(kind, window).steps, self.local_len, None
            if self.rows == 1 and steps[0].chunk_len == L:
                for u, call in enumerate(steps[0].calls):
                    n = int(call.q_index.numel())
                    if call.causal and 0 < n < L and _is_prefix(call.q_index, n) and _is_prefix(call.k_index, n):
                        found = (u, n)
            if found is not None and any(int(call.q_index.max()) >= found[1]
                                         for step in steps for call in step.calls if call.q_index.numel()):
                found = None
            self._device_index[key] = found
        return self._device_index[key]

    def run_steps(self, kind: str, window: Optional[int] = None):
        """The steps the streamed op runs: ``stream_plan``'s, with the own call of ``own_padding`` given one
        more causal segment over the padding rows. That call then covers every local row, as queries and as
        keys, so its out / lse, dq and dK / dV become the results (no copy of them into a larger tensor);
        the padding rows attend only each other and are zeroed at the end (``MergePlan.padding``)."""
        steps = self.stream_plan(kind, window).steps
        padding = self.own_padding(kind, window)
        if padding is None:
            return steps
        key = ("run_steps", kind, window)
        if key not in self._device_index:
            u, n = padding
            L = self.local_len
            call = steps[0].calls[u]
            rows = torch.arange(L)
            padded = replace(call, q_index=rows, k_index=rows, q_lens=call.q_lens + (L - n,),
                             k_lens=call.k_lens + (L - n,))
            own = replace(steps[0], calls=steps[0].calls[:u] + (padded,) + steps[0].calls[u + 1:])
            self._device_index[key] = (own,) + tuple(steps[1:])
        return self._device_index[key]

    def _padding_rows(self, kind: str, window: Optional[int]) -> Optional[slice]:
        padding = self.own_padding(kind, window)
        return None if padding is None else slice(padding[1], self.local_len)

    def send_indices_on(self, device: torch.device, window: Optional[int] = None) -> List[Optional[torch.Tensor]]:
        """Per destination, the local rows this rank sends it (needed-only), on the device once per step.

        None: every local row in order (a long document's whole shard), sent without a gather copy.
        """
        key = ("send_list", str(device), window)
        if key not in self._device_index:
            self._device_index[key] = [_non_identity(t, self.local_len, device)
                                       for t in self.plan_for(window).exchange.send_index]
        return self._device_index[key]

    def fall_back_from_heads(self, q_heads: int) -> None:
        """kv_exchange "planned" chose a head-parallel option whose group the model's query heads do not
        split (the choice priced the cost model's heads): this step runs ``a2a`` over the whole group
        instead. Called at the step's first attention call, after every rank agreed on q's shape, so
        every rank switches alike; the report says why."""
        chosen = self.kv_exchange_reason
        self.kv_exchange_reason = (f"planned: the chosen option splits heads over {self.ulysses_size} ranks, but "
                                   f"{q_heads} % {self.ulysses_size} = {q_heads % self.ulysses_size}: a2a instead "
                                   f"({chosen})")
        self.kv_exchange, self.ulysses_size, self.ulysses_group, self.ring_state = "a2a", 1, None, None
        self.kv_backward, self.kv_backward_reason = resolve_kv_backward(self.kv_backward_requested, "a2a", self.plan)
        log_once(logging.WARNING, f"blockdiag-cp: {self.kv_exchange_reason}")

    def ulysses_on(self, device: torch.device):
        """(the state the head shards are attended with: single-rank over the whole pack, or with two
        dimensions the ring level's; [n] the group-rank-major row of each of its local rows; [n] its local
        row of each group-rank-major row; both on the device), once per step."""
        key = ("ulysses", str(device))
        if key not in self._device_index:
            to_local, to_ranks = ulysses_orders(self)
            heads = self.ring_state if self.ring_state is not None else ulysses_single_rank_state(self)
            self._device_index[key] = (heads, to_local.to(device), to_ranks.to(device))
        return self._device_index[key]

    def ring_gradients(self, window: Optional[int] = None) -> RingGradients:
        """The ring steps that move a K/V gradient to or from this rank (host sets), once per step and window."""
        key = ("ring_gradients", window)
        if key not in self._device_index:
            plan = self.plan_for(window)
            self._device_index[key] = RingGradients.of(plan, self.layout.runs, plan.stream["ring"].chunk_rows)
        return self._device_index[key]

    def stream_on(self, kind: str, device: torch.device, window: Optional[int] = None) -> List[List["DeviceCall"]]:
        """Per step, the kernel calls of the streamed plan with their indices on the device."""
        key = ("stream", kind, str(device), window)
        if key not in self._device_index:
            self._device_index[key] = [[DeviceCall.of(call, self.local_len * self.rows, step.chunk_len * self.rows,
                                                      device) for call in step.calls]
                                       for step in self.run_steps(kind, window)]
        return self._device_index[key]

    def key_partitions_on(self, kind: str, window: Optional[int] = None) -> List[bool]:
        """Per step of ``stream_on``, whether its calls read every row of its chunk exactly once
        (``Step.reads_each_row_once``; host tables, once per step, kind and window): then each row's
        K / V gradient is written, not summed."""
        key = ("key_partitions", kind, window)
        if key not in self._device_index:
            self._device_index[key] = [step.reads_each_row_once(self.rows)
                                       for step in self.stream_plan(kind, window).steps]
        return self._device_index[key]

    def _last_gradient_rows(self, kind: str, window: Optional[int]) -> int:
        """Positions of the gradients the last remote step moves: the larger of the chunk it received (its
        gradient goes home) and the rows this rank sent at that step (theirs come back)."""
        plan, last = self.plan_for(window), self.stream_plan(kind, window).steps[-1]
        if kind == "needed" and self.needed_whole(window):  # the last group's pieces, both ways
            received = _received_rows(plan.exchange.counts)
            pieces = self.band_pieces(window)
            return max(sum(pieces.span(n, pieces.parts - 1)[1] for n in received[self.rank].tolist()),
                       sum(pieces.span(n, pieces.parts - 1)[1] for n in received[:, self.rank].tolist()))
        dst, src = (self.rank + last.round) % self.cp, (self.rank - last.round) % self.cp
        c = plan.stream[kind].chunk_rows
        sent = piece_rows(int(plan.exchange.send_index[dst].numel()), c, last.piece)
        received = piece_rows(int(plan.exchange.counts[src, self.rank]), c, last.piece)
        return max(sent, received)

    def merges_on(self, kind: str, device: torch.device, window: Optional[int] = None,
                  sink: bool = False, ends: str = "forward", own_last: bool = False) -> MergePlan:
        """Per call of ``stream_on``, which of its query rows it writes alone and which are merged (host work
        once per step, kind, window, sink and ends; with a sink every row is merged): forward's out
        (``ends`` "forward") and backward's dq ("gradient") have the same writers (``MergePlan.of``).
        ``own_last``: the calls in backward's order when it takes the own step last (``backward_own_last``):
        the remote steps' plans, then the own step's."""
        key = ("merges", kind, str(device), window, sink, ends, own_last)
        if key not in self._device_index:
            steps = [[call.q_index for call in step.calls] for step in self.run_steps(kind, window)]
            if own_last:
                steps = steps[1:] + steps[:1]
            self._device_index[key] = MergePlan.of(steps, self.local_len * self.rows, device,
                                                   every_row_merged=sink, ends=ends,
                                                   padding=self._padding_rows(kind, window))
        return self._device_index[key]

    def backward_own_last(self, kind: str, device: torch.device, window: Optional[int] = None,
                          sink: bool = False) -> bool:
        """Whether backward differentiates the remote steps first and the own keys last (this rank's own plan:
        the gradients are posted in step order either way, so ranks that differ still pair their transfers).

        With the received K/V kept from forward (``kv_backward`` "save") backward waits for no fetch, so
        its first call need not hide one; the last gradient sent home is then in flight while the own
        keys are differentiated instead of after every call. The gradients coming back for our rows are
        added after the own calls wrote theirs (``KeyGradients``' order), so all of them are in flight
        until then: only where they are at most the local rows (a2a / halo: ``KV_SAVE_BUDGET_LOCAL_MULTIPLE``),
        where the gradients the last step moves (home and back) have at least ``OWN_LAST_ROWS_PER_LAUNCH``
        positions per launch the received chunks' steps make before the own calls, and where dq's plan in that
        order copies no more rows than in stream order (``merge.copied_rows``).

        With a refetch the own keys go first, to hide the first fetch, except on a rank that attends no
        received key (the first rank of ``contiguous``, say): there is no fetch of its own to hide, and
        its rows' gradients, which come back after the other ranks' calls, are posted for before its own
        calls instead of after them (under the same bounds on what comes back)."""
        key = ("own_last", kind, str(device), window, sink)
        if key not in self._device_index:
            steps = self.stream_plan(kind, window).steps
            fine = (kind == "needed" and self.kv_exchange in ("a2a", "halo") and len(steps) > 1
                    and (self.kv_backward == "save" or not any(step.calls for step in steps[1:]))
                    and sum(int(t.numel()) for t in self.plan_for(window).exchange.send_index)
                    <= KV_SAVE_BUDGET_LOCAL_MULTIPLE * self.local_len
                    and self._last_gradient_rows(kind, window) >= OWN_LAST_ROWS_PER_LAUNCH * sum(
                        len(step.calls) + 1 for step in steps[1:]))
            if fine:
                rows = [[call.q_index for call in step.calls] for step in self.run_steps(kind, window)]
                fine = copied_rows(self.merges_on(kind, device, window, sink, "gradient", own_last=True),
                                   rows[1:] + rows[:1]) <= copied_rows(
                    self.merges_on(kind, device, window, sink, "gradient"), rows)
            self._device_index[key] = fine
        return self._device_index[key]

    def key_merges_on(self, kind: str, device: torch.device, window: Optional[int] = None):
        """(``MergePlan`` over the local key rows, their buffer slots on the device or None, the returned
        gradients' ``KeyReturns`` or None), once per step, kind and window: the own step's calls write the
        rows.

        a2a / halo (one row of doc ids): a row whose own calls and returned gradients are at most two
        writers takes them in dK / dV themselves (the second added in place, one rounding), only rows of
        three or more in the float32 buffer; ``KeyReturns`` tells each returned gradient's rows where they
        go. The ring, hierarchical and several rows of doc ids: every returned row is merged."""
        key = ("key_merges", kind, str(device), window)
        if key not in self._device_index:
            plan = self.plan_for(window)
            L = self.local_len
            own = [call.k_index for call in self.run_steps(kind, window)[0].calls]
            every = self.rows > 1
            direct = kind == "needed" and self.kv_exchange != "hierarchical" and not every
            if kind == "ring":
                c = plan.stream["ring"].chunk_rows
                pieces = sorted({j for _, j in self.ring_gradients(window).returned})
                back = [np.arange(j * c, min(L, (j + 1) * c)) for j in pieces]
            elif self.kv_exchange == "hierarchical":  # the rows sent in stage 1 (to a peer or a node's fetcher)
                back = [self.hierarchical_route_on(torch.device("cpu"), window).send1_index.numpy()]
            else:
                back = [t.numpy() for t in plan.exchange.send_index if t.numel()]
            back = np.concatenate(back) if back else np.zeros(0, dtype=np.int64)  # host tables: numpy
            if direct:  # writers of a row: its own calls and every rank its gradient comes back from
                writers = np.bincount(back, minlength=L)
                for index in own:
                    writers[index.numpy()] += 1
                back = back[writers[back] >= 3]
            merges = MergePlan.of([own], L * self.rows, device, every_row_merged=every,
                                  also_merged=torch.from_numpy(np.unique(back)),
                                  padding=self._padding_rows(kind, window))
            at = np.full(L * self.rows, -1, dtype=np.int64)  # a row's buffer slot (-1: not merged)
            at[np.flatnonzero(merges.merged_mask)] = np.arange(merges.merged_count)
            slot = None if merges.merged is None else torch.from_numpy(at).to(device)  # None: every row, in order
            batched = ()
            if kind == "needed" and self.needed_whole(window):
                batched = tuple(g for g, m in enumerate(self.whole_delivery_on(device, window).messages) if m.one_batch)
            returns = (KeyReturns.of(plan, self.stream_pieces(kind, window)[0], merges, at, device, batched)
                       if direct else None)
            self._device_index[key] = (merges, slot, returns)
        return self._device_index[key]


def ulysses_single_rank_state(state):
    """The cp = 1 state the head shards are attended with: the outer state's padded doc ids in global
    order, its backend, its kernel-failure list (so a failure is agreed at the end of the step)."""
    ids = state.doc_ids  # [R, P] padded
    layout = build_layout("contiguous", ids, 1)
    inner = BlockDiagCPState(
        group=None, cp=1, rank=0, layout=layout, doc_ids=ids, seq_len=ids.shape[1],
        plan=build_plan(ids, layout, 0, kinds=("needed",)),
        attn_backend_requested=state.attn_backend_requested, attn_backend=state.attn_backend,
        attn_backend_reason=state.attn_backend_reason, kv_exchange_requested="ulysses",
        kv_exchange="ulysses", kv_exchange_reason="the head shards of a ulysses step", strict=state.strict,
        available=state.available, backend_explicit=state.backend_explicit)
    inner.kernel_failures = state.kernel_failures
    inner.windows = state.windows
    return inner


def ulysses_orders(state) -> Tuple[torch.Tensor, torch.Tensor]:
    """([n] the group-rank-major row of each of the heads state's local rows, [n] the local row of each
    group-rank-major row): the Ulysses group's positions, each rank's ascending, concatenated rank by
    rank, against their ascending union (the whole pack in one dimension, the ring layout's rank in two)."""
    u = state.ulysses_size
    first = state.rank // u * u  # the group's first CP rank
    by_rank = state.layout.positions[first:first + u].reshape(-1)  # [n] global position of group-rank-major row m
    to_local = torch.argsort(by_rank)
    to_ranks = torch.empty_like(to_local)
    to_ranks[to_local] = torch.arange(to_local.numel())
    return to_local, to_ranks


class KeyReturns:
    """Per a2a / halo step (i, j), where the gradient coming back for the rows sent at that step goes:
    ``added`` (its rows, their dK / dV rows: a row of at most two writers, added in place) and ``merged``
    (its rows, their float32 buffer slots), each ``Rows`` or None when empty."""

    def __init__(self, steps: Dict[Tuple[int, int], tuple]):
        self.steps = steps  # (i, j) -> (added, merged): each None or (Rows of the gradient, Rows there)

    @classmethod
    def of(cls, plan, pieces: Pieces, merges: MergePlan, slot_of: Optional[np.ndarray], device,
           batched: Tuple[int, ...] = ()) -> "KeyReturns":
        """``pieces``: how a pair's rows are cut into its messages (``BlockDiagCPState.stream_pieces``); and
        for each band group in ``batched`` (``exchange.GroupMessages.one_batch``: its gradients come back in
        one batch) an entry ``("group", g)`` over its rows, destination by destination."""
        L, cp, rank = plan.local_len, plan.cp, plan.rank
        counts = plan.exchange.counts[rank].tolist()

        def on_device(index, size):
            return device_rows(torch.from_numpy(index), size, device)

        def entry(part):
            merged = merges.merged_mask[part]
            added, buffered = np.flatnonzero(~merged), np.flatnonzero(merged)
            n = part.size
            return ((on_device(added, n), on_device(part[added], L)) if added.size else None,
                    (on_device(buffered, n), on_device(slot_of[part[buffered]], merges.merged_count))
                    if buffered.size else None)

        steps = {("group", g): entry(_group_sends(plan, pieces, g)[0]) for g in batched}
        for i in range(1, cp):
            dst = (rank + i) % cp
            rows = plan.exchange.send_index[dst].numpy()
            for j in range(pieces.count(counts[dst])):  # the pieces NeededTransport.sent_rows sends
                if j in batched:  # a batched band group's gradients come back together: its own entry
                    continue
                first, n = pieces.span(counts[dst], j)
                steps[(i, j)] = entry(rows[first:first + n])
        return cls(steps)


class DeviceCall:
    """A ``chunks.CallPlan`` on the kernel's device: the rows it reads (``Rows``) and ``kernels.Segments``."""

    def __init__(self, plan, q_index: Rows, k_index: Rows, seg: kernels.Segments):
        self.plan, self.q_index, self.k_index, self.seg = plan, q_index, k_index, seg

    @classmethod
    def of(cls, call, q_rows: int, k_rows: int, device) -> "DeviceCall":
        cu_q = torch.tensor((0,) + call.q_lens, dtype=torch.long).cumsum(0).to(torch.int32)
        cu_k = torch.tensor((0,) + call.k_lens, dtype=torch.long).cumsum(0).to(torch.int32)
        seg = kernels.Segments(cu_q.to(device), cu_k.to(device), max(call.q_lens), max(call.k_lens),
                               call.q_lens, call.k_lens, call.causal, call.window)
        return cls(call, device_rows(call.q_index, q_rows, device), device_rows(call.k_index, k_rows, device), seg)


def _whole_pays(state, window: Optional[int]) -> bool:
    """``needed_whole``'s rule, the same on every rank (the group's transfers pair up only if every rank
    posts them in the same order: all at once, or chunk by chunk): the ranks receive enough chunks that
    their calls and merges outweigh the overlap streaming them buys, and none receives too many rows to
    hold at once. Every received chunk has calls (needed-only), so the counts say it. Under refetch, also
    where ``REFETCH_GROUP_LOCAL_MULTIPLE`` is set and every rank's groups are each within it."""
    plan = state.plan_for(window)
    received = _received_rows(plan.exchange.counts)
    chunks = -(-received // plan.stream["needed"].chunk_rows)  # the streamed steps' pieces
    pays = (float(chunks.sum()) >= WHOLE_MIN_CHUNKS_PER_RANK * state.cp
            and int(received.sum(0).max()) <= WHOLE_RECEIVED_LOCAL_MULTIPLE * state.local_len)
    if pays and state.kv_backward == "refetch":
        pays = REFETCH_GROUP_LOCAL_MULTIPLE > 0 and bool(
            _group_rows(received, state.band_pieces(window).parts).max()
            <= REFETCH_GROUP_LOCAL_MULTIPLE * state.local_len)
    return pays


def _band_pieces(counts: torch.Tensor, runs, doc_runs, least: int = 1) -> Pieces:
    """How the band mode cuts a pair's rows (its groups), from global tables (the counts, the layout's runs,
    the documents), the same on every rank: up to ``BAND_GROUPS`` parts (or ``least``, where more), each at
    least ``BAND_MIN_PIECE_ROWS`` rows of the largest pair and ``BAND_MIN_DOCS_PER_PIECE`` (0: any) times the
    largest document of every pair that moves rows (its positions on the source, of the documents both
    ranks hold). Where that document bound leaves fewer than ``least`` parts (the groups refetch's memory
    bound needs), ``least`` where at most ``BAND_CUT_ROWS_SHARE`` of every such pair's rows lie in documents
    its pieces cut."""
    received = _received_rows(counts)
    parts = min(max(BAND_GROUPS, least), int(received.max()) // BAND_MIN_PIECE_ROWS)
    if parts > 1 and BAND_MIN_DOCS_PER_PIECE:
        starts, ends, ids = (np64(t) for t in doc_runs[0])
        real = ids != 0  # padding is no document
        starts, ends = starts[real], ends[real]
        held = np.zeros((runs.cp, starts.size), dtype=np.int64)  # [rank, document] its positions there
        first = np64(runs.start)
        end = first + np64(runs.length)
        lo = np.searchsorted(ends, first, side="right")  # the first document ending past the run's start
        hi = np.searchsorted(starts, end - 1, side="right")  # past the last document starting in the run
        run = np.repeat(np.arange(lo.size), np.maximum(hi - lo, 0))  # one entry per (run, document) met
        doc = ranges_np(lo, hi - lo)
        np.add.at(held, (np64(runs.rank)[run], doc),
                  np.minimum(ends[doc], end[run]) - np.maximum(starts[doc], first[run]))
        need = min(least, parts)  # the groups the memory bound asks for, as the piece rows allow
        cut_share = 0.0
        for src, dst in zip(*np.nonzero(received)):
            pair_docs = held[src] * (held[dst] > 0)  # [document] the source's positions of the pair's documents
            largest = int(pair_docs.max())
            parts = min(parts, int(received[src, dst]) // max(1, BAND_MIN_DOCS_PER_PIECE * largest))
            if need > 1:
                cut = pair_docs * BAND_MIN_DOCS_PER_PIECE > -(-int(received[src, dst]) // need)
                cut_share = max(cut_share, float(pair_docs[cut].sum()) / max(1, int(pair_docs.sum())))
        if parts < need and cut_share <= BAND_CUT_ROWS_SHARE:
            parts = need
    return Pieces(parts=max(1, parts))


def _group_rows(received: np.ndarray, parts: int) -> np.ndarray:
    """[group, destination] the rows each rank receives in each band group when every pair's rows
    (``received[source, destination]``) are cut into ``parts`` pieces (``exchange.Pieces(parts=...)``)."""
    c = np.maximum(1, -(-received // parts))  # [source, destination] rows a piece
    g = np.arange(parts).reshape(-1, 1, 1)
    return np.clip(received[None] - g * c[None], 0, c[None]).sum(1)


def _band_posts(cp: int, pieces: Pieces) -> Tuple[Tuple[Tuple[int, int], ...], ...]:
    """Per band step g, the (round, piece) messages it posts: piece g of every pair, round by round."""
    return tuple(tuple((i, g) for i in range(1, cp)) for g in range(pieces.parts))


def _group_sends(plan, pieces: Pieces, g: int) -> Tuple[np.ndarray, Tuple[Tuple[int, int, int], ...]]:
    """Band group g's sends from this rank: the local rows, destination by destination in posting order
    (rank + 1, rank + 2, ...), and (destination, first, rows) of each among them."""
    rank, cp = plan.rank, plan.cp
    rows, sends, first = [], [], 0
    for i in range(1, cp):
        dst = (rank + i) % cp
        index = plan.exchange.send_index[dst].numpy()
        lo, n = pieces.span(index.size, g)
        if n:
            rows.append(index[lo:lo + n])
            sends.append((i, dst, first, n))
            first += n
    return (np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)), tuple(sends)


def _received_rows(counts: torch.Tensor) -> np.ndarray:
    """[source, destination] the rows each rank receives from each other rank (the exchange's counts, the
    diagonal, a rank's own rows, zeroed)."""
    received = counts.numpy().copy()
    np.fill_diagonal(received, 0)
    return received


def _is_prefix(index: torch.Tensor, n: int) -> bool:
    """Whether a host index is 0, 1, ..., n - 1."""
    host = index.numpy()
    return host.size == n and bool((host == np.arange(n)).all())


def _non_identity(index: torch.Tensor, rows: int, device) -> Optional[torch.Tensor]:
    if index.numel() == rows and bool((index == torch.arange(rows)).all()):
        return None
    return index.to(device)

