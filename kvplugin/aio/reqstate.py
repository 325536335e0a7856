"""The async manager's per-request bookkeeping, shared by its load and store sides."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvplugin.aio.jobs import LoadJob, StoreJob
from kvplugin.aio.keys import KeyScope, KeySpace
from kvplugin.aio.ledger import RequestLedger
from kvplugin.aio.offload_ledger import OffloadRequest
from kvplugin.aio.values import LoadOutcome
from kvplugin.connectors.keys import ObjectKey
from kvplugin.core.request import Request

__all__ = ["ReqState"]


@dataclass(eq=False, slots=True)
class ReqState:
    req: Request
    tenant: str
    scope: KeyScope  # whose namespace its objects are keyed in
    offload: OffloadRequest  # the offload ledger's state of it (cursors, hole)
    admitted: bool = False  # holds blocks in the core
    skip_external: bool = False  # a load of it failed: do not claim from the tiers again
    load: LoadJob | None = None
    outcome: LoadOutcome | None = None
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    stores: set[StoreJob] = field(default_factory=set)  # its store jobs running
    ledger: RequestLedger = field(default_factory=RequestLedger)  # its prompt's books

    def chunk_keys(self, keyspace: KeySpace, group: int, first: int,
                   stop: int) -> list[ObjectKey]:
        """Keys of the group's chunks ``[first, stop)``, derived once per request."""
        return self.offload.chunk_keys(keyspace, self.req.block_hashes, group, first, stop)
