"""KV events of the connector's offload tiers, the way vLLM 0.33's connector API carries them.

A store is decided by the scheduler but done by the workers, so an event is born in two
halves: the scheduler describes each stored object (:class:`StoredObject`: its block
hashes, tokens, group) in the step's metadata; a worker turns the description into a
``BlockStored`` once the tiers confirmed the put, and returns it through
``get_kv_connector_kv_cache_events``. The scheduler's connector gathers every worker's
events (``update_connector_output``) and hands vLLM those all workers reported
(``take_events``): with tensor parallelism an object is stored only once every rank's
shard is. vLLM publishes them with its own GPU events (``KVEventBatch``).

``BlockRemoved`` is not emitted: the tiers evict on their own (LRU, capacity, TTL) and tell
no one; a failed store emits nothing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["StoredObject", "medium_of", "new_events", "stored_event"]

# Tier kinds (kvplugin.config) -> vLLM's media: host memory is "CPU", the rest "STORAGE".
_MEDIA = {"memory": "CPU"}


def medium_of(tier_kinds: list[str]) -> str:
    """The medium of a store: the fastest tier's (a store lands there first)."""
    return _MEDIA.get(tier_kinds[0], "STORAGE") if tier_kinds else "STORAGE"


@dataclass(frozen=True, slots=True)
class StoredObject:
    """What a ``BlockStored`` says about one stored object (picklable, vLLM-free)."""

    group: int
    block_hashes: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    spec_kind: str | None
    sliding_window: int | None


def stored_event(obj: StoredObject, medium: str) -> Any:
    kv_events = importlib.import_module("vllm.distributed.kv_events")
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    conv = utils.maybe_convert_block_hash
    return kv_events.BlockStored(
        block_hashes=[conv(h) for h in obj.block_hashes],
        parent_block_hash=None if obj.parent is None else conv(obj.parent),
        token_ids=list(obj.token_ids), block_size=obj.block_size, lora_id=None,
        medium=medium, lora_name=None, group_idx=obj.group,
        kv_cache_spec_kind=obj.spec_kind, kv_cache_spec_sliding_window=obj.sliding_window,
        ownership="kvplugin")


_EVENTS_CLASS: Any = None


def new_events(num_workers: int = 1) -> Any:
    """An empty ``KVConnectorKVEvents`` (vLLM's aggregator semantics: an event counts when
    every worker reported it)."""
    global _EVENTS_CLASS
    if _EVENTS_CLASS is None:
        _EVENTS_CLASS = _events_class()
    return _EVENTS_CLASS(num_workers)


def _events_class() -> Any:
    kv_events = importlib.import_module("vllm.distributed.kv_events")
    base: Any = kv_events.KVConnectorKVEvents

    class KVPluginKVEvents(base):  # type: ignore[misc]
        """The events of one interval, counted per worker."""

        def __init__(self, num_workers: int) -> None:
            self._agg = kv_events.KVEventAggregator(num_workers)

        def add_events(self, events: list[Any]) -> None:
            self._agg.add_events(events)

        def aggregate(self) -> KVPluginKVEvents:
            common = self._agg.get_common_events()
            self._agg.clear_events()
            self._agg.add_events(common)
            self._agg.reset_workers()
            return self

        def increment_workers(self, count: int = 1) -> None:
            self._agg.increment_workers(count)

        def get_all_events(self) -> list[Any]:
            return list(self._agg.get_all_events())

        def get_common_events(self) -> list[Any]:
            return list(self._agg.get_common_events())

        def get_number_of_workers(self) -> int:
            return int(self._agg.get_number_of_workers())

        def clear_events(self) -> None:
            self._agg.clear_events()
            self._agg.reset_workers()

    return KVPluginKVEvents
