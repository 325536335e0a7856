"""The async manager's per-request bookkeeping, shared by its load and store sides."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvplugin.aio.jobs import LoadJob, StoreJob
from kvplugin.aio.keys import KeyScope, KeySpace
from kvplugin.aio.ledger import RequestLedger
from kvplugin.aio.values import LoadOutcome
from kvplugin.connectors.keys import ObjectKey
from kvplugin.core.request import Request

__all__ = ["NO_HOLE", "ReqState"]

NO_HOLE = 1 << 62  # "every chunk offered so far was stored"


@dataclass(eq=False, slots=True)
class ReqState:
    req: Request
    tenant: str
    scope: KeyScope  # whose namespace its objects are keyed in
    keys: list[list[ObjectKey]]  # per group, the keys of chunks 0.. computed so far
    next_chunk: list[int]  # per group, the first chunk not yet offered for storing
    admitted: bool = False  # holds blocks in the core
    finished: bool = False
    skip_external: bool = False  # a load of it failed: do not claim from the tiers again
    load: LoadJob | None = None
    outcome: LoadOutcome | None = None
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    stores: set[StoreJob] = field(default_factory=set)
    # States at or below this came with the hit (device or tier): not this request's to store.
    known_until: int = 0
    # First token of an attention chunk this request offered but could not store: a state
    # beyond it would be a checkpoint missing a part.
    hole: int = NO_HOLE
    ledger: RequestLedger = field(default_factory=RequestLedger)  # its prompt's books

    def chunk_keys(self, keyspace: KeySpace, group: int, first: int,
                   stop: int) -> list[ObjectKey]:
        """Keys of the group's chunks ``[first, stop)``, derived once per request."""
        have = self.keys[group]
        if stop > len(have):
            have.extend(keyspace.chunk_keys(self.scope, group, self.req.block_hashes,
                                            len(have), stop))
        return have[first:stop]
