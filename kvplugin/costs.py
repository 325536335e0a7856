"""What a step and a KV load would cost on a named GPU deployment (the engine's simulated time).

The reference engine's model writes small test pages so that a run fits two CPU cores; its
time is simulated. :class:`ModelCost` says how long the *deployment* would take: a step of
the model on its GPU, and moving the model's KV bytes (not the test pages') from a tier to
the GPU. A preset is chosen by name in the config (``engine.model_cost``); every figure is
a field, and where it comes from is in the preset's ``source``.

A step (chunked prefill and decodes batched together, as vLLM schedules them):

    max(weights_read_s, batch_tokens / tokens_per_s)      the linear layers: memory- or
                                                          compute-bound, whichever is longer
  + attention_pairs / attention_pairs_per_s               causal attention of the prefill
                                                          chunks (query x key pairs)
  + decode_context_tokens * kv_read_s_per_token           decodes reading their KV

A load of ``n`` tokens from tier t: ``latency_s[t] + n * kv_bytes_per_token /
min(bandwidth[t], host_link)``; loads share the host link one after another (each way has
its own: stores, device to host, do not delay loads).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

__all__ = ["PRESETS", "ModelCost", "TierLink", "WorkShape", "model_cost"]


class WorkShape(Protocol):
    """What a step's cost depends on, per request (``kvplugin.engine.model.Work``)."""

    @property
    def start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def decode(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class TierLink:
    """How fast a tier hands bytes to the host: its bandwidth and per-load latency."""

    bytes_per_s: float
    latency_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelCost:
    name: str
    description: str  # the deployment, for reports ("Llama-3.1-8B, 1x H100 80GB SXM")
    source: str  # where the figures come from
    kv_bytes_per_token: int
    weights_read_s: float  # one pass over the weights (a decode step's floor)
    tokens_per_s: float  # linear layers, compute-bound
    attention_pairs_per_s: float  # causal attention, query x key pairs
    kv_read_s_per_token: float  # a decode reading one context token's KV
    host_link_bytes_per_s: float  # host <-> GPU, each way
    tiers: Mapping[str, TierLink] = field(default_factory=dict)  # memory: the link alone

    def __post_init__(self) -> None:
        for name in ("weights_read_s", "tokens_per_s", "attention_pairs_per_s",
                     "kv_read_s_per_token", "host_link_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"model cost {self.name}: {name} must be positive")
        if self.kv_bytes_per_token < 1:
            raise ValueError(f"model cost {self.name}: kv_bytes_per_token must be positive")

    def step_s(self, work: Sequence[WorkShape]) -> float:
        """Simulated seconds of one step computing ``work``."""
        if not work:
            return 0.0
        tokens = sum(w.num_tokens for w in work)
        pairs = 0
        context = 0
        for w in work:
            if w.decode:
                context += w.start + w.num_tokens  # the KV it attends to, its own included
            else:
                pairs += _causal_pairs(w.start, w.num_tokens)
        return (max(self.weights_read_s, tokens / self.tokens_per_s)
                + pairs / self.attention_pairs_per_s + context * self.kv_read_s_per_token)

    def load_s(self, tokens_by_tier: Mapping[str, int]) -> float:
        """Simulated seconds to bring these tokens' KV from the tiers to the GPU."""
        total = 0.0
        for tier, tokens in tokens_by_tier.items():
            if tokens <= 0:
                continue
            link = self.tiers.get(tier)
            bw = self.host_link_bytes_per_s
            latency = 0.0
            if link is not None:
                bw = min(bw, link.bytes_per_s)
                latency = link.latency_s
            total += latency + tokens * self.kv_bytes_per_token / bw
        return total

    def recompute_s(self, start: int, num_tokens: int) -> float:
        """The compute a load of tokens ``[start, start + num_tokens)`` saves: their linear
        layers and their attention (the weight pass is the step's, shared with the batch)."""
        return (num_tokens / self.tokens_per_s
                + _causal_pairs(start, num_tokens) / self.attention_pairs_per_s)

    def tier_s_per_token(self, tier: str) -> float:
        """Seconds per token of a load's bytes from ``tier`` (link and tier bandwidth)."""
        link = self.tiers.get(tier)
        bw = self.host_link_bytes_per_s if link is None else min(
            self.host_link_bytes_per_s, link.bytes_per_s)
        return self.kv_bytes_per_token / bw

    def prefill_s(self, num_tokens: int, start: int = 0, chunk: int = 2048) -> float:
        """Computing ``num_tokens`` from ``start`` alone, in chunks of ``chunk`` (what a
        load of those tokens saves)."""
        out = 0.0
        pos = start
        end = start + num_tokens
        while pos < end:
            n = min(chunk, end - pos)
            out += self.step_s([_Chunk(pos, n)])
            pos += n
        return out


def _causal_pairs(start: int, num_tokens: int) -> int:
    """Query x key pairs of tokens ``[start, start + n)``: token i attends to i + 1 keys."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True, slots=True)
class _Chunk:
    start: int
    num_tokens: int
    decode: bool = False


# Llama-3.1-8B (32 layers, 8 KV heads of 128, 32 query heads, bf16) on one H100 80 GB SXM:
# KV 32 x 8 x 128 x 2 (K, V) x 2 bytes = 128 KiB per token; weights 16 GB at 3.35 TB/s
# (HBM3) = 4.8 ms per pass; linear layers 2 x 8e9 FLOP per token at ~50 % of 989 TFLOP/s
# dense bf16 = ~30k tokens/s; attention 4 x 32 x 32 x 128 = 0.52 MFLOP per query-key pair
# at ~400 TFLOP/s effective (FlashAttention) = 7.6e8 pairs/s; a decode reads 128 KiB of KV
# per context token at 3.35 TB/s = 39 ns; host link PCIe Gen5 x16, ~20 GB/s each way in
# practice. Tiers: NVMe Gen4 ~6 GB/s, 100 us; Redis over 25 GbE ~2.5 GB/s, 0.5 ms.
# Check: decode at batch 1 ~4.9 ms, at batch 100 with 1k-token contexts ~8.7 ms; prefill
# of 20k tokens ~0.93 s (LMCache and vLLM report 0.5-1.5 s TTFT for 8B at this length).
LLAMA_31_8B_H100 = ModelCost(
    name="llama-3.1-8b-h100",
    description="Llama-3.1-8B, bf16, on one H100 80GB SXM (PCIe Gen5 host link)",
    source="H100 SXM datasheet (989 TFLOP/s dense bf16, 3.35 TB/s HBM3), Llama-3.1-8B "
           "config (32 layers, 8 KV heads x 128), PCIe Gen5 x16 ~20 GB/s each way; see "
           "kvplugin/costs.py",
    kv_bytes_per_token=32 * 8 * 128 * 2 * 2,
    weights_read_s=16.06e9 / 3.35e12,
    tokens_per_s=30_000.0,
    attention_pairs_per_s=7.6e8,
    kv_read_s_per_token=32 * 8 * 128 * 2 * 2 / 3.35e12,
    host_link_bytes_per_s=20e9,
    tiers={"disk": TierLink(6e9, 100e-6), "redis": TierLink(2.5e9, 0.5e-3)},
)

PRESETS: dict[str, ModelCost] = {LLAMA_31_8B_H100.name: LLAMA_31_8B_H100}


def model_cost(name: str, links: Mapping[str, TierLink] | None = None) -> ModelCost:
    """The preset ``name``, its tiers' figures replaced by ``links`` where given."""
    try:
        cost = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model cost {name!r}; known: {sorted(PRESETS)}") from None
    if not links:
        return cost
    return replace(cost, tiers={**cost.tiers, **links})
