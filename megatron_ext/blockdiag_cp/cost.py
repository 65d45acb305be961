"""A one-layer attention cost model: the busiest rank's compute plus its K/V traffic.

    modeled = max over ranks r of  work[r] * seconds_per_pair + needed[r] * seconds_per_position
    ideal   = total work / cp * seconds_per_pair        (perfect balance, free exchange)

``work`` counts causal query-key pairs (forward 4*Hq*D flops each, backward 2.5x:
14*Hq*D in all); ``needed`` counts the K/V positions a rank receives (K and V
forward, their gradients backward: 2 * 2*Hkv*D*bytes each). The exchange is not
overlapped with compute, so the model is an upper bound on what overlap can
win back. It is a ranking device for layouts, not a prediction of seconds.

Presets: H200 bf16 attention at 500e12 FLOP/s effective; NVLink 400e9 B/s per
GPU inside a node; InfiniBand 400 Gb/s = 50e9 B/s per GPU across nodes. The
default dims (32 query heads, 8 K/V heads, head dim 128, bf16: a Llama-3-8B
layer) stand in when no model config is at hand.
"""

from dataclasses import dataclass
from typing import Optional

import torch

H200_BF16_ATTENTION_FLOPS = 500e12
LINK_BYTES_PER_SECOND = {"nvlink": 400e9, "ib": 50e9}
DEFAULT_DIMS = {"heads": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}


def normalize_link(link: str) -> str:
    cleaned = str(link).strip().lower().replace("-", "").replace("_", "")
    aliases = {"nvlink": "nvlink", "nvl": "nvlink", "ib": "ib", "infiniband": "ib"}
    if cleaned not in aliases:
        raise ValueError(f"unknown link {link!r}; use 'nvlink' (one node) or 'ib' (across nodes)")
    return aliases[cleaned]


@dataclass(frozen=True)
class CostModel:
    seconds_per_pair: float  # one causal query-key pair, forward + backward
    seconds_per_position: float  # one K/V position received, forward + backward
    name: str = "custom"

    def __post_init__(self):
        if not (self.seconds_per_pair > 0 and self.seconds_per_position >= 0):
            raise ValueError(f"CostModel needs seconds_per_pair > 0 and seconds_per_position >= 0, "
                             f"got {self.seconds_per_pair!r}, {self.seconds_per_position!r}")

    @classmethod
    def preset(cls, link: str = "nvlink", heads: int = DEFAULT_DIMS["heads"],
               kv_heads: int = DEFAULT_DIMS["kv_heads"], head_dim: int = DEFAULT_DIMS["head_dim"],
               dtype_bytes: int = DEFAULT_DIMS["dtype_bytes"],
               flops: float = H200_BF16_ATTENTION_FLOPS) -> "CostModel":
        """H200 attention with the given model dims over NVLink or InfiniBand."""
        link = normalize_link(link)
        for name, value in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim),
                            ("dtype_bytes", dtype_bytes)):
            if int(value) <= 0:
                raise ValueError(f"CostModel.preset: {name} must be positive, got {value!r}")
        pair = 14 * heads * head_dim / flops
        position = 2 * (2 * kv_heads * head_dim * dtype_bytes) / LINK_BYTES_PER_SECOND[link]
        return cls(pair, position, name=f"{link}:hq{heads}/hkv{kv_heads}/d{head_dim}")

    @classmethod
    def from_config(cls, config, link: str = "nvlink") -> "CostModel":
        """From a megatron TransformerConfig (num_attention_heads, num_query_groups, kv_channels)."""
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_query_groups", None) or heads)
        head_dim = int(getattr(config, "kv_channels", None) or config.hidden_size // heads)
        dtype_bytes = 2 if (getattr(config, "bf16", False) or getattr(config, "fp16", False)) else 4
        return cls.preset(link, heads, kv_heads, head_dim, dtype_bytes)

    @property
    def positions_per_pair(self) -> float:
        """How many query-key pairs one received K/V position costs."""
        return self.seconds_per_position / self.seconds_per_pair

    def modeled_seconds(self, work: torch.Tensor, needed: torch.Tensor) -> float:
        return float((work.double() * self.seconds_per_pair + needed.double() * self.seconds_per_position).max())

    def ideal_seconds(self, work: torch.Tensor) -> float:
        return float(work.double().sum()) / work.numel() * self.seconds_per_pair


def default_cost_model(cp_group=None, config=None) -> CostModel:
    """NVLink when the CP group sits on one node, InfiniBand when it spans nodes.

    Without a process group (planning ahead, tests) the group is taken to sit on one node.
    """
    link = "nvlink"
    try:
        from .. import parallel_state as ps

        group = ps.get_cp_group() if cp_group is None else cp_group
        if group is not None and ps.group_size(group) > 1 and ps.cp_spans_nodes(group):
            link = "ib"
    except Exception:  # noqa: BLE001 - no distributed context: one node
        link = "nvlink"
    return CostModel.from_config(config, link) if config is not None else CostModel.preset(link)


def resolve_cost_model(cost_model: Optional[object]) -> CostModel:
    """None -> the default; a CostModel as is; 'nvlink' / 'ib' -> that preset."""
    if cost_model is None:
        return default_cost_model()
    if isinstance(cost_model, CostModel):
        return cost_model
    if isinstance(cost_model, str):
        return CostModel.preset(cost_model)
    raise ValueError(f"cost_model must be a CostModel, 'nvlink', 'ib' or None; got {cost_model!r}")


__all__ = ["CostModel", "default_cost_model", "resolve_cost_model", "normalize_link",
           "H200_BF16_ATTENTION_FLOPS", "LINK_BYTES_PER_SECOND", "DEFAULT_DIMS"]
