"""megatron-ext: block-diagonal context-parallel attention for packed-document pretraining."""

__version__ = "0.1.0"
