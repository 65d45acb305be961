"""The pretrain script's log lines (Megatron's iteration line format) and its loss curve.

The iteration line keeps Megatron-LM's ``training_log`` fields and spelling
(`` iteration N/ M | consumed samples: ... | lm loss: ...``) so log parsers written
for Megatron read it, followed by what the CP engine reports for the step.
"""

import json
import os

LOG_PREFIX = "[pretrain_gpt]"


def log(msg: str, ctx=None) -> None:
    """Rank 0 only when a context is given; one write per line so ranks never interleave."""
    if ctx is None or ctx.rank == 0:
        os.write(1, (msg.rstrip("\n") + "\n").encode())


def summarize_cp_reports(args, reports) -> str:
    """The engine's per-micro-batch reports (``state.report()``) as one log-line field."""
    r = reports[0]
    sent = sum(x.get("bytes_sent") or 0 for x in reports) * args.num_layers
    recv = sum(x.get("bytes_received") or 0 for x in reports) * args.num_layers
    work = max(float(x.get("work_max_over_mean") or 1.0) for x in reports)
    planned = [x for x in reports if x.get("plan_seconds") is not None]
    if planned:  # built one step ahead: its host time, and how much of it the step did not wait for
        seconds = sum(x["plan_seconds"] for x in planned)
        hidden = sum(x["plan_hidden_seconds"] for x in planned)
        plan = f"plan {seconds * 1000:.1f} ms ahead, {100 * hidden / max(seconds, 1e-12):.0f}% hidden"
    else:
        plan = "plan in line"
    layout, attended = r.get("layout"), r.get("attended_layout")
    shown = layout if attended in (None, layout) else f"{layout}->{attended}"  # relayout: where it attended
    return (f"cp: backend={r.get('attn_backend')} exchange={r.get('kv_exchange')} "
            f"layout={shown} | kv bytes/step (fwd, all layers): "
            f"sent {sent / 2**20:.2f} MiB recv {recv / 2**20:.2f} MiB | "
            f"attn work max/mean: {work:.3f} | {plan}")


def cp_resolution_line(report) -> str:
    """What the engine resolved the requested knobs to, and why (logged once per run)."""
    return (f"{LOG_PREFIX} cp attention: backend {report.get('attn_backend_requested')} -> "
            f"{report.get('attn_backend')} ({report.get('attn_backend_reason')}), exchange "
            f"{report.get('kv_exchange_requested')} -> {report.get('kv_exchange')} "
            f"({report.get('kv_exchange_reason')}), layout {report.get('layout')}"
            + ("" if report.get("relayout", "none") == "none" else
               f", relayout {report.get('relayout')} ({report.get('relayout_reason')})"))


def iteration_line(args, iteration, consumed, ms_per_iter, lr, loss, grad_norm, reports) -> str:
    tokens_per_s = args.global_batch_size * args.seq_length / (ms_per_iter / 1000)
    return (f" iteration {iteration:8d}/{args.train_iters:8d} | consumed samples: "
            f"{consumed:10d} | elapsed time per iteration (ms): {ms_per_iter:.1f} | "
            f"learning rate: {lr:.6E} | global batch size: {args.global_batch_size:5d} | "
            f"lm loss: {loss:.6E} | grad norm: {grad_norm:.3f} | "
            f"tokens/s: {tokens_per_s:.0f} | {summarize_cp_reports(args, reports)}")


def write_curve(out_dir: str, history, args) -> str:
    """losses.json (every iteration's loss) and, unless --no-plot, loss_curve.png; returns the PNG."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "losses.json"), "w") as f:
        json.dump({"iteration": [h[0] for h in history], "loss": [h[1] for h in history]}, f)
    if args.no_plot or not history:
        return ""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    its, losses = [h[0] for h in history], [h[1] for h in history]
    ax.plot(its, losses, lw=0.8, alpha=0.5, label="loss")
    k = max(1, min(20, len(losses) // 10))
    if k > 1:  # trailing moving average: the trend under the per-batch noise
        avg = [sum(losses[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1))
               for i in range(len(losses))]
        ax.plot(its, avg, lw=1.8, label=f"{k}-iteration mean")
    ax.legend()
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title(f"GPT {args.num_layers}L h{args.hidden_size} seq {args.seq_length}, "
                 f"TP{args.tensor_model_parallel_size} CP{args.context_parallel_size} "
                 f"DP{args.data_parallel_size}")
    ax.grid(alpha=0.3)
    path = os.path.join(out_dir, "loss_curve.png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
