"""A one-layer attention cost model: the busiest rank's compute plus its K/V traffic, by link.

    modeled = max over ranks r of  work[r] * seconds_per_pair + comm[r]
    comm[r] = sum over links of  seconds_per_position(link) * max(received[r], sent[r])
                                 (+ seconds_per_message(link) * messages[r], forward and backward)
    ideal   = total work / cp * seconds_per_pair        (perfect balance, free exchange)

``work`` counts causal query-key pairs (forward 4*Hq*D flops each, backward 2.5x:
14*Hq*D in all); a K/V position costs 2 * 2*Hkv*D*bytes over its link (K and V
forward, their gradients backward). Links are full duplex, so a rank's time on a
link is the larger of what it receives and what it sends (an owner whose rows
many ranks need is a bottleneck too). Without ``overlap`` the exchange is not
hidden behind compute: an upper bound on what overlap can win back.

Topology. One level (``ranks_per_node`` 0): every pair of ranks talks over one
link at ``seconds_per_position``. Two levels: ranks ``r // ranks_per_node`` share
a node; inside a node ``seconds_per_position`` (NVLink), between nodes
``seconds_per_position_inter`` (InfiniBand, one NIC per GPU). A position is priced
by the link it crosses (``hierarchy.layout_traffic`` counts them). With
``hierarchical`` (the default of two levels) what a node needs from another node
crosses IB once: its ranks each fetch an equal share of the node's remote rows
and forward them over NVLink to the node's ranks that need them
(``hierarchy.node_routes``); without it every rank fetches its own rows.

Overlap (``overlapped``): the streaming op attends the local keys while the first
remote chunk is in flight, then one chunk per source rank in round order
(round i receives from source (r - i) mod cp; needed-only exchanges skip empty
rounds; all-gather is a ring of full chunks), prefetch depth 1:

    C_0 = local compute, fetch_1 starts at 0
    chunk i >= 1: begin_i = max(T_{i-1}, fetch_end_i); fetch_{i+1} starts at begin_i; T_i = begin_i + C_i

modeled = T_last (forward, then backward), exposed communication = T_last - sum C.
The hierarchical exchange delivers its routes at once (``one_shot``): its
inter-node stage hides behind the local compute, its intra-node stage and the
gradients' return do not.
A chunk's fetch time is the rank's exchange time (``comm`` above) shared over its
chunks by their priced size. Backward with ``kv_backward="refetch"`` fetches the
chunks again and sends dK/dV home (twice the forward's bytes); "save" only sends
dK/dV home. Backward compute is 2.5x forward, as in ``seconds_per_pair``.

Presets: H200 bf16 attention at 500e12 FLOP/s effective; NVLink 400e9 B/s per
GPU inside a node; InfiniBand 400 Gb/s = 50e9 B/s per GPU across nodes; message
latency 0 unless given: at 3 us inside a node / 10 us between, the scale_latency suite
(``bench/SUMMARY.md``) finds +0.01-0.03x ideal where documents are long and up to +0.18x on
short ones, whose attention is too cheap to carry a message's fixed cost.
The default dims (32 query heads, 8 K/V heads, head dim 128, bf16: a Llama-3-8B
layer) stand in when no model config is at hand. It is a ranking device for
layouts, not a prediction of seconds.
"""

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple, Union

import torch

H200_BF16_ATTENTION_FLOPS = 500e12
LINK_BYTES_PER_SECOND = {"nvlink": 400e9, "ib": 50e9}
DEFAULT_DIMS = {"heads": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}
FORWARD_SHARE = 4 / 14  # forward flops of a query-key pair over forward + backward
KV_BACKWARD_MODES = ("refetch", "save")

_log = logging.getLogger("megatron_ext.blockdiag_cp")


def normalize_link(link: str) -> str:
    cleaned = str(link).strip().lower().replace("-", "").replace("_", "")
    aliases = {"nvlink": "nvlink", "nvl": "nvlink", "ib": "ib", "infiniband": "ib"}
    if cleaned not in aliases:
        raise ValueError(f"unknown link {link!r}; use 'nvlink' (one node) or 'ib' (across nodes)")
    return aliases[cleaned]


@dataclass(frozen=True)
class Traffic:
    """K/V positions each rank receives and sends in one attention call, by link ([cp] int64 each).

    ``intra``: inside a node (the only link of a one-level model); ``inter``:
    between nodes. ``*_messages``: per rank, the larger of its incoming and
    outgoing non-empty transfers on that link.
    """

    intra_in: torch.Tensor
    intra_out: torch.Tensor
    inter_in: torch.Tensor
    inter_out: torch.Tensor
    intra_messages: torch.Tensor
    inter_messages: torch.Tensor

    @classmethod
    def from_counts(cls, counts: torch.Tensor, ranks_per_node: int = 0) -> "Traffic":
        """Every rank fetches its own rows: counts[src, dst] split by whether src and dst share a node."""
        cp = counts.shape[0]
        rank = torch.arange(cp)
        same = (rank.view(-1, 1) // ranks_per_node == rank.view(1, -1) // ranks_per_node) if ranks_per_node \
            else torch.ones(cp, cp, dtype=torch.bool)
        intra, inter = counts * same, counts * ~same
        return cls(intra.sum(0), intra.sum(1), inter.sum(0), inter.sum(1), _messages(intra), _messages(inter))

    @classmethod
    def received_only(cls, needed: torch.Tensor) -> "Traffic":
        """What each rank receives over one link, nothing else known (sends and messages count 0)."""
        zero = torch.zeros_like(needed)
        return cls(needed, zero, zero, zero, zero, zero)


def _messages(matrix: torch.Tensor) -> torch.Tensor:
    nonzero = matrix > 0
    return torch.maximum(nonzero.sum(0), nonzero.sum(1))


@dataclass(frozen=True)
class Overlapped:
    """``CostModel.overlapped``: the busiest rank's streamed forward + backward."""

    modeled_seconds: float  # max over ranks of T_last (forward + backward)
    compute_seconds: float  # that rank's compute
    exposed_seconds: float  # that rank's communication left after overlap
    rank: int
    per_rank: torch.Tensor = field(repr=False)  # [cp] modeled seconds

    @property
    def exposed_share(self) -> float:
        return self.exposed_seconds / self.modeled_seconds if self.modeled_seconds > 0 else 0.0


@dataclass(frozen=True)
class CostModel:
    seconds_per_pair: float  # one causal query-key pair, forward + backward
    seconds_per_position: float  # one K/V position over the intra-node link (one level: the only link)
    name: str = "custom"
    ranks_per_node: int = 0  # 0: one level; else ranks r // ranks_per_node share a node
    seconds_per_position_inter: float = 0.0  # between nodes (two levels)
    hierarchical: bool = True  # two levels: a node's remote rows cross IB once, then NVLink
    seconds_per_message: float = 0.0  # latency of one transfer inside a node (each pass)
    seconds_per_message_inter: float = 0.0  # ... between nodes

    def __post_init__(self):
        if not (self.seconds_per_pair > 0 and self.seconds_per_position >= 0):
            raise ValueError(f"CostModel needs seconds_per_pair > 0 and seconds_per_position >= 0, "
                             f"got {self.seconds_per_pair!r}, {self.seconds_per_position!r}")
        if int(self.ranks_per_node) != self.ranks_per_node or self.ranks_per_node < 0:
            raise ValueError(f"CostModel: ranks_per_node must be an integer >= 0 (0: one level), "
                             f"got {self.ranks_per_node!r}")
        if self.ranks_per_node and not self.seconds_per_position_inter >= self.seconds_per_position:
            raise ValueError(f"CostModel: a two-level model needs seconds_per_position_inter >= "
                             f"seconds_per_position (the inter-node link is the slower one), got "
                             f"{self.seconds_per_position_inter!r} < {self.seconds_per_position!r}")
        if min(self.seconds_per_position_inter, self.seconds_per_message, self.seconds_per_message_inter) < 0:
            raise ValueError("CostModel: link prices and latencies must be >= 0")

    # -- construction ------------------------------------------------------

    @classmethod
    def preset(cls, link: str = "nvlink", heads: int = DEFAULT_DIMS["heads"],
               kv_heads: int = DEFAULT_DIMS["kv_heads"], head_dim: int = DEFAULT_DIMS["head_dim"],
               dtype_bytes: int = DEFAULT_DIMS["dtype_bytes"],
               flops: float = H200_BF16_ATTENTION_FLOPS) -> "CostModel":
        """H200 attention with the given model dims, one link for the whole group (NVLink or InfiniBand)."""
        link = normalize_link(link)
        pair, row = _pair_and_row(heads, kv_heads, head_dim, dtype_bytes, flops)
        return cls(pair, 2 * row / LINK_BYTES_PER_SECOND[link], name=f"{link}:hq{heads}/hkv{kv_heads}/d{head_dim}")

    @classmethod
    def two_level(cls, ranks_per_node: int, heads: int = DEFAULT_DIMS["heads"],
                  kv_heads: int = DEFAULT_DIMS["kv_heads"], head_dim: int = DEFAULT_DIMS["head_dim"],
                  dtype_bytes: int = DEFAULT_DIMS["dtype_bytes"], flops: float = H200_BF16_ATTENTION_FLOPS,
                  intra: str = "nvlink", inter: str = "ib", hierarchical: bool = True,
                  latency: float = 0.0, latency_inter: float = 0.0) -> "CostModel":
        """H200 attention, ``ranks_per_node`` CP ranks per node: ``intra`` inside a node, ``inter`` between."""
        if int(ranks_per_node) < 1:
            raise ValueError(f"CostModel.two_level: ranks_per_node must be >= 1, got {ranks_per_node!r} "
                             "(the number of CP ranks on one node, e.g. 8 GPUs per node)")
        intra, inter = normalize_link(intra), normalize_link(inter)
        pair, row = _pair_and_row(heads, kv_heads, head_dim, dtype_bytes, flops)
        return cls(pair, 2 * row / LINK_BYTES_PER_SECOND[intra],
                   name=f"{int(ranks_per_node)}x{intra}+{inter}{'/hier' if hierarchical else ''}:"
                        f"hq{heads}/hkv{kv_heads}/d{head_dim}",
                   ranks_per_node=int(ranks_per_node),
                   seconds_per_position_inter=2 * row / LINK_BYTES_PER_SECOND[inter],
                   hierarchical=bool(hierarchical), seconds_per_message=float(latency),
                   seconds_per_message_inter=float(latency_inter))

    @classmethod
    def from_config(cls, config, link: str = "nvlink", ranks_per_node: int = 0,
                    hierarchical: bool = True) -> "CostModel":
        """From a megatron TransformerConfig (num_attention_heads, num_query_groups, kv_channels);
        ``ranks_per_node`` > 0: two levels (NVLink inside a node, IB between; ``hierarchical``: the
        exchange routes a node's remote keys once), ``link`` ignored."""
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_query_groups", None) or heads)
        head_dim = int(getattr(config, "kv_channels", None) or config.hidden_size // heads)
        dtype_bytes = 2 if (getattr(config, "bf16", False) or getattr(config, "fp16", False)) else 4
        if ranks_per_node:
            return cls.two_level(ranks_per_node, heads, kv_heads, head_dim, dtype_bytes, hierarchical=hierarchical)
        return cls.preset(link, heads, kv_heads, head_dim, dtype_bytes)

    # -- topology ----------------------------------------------------------

    def nodes(self, cp: int) -> int:
        """Nodes a CP group of ``cp`` ranks spans under this model (1 for a one-level model)."""
        g = self.ranks_per_node
        return 1 if not g or g >= cp else -(-cp // g)

    def spans_nodes(self, cp: int) -> bool:
        return self.nodes(cp) > 1

    def check_group(self, cp: int) -> None:
        """A two-level model splits the group in whole nodes: cp must be a multiple of ranks_per_node."""
        g = self.ranks_per_node
        if g and g < cp and cp % g:
            raise ValueError(f"cost model {self.name!r}: a CP group of {cp} ranks does not split into nodes of "
                             f"{g} ranks; give ranks_per_node dividing cp (--gpus-per-node / LOCAL_WORLD_SIZE)")

    @property
    def positions_per_pair(self) -> float:
        """How many query-key pairs one K/V position over the intra-node (or only) link costs."""
        return self.seconds_per_position / self.seconds_per_pair

    @property
    def positions_per_pair_inter(self) -> float:
        """... over the inter-node link (the intra-node price for a one-level model)."""
        return (self.seconds_per_position_inter if self.ranks_per_node else self.seconds_per_position) \
            / self.seconds_per_pair

    def agreement_key(self) -> int:
        """A 64-bit fact of everything that decides where balanced cuts fall (agreed across ranks)."""
        return hash((self.seconds_per_pair, self.seconds_per_position, int(self.ranks_per_node),
                     self.seconds_per_position_inter, bool(self.hierarchical), self.seconds_per_message,
                     self.seconds_per_message_inter))

    # -- pricing -----------------------------------------------------------

    def comm_seconds(self, traffic: Traffic) -> torch.Tensor:
        """[cp] seconds of each rank's K/V exchange (forward + backward), not overlapped."""
        t = (torch.maximum(traffic.intra_in, traffic.intra_out).double() * self.seconds_per_position
             + torch.maximum(traffic.inter_in, traffic.inter_out).double() * self.seconds_per_position_inter)
        if self.seconds_per_message or self.seconds_per_message_inter:
            t = t + 2 * (traffic.intra_messages.double() * self.seconds_per_message
                         + traffic.inter_messages.double() * self.seconds_per_message_inter)
        return t

    def rank_seconds(self, work: torch.Tensor, traffic: Union[Traffic, torch.Tensor]) -> torch.Tensor:
        """[cp] modeled seconds per rank; a tensor ``traffic`` is positions received over the intra link."""
        if not isinstance(traffic, Traffic):
            traffic = Traffic.received_only(torch.as_tensor(traffic))
        return work.double() * self.seconds_per_pair + self.comm_seconds(traffic)

    def modeled_seconds(self, work: torch.Tensor, traffic: Union[Traffic, torch.Tensor]) -> float:
        return float(self.rank_seconds(work, traffic).max())

    def ideal_seconds(self, work: torch.Tensor) -> float:
        return float(work.double().sum()) / work.numel() * self.seconds_per_pair

    def overlapped(self, pair_work: torch.Tensor, traffic: Traffic, chunk_positions: torch.Tensor,
                   kv_backward: str = "refetch", ring: bool = False, one_shot: bool = False) -> Overlapped:
        """The streamed op's modeled time (see the module docstring).

        pair_work[src, dst]: query-key pairs of dst's queries on src's keys
        (``intervals.pair_work``; the diagonal is the local compute);
        chunk_positions[src, dst]: K/V positions dst receives from src (its chunk);
        ``ring``: every round moves a chunk (all-gather as a ring), none is skipped;
        ``one_shot``: the hierarchical routes, delivered at once (``_one_shot``).
        """
        if kv_backward not in KV_BACKWARD_MODES:
            raise ValueError(f"kv_backward must be one of {KV_BACKWARD_MODES}, got {kv_backward!r}")
        if one_shot:
            return self._one_shot(pair_work, traffic, kv_backward)
        cp = pair_work.shape[0]
        rank = torch.arange(cp)
        comm_fwd = self.comm_seconds(traffic) / 2  # [cp] forward K/V only: half of fwd + bwd
        same = self._same_node(cp)
        price = torch.where(same, torch.tensor(self.seconds_per_position, dtype=torch.float64),
                            torch.tensor(self.seconds_per_position_inter if self.ranks_per_node
                                         else self.seconds_per_position, dtype=torch.float64))
        weight = chunk_positions.double() * price  # [src, dst]
        # Rounds: i = 1..cp-1 receives from (dst - i) mod cp; order the chunks per dst by round.
        src_of = (rank.view(1, -1) - torch.arange(1, cp).view(-1, 1)) % cp  # [cp-1 rounds, dst]
        w = weight[src_of, rank.view(1, -1)].t()  # [dst, rounds]
        c = pair_work.double()[src_of, rank.view(1, -1)].t() * self.seconds_per_pair
        present = torch.ones_like(w, dtype=torch.bool) if ring else (chunk_positions[src_of, rank.view(1, -1)].t() > 0)
        # Needed-only: skip empty rounds (stable: present chunks first, in round order).
        order = torch.sort((~present).to(torch.int8), dim=1, stable=True).indices
        w, c, present = w.gather(1, order), c.gather(1, order), present.gather(1, order)
        w_total = w.sum(1, keepdim=True)
        fetch = torch.where(w_total > 0, w / w_total.clamp(min=1e-300), torch.zeros_like(w)) * comm_fwd.view(-1, 1)
        local = pair_work.double().diagonal() * self.seconds_per_pair
        total = torch.zeros(cp, dtype=torch.float64)
        for share, fetch_mult in ((FORWARD_SHARE, 1.0), (1 - FORWARD_SHARE, 2.0 if kv_backward == "refetch" else 1.0)):
            total += _stream(local * share, c * share, fetch * fetch_mult, present)
        compute = pair_work.double().sum(0) * self.seconds_per_pair
        total = torch.maximum(total, compute)  # T_last >= sum C; only float rounding says otherwise
        r = int(torch.argmax(total))
        return Overlapped(float(total[r]), float(compute[r]), float(total[r] - compute[r]), r, total)

    def _one_shot(self, pair_work: torch.Tensor, traffic: Traffic, kv_backward: str) -> Overlapped:
        """The hierarchical exchange: the routes deliver every needed row at once, not chunk by chunk.

        Its inter-node stage is posted before the local keys are attended and hides behind them;
        the intra-node stage needs it and is exposed; the remote keys are attended after.
        Backward: "refetch" runs the routes again the same way; the gradients go back through
        the routes at the end, exposed (forward's traffic once more).
        """
        half = 0.5  # Traffic and comm_seconds count forward + backward: one direction is half
        inter = half * torch.maximum(traffic.inter_in, traffic.inter_out).double() * self.seconds_per_position_inter
        intra = half * torch.maximum(traffic.intra_in, traffic.intra_out).double() * self.seconds_per_position
        if self.seconds_per_message or self.seconds_per_message_inter:
            inter = inter + traffic.inter_messages.double() * self.seconds_per_message_inter
            intra = intra + traffic.intra_messages.double() * self.seconds_per_message
        local = pair_work.double().diagonal() * self.seconds_per_pair
        compute = pair_work.double().sum(0) * self.seconds_per_pair
        remote = compute - local
        forward = torch.maximum(local * FORWARD_SHARE, inter) + intra + remote * FORWARD_SHARE
        back_local = local * (1 - FORWARD_SHARE)
        fetch = torch.maximum(back_local, inter) + intra if kv_backward == "refetch" else back_local
        backward = fetch + remote * (1 - FORWARD_SHARE) + inter + intra  # + the gradients home
        total = torch.maximum(forward + backward, compute)
        r = int(torch.argmax(total))
        return Overlapped(float(total[r]), float(compute[r]), float(total[r] - compute[r]), r, total)

    def _same_node(self, cp: int) -> torch.Tensor:
        rank = torch.arange(cp)
        if not self.ranks_per_node:
            return torch.ones(cp, cp, dtype=torch.bool)
        node = rank // self.ranks_per_node
        return node.view(-1, 1) == node.view(1, -1)


def _stream(local: torch.Tensor, compute: torch.Tensor, fetch: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """[cp] T_last of the prefetch-depth-1 pipeline; compute/fetch/present: [cp, rounds], absent rounds last."""
    T = local.clone()  # T_0 = C_0
    arrival = torch.where(present[:, 0], fetch[:, 0], torch.zeros_like(T)) if fetch.shape[1] else T * 0
    for i in range(fetch.shape[1]):
        on = present[:, i]
        begin = torch.maximum(T, arrival)
        nxt = fetch[:, i + 1] if i + 1 < fetch.shape[1] else torch.zeros_like(T)
        arrival = torch.where(on, begin + nxt, arrival)
        T = torch.where(on, begin + compute[:, i], T)
    return T


def _pair_and_row(heads, kv_heads, head_dim, dtype_bytes, flops):
    for name, value in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("dtype_bytes", dtype_bytes)):
        if int(value) <= 0:
            raise ValueError(f"CostModel: {name} must be positive, got {value!r}")
    return 14 * heads * head_dim / flops, 2 * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class WindowMix:
    """The model's sliding windows as the planner prices one layer: (window, share of layers) pairs.

    A query at p of a document starting at s sees keys [max(s, p - window), p] (Megatron's
    ``window_size=(window, 0)``); window None is full causal attention. Layers may mix them
    (``window_attn_skip_freq``): every layer waits for its slowest rank, so a layout costs the
    shares' modeled times weighed by the shares (``balanced`` counts each share's work and the
    keys its windows reach). Canonical: one entry per distinct window, ascending, None last.
    """

    shares: Tuple[Tuple[Optional[int], float], ...] = ((None, 1.0),)

    def __post_init__(self):
        merged = {}
        for entry in self.shares:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise ValueError(f"WindowMix.shares: (window, share) pairs, got {entry!r}")
            window, share = entry
            if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
                raise ValueError(f"WindowMix: a window is an int >= 0 (keys before the query) or None (full "
                                 f"attention), got {window!r}")
            if not (isinstance(share, (int, float)) and not isinstance(share, bool) and share > 0):
                raise ValueError(f"WindowMix: each share of layers must be > 0, got {share!r} for window {window!r}")
            merged[window] = merged.get(window, 0.0) + float(share)
        total = sum(merged.values())
        if not merged or abs(total - 1.0) > 1e-9:
            raise ValueError(f"WindowMix: the shares of layers must sum to 1, got {total!r} ({self.shares!r})")
        canonical = tuple(sorted(merged.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))
        object.__setattr__(self, "shares", canonical)

    @classmethod
    def of(cls, window: Optional[int], windowed: float = 1.0) -> "WindowMix":
        """``window`` on a ``windowed`` share of the layers (0 < windowed <= 1), full attention on the rest."""
        if window is None:
            return cls()
        if not (isinstance(windowed, (int, float)) and 0 < windowed <= 1):
            raise ValueError(f"WindowMix.of: windowed is the share of windowed layers, in (0, 1], got {windowed!r}")
        return cls(((window, float(windowed)),) + (((None, 1.0 - windowed),) if windowed < 1 else ()))

    @classmethod
    def from_layers(cls, windows: Sequence) -> "WindowMix":
        """Per layer: its window (int), None (full attention), or Megatron's (left, 0) pair."""
        windows = list(windows)
        if not windows:
            raise ValueError("WindowMix.from_layers: no layers given")
        counts = {}
        for w in windows:
            w = _left_window(w)
            counts[w] = counts.get(w, 0) + 1
        return cls(tuple((w, n / len(windows)) for w, n in counts.items()))

    @property
    def windows(self) -> Tuple[int, ...]:
        """The distinct sliding windows, ascending (none for full attention only)."""
        return tuple(w for w, _ in self.shares if w is not None)

    @property
    def full_only(self) -> bool:
        return not self.windows

    def agreement_key(self) -> int:
        """A 64-bit fact of the mix (agreed across ranks: it decides where balanced cuts fall).

        A digest of its text, not ``hash()``: None's hash differs between processes before Python 3.12.
        """
        if self.full_only:
            return 0
        digest = hashlib.blake2b(repr(self.shares).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    def describe(self) -> str:
        return ", ".join(f"{'full' if w is None else f'window {w}'}: {f:.3g}" for w, f in self.shares)


def _left_window(w) -> Optional[int]:
    """A layer's window as the planner takes it: Megatron's (left, 0) pair, an int, or None."""
    if w is None:
        return None
    if isinstance(w, (tuple, list)):
        if len(w) != 2 or w[1] not in (0, None):
            raise ValueError(f"a sliding window is Megatron's (left, 0) (causal), got {tuple(w)!r}")
        w = w[0]
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
        raise ValueError(f"a sliding window's left size is an int >= 0, got {w!r}")
    return int(w)


def resolve_windows(windows) -> WindowMix:
    """None -> full attention on every layer; an int or Megatron (left, 0) pair -> that window on
    every layer; a ``WindowMix`` as is; a list -> per-layer windows (``WindowMix.from_layers``)."""
    if windows is None:
        return WindowMix()
    if isinstance(windows, WindowMix):
        return windows
    if isinstance(windows, int) and not isinstance(windows, bool):
        return WindowMix.of(_left_window(windows))
    if isinstance(windows, tuple) and len(windows) == 2:
        return WindowMix.of(_left_window(windows))  # Megatron's window_size (left, 0), every layer
    if isinstance(windows, list):
        return WindowMix.from_layers(windows)
    raise ValueError(f"windows must be None, a window (int or Megatron's (left, 0)), a WindowMix, or a list of "
                     f"per-layer windows; got {windows!r:.80}")


def default_cost_model(cp_group=None, config=None, kv_exchange: Optional[str] = None) -> CostModel:
    """From the launch: NVLink when the CP group sits on one node, else two levels (NVLink inside a
    node, InfiniBand between nodes) with the group's CP ranks per node.

    The two levels price the exchange the step runs (``kv_exchange``; None: the configured knob):
    a node's remote keys crossing IB once only for "hierarchical" (with more than one CP rank per
    node, else it falls back to a2a), every rank fetching its own keys for the others. CP ranks
    per node come from ``parallel_state.cp_ranks_per_node`` (global ranks node-major,
    ``LOCAL_WORLD_SIZE`` / ``SLURM_NTASKS_PER_NODE`` processes per node). A group that does not
    split into equal node blocks gets one-level InfiniBand (logged). Without a process group
    (planning ahead, tests) the group is taken to sit on one node.
    """
    from . import state as knobs

    exchange = knobs.normalize_kv_exchange(knobs._CP_KV_EXCHANGE if kv_exchange is None else kv_exchange)
    kind, per_node = "nvlink", 0
    try:
        from .. import parallel_state as ps

        group = ps.get_cp_group() if cp_group is None else cp_group
        if group is not None and ps.group_size(group) > 1 and ps.cp_spans_nodes(group):
            per_node = ps.cp_ranks_per_node(group)
            kind = "two_level" if per_node else "ib"
            if not per_node:
                _log.info("blockdiag-cp: the CP group's ranks do not form equal node blocks; "
                          "cost model: one-level InfiniBand")
    except Exception:  # noqa: BLE001 - no distributed context: one node
        kind = "nvlink"
    if kind == "two_level":
        hierarchical = exchange == "hierarchical" and per_node > 1
        return CostModel.from_config(config, ranks_per_node=per_node, hierarchical=hierarchical) \
            if config is not None else CostModel.two_level(per_node, hierarchical=hierarchical)
    return CostModel.from_config(config, kind) if config is not None else CostModel.preset(kind)


def resolve_cost_model(cost_model: Optional[object]) -> CostModel:
    """None -> the default; a CostModel as is; 'nvlink' / 'ib' -> that preset."""
    if cost_model is None:
        return default_cost_model()
    if isinstance(cost_model, CostModel):
        return cost_model
    if isinstance(cost_model, str):
        return CostModel.preset(cost_model)
    raise ValueError(f"cost_model must be a CostModel, 'nvlink', 'ib' or None; got {cost_model!r}")


__all__ = ["CostModel", "Traffic", "Overlapped", "WindowMix", "default_cost_model", "resolve_cost_model",
           "resolve_windows", "normalize_link",
           "H200_BF16_ATTENTION_FLOPS", "LINK_BYTES_PER_SECOND", "DEFAULT_DIMS", "FORWARD_SHARE"]
