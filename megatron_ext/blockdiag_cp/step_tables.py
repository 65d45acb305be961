"""The step's tables: what the streamed op reads on every layer call, built once per step.

``StepTables`` is the half of ``step.BlockDiagCPState`` the layer calls ask: from the
step's plan (host tables, alike on every rank), per chunk kind and window, the calls
each step makes with their rows on the device (``stream_on``, ``DeviceCall``), where
each call's rows go (``merges_on``, ``key_merges_on``, ``KeyReturns``), the rows
each peer is sent (``send_indices_on``), the band mode's groups (``needed_whole``,
``whole_delivery_on``), the hierarchical route, the ring's gradient steps and the
head shards' state (``ulysses_on``). Each is built by the first call that asks and
kept for the step, so the calls after it run no host work and no host sync. The
constants below steer those choices; they are read from global tables, so every
rank decides alike.
"""

from dataclasses import replace
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import parallel_state as ps
from . import kernels
from .exchange import GroupMessages, Pieces, RingGradients, RingReach, WholeDelivery, piece_rows
from .intervals import np64, ranges_np
from .layouts import build_layout
from .merge import MergePlan, Rows, RowSums, copied_rows, device_rows
from .plan import PairRuns, StepPlan, build_plan

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


class StepTables:
    """The per-step tables of ``BlockDiagCPState`` (its base class): they read the state's plan, layout,
    rank, cp, rows, local_len, kv_exchange and kv_backward, and keep what they build in its
    ``_device_index`` (keyed by table, kind, device and window), ``_window_plans`` and ``_host_routes``."""

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
        ``"refetch"`` only where ``REFETCH_GROUP_LOCAL_MULTIPLE`` is above 0 (1 by default; 0 turns it off) and no rank
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
            all_to_all = one_batch & _every_rank_sends_and_receives(every_rank, pieces.parts)
            messages = []
            for g in range(pieces.parts):
                sent, sends = _group_sends(plan, pieces, g)
                arrivals, receives, first = [], [], 0
                for src in range(self.cp):  # the sources in rank order, as an all-to-all lands them (own: 0 rows)
                    lo, n = pieces.span(int(received[src]), g)
                    if n:
                        arrivals.append(band_of[at[src] + lo:at[src] + lo + n] - band.starts[g])
                        receives.append(((self.rank - src) % self.cp, src, first, n))
                        first += n
                band_rows = np.concatenate(arrivals) if arrivals else np.zeros(0, dtype=np.int64)
                place = np.empty_like(band_rows)
                place[band_rows] = np.arange(band_rows.size)  # a permutation: every band row arrives once
                splits = None
                if all_to_all[g]:  # rows to and from each rank, in rank order
                    to_rank, from_rank = [0] * self.cp, [0] * self.cp
                    for _, dst, _, n in sends:
                        to_rank[dst] = n
                    for _, src, _, n in receives:
                        from_rank[src] = n
                    splits = (tuple(to_rank), tuple(from_rank))
                messages.append(GroupMessages(
                    device_rows(torch.from_numpy(sent), self.local_len, device), sends, tuple(receives),
                    device_rows(torch.from_numpy(band_rows), first, device),
                    device_rows(torch.from_numpy(place), first, device), int(sent.size), first, bool(one_batch[g]),
                    splits))
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
            self._device_index[key] = [None if _is_prefix(t, self.local_len) else t.to(device)
                                       for t in self.plan_for(window).exchange.send_index]
        return self._device_index[key]

    def pair_runs(self, window: Optional[int] = None) -> PairRuns:
        """Which needed-only pairs move a run of their source's rows (``plan.PairRuns``), once per step."""
        key = ("pair_runs", window)
        if key not in self._device_index:
            self._device_index[key] = PairRuns.of(self.plan_for(window), self.layout.runs)
        return self._device_index[key]

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

    def ring_reach(self, window: Optional[int] = None) -> RingReach:
        """Which way and how far around the ring each piece of K/V goes (``chunks.RingReach``): the ring
        plan's, built with its steps (whose order it sets)."""
        return self.plan_for(window).stream["ring"].reach

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

    def key_merges_on(self, kind: str, device: torch.device, window: Optional[int] = None, narrow: bool = False):
        """(``MergePlan`` over the local key rows, their buffer slots on the device or None, the returned
        gradients' ``KeyReturns`` or None), once per step, kind and window: the own step's calls write the
        rows.

        a2a / halo (one row of doc ids): a row whose own calls and returned gradients are at most two
        writers takes them in dK / dV themselves (the second added in place, one rounding), only rows of
        three or more in the float32 buffer; ``KeyReturns`` tells each returned gradient's rows where they
        go. The ring, hierarchical and several rows of doc ids: every returned row is merged (hierarchical:
        its routes' one return, step "route", summed into each row once, ``merge.RowSums``).

        Where half the rows or more are merged, every row is, if that holds less: else the own call's
        kernel dK / dV become the result at backward's first call and stay to its end beside the buffer.
        A float32 buffer of N rows holds less than a result of N rows and a buffer of M >= N / 2 where
        the result is float32 too, and, where it is 16-bit (``narrow``), once M > N / 2 (at M = N / 2
        they hold the same, and the result is lent). A row of one writer passes float32 exactly."""
        key = ("key_merges", kind, str(device), window, narrow)
        if key not in self._device_index:
            plan = self.plan_for(window)
            L = self.local_len
            own = [call.k_index for call in self.run_steps(kind, window)[0].calls]
            every = self.rows > 1
            direct = kind == "needed" and self.kv_exchange != "hierarchical" and not every
            sent = None  # hierarchical: the rows sent in stage 1 (to a peer or a node's fetcher), as they come back
            if kind == "ring":
                reach = self.ring_reach(window)
                pieces = sorted({j for _, j in self.ring_gradients(window).returned})
                back = [np.arange(*reach.span[self.rank][j]) for j in pieces]
            elif self.kv_exchange == "hierarchical":
                sent = self.hierarchical_route_on(torch.device("cpu"), window).send1_index.numpy()
                back = [sent]
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
            twice, rows = 2 * merges.merged_count, L * self.rows
            if not every and (twice > rows if narrow else twice >= rows):  # the memory rule above
                merges = MergePlan.of([own], L * self.rows, device, every_row_merged=True,
                                      padding=self._padding_rows(kind, window))
            at = np.full(L * self.rows, -1, dtype=np.int64)  # a row's buffer slot (-1: not merged)
            at[np.flatnonzero(merges.merged_mask)] = np.arange(merges.merged_count)
            slot = None if merges.merged is None else torch.from_numpy(at).to(device)  # None: every row, in order
            batched = ()
            if kind == "needed" and self.needed_whole(window):
                batched = tuple(g for g, m in enumerate(self.whole_delivery_on(device, window).messages) if m.one_batch)
            returns = None
            if direct:
                returns = KeyReturns.of(plan, self.stream_pieces(kind, window)[0], merges, at, device, batched)
            elif sent is not None and kind == "needed" and not every:
                returns = KeyReturns({"route": _returned(sent, merges, at, L, device)})
            self._device_index[key] = (merges, slot, returns)
        return self._device_index[key]


def ulysses_single_rank_state(state):
    """The cp = 1 state the head shards are attended with: the outer state's padded doc ids in global
    order, its backend, its kernel-failure list (so a failure is agreed at the end of the step)."""
    ids = state.doc_ids  # [R, P] padded
    layout = build_layout("contiguous", ids, 1)
    inner = type(state)(
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
    (its rows, their float32 buffer slots), each ``Rows`` or None when empty; a band group's ``merged``
    ("group", g), or the hierarchical routes' one return ("route"), whose rows several ranks send back,
    is (None, ``merge.RowSums``) where a slot repeats."""

    def __init__(self, steps: Dict[object, tuple]):
        self.steps = steps  # step -> (added, merged): each None or (Rows of the gradient, Rows there)

    @classmethod
    def of(cls, plan, pieces: Pieces, merges: MergePlan, slot_of: np.ndarray, device,
           batched: Tuple[int, ...] = ()) -> "KeyReturns":
        """``pieces``: how a pair's rows are cut into its messages (``BlockDiagCPState.stream_pieces``); and
        for each band group in ``batched`` (``exchange.GroupMessages.one_batch``: its gradients come back in
        one batch) an entry ``("group", g)`` over its rows, destination by destination."""
        L, cp, rank = plan.local_len, plan.cp, plan.rank
        counts = plan.exchange.counts[rank].tolist()

        def entry(part):
            return _returned(part, merges, slot_of, L, device)

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


def _returned(part: np.ndarray, merges: MergePlan, slot_of: np.ndarray, L: int, device):
    """``KeyReturns``' entry for a gradient coming back for our rows ``part`` (host local rows, in the order
    it comes; ``slot_of``: a row's buffer slot): (added, merged), each None when empty; merged is (None,
    ``RowSums``) where a slot repeats (rows several ranks send back at once)."""
    def on_device(index, size):
        return device_rows(torch.from_numpy(index), size, device)

    merged = merges.merged_mask[part]
    added, buffered = np.flatnonzero(~merged), np.flatnonzero(merged)
    n = part.size
    slots = slot_of[part[buffered]]
    sums = RowSums.of(buffered, slots, device)
    return ((on_device(added, n), on_device(part[added], L)) if added.size else None,
            ((None, sums) if sums is not None else
             (on_device(buffered, n), on_device(slots, merges.merged_count))) if buffered.size else None)


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


def _every_rank_sends_and_receives(received: np.ndarray, parts: int) -> np.ndarray:
    """[group] whether every rank sends rows and receives rows in that band group when every pair's rows
    (``received[source, destination]``, the global counts, so alike on every rank) are cut into ``parts``
    pieces: the batches an all-to-all can carry on every rank."""
    receives = _group_rows(received, parts)  # [group, destination]
    sends = _group_rows(received.T, parts)  # [group, source]: the same pieces, summed the other way
    return (receives > 0).all(1) & (sends > 0).all(1)


def _group_sends(plan, pieces: Pieces, g: int) -> Tuple[np.ndarray, Tuple[Tuple[int, int, int, int], ...]]:
    """Band group g's sends from this rank: the local rows, destination by destination in rank order (as
    an all-to-all sends them), and (round, destination, first, rows) of each among them."""
    rank, cp = plan.rank, plan.cp
    rows, sends, first = [], [], 0
    for dst in range(cp):
        if dst == rank:
            continue
        index = plan.exchange.send_index[dst].numpy()
        lo, n = pieces.span(index.size, g)
        if n:
            rows.append(index[lo:lo + n])
            sends.append(((dst - rank) % cp, dst, first, n))
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
