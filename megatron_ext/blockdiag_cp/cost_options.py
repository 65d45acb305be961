"""Every K/V exchange priced on one pack: 1-D (allgather, a2a, halo, hierarchical, ulysses), 2-D CP, and
the rows moved to the balanced layout first (``relayout``: "relaid a2a", ``price_relaid``).

``price_exchange_options`` takes global tables only (the replicated doc ids, the model's dims, the
topology), so every rank computes the same list and a per-step chooser can call it without a
collective. One attention layer, forward + backward, the busiest rank, nothing overlapped unless a
field says ``overlap``; the constants are ``cost.py``'s: H200 bf16 attention at 500e12 FLOP/s,
NVLink 400e9 B/s per GPU inside a node, InfiniBand 50e9 B/s per GPU between nodes.

Two-dimensional CP with ``ulysses_size`` u: cp = u * r ranks, CP rank c = j * u + i, u-group j =
u consecutive ranks (inside one node: u divides the GPUs per node G). Per rank:

    modeled(u, r) = A2A_u + outer(layout at r, heads / u)

    A2A_u    = 2 * B_u / 400e9 (+ 2 * B_u,ib / 50e9 where a u-group spans nodes, 1-D ulysses only)
    B_u      = (u - 1) / u * local_len * D * bytes * (2 * Hq + 2 * Hkv * rep)     forward bytes sent
    rep      = u / gcd(Hkv, u)   (K/V heads repeated so they split; refused when Hq % u != 0)
    local_len = padded_len / cp  (the layout's padding at cp)
    outer    = plan_summary(doc_ids, r, layout, CostModel(Hq / u, Hkv * rep / u, D)).modeled_seconds
             = max over the r groups of  work * 14 * (Hq / u) * D / 500e12
                                        + K/V positions * 2 * 2 * (Hkv * rep / u) * D * bytes / link

the factor 2 of ``A2A_u`` is the backward mirroring the forward (the gradients of q, k, v and out
make the same trip back). The outer level's links: r groups of u ranks, G / u groups per node; all
on one node (cp <= G): ``link`` (NVLink); several nodes with G / u > 1 groups per node: two levels
(NVLink between a node's groups, IB between nodes; outer ``hierarchical``: a node's remote rows
cross IB once); u == G: one group per node, every outer transfer over IB. Rank c exchanges its
own head shard with ranks j' * u + i, so per rank the outer exchange moves 1/u of the K/V of the
1-D exchange at r. u = 1 is the 1-D exchange; u = cp is 1-D ulysses (r = 1: no outer exchange,
compute the ideal, total causal pairs / cp). ``ideal``: total pairs / cp x seconds per pair, the
same for every option. Bytes: forward, the busiest rank's larger of sent and received (ulysses'
all-to-alls send what they receive), the inner all-to-alls plus the outer exchange.

Merges (``merge_seconds``, in ``modeled_seconds``): a row whose keys sit on several ranks gets one
partial output per rank and merges them. Every sequence option (r > 1, and the relaid ones) adds the
busiest rank's merged partials of its layout (``merged_rows``) at 14 HBM bytes per output element
over 3.3e12 B/s forward, backward 1.5x that: the elementwise time the gpu_model replay prices for
thd and one-document packs (128k / cp 8), within 10%. Ulysses (r = 1) attends whole sequences: none.
This is what separates a THD pack of short documents (every document on every rank) from the same
documents relaid, whose K/V bytes can price alike.

``overlap_seconds`` streams what the engine streams: the needed-only and all-gather exchanges behind
compute (``CostModel.overlapped``), and the all-to-alls of ulysses, of 2-D's inner level and of the
relaid rows a group of heads at a time (``head_groups``): hidden behind the attention but for the
first group's move in and the last one's move home (``pipelined_seconds``). ``modeled_seconds``, which
the per-step choice compares, overlaps nothing.
"""

from dataclasses import dataclass, replace
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from .cost import CostModel, DEFAULT_DIMS, LINK_BYTES_PER_SECOND, Traffic, normalize_link
from .head_groups import head_groups_for

ONE_D = ("allgather", "a2a", "halo", "hierarchical", "ulysses")
HBM_BYTES_PER_SECOND = 3.3e12  # H200
# HBM bytes per merged output element in forward (the partial, the float32 running output and its lse
# read and written, the call's rows gathered), and backward's over forward's (q, dout and out gathered
# per call, dq added): the elementwise time the gpu_model replay prices for thd and one-document packs
# at 128k / cp 8 (bf16, 32 x 128 query heads), within 10%.
MERGE_BYTES_PER_ELEMENT = 14
MERGE_BACKWARD_FACTOR = 1.5
RELAID = "relaid "  # + a needed-only exchange: the rows moved to the balanced layout, attended there
OUTER_EXCHANGES = ("a2a", "hierarchical")


@dataclass(frozen=True)
class ExchangeOption:
    """One exchange's price for one pack (module docstring); ``refused`` non-empty: not priced, why."""

    name: str  # "a2a", "ulysses", "2d u4 x r2 a2a"
    exchange: str  # the K/V exchange between sequence shards ("ulysses": none), 2-D: the outer one
    ulysses_size: int  # u: 1 for the 1-D K/V exchanges, cp for ulysses
    layout: str  # the layout priced ("any" for ulysses: its cost does not depend on it)
    bytes_max: int = 0  # forward bytes, busiest rank, larger of sent / received, per layer
    inter_node_bytes_max: int = 0  # of them, across nodes
    modeled_seconds: float = 0.0  # forward + backward, not overlapped
    ideal_seconds: float = 0.0  # total pairs / cp x seconds per pair
    overlap_seconds: Optional[float] = None  # exchanges streamed behind compute, all-to-alls by head groups
    refused: str = ""
    relayout: str = "none"  # "balanced": the rows moved there for the attention (``relayout``)
    merge_seconds: float = 0.0  # of modeled_seconds: the busiest rank's merges of partial outputs

    @property
    def modeled_over_ideal(self) -> float:
        return self.modeled_seconds / self.ideal_seconds if self.ideal_seconds > 0 else float("nan")


def option_name(exchange: str, u: int, cp: int) -> str:
    """"a2a" (u = 1), "ulysses" (u = cp), "relaid a2a" (``RELAID`` + an exchange), else
    "2d u{u} x r{cp // u} {exchange}"."""
    if exchange.startswith(RELAID):
        return exchange
    if u == cp and cp > 1:
        return "ulysses"
    if u == 1:
        return exchange
    return f"2d u{u} x r{cp // u} {exchange}"


# -- ulysses' all-to-alls ---------------------------------------------------


def ulysses_forward_bytes(local_len: int, b: int, hq: int, hkv: int, d_qk: int, d_v: int, dtype_bytes: int,
                          u: int) -> Tuple[int, int, str]:
    """(bytes one rank sends (= receives) in a layer's forward, K/V head repeats, refusal or '').

    The two all-to-alls among u ranks move all but the rank's own block of q [L, b, Hq, Dqk],
    k [L, b, Hkv*rep, Dqk], v [L, b, Hkv*rep, Dv] and out [L, b, Hq, Dv], counted per tensor as
    the engine counts them (``ulysses._count``: numel * element size * (u - 1) // u).
    """
    from .ulysses import kv_head_repeats

    repeats, error = kv_head_repeats(hq, hkv, u)
    if error:
        return 0, repeats, error
    tensors = (local_len * b * hq * d_qk, local_len * b * hkv * repeats * d_qk, local_len * b * hkv * repeats * d_v,
               local_len * b * hq * d_v)
    return sum(n * dtype_bytes * (u - 1) // u for n in tensors), repeats, ""


def ulysses_link_bytes(local_len: int, hq: int, hkv: int, d: int, dtype_bytes: int, u: int, repeats: int,
                       ranks_per_node: int) -> Tuple[float, float]:
    """(forward bytes a rank sends inside its node, across nodes) in an all-to-all of u ranks,
    ranks node-major, ``ranks_per_node`` per node (0: all on one node): a tensor of T bytes sends
    T (g - 1) / u over NVLink and T (u - g) / u over IB, g = min(ranks_per_node, u)."""
    g = min(ranks_per_node, u) if ranks_per_node else u
    total = local_len * d * dtype_bytes * (2 * hq + 2 * hkv * repeats)  # q, k, v, out (b = 1)
    return total * (g - 1) / u, total * (u - g) / u


def ulysses_seconds(cost: CostModel, pairs: float, cp: int, bytes_intra: float, bytes_inter: float,
                    row_bytes: int) -> Tuple[float, float, float]:
    """(modeled, ideal, communication) seconds of one 1-D ulysses layer forward + backward:
    compute the ideal (pairs / cp x ``seconds_per_pair``), the all-to-alls on ``cost``'s links,
    backward mirroring forward, nothing overlapped (the attention needs the first all-to-all, the
    second needs the attention). ``row_bytes``: ``cost``'s K/V row (its ``seconds_per_position``
    covers forward + backward of one)."""
    intra, inter = torch.tensor([bytes_intra / row_bytes]), torch.tensor([bytes_inter / row_bytes])
    zero = torch.zeros(1)
    comm = float(cost.comm_seconds(Traffic(intra, intra, inter, inter, zero, zero))[0])
    ideal = pairs / cp * cost.seconds_per_pair
    return ideal + comm, ideal, comm


def pipelined_seconds(compute: float, moves: float, groups) -> float:
    """Attention of ``compute`` seconds between all-to-alls of ``moves`` seconds (q, k, v in, the output home,
    and backward the same), pipelined over head groups (``head_groups.HeadGroups``): the share no group
    can hide is exposed, the rest as far as the attention lasts."""
    hidden = min((1.0 - groups.exposed_share()) * moves, compute)
    return compute + moves - hidden


# -- merges: a row's partial outputs, one per rank its keys come from ------------


def merged_rows(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[cp] per rank: the partial outputs it merges into its query rows in one layer's forward, one per
    row and other rank holding keys the row attends (causal, no window): a row's own rank attends the
    first partial, every other rank holding an earlier position of its document adds one.

    ``ids``: [b, S] doc ids (0 = padding), padded to the layout's length; ``positions``: [cp, L] the
    global positions each rank owns (``Layout.positions``). Counted on runs of one document and one
    owner: a run's rows see the distinct owners of its document's runs up to it."""
    from .layouts.base import owner_of

    cp = positions.shape[0]
    owner = owner_of(positions)
    merged = torch.zeros(cp, dtype=torch.float64)
    for row in ids:
        new_doc = torch.ones_like(row, dtype=torch.bool)
        new_doc[1:] = row[1:] != row[:-1]
        new_run = new_doc.clone()
        new_run[1:] |= owner[1:] != owner[:-1]
        starts = new_run.nonzero().squeeze(1)  # [runs]
        lengths = torch.diff(starts, append=torch.tensor([row.numel()]))
        run_owner, run_doc = owner[starts], torch.cumsum(new_doc.long(), 0)[starts]
        key = run_doc * cp + run_owner
        _, inverse = torch.unique(key, return_inverse=True)
        index = torch.arange(starts.numel())
        first = torch.full((int(inverse.max()) + 1,), starts.numel(), dtype=torch.long)
        first = first.scatter_reduce(0, inverse, index, reduce="amin")
        seen = torch.cumsum((first[inverse] == index).long(), 0)  # distinct (document, owner) so far
        doc_first = torch.ones_like(run_doc, dtype=torch.bool)
        doc_first[1:] = run_doc[1:] != run_doc[:-1]
        before = torch.cummax(torch.where(doc_first, seen - 1, torch.zeros_like(seen)), 0).values
        others = seen - before - 1  # owners of the document's runs so far, the run's own apart
        attended = (row[starts] > 0).double()
        merged += torch.bincount(run_owner, weights=lengths.double() * others.double() * attended, minlength=cp)
    return merged


def merge_seconds(rows: float, hq: int, d_v: int) -> float:
    """Forward + backward seconds of ``rows`` merged partial outputs of Hq heads x Dv:
    ``MERGE_BYTES_PER_ELEMENT`` per element at ``HBM_BYTES_PER_SECOND``, backward
    ``MERGE_BACKWARD_FACTOR`` times forward."""
    return (1.0 + MERGE_BACKWARD_FACTOR) * rows * hq * d_v * MERGE_BYTES_PER_ELEMENT / HBM_BYTES_PER_SECOND


def _busiest_merges(cache: dict, key, ids: torch.Tensor, summary: dict) -> float:
    """The most partial outputs one rank merges in ``summary``'s layout (``merged_rows``), once per
    layout of a pack."""
    key = ("merged",) + tuple(key)
    if key not in cache:
        padded = torch.nn.functional.pad(ids, (0, summary["padded_len"] - ids.shape[1]))
        cache[key] = float(merged_rows(padded, summary["positions"]).max())
    return cache[key]


# -- the options ----------------------------------------------------------


def _pairs(ids: torch.Tensor) -> float:
    """Causal query-key pairs of the documents (0 = padding, not attended)."""
    ids = ids.reshape(-1, ids.shape[-1])
    total = 0.0
    for row in ids:
        docs, lengths = torch.unique_consecutive(row, return_counts=True)
        lengths = lengths[docs > 0].double()
        total += float((lengths * (lengths + 1) / 2).sum())
    return total


def _outer_cost(r: int, u: int, G: int, link: str, hierarchical: bool, dims) -> Tuple[CostModel, bool]:
    """The outer level's cost model over r groups of u ranks (module docstring) and whether every
    outer transfer crosses nodes (one group per node on several nodes)."""
    hq, hkv_rep, d, nbytes = dims
    if r * u <= G:
        return CostModel.preset(link, hq, hkv_rep, d, nbytes), normalize_link(link) == "ib"
    groups_per_node = G // u
    if groups_per_node > 1:
        return CostModel.two_level(groups_per_node, hq, hkv_rep, d, nbytes, hierarchical=hierarchical), False
    return CostModel.preset("ib", hq, hkv_rep, d, nbytes), True


def price_option(doc_ids, cp: int, layout: str, exchange: str, u: int = 1,
                 dims: Sequence[int] = tuple(DEFAULT_DIMS.values()), gpus_per_node: Optional[int] = None,
                 link: str = "nvlink", layout_at: Optional[dict] = None) -> ExchangeOption:
    """One option: ``exchange`` ("allgather", "a2a", "halo", "hierarchical") between cp / u groups
    after a ulysses all-to-all over u ranks (u = 1: 1-D; u = cp with ``exchange`` "ulysses" or any:
    1-D ulysses). ``dims`` = (Hq, Hkv, D, dtype bytes). ``gpus_per_node`` None: the group on one
    node. ``layout_at``: a cache of ``plan_summary`` results by (r, layout, cost name), shared by
    the calls of one pack."""
    from .layouts import padded_length
    from .prepare import _as_rows, plan_summary
    from .ulysses import kv_head_repeats

    hq, hkv, d, nbytes = (int(x) for x in dims)
    cp, u = int(cp), int(u)
    G = int(gpus_per_node) if gpus_per_node else cp
    ids = _as_rows(doc_ids)
    if exchange.startswith(RELAID):
        return price_relaid(ids, cp, layout, exchange[len(RELAID):], dims, gpus_per_node, link, layout_at)
    if exchange == "ulysses":
        u = cp
    name = option_name(exchange, u, cp)
    shown_layout = "any" if u == cp and cp > 1 else layout
    base = ExchangeOption(name, "ulysses" if u == cp and cp > 1 else exchange, u, shown_layout)
    if u < 1 or cp % u:
        return replace(base, refused=f"ulysses_size {u} must divide cp={cp}")
    if 1 < u < cp and (u > G or G % u):
        return replace(base, refused=f"ulysses_size {u} must divide the {G} GPUs per node ({G} % {u} = {G % u}): "
                                     "a u-group's all-to-all stays inside one node")
    repeats, error = kv_head_repeats(hq, hkv, u)
    if error and u < cp:
        error = (f"ulysses_size {u} splits the {hq} query heads over {u} ranks, and {hq} % {u} = {hq % u}; use a "
                 f"ulysses_size that divides the query heads")
    if error:
        return replace(base, refused=error)
    r = cp // u
    spans = cp > G
    if exchange == "hierarchical" and not (spans and G // u > 1):
        return replace(base, refused=f"hierarchical needs the {'outer level' if u > 1 else 'CP group'} to span "
                                     f"several nodes with several {'groups' if u > 1 else 'ranks'} per node "
                                     f"(cp={cp}, {G} GPUs per node, u={u}); the step would run a2a")
    one_pairs_cost = CostModel.preset("nvlink", hq, hkv, d, nbytes)
    ideal = _pairs(ids) / cp * one_pairs_cost.seconds_per_pair
    # Inner: ulysses over u ranks (inside a node for 2-D; 1-D ulysses may span nodes).
    local_len = padded_length(ids.shape[1], layout, cp) // cp
    intra_link = "nvlink" if spans else normalize_link(link)
    inner, inner_inter, inner_seconds = 0, 0.0, 0.0
    if u > 1:
        inner, _, _ = ulysses_forward_bytes(local_len, ids.shape[0], hq, hkv, d, d, nbytes, u)
        intra_b, inter_b = ulysses_link_bytes(local_len * ids.shape[0], hq, hkv, d, nbytes, u, repeats,
                                              G if spans else 0)
        inner_seconds = 2 * (intra_b / LINK_BYTES_PER_SECOND[intra_link] + inter_b / LINK_BYTES_PER_SECOND["ib"])
        inner_inter = inter_b + (intra_b if intra_link == "ib" else 0.0)
    if r == 1:
        return replace(base, bytes_max=inner, inter_node_bytes_max=round(inner_inter),
                       modeled_seconds=ideal + inner_seconds, ideal_seconds=ideal,
                       overlap_seconds=pipelined_seconds(ideal, inner_seconds,
                                                         head_groups_for(hq // u, hkv * repeats // u, False)))
    # Outer: the layout at r on Hq / u query heads and Hkv * rep / u K/V heads.
    kv_per_rank = hkv * repeats // u
    outer_dims = (hq // u, kv_per_rank, d, nbytes)
    cost, all_inter = _outer_cost(r, u, G, link, exchange == "hierarchical", outer_dims)
    key = (r, layout, cost.name, cost.hierarchical)
    cache = {} if layout_at is None else layout_at
    if key not in cache:
        cache[key] = plan_summary(ids, r, layout=layout, cost_model=cost)
    s = cache[key]
    if exchange == "halo" and not s["halo_ok"]:
        return replace(base, refused="halo: a document straddles more than one shard boundary; the step would "
                                     "run a2a")
    gather = exchange == "allgather"
    traffic = s["traffic_allgather" if gather else "traffic"]
    row_bytes = 2 * kv_per_rank * d * nbytes
    both = torch.maximum(traffic.intra_in + traffic.inter_in, traffic.intra_out + traffic.inter_out)
    inter = torch.maximum(traffic.inter_in, traffic.inter_out)
    if all_inter:
        inter = both
    outer_modeled = s["modeled_allgather_seconds" if gather else "modeled_seconds"]
    outer_overlap = s["overlap_allgather_seconds" if gather else "overlap_seconds"]
    merges = merge_seconds(_busiest_merges(cache, key, ids, s), hq // u, d)
    return replace(base, layout=s["layout"], bytes_max=inner + int(both.max()) * row_bytes,
                   inter_node_bytes_max=round(inner_inter) + int(inter.max()) * row_bytes,
                   modeled_seconds=outer_modeled + inner_seconds + merges, ideal_seconds=ideal,
                   overlap_seconds=pipelined_seconds(outer_overlap, inner_seconds,
                                                     head_groups_for(hq // u, kv_per_rank, True)) + merges,
                   merge_seconds=merges)


# -- relayout: the rows moved to the balanced layout ----------------------------


def relayout_rows(source: torch.Tensor, target: torch.Tensor, G: int
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """([cp] rows each rank sends inside its node, across nodes, receives inside, across) when every row
    moves from its owner in one layout to its owner in another (``source``, ``target``: [cp, L] the global
    positions each rank owns, ``Layout.positions``; ranks node-major, ``G`` per node)."""
    from .layouts.base import owner_of

    cp = source.shape[0]
    dest = owner_of(target)[source]  # [cp, L] where each rank's rows go
    rank = torch.arange(cp).unsqueeze(1)
    moved, same_node = dest != rank, dest // G == rank // G
    send_intra, send_inter = (moved & same_node).sum(1), (moved & ~same_node).sum(1)
    recv_intra = torch.bincount(dest[moved & same_node], minlength=cp)
    recv_inter = torch.bincount(dest[moved & ~same_node], minlength=cp)
    return send_intra, send_inter, recv_intra, recv_inter


def price_relaid(ids: torch.Tensor, cp: int, layout: str, exchange: str,
                 dims: Sequence[int] = tuple(DEFAULT_DIMS.values()), gpus_per_node: Optional[int] = None,
                 link: str = "nvlink", layout_at: Optional[dict] = None) -> ExchangeOption:
    """``relayout="balanced"`` with ``exchange`` (a2a or hierarchical) in the balanced layout: the four
    all-to-alls (q, k, v there, out back; backward the same bytes the other way), not overlapped, plus
    the balanced layout's own price (``plan_summary``) with that exchange. A rank's moves: its rows whose
    balanced owner is another rank, by link."""
    from .layouts import build_layout, padded_length
    from .prepare import plan_summary

    hq, hkv, d, nbytes = (int(x) for x in dims)
    G = int(gpus_per_node) if gpus_per_node else cp
    base = ExchangeOption(RELAID + exchange, exchange, 1, "balanced", relayout="balanced")
    if layout == "balanced":
        return replace(base, refused="the batch is laid out balanced already")
    if exchange not in OUTER_EXCHANGES:
        return replace(base, refused=f"relayout is priced with a2a or hierarchical, not {exchange!r}")
    if exchange == "hierarchical" and not (cp > G and G > 1):
        return replace(base, refused=f"hierarchical needs the CP group to span several nodes with several ranks "
                                     f"per node (cp={cp}, {G} GPUs per node); the step would run a2a")
    padded = torch.nn.functional.pad(ids, (0, padded_length(ids.shape[1], layout, cp) - ids.shape[1]))
    cost, _ = _outer_cost(cp, 1, G, link, exchange == "hierarchical", (hq, hkv, d, nbytes))
    key = ("relaid", cp, cost.name, cost.hierarchical)
    cache = {} if layout_at is None else layout_at
    if key not in cache:
        cache[key] = plan_summary(padded, cp, layout="balanced", cost_model=cost)
    s = cache[key]
    source = build_layout(layout, padded, cp).positions
    send_intra, send_inter, recv_intra, recv_inter = relayout_rows(source, s["positions"], G)
    row = ids.shape[0] * d * nbytes * (2 * hq + 2 * hkv)  # q, k, v and out of one position
    intra_link = "ib" if cp <= G and normalize_link(link) == "ib" else "nvlink"
    per_rank = (torch.maximum(send_intra, recv_intra).double() * row / LINK_BYTES_PER_SECOND[intra_link]
                + torch.maximum(send_inter, recv_inter).double() * row / LINK_BYTES_PER_SECOND["ib"])
    moves = 2 * float(per_rank.max())  # backward moves the gradients of the same rows
    moved_bytes = int(torch.maximum(send_intra + send_inter, recv_intra + recv_inter).max()) * row
    inter_bytes = int(torch.maximum(send_inter, recv_inter).max()) * row
    traffic = s["traffic"]
    kv_row = 2 * hkv * d * nbytes
    both = torch.maximum(traffic.intra_in + traffic.inter_in, traffic.intra_out + traffic.inter_out)
    one_pairs_cost = CostModel.preset("nvlink", hq, hkv, d, nbytes)
    ideal = _pairs(ids) / cp * one_pairs_cost.seconds_per_pair
    merges = merge_seconds(_busiest_merges(cache, key, padded, s), hq, d)
    return replace(base, bytes_max=moved_bytes + int(both.max()) * kv_row,
                   inter_node_bytes_max=inter_bytes + int(torch.maximum(traffic.inter_in, traffic.inter_out).max())
                   * kv_row, modeled_seconds=s["modeled_seconds"] + moves + merges, ideal_seconds=ideal,
                   overlap_seconds=pipelined_seconds(s["overlap_seconds"], moves, head_groups_for(hq, hkv, True)) + merges,
                   merge_seconds=merges)


def default_options(cp: int, gpus_per_node: Optional[int] = None) -> List[Tuple[str, int]]:
    """(exchange, u) pairs worth pricing: 1-D allgather, a2a, halo, hierarchical (several nodes of
    several ranks), ulysses; 2-D for every u with 1 < u < cp dividing cp and the GPUs per node, outer
    a2a, and hierarchical where the outer level spans nodes with several groups per node."""
    G = int(gpus_per_node) if gpus_per_node else cp
    out = [("allgather", 1), ("a2a", 1), ("halo", 1)]
    if cp > G and G > 1:
        out.append(("hierarchical", 1))
    out.append(("ulysses", cp))
    for u in range(2, cp):
        if cp % u or G % u or u > G:
            continue
        out.append(("a2a", u))
        if cp > G and G // u > 1:
            out.append(("hierarchical", u))
    return out


def price_exchange_options(doc_ids, cp: int, layout: str = "balanced",
                           dims: Sequence[int] = tuple(DEFAULT_DIMS.values()),
                           gpus_per_node: Optional[int] = None, link: str = "nvlink",
                           options: Optional[Iterable[Tuple[str, int]]] = None) -> List[ExchangeOption]:
    """Every option's price for these doc ids ([S] or [b, S], replicated: global tables only).

    ``dims`` (Hq, Hkv, head dim, dtype bytes); ``gpus_per_node`` G (None: the group sits on one
    node, ``link`` its link); ``options``: (exchange, u) pairs (default ``default_options``:
    1-D allgather / a2a / halo / hierarchical / ulysses and 2-D u x r with outer a2a and
    hierarchical). Refused options come back with ``refused`` saying why (the numbers).
    Sorted as asked; pick with ``min(o for o in opts if not o.refused, key=modeled_seconds)``.
    """
    opts = default_options(cp, gpus_per_node) if options is None else list(options)
    cache: dict = {}
    return [price_option(doc_ids, cp, layout, ex, u, dims, gpus_per_node, link, cache) for ex, u in opts]


def relaid_options(cp: int, gpus_per_node: Optional[int] = None) -> List[Tuple[str, int]]:
    """The relayout options worth pricing: the rows moved to balanced, then a2a (and hierarchical
    where the group spans nodes of several ranks)."""
    G = int(gpus_per_node) if gpus_per_node else cp
    return [(RELAID + "a2a", 1)] + ([(RELAID + "hierarchical", 1)] if cp > G and G > 1 else [])


__all__ = ["ExchangeOption", "price_exchange_options", "price_option", "default_options", "option_name",
           "price_relaid", "relaid_options", "relayout_rows", "RELAID", "merged_rows", "merge_seconds",
           "ulysses_forward_bytes", "ulysses_link_bytes", "ulysses_seconds", "ONE_D", "OUTER_EXCHANGES"]
