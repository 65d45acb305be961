"""Planner for users before they launch: what each layout and exchange costs on their data.

    python -m megatron_ext.plan --data-path PREFIX --seq-length S --cp N
        [--nodes M | --gpus-per-node G] [--link nvlink|ib] [--flat]
        [--heads 32 --kv-heads 8 --head-dim 128] [--samples 8] [--plot plan.png]

Samples ``--samples`` sequences of ``--seq-length`` tokens from a megatron indexed
dataset (``PREFIX.bin`` / ``PREFIX.idx``; several prefixes, or the pretrain script's
blend ``W1 PREFIX1 W2 PREFIX2 ...``, each sample's dataset drawn by weight, or by
token count without weights), documents split at the EOD token as
training packs them (megatron_ext.training.data's byte tokenizer: EOD = 256, or
``--eod``), runs ``plan_summary`` for every layout (the exact layout + plan code
of one rank) and prints per layout x exchange the K/V bytes the busiest rank
receives per layer (and of them, across nodes), work max/mean, the modeled
attention time over the ideal and the lower bound, the same with the exchange
streamed behind compute (``CostModel.overlapped``, refetch in backward) and its
exposed share, and the host plan time; with ``--plot PATH``, a PNG of modeled / ideal.
A second table sets the exchanges side by side on the ``balanced`` layout, 1-D (allgather, a2a,
halo, hierarchical, ulysses) and two-dimensional CP (ulysses over u ranks inside a node, a2a or
hierarchical between the cp / u groups; ``cost_options.price_exchange_options``): the busiest
rank's forward bytes (larger of sent and received; of them across nodes), modeled ms and over the
ideal, streamed over the ideal, or why an option is refused.

Refused before any work: a ``--cp`` above ``--seq-length`` (a rank would own no
token), and a ``--cp`` whose plan tables (``[cp, cp]``, up to about 768 bytes per pair
of ranks at the peak) would not fit in the memory this machine has available.

Topology: the CP group spans ``--nodes`` nodes of ``--gpus-per-node`` CP ranks
(give either; the other follows from ``--cp``): more than one node prices
NVLink inside a node and InfiniBand between nodes, with the hierarchical
exchange (a node's remote keys cross IB once; ``--flat``: every rank fetches
its own). One node, or neither flag: ``--link`` for the whole group.
"""

import argparse
import os
import sys

from megatron_ext.training import data
from megatron_ext.training.arguments import add_data_path_argument

LAYOUTS = ("contiguous", "zigzag", "balanced")
# Peak bytes of one plan_summary per pair of CP ranks: its [cp, cp] tables dominate once cp is in
# the hundreds (measured: the peak resident set grew 300-580 bytes per pair at cp 512 / 1024 / 2048,
# every layout, 552 at cp 1024 of a 65536-token sequence; rounded up with a margin).
PLAN_BYTES_PER_RANK_PAIR = 768


def available_memory_bytes():
    """MemAvailable from /proc/meminfo (Linux), else physical memory; None when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: float) -> str:
    return f"{n / 2**40:.1f} TiB" if n >= 2**40 else f"{n / 2**30:.1f} GiB"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m megatron_ext.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_path_argument(p, required=True)  # the pretrain script's flag, blends included
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--cp", type=int, required=True)
    p.add_argument("--nodes", type=int, default=None, help="nodes the CP group spans (two levels when > 1)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="CP ranks per node (default: cp / --nodes); fewer than --cp: two levels")
    p.add_argument("--flat", action="store_true",
                   help="two levels without the hierarchical exchange: every rank fetches its own keys")
    p.add_argument("--link", default="nvlink",
                   help="one level: nvlink (CP group on one node) or ib (every pair over InfiniBand)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--eod", type=int, default=256, help="end-of-document token id (default: 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", "--png", dest="plot", default=None, metavar="PATH",
                   help="also write a PNG of modeled / ideal per layout and exchange to PATH")
    args = p.parse_args(argv)
    for name in ("seq_length", "cp", "samples", "nodes", "gpus_per_node"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.cp > args.seq_length:
        p.error(f"--cp {args.cp} exceeds --seq-length {args.seq_length}: every CP rank must own at least "
                f"one token of the sequence; plan a --cp of at most {args.seq_length}, or a longer --seq-length")
    need, have = PLAN_BYTES_PER_RANK_PAIR * args.cp ** 2, available_memory_bytes()
    if have is not None and need > have:
        fits = int((have / PLAN_BYTES_PER_RANK_PAIR) ** 0.5)
        p.error(f"--cp {args.cp}: planning would need about {_gib(need)} (the plan's [cp, cp] tables, "
                f"~{PLAN_BYTES_PER_RANK_PAIR} bytes per pair of ranks), more than the {_gib(have)} this machine "
                f"has available; plan a --cp of at most about {fits}")
    if args.nodes is not None and args.gpus_per_node is not None and args.nodes * args.gpus_per_node != args.cp:
        p.error(f"--nodes {args.nodes} x --gpus-per-node {args.gpus_per_node} != --cp {args.cp}; give one of "
                "them or make them multiply to --cp")
    if args.nodes is not None and args.gpus_per_node is None:
        if args.cp % args.nodes:
            p.error(f"--cp {args.cp} does not split into --nodes {args.nodes} equal nodes")
        args.gpus_per_node = args.cp // args.nodes
    if args.gpus_per_node is not None and args.gpus_per_node < args.cp and args.cp % args.gpus_per_node:
        p.error(f"--cp {args.cp} does not split into nodes of --gpus-per-node {args.gpus_per_node}")
    try:  # the pretrain script's reading of --data-path and its check of each dataset on disk
        prefixes, args.data_weights = data.parse_data_path(args.data_path)
        args.data_prefixes = [data.strip_prefix(prefix) for prefix in prefixes]
        for prefix in args.data_prefixes:
            data.validate_indexed_dataset(prefix)
    except data.DataPathError as exc:
        p.error(str(exc))
    return args


def sample_sequences(prefixes, seq_length: int, samples: int, seed: int, weights=None):
    """``samples`` windows of ``seq_length`` tokens, each from one dataset's concatenated token stream.

    ``prefixes``: one prefix or a list; several are blended like megatron's BlendedDataset mixes
    samples: each sample's dataset drawn by ``weights`` (None: by token count).
    """
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefixes = [prefixes] if isinstance(prefixes, str) else list(prefixes)
    datasets = [IndexedDataset(prefix) for prefix in prefixes]
    sizes = [np.asarray(ds.sequence_lengths, dtype=np.int64) for ds in datasets]
    totals = [int(s.sum()) for s in sizes]
    for prefix, total in zip(prefixes, totals):
        if total < seq_length:
            raise SystemExit(f"the dataset {prefix} has {total} tokens, fewer than --seq-length {seq_length}")
    share = np.asarray(weights if weights else totals, dtype=np.float64)
    rng = np.random.default_rng(seed)
    which = rng.choice(len(datasets), size=samples, p=share / share.sum()) if len(datasets) > 1 \
        else np.zeros(samples, dtype=np.int64)
    for d in which:
        ds, sizes_d, total = datasets[d], sizes[d], totals[d]
        cum = np.concatenate([[0], np.cumsum(sizes_d)])
        start = rng.integers(0, total - seq_length + 1)
        doc = int(np.searchsorted(cum, start, side="right") - 1)
        out, need, offset = [], seq_length, int(start - cum[doc])
        while need > 0:
            piece = ds.get(doc % len(sizes_d), offset=offset,
                           length=min(need, int(sizes_d[doc % len(sizes_d)]) - offset))
            out.append(np.asarray(piece, dtype=np.int64))
            need -= len(piece)
            doc, offset = doc + 1, 0
        yield np.concatenate(out)


def cost_model_for(args):
    """Two levels when the group spans nodes (--nodes > 1 or --gpus-per-node < --cp), else --link."""
    from megatron_ext.blockdiag_cp.cost import CostModel

    dims = (args.heads, args.kv_heads, args.head_dim, args.dtype_bytes)
    if args.gpus_per_node is not None and args.gpus_per_node < args.cp:
        return CostModel.two_level(args.gpus_per_node, *dims, hierarchical=not args.flat)
    return CostModel.preset(args.link, *dims)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    from megatron_ext.blockdiag_cp import doc_ids_from_eod, plan_summary
    from megatron_ext.blockdiag_cp.cost_options import price_exchange_options

    cost = cost_model_for(args)
    dims = (args.heads, args.kv_heads, args.head_dim, args.dtype_bytes)
    two_level = cost.spans_nodes(args.cp)
    needed = "hier" if two_level and cost.hierarchical else "a2a"
    row_bytes = 2 * args.kv_heads * args.head_dim * args.dtype_bytes  # K and V of one position
    results = {(l, x): [] for l in LAYOUTS for x in (needed, "allgather")}
    options = {}  # option name -> [ExchangeOption per sample]
    warm = True  # the first plan of a process pays one-time costs (lazy inits): plan once untimed
    for tokens in tqdm(sample_sequences(args.data_prefixes, args.seq_length, args.samples, args.seed,
                                        args.data_weights),
                       total=args.samples, desc="planning", disable=args.samples < 4, file=sys.stderr):
        ids = doc_ids_from_eod(torch.from_numpy(tokens).unsqueeze(0), args.eod)[0]
        if warm:
            for layout in LAYOUTS:
                plan_summary(ids, args.cp, layout=layout, cost_model=cost)
            warm = False
        for layout in LAYOUTS:
            s = plan_summary(ids, args.cp, layout=layout, cost_model=cost)
            for exchange, traffic, modeled, overlap, exposed in (
                    (needed, s["traffic"], s["modeled_seconds"], s["overlap_seconds"], s["exposed_share"]),
                    ("allgather", s["traffic_allgather"], s["modeled_allgather_seconds"],
                     s["overlap_allgather_seconds"], s["exposed_allgather_share"])):
                received = traffic.intra_in + traffic.inter_in
                results[(layout, exchange)].append({
                    "bytes": int(received.max()) * row_bytes, "inter_bytes": int(traffic.inter_in.max()) * row_bytes,
                    "balance": s["work_max_over_mean"], "modeled": modeled,
                    "over_ideal": modeled / s["ideal_seconds"], "over_bound": modeled / s["lower_bound_seconds"],
                    "overlap_over_ideal": overlap / s["ideal_seconds"], "exposed": exposed,
                    "plan_ms": 1e3 * s["plan_seconds"]})
        for o in price_exchange_options(ids, args.cp, "balanced", dims, args.gpus_per_node, args.link):
            options.setdefault(o.name, []).append(o)

    topology = (f"{cost.nodes(args.cp)} nodes x {cost.ranks_per_node} (NVLink inside, IB between"
                f"{', hierarchical' if cost.hierarchical else ', flat'})" if two_level else f"link={args.link}")
    print(f"S={args.seq_length} cp={args.cp} {topology} heads={args.heads}/{args.kv_heads} "
          f"head_dim={args.head_dim}; {args.samples} samples from {' '.join(args.data_path)}; means over samples, "
          "per attention layer; K/V received in forward (IB: of it, across nodes)")
    print(f"{'layout':<11} {'exchange':<10} {'K/V MiB max':>11} {'IB MiB max':>10} {'work max/mean':>13} "
          f"{'modeled ms':>10} {'/ideal':>7} {'/bound':>7} {'overlap/ideal':>13} {'exposed':>8} {'plan ms':>8}")
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    for (layout, exchange), rs in results.items():
        print(f"{layout:<11} {exchange:<10} {mean(rs, 'bytes') / 2**20:>11.2f} {mean(rs, 'inter_bytes') / 2**20:>10.2f} "
              f"{mean(rs, 'balance'):>13.3f} {1e3 * mean(rs, 'modeled'):>10.3f} {mean(rs, 'over_ideal'):>7.2f} "
              f"{mean(rs, 'over_bound'):>7.2f} {mean(rs, 'overlap_over_ideal'):>13.2f} "
              f"{100 * mean(rs, 'exposed'):>7.0f}% {mean(rs, 'plan_ms'):>8.1f}")
    print_options(options)
    if args.plot:
        write_plot(args.plot, results, args, cost)
    return 0


def print_options(options) -> None:
    """The 1-D and 2-D exchanges side by side (balanced layout), means over the samples."""
    print("\nexchange options, balanced layout (2d uU x rR: ulysses over U ranks in a node, then the exchange "
          "between the R groups); modeled per layer (H200 500e12 FLOP/s, NVLink 400e9 B/s, IB 50e9 B/s), "
          "MiB forward, busiest rank, larger of sent and received")
    print(f"{'option':<26} {'MiB max':>9} {'IB MiB max':>10} {'modeled ms':>10} {'/ideal':>7} {'streamed/ideal':>14}  "
          "refused")
    for name, os_ in options.items():
        refused = next((o.refused for o in os_ if o.refused), "")
        if refused:
            print(f"{name:<26} {'-':>9} {'-':>10} {'-':>10} {'-':>7} {'-':>14}  {refused}")
            continue
        mean = lambda f: sum(f(o) for o in os_) / len(os_)  # noqa: E731
        print(f"{name:<26} {mean(lambda o: o.bytes_max) / 2**20:>9.2f} "
              f"{mean(lambda o: o.inter_node_bytes_max) / 2**20:>10.2f} {1e3 * mean(lambda o: o.modeled_seconds):>10.3f} "
              f"{mean(lambda o: o.modeled_over_ideal):>7.2f} "
              f"{mean(lambda o: o.overlap_seconds / o.ideal_seconds):>14.2f}")


def write_plot(path, results, args, cost) -> None:
    """A bar per layout x exchange: the mean over the samples of modeled / ideal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = [f"{l}\n{x}" for l, x in results]
    ax.bar(range(len(labels)), [sum(r["over_ideal"] for r in rs) / len(rs) for rs in results.values()])
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("modeled / ideal")
    ax.set_title(f"S={args.seq_length}, cp={args.cp}, {cost.name.split(':')[0]}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
