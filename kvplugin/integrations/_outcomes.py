"""What the vLLM workers tell the scheduler's connector each step: how every store and load
ended, and the tiers' object events.

vLLM runs the two halves of a connector apart (the scheduler in the engine core, the
workers in their own processes), and only the scheduler's half holds the offload ledger
(:class:`~kvplugin.aio.offload_ledger.OffloadLedger`) that plans stores and loads. Its
plans are completed from these reports, as vLLM's own ``OffloadingConnectorScheduler``
completes its stores from the worker's: the worker returns a :class:`KVPluginWorkerMeta`
from ``build_connector_worker_meta()``, vLLM aggregates the workers' (``aggregate``) and
hands the result to ``update_connector_output`` in ``KVConnectorOutput
.kv_connector_worker_meta``. So the vLLM ledger is tracked as the native one is: the
in-flight store budget, deduplication of an object two requests store at once, and tenant
tier byte quotas on bytes *held* (the tiers' ``stored`` / ``removed`` events travel here).

With tensor parallelism every worker stores and loads its own part of a plan: a plan ends
when every worker reported it (:meth:`Outcomes.store_ended`), and it is done only if every
worker's part is. Tier events come from one worker (TP rank 0 opens the event feed).

vLLM is imported by name; without it the metadata derives from ``object``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from kvplugin.connectors.events import TierEvent

__all__ = ["KVPluginWorkerMeta", "LoadOutcome", "Outcomes", "StoreOutcome"]


def _base() -> Any:
    try:
        mod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
        return mod.KVConnectorWorkerMetadata
    except (ImportError, AttributeError):  # no vLLM, or one without worker metadata
        return object


_WorkerMetaBase: Any = _base()


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    """How one worker's part of store plan ``plan`` ended: ``ok`` (every object present
    on some tier) and, per tier (fastest first), how many of its objects that tier holds
    now (0 where the tier's write failed)."""

    plan: int
    ok: bool
    tier_counts: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """How one worker's part of a request's load ended: ``verified`` tokens of the claim
    ``[start, end)`` arrived verified from ``start`` (``end`` when all did); ``copied``:
    per object copied in, (tier level, bytes, whether it is a Mamba state)."""

    req_id: str
    start: int
    end: int
    verified: int
    copied: tuple[tuple[int, int, bool], ...] = ()


class KVPluginWorkerMeta(_WorkerMetaBase):  # type: ignore[misc]
    """One step's reports of one worker (or, aggregated, of several)."""

    def __init__(self, stores: list[StoreOutcome] | None = None,
                 loads: list[LoadOutcome] | None = None,
                 events: list[TierEvent] | None = None, tiers: tuple[str, ...] = ()) -> None:
        self.stores = stores or []
        self.loads = loads or []
        self.events = events or []
        self.tiers = tiers  # the worker's tier names, fastest first (tier_counts' order)

    def aggregate(self, other: Any) -> KVPluginWorkerMeta:
        self.stores.extend(getattr(other, "stores", ()))
        self.loads.extend(getattr(other, "loads", ()))
        self.events.extend(getattr(other, "events", ()))
        self.tiers = self.tiers or tuple(getattr(other, "tiers", ()))
        return self

    def __repr__(self) -> str:
        return (f"KVPluginWorkerMeta(stores={len(self.stores)}, loads={len(self.loads)}, "
                f"events={len(self.events)})")


@dataclass(slots=True)
class Outcomes:
    """The scheduler's gathering of the workers' parts until every worker reported."""

    workers: int
    _stores: dict[int, list[StoreOutcome]] = field(default_factory=dict)
    _loads: dict[str, list[LoadOutcome]] = field(default_factory=dict)

    def store_ended(self, o: StoreOutcome) -> StoreOutcome | None:
        """The plan's outcome once every worker reported its part (None before): done
        only if every part is; a tier holds the objects every worker's part put there."""
        parts = self._stores.setdefault(o.plan, [])
        parts.append(o)
        if len(parts) < self.workers:
            return None
        del self._stores[o.plan]
        counts = [p.tier_counts for p in parts]
        width = min(len(c) for c in counts)
        return StoreOutcome(o.plan, all(p.ok for p in parts),
                            tuple(min(c[i] for c in counts) for i in range(width)))

    def load_ended(self, o: LoadOutcome) -> LoadOutcome | None:
        parts = self._loads.setdefault(o.req_id, [])
        parts.append(o)
        if len(parts) < self.workers:
            return None
        del self._loads[o.req_id]
        first = parts[0]
        return LoadOutcome(o.req_id, first.start, first.end, min(p.verified for p in parts),
                           first.copied)
