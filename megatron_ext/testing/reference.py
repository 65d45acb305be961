"""An independent single-process reference: dense per-document causal attention.

Builds the full [S, S] mask from document ids on global positions and runs plain
softmax attention in the input's dtype and on its device; shares no code with the
engine (megatron_ext.blockdiag_cp). The tests compare against it on CPU, the GPU
check in fp32 on the GPU.
"""

import itertools

import torch


def doc_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[R, S, S] bool: query i may attend key j (same non-zero document, j <= i)."""
    ids = doc_ids if doc_ids.dim() == 2 else doc_ids.unsqueeze(0)
    S = ids.shape[-1]
    # A document is a maximal run of equal ids: the same id in two runs is two documents.
    change = torch.ones_like(ids, dtype=torch.bool)
    change[:, 1:] = ids[:, 1:] != ids[:, :-1]
    run = torch.cumsum(change.long(), dim=-1)
    same = run.unsqueeze(-1) == run.unsqueeze(-2)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    return same & causal & (ids.unsqueeze(-1) > 0)


def reference_attention(q, k, v, doc_ids, scale=None, window=None, sink=None):
    """q: [S, b, Hq, Dqk], k: [S, b, Hkv, Dqk], v: [S, b, Hkv, Dv] -> [S, b, Hq, Dv]; padding rows give zeros.

    ``window``: query i sees keys j >= i - window only (Megatron's window_size (window, 0)).
    ``sink``: [Hq] logits appended to every row's softmax with no value (attention sinks,
    Megatron's softmax_offset): softmax over [scores, sink], the sink's column dropped.
    """
    S, b, hq, d = q.shape
    rep = hq // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scale = d ** -0.5 if scale is None else scale
    mask = doc_mask(doc_ids).to(q.device)  # [R, S, S]
    if window is not None:
        i = torch.arange(S, device=q.device)
        mask = mask & (i.unsqueeze(0) >= i.unsqueeze(1) - window)
    mask = mask.expand(b, S, S) if mask.shape[0] == 1 else mask
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    if sink is not None:
        column = sink.to(scores.dtype).view(1, hq, 1, 1).expand(b, hq, S, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # fully masked (padding) rows
    return torch.einsum("bhst,tbhd->sbhd", probs, v)


def runs_to_doc_ids(runs):
    """[(doc_id, length), ...] -> LongTensor [S]."""
    return torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in runs])


def ring_routes(read, local_len: int, chunk_rows: int):
    """How an all-gather ring that sends each piece only as far as its last reader routes the K/V, by plain
    loops (no engine code). ``read[s][dst]``: the local rows of source s that rank dst attends. A shard is cut
    into pieces of ``chunk_rows``; piece j of s carries its rows from the first some rank reads to the last
    (its span) and goes the same way for every source, to s + 1, s + 2 ... or to s - 1, s - 2 ..., as far as
    the farthest of its readers that way; of the choices, the one whose busiest rank sends or receives the
    fewest rows, then the fewest rows in all, then the fewest pieces reversed. -> {"reverse": per piece,
    "far": [s][j] in hops that way, "span": [s][j] (first row, last + 1) or (j c, j c) where none is read,
    "hops": per rank (sent, received), "rows": per rank (sent, received)}."""
    cp, pieces = len(read), -(-local_len // chunk_rows)
    attended = [[{dst for dst in range(cp) if dst != s and any(r // chunk_rows == j for r in read[s][dst])}
                 for j in range(pieces)] for s in range(cp)]
    span = [[(j * chunk_rows, j * chunk_rows) for j in range(pieces)] for _ in range(cp)]
    for s in range(cp):
        for j in range(pieces):
            mine = [r for dst in attended[s][j] for r in read[s][dst] if r // chunk_rows == j]
            if mine:
                span[s][j] = (min(mine), max(mine) + 1)

    def far(way, s, j):
        return max([h for h in range(1, cp) if (s + way * h) % cp in attended[s][j]], default=0)

    best = None
    for choice in itertools.product((False, True), repeat=pieces):
        sent, received = [0] * cp, [0] * cp
        hops = [[0, 0] for _ in range(cp)]
        for j, reverse in enumerate(choice):
            way = -1 if reverse else 1
            for s in range(cp):
                rows = span[s][j][1] - span[s][j][0]
                for h in range(1, far(way, s, j) + 1):  # hop h: from s + way (h - 1) to s + way h
                    frm, to = (s + way * (h - 1)) % cp, (s + way * h) % cp
                    sent[frm] += rows
                    received[to] += rows
                    hops[frm][0] += 1
                    hops[to][1] += 1
        score = (max(max(a, b) for a, b in zip(sent, received)), sum(received), sum(choice))
        if best is None or score < best[0]:
            far_table = [[far(-1 if choice[j] else 1, s, j) for j in range(pieces)] for s in range(cp)]
            best = (score, {"reverse": list(choice), "far": far_table, "span": span,
                            "hops": [tuple(x) for x in hops], "rows": list(zip(sent, received))})
    return best[1]
