"""A small Megatron-LM-style training package for scripts/pretrain_gpt.py.

Megatron-LM splits a pretraining run into an entry script that holds the providers
(model, dataset, batch, forward step, loss) and ``megatron/training`` that holds the
rest; this package is the second half, for CPU and GPU processes alike:

    arguments.py      Megatron's flag names, validation before any process group exists
    initialize.py     torchrun / srun rendezvous, process groups, workers that die with the launcher
    training.py       pretrain(): the loop, gradient reduction, megatron-core's LR scheduler
    checkpointing.py  atomic per-rank checkpoints read with torch.load(weights_only=True)
    logs.py           Megatron's iteration log line, the loss curve
    data.py           byte tokenizer, megatron indexed datasets, megatron-core's GPTDataset

Importing the package, ``arguments`` or ``data`` imports neither torch nor megatron,
so a bad flag is reported in well under a second.
"""

from .arguments import get_args

__all__ = ["get_args", "pretrain"]


def pretrain(*args, **kwargs):
    """See ``megatron_ext.training.training.pretrain`` (imported on first use: it needs torch)."""
    from .training import pretrain as _pretrain
    return _pretrain(*args, **kwargs)
