"""The per-step state: documents, layout, plan and the knobs every CP rank agreed on.

``BlockDiagCPState.build`` is the one place a step is set up, whatever the
documents come from (a ``DocumentSource``: replicated doc ids from ``shard_batch``,
Megatron's attention mask, THD ``cu_seqlens``). It takes the source's local
facts, this process's knobs and kernel availability, and its pending kernel
failures into ONE agreement all-reduce; every rank then raises the same error or
takes the same decisions from the same reduced vector, lays out and plans the
step on the host, and never enters a K/V collective its peers skip. What the
layer calls then read of the step (its calls, merges and sends on the device) is
the state's other half, ``step_tables.StepTables``.
"""

import logging
import re
import threading
import zlib
from typing import Dict, Optional, Tuple

import torch

from .. import parallel_state as ps
from . import kernels
from . import state as knobs
from . import step_tables as tables
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
from .layouts import Layout, build_layout, padded_length
from .layouts.two_dim import two_dim_layouts
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
from .step_tables import StepTables


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
    budget = tables.KV_SAVE_BUDGET_LOCAL_MULTIPLE * plan.local_len
    if received <= budget:
        return "save", (f"auto: the busiest rank receives {received} K/V rows, within the save budget "
                        f"of {budget:g} ({tables.KV_SAVE_BUDGET_LOCAL_MULTIPLE:g} x local {plan.local_len})")
    return "refetch", (f"auto: the busiest rank receives {received} K/V rows, over the save budget "
                       f"of {budget:g} ({tables.KV_SAVE_BUDGET_LOCAL_MULTIPLE:g} x local {plan.local_len})")


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


class BlockDiagCPState(StepTables):
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
        elif chunk_kind(self.kv_exchange) == "ring":  # the hops the ring posts
            sent_pos, recv_pos = self.ring_reach(window).positions(self.rank)
        else:
            sent_pos, recv_pos = plan.positions_moved()
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
