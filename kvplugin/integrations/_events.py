"""KV events of the connector's offload tiers, the way vLLM 0.33's connector API carries them.

A store is decided by the scheduler but done by the workers, so an event is born in two
halves: the scheduler describes each stored object (:class:`StoredObject`: its block
hashes, tokens, group) in the step's metadata; the worker that stores it hands the
description to a :class:`~kvplugin.aio.tier_events.TierEventView` (the native manager's
rules: told once per tier, taken back exactly) and turns the tiers' own events into
``BlockStored`` when a tier confirmed the write and ``BlockRemoved`` when a tier evicts,
deletes, drops a corrupt object or (Redis) is found without it. The worker returns them
through ``get_kv_connector_kv_cache_events``; the scheduler's connector gathers every
worker's events (``update_connector_output``) and hands vLLM those all workers reported
(``take_events``: with tensor parallelism an object is stored once every rank's shard
is, and a removal is told once every rank reported it). vLLM publishes them with its own
GPU events (``KVEventBatch``). The medium is the tier: CPU (memory), DISK, REDIS.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from kvplugin.aio.keys import KeySpace
from kvplugin.aio.offload_ledger import StoreObject
from kvplugin.aio.tier_events import ObjectInfo, chunk_span, state_span
from kvplugin.core import events as core_events

__all__ = ["StoredObject", "describe", "info_of", "new_events", "to_vllm"]


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


def describe(obj: StoreObject, request: Any, keys: KeySpace,
             spec_kind: tuple[str | None, int | None]) -> StoredObject:
    """What a ``BlockStored`` of one planned object says (the native manager's
    description, :mod:`kvplugin.aio.tier_events`, in vLLM's raw hashes)."""
    hbs, hashes = keys.hash_block_size, request.block_hashes
    if obj.state:
        start, stop, bs = obj.index - hbs, obj.index, hbs
        span = state_span(hashes, obj.index, hbs)
    else:
        g = keys.groups[obj.group]
        start, bs = obj.index * g.chunk_tokens, g.block_size
        stop = start + g.chunk_tokens
        span = chunk_span(hashes, start, stop, hbs, bs)
    return StoredObject(obj.group, span[0], span[1], tuple(request.all_token_ids[start:stop]),
                        bs, *spec_kind)


def info_of(obj: StoredObject) -> ObjectInfo:
    """The description the tier event view keeps, hashes in vLLM's published form."""
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    conv = utils.maybe_convert_block_hash
    return ObjectInfo(obj.group, tuple(conv(h) for h in obj.block_hashes),
                      None if obj.parent is None else conv(obj.parent), obj.token_ids,
                      obj.block_size, obj.spec_kind, obj.sliding_window)


def to_vllm(event: core_events.KVCacheEvent) -> Any:
    """kvplugin's event (vLLM's fields) as vLLM's own class."""
    kv_events = importlib.import_module("vllm.distributed.kv_events")
    if isinstance(event, core_events.BlockStored):
        return kv_events.BlockStored(
            block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids, block_size=event.block_size, lora_id=None,
            medium=event.medium, lora_name=None, group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
            ownership=event.ownership)
    if isinstance(event, core_events.BlockRemoved):
        return kv_events.BlockRemoved(block_hashes=event.block_hashes, medium=event.medium,
                                      group_idx=event.group_idx, ownership=event.ownership)
    return kv_events.AllBlocksCleared()


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
