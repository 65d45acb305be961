"""Planner for users before they launch: what each layout and exchange costs on their data.

    python -m megatron_ext.plan --data-path PREFIX --seq-length S --cp N [--link nvlink|ib]
        [--heads 32 --kv-heads 8 --head-dim 128] [--samples 8] [--png plan.png]

Samples ``--samples`` sequences of ``--seq-length`` tokens from a megatron indexed
dataset (``PREFIX.bin`` / ``PREFIX.idx``), documents split at the EOD token as
training packs them (megatron_ext.training.data's byte tokenizer: EOD = 256, or
``--eod``), runs ``plan_summary`` for every layout (the exact layout + plan code
of one rank) and prints per layout x exchange the K/V bytes the busiest rank
receives per layer, work max/mean, the modeled attention time over the ideal
and the lower bound, and the host plan time; writes a PNG of modeled / ideal.
"""

import argparse
import os
import sys

LAYOUTS = ("contiguous", "zigzag", "balanced")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m megatron_ext.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", required=True, help="indexed dataset prefix (PREFIX.bin, PREFIX.idx)")
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--cp", type=int, required=True)
    p.add_argument("--link", default="nvlink", help="nvlink (CP group on one node) or ib (across nodes)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--eod", type=int, default=256, help="end-of-document token id (default: 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", default="plan.png")
    args = p.parse_args(argv)
    for name in ("seq_length", "cp", "samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for ext in (".bin", ".idx"):
        if not os.path.exists(args.data_path + ext):
            p.error(f"--data-path {args.data_path!r}: {args.data_path + ext} does not exist "
                    "(pass the prefix without .bin/.idx)")
    return args


def sample_sequences(prefix: str, seq_length: int, samples: int, seed: int):
    """``samples`` windows of ``seq_length`` tokens from the concatenated token stream."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    sizes = np.asarray(ds.sequence_lengths, dtype=np.int64)
    total = int(sizes.sum())
    if total < seq_length:
        raise SystemExit(f"the dataset has {total} tokens, fewer than --seq-length {seq_length}")
    rng = np.random.default_rng(seed)
    cum = np.concatenate([[0], np.cumsum(sizes)])
    for start in rng.integers(0, total - seq_length + 1, size=samples):
        doc = int(np.searchsorted(cum, start, side="right") - 1)
        out, need, offset = [], seq_length, int(start - cum[doc])
        while need > 0:
            piece = ds.get(doc % len(sizes), offset=offset, length=min(need, int(sizes[doc % len(sizes)]) - offset))
            out.append(np.asarray(piece, dtype=np.int64))
            need -= len(piece)
            doc, offset = doc + 1, 0
        yield np.concatenate(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    from megatron_ext.blockdiag_cp import doc_ids_from_eod, plan_summary
    from megatron_ext.blockdiag_cp.cost import CostModel

    cost = CostModel.preset(args.link, args.heads, args.kv_heads, args.head_dim, args.dtype_bytes)
    row_bytes = 2 * args.kv_heads * args.head_dim * args.dtype_bytes  # K and V of one position
    results = {(l, x): [] for l in LAYOUTS for x in ("a2a", "allgather")}
    for tokens in tqdm(sample_sequences(args.data_path, args.seq_length, args.samples, args.seed),
                       total=args.samples, desc="planning", disable=args.samples < 4, file=sys.stderr):
        ids = doc_ids_from_eod(torch.from_numpy(tokens).unsqueeze(0), args.eod)[0]
        for layout in LAYOUTS:
            s = plan_summary(ids, args.cp, layout=layout, cost_model=cost)
            for exchange, key in (("a2a", "needed_positions_per_rank"), ("allgather", "allgather_positions_per_rank")):
                work = torch.tensor(s["work_per_rank"], dtype=torch.float64)
                need = torch.tensor(s[key])
                modeled = cost.modeled_seconds(work, need)
                results[(layout, exchange)].append({
                    "bytes": int(need.max()) * row_bytes, "balance": s["work_max_over_mean"],
                    "modeled": modeled, "over_ideal": modeled / s["ideal_seconds"],
                    "over_bound": modeled / s["lower_bound_seconds"], "plan_ms": 1e3 * s["plan_seconds"]})

    print(f"S={args.seq_length} cp={args.cp} link={args.link} heads={args.heads}/{args.kv_heads} "
          f"head_dim={args.head_dim}; {args.samples} samples from {args.data_path}; means over samples, "
          "per attention layer, forward")
    print(f"{'layout':<11} {'exchange':<10} {'K/V MiB max':>11} {'work max/mean':>13} {'modeled ms':>10} "
          f"{'/ideal':>7} {'/bound':>7} {'plan ms':>8}")
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    for (layout, exchange), rs in results.items():
        print(f"{layout:<11} {exchange:<10} {mean(rs, 'bytes') / 2**20:>11.2f} {mean(rs, 'balance'):>13.3f} "
              f"{1e3 * mean(rs, 'modeled'):>10.3f} {mean(rs, 'over_ideal'):>7.2f} {mean(rs, 'over_bound'):>7.2f} "
              f"{mean(rs, 'plan_ms'):>8.1f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = [f"{l}\n{x}" for l, x in results]
    ax.bar(range(len(labels)), [mean(rs, "over_ideal") for rs in results.values()])
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("modeled / ideal")
    ax.set_title(f"S={args.seq_length}, cp={args.cp}, {args.link}")
    fig.tight_layout()
    fig.savefig(args.png, dpi=100)
    plt.close(fig)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
