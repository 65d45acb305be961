"""window suite: plan-only, no processes. What a sliding window saves in K/V moved and work.

For one 128k-token pack at cp = 8 (and 32k / 64k), with and without a 4k sliding window
(and 1k, 16k), every layout: the busiest rank's K/V rows received per layer by the
needed-only exchanges (a2a = halo = the windowed lower bound: exactly the keys some
query's window reaches on another rank) against the all-gather ring ((cp - 1) x
local), in bytes at Llama-3-8B's K/V (8 heads x 128 x 2 (K and V) x 2 bytes = 4 KiB a
row), and the attention pairs (work) per rank, max over mean.

Mixes: ``short`` (64-1024 tokens), ``long`` (documents of 32k-128k tokens), ``single``
(one document the length of the pack). TransformerEngine's CP takes sliding windows
only with the all-gather / a2a exchanges and still moves every key; ring-flash-attn has
no window.
"""

from typing import Dict, List

import torch

ROW_BYTES = 8 * 128 * 2 * 2  # Llama-3-8B: 8 K/V heads, head dim 128, K and V, bf16
LAYOUTS = ("contiguous", "zigzag", "balanced")
WINDOWS = (None, 1024, 4096, 16384)
POINTS = ((32768, 8), (65536, 8), (131072, 8))


def long_doc_ids(S: int, seed: int = 0) -> torch.Tensor:
    """Documents of 32k-128k tokens (the last one cut to fill S), deterministic."""
    g = torch.Generator().manual_seed(seed + 7)
    lengths, n = [], 0
    while n < S:
        length = min(int(torch.randint(32768, 131073, (1,), generator=g)), S - n)
        lengths.append(length)
        n += length
    return torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))


def doc_ids(mix: str, S: int) -> torch.Tensor:
    from megatron_ext.testing.mixes import make_doc_ids

    return long_doc_ids(S) if mix == "long" else make_doc_ids(mix, S)


def run(points=POINTS, windows=WINDOWS, mixes=("short", "long", "single"), log=print) -> List[Dict]:
    import megatron_ext.blockdiag_cp as bdcp

    torch.set_num_threads(1)
    rows = []
    for S, cp in points:
        for mix in mixes:
            ids = doc_ids(mix, S)
            for layout in LAYOUTS:
                for window in windows:
                    s = bdcp.plan_summary(ids, cp, layout=layout, window=window)
                    needed = s["needed_positions_per_rank"]
                    work = torch.tensor(s["work_per_rank"], dtype=torch.float64)
                    allgather = s["allgather_positions_per_rank"][0]
                    rows.append({
                        "suite": "window", "mix": mix, "S": S, "cp": cp, "layout": layout, "window": window,
                        "exchange": "a2a", "backend": "-",
                        "needed_rows_max": max(needed), "needed_rows_per_rank": needed,
                        "allgather_rows": allgather, "row_bytes": ROW_BYTES,
                        "needed_bytes_max": max(needed) * ROW_BYTES, "allgather_bytes": allgather * ROW_BYTES,
                        "pairs_total": int(work.sum()), "work_max_over_mean": s["work_max_over_mean"],
                        "plan_seconds": s["plan_seconds"]})
            log(f"  window {mix} S={S} cp={cp}: " + ", ".join(
                f"{r['layout']}/{r['window']}: {r['needed_bytes_max'] / 2**20:.0f} MiB"
                for r in rows[-len(LAYOUTS) * len(windows):]))
    return rows
