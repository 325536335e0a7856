"""``kvplugin run``'s config: the library's deployment config
(:class:`~kvplugin.config.KVPluginConfig`) with its ``workload`` section validated as the
reference engine's traffic.

The library keeps that section as given (an engine loading the plugin has traffic of its
own); :class:`RunConfig` is the schema ``kvplugin run``, ``kvplugin validate-config``, the
engine and the core-only simulation load with (``load_config(path, schema=RunConfig)``):
the same strictness, and the same errors (file, key path, reason), for every key.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvplugin.config import KVPluginConfig

__all__ = ["RunConfig", "WorkloadConfig"]


class WorkloadConfig(BaseModel):
    """The reference engine's traffic (``kvplugin run``) and the core-only simulation's.
    Ranges are ``[lo, hi]`` in tokens (or ms). ``kvplugin run`` and ``validate-config`` check
    this section; ``load_plugin`` keeps it as given, unread (an engine has its own traffic)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_requests: int = Field(default=48, ge=1, description="requests to serve")
    num_system_prompts: int = Field(default=3, ge=1, description="distinct system prompts")
    system_prompt_len: tuple[int, int] = Field(default=(32, 256),
                                               description="system prompt length range")
    user_len: tuple[int, int] = Field(default=(8, 160), description="user message length range")
    output_len: tuple[int, int] = Field(default=(1, 48), description="answer length range")
    follow_up_prob: float = Field(default=0.35, ge=0, le=1, description="share of follow-ups "
                                  "(resending the conversation so far plus a new message)")
    resend_prob: float = Field(default=0.1, ge=0, le=1,
                               description="share of exact resends of an earlier prompt")
    salt_prob: float = Field(default=0.1, ge=0, le=1,
                             description="share of requests with a user cache salt")
    lora_prob: float = Field(default=0.1, ge=0, le=1,
                             description="share of requests with a LoRA adapter")
    arrivals_per_step: float = Field(default=1.5, gt=0,
                                     description="arrivals per step (core-only simulation)")
    vocab: int = Field(default=32000, ge=2, description="vocabulary size")
    seed: int = Field(default=0, description="the workload's seed: a run repeats exactly")
    # The engine's workload (kvplugin.engine.workload): tenants share the system prompts'
    # tokens (the tiers must still keep them apart), ask about their own documents, and
    # arrive in real time; a follow-up comes a think time after its parent's answer.
    num_tenants: int = Field(default=3, ge=1, description="tenants (tenant0, tenant1, ...); "
                             "with tenants.declared: their number, which is the default")
    num_documents: int = Field(default=2, ge=1, description="documents per tenant")
    document_len: tuple[int, int] = Field(default=(256, 768),
                                          description="document length range")
    doc_qa_prob: float = Field(default=0.25, ge=0, le=1,
                               description="share of questions about a tenant's document")
    # Below the default deployment's capacity (~90 requests/s of simulated time): an open
    # loop above it queues without bound, and a longer run then only waits longer (its TTFT
    # and its memory grow with the number of requests).
    requests_per_s: float = Field(default=50.0, gt=0,
                                  description="Poisson arrival rate (engine)")
    think_time_ms: tuple[int, int] = Field(default=(0, 20), description="delay range between "
                                           "an answer and its follow-up, ms")

    @model_validator(mode="after")
    def _ranges(self) -> WorkloadConfig:
        lo, hi = self.think_time_ms
        if not 0 <= lo <= hi:
            raise ValueError("think_time_ms must be a range [lo, hi] with 0 <= lo <= hi")
        for name in ("system_prompt_len", "user_len", "output_len", "document_len"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} must be a range [lo, hi] with 0 < lo <= hi")
        if self.follow_up_prob + self.resend_prob > 1:
            raise ValueError("follow_up_prob + resend_prob must not exceed 1")
        return self


class RunConfig(KVPluginConfig):
    """A deployment as ``kvplugin run`` serves it: the library's sections, and the reference
    engine's traffic."""

    # Narrower than the library's (a mapping kept as given): the library never reads it.
    workload: WorkloadConfig = Field(  # type: ignore[assignment]
        default_factory=WorkloadConfig, description="the reference engine's traffic")

    @model_validator(mode="before")
    @classmethod
    def _tenant_count(cls, data: Any) -> Any:
        """With declared tenants the workload serves them all: num_tenants defaults to
        their number (set explicitly, it must agree)."""
        if not isinstance(data, dict):
            return data
        declared = (data.get("tenants") or {}).get("declared") if isinstance(
            data.get("tenants"), dict) else getattr(data.get("tenants"), "declared", None)
        workload = data.get("workload", {})
        if isinstance(declared, dict) and declared and isinstance(workload, dict) \
                and "num_tenants" not in workload:
            data = {**data, "workload": {**workload, "num_tenants": len(declared)}}
        return data
