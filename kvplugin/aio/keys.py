"""From the core's chained block hashes to the tiers' object keys.

One stored object ("chunk") holds ``chunk_blocks`` consecutive full blocks of one KV-cache
group and is keyed by the chained hash of its last block, in the namespace of the request's
tenant, the model, the group's layout fingerprint and the group index. The chain makes that
hash depend on every earlier token (and on the cache salt and LoRA, which enter the hash),
so one key names the whole prefix up to the chunk's end; the hashes are vLLM's own, so
engines sharing a tier and a hash seed share objects. A request scoped to a prefix group
(:class:`KeyScope`) keys the objects of its shared part in the group's (salted) namespace
instead (see :mod:`kvplugin.aio.tenants`).

A Mamba group stores no chunks: its state at a token boundary is one object (kind
``"mamba_state"``) keyed by the chain hash *at the boundary* (vLLM's ``hash_idx = boundary //
tokens_per_hash - 1``), so the states of two requests sharing a prefix share a key whether
the state was a retained block, a copy-on-write copy or a finish-time partial tail.

Default ``chunk_blocks = 1``: a real model's page is hundreds of KiB to MiBs, so the
per-object overhead (one key, a ~0.5 KiB envelope, one round trip per batch anyway) is noise,
while one block per object keeps hits at the core's block granularity (a chunk is all or
nothing) and a stored page is one contiguous row, so a store can hand out a zero-copy view.
Raise it for tiny pages, where per-object overhead dominates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvplugin.aio import group_kinds
from kvplugin.connectors.keys import Namespace, ObjectKey, layout_fingerprint

if TYPE_CHECKING:  # the offload ledger names objects without loading host memory (numpy)
    from kvplugin.aio.memory import GroupShape

__all__ = ["GROUP_NAMESPACE_SALT", "GroupKeying", "KeyScope", "KeySpace"]

# Hashed into a prefix group's namespaces: a tenant that happens to bear a group's name
# still gets other keys, so no tenant name can reach a group's objects.
GROUP_NAMESPACE_SALT = b"kvplugin/prefix-group/v1"


@dataclass(frozen=True, slots=True)
class KeyScope:
    """Whose namespace a request's objects are keyed in: the tenant's, except the first
    ``shared_tokens`` tokens of a request in the prefix group ``group``, keyed in the group's
    (see :mod:`kvplugin.aio.tenants`). A plain tenant name is the scope of a private request.
    """

    tenant: str
    group: str | None = None
    shared_tokens: int = 0

    def __post_init__(self) -> None:
        if self.group is None:
            if self.shared_tokens:
                raise ValueError("shared_tokens needs a prefix group")
        elif type(self.shared_tokens) is not int or self.shared_tokens < 1:
            raise ValueError(f"shared_tokens must be a positive int, got {self.shared_tokens!r}")


@dataclass(frozen=True, slots=True)
class GroupKeying:
    """How one group's blocks become chunks."""

    group: int
    block_size: int  # tokens per block of this group
    chunk_blocks: int  # blocks per stored object
    hash_stride: int  # hash-list entries per block (group block size / hash block size)
    layout: str  # the layout fingerprint (32 hex)
    kind: str = "full"  # the plan kind (kvplugin.aio.group_kinds.plan_kinds)

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.chunk_blocks

    def hash_index(self, chunk: int) -> int:
        """Index in ``request.block_hashes`` of the hash of the chunk's last block."""
        return (chunk + 1) * self.chunk_blocks * self.hash_stride - 1

    def num_chunks(self, num_hashes: int) -> int:
        """Full chunks a request with ``num_hashes`` block hashes can name."""
        return num_hashes // (self.chunk_blocks * self.hash_stride)

    @property
    def chunked(self) -> bool:
        """Stored as chunks of blocks (attention), not as one state per boundary."""
        return group_kinds.plan_kind(self.kind).chunked


class KeySpace:
    """The keys of one model deployment: per group keying, per tenant namespaces."""

    def __init__(self, model: str, shapes: Sequence[GroupShape], hash_block_size: int,
                 chunk_blocks: int = 1) -> None:
        if type(chunk_blocks) is not int or chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be a positive int, got {chunk_blocks!r}")
        groups = []
        for gid, shape in enumerate(shapes):
            if shape.block_size % hash_block_size:
                raise ValueError(f"group {gid}: block size {shape.block_size} is not a multiple "
                                 f"of the hash block size {hash_block_size}")
            groups.append(GroupKeying(gid, shape.block_size, chunk_blocks,
                                      shape.block_size // hash_block_size,
                                      _fingerprint(shape, chunk_blocks), shape.kind))
        self.model = model
        self.hash_block_size = hash_block_size
        self.groups = tuple(groups)
        self._namespaces: dict[str, tuple[Namespace, ...]] = {}
        self._group_namespaces: dict[str, tuple[Namespace, ...]] = {}
        Namespace("probe", model, groups[0].layout)  # a bad model name fails here, not later

    def namespaces(self, tenant: str) -> tuple[Namespace, ...]:
        """The tenant's namespace per group (cached; a bad tenant name raises here)."""
        ns = self._namespaces.get(tenant)
        if ns is None:
            ns = tuple(Namespace(tenant, self.model, g.layout, g.group) for g in self.groups)
            self._namespaces[tenant] = ns
        return ns

    def group_namespaces(self, name: str) -> tuple[Namespace, ...]:
        """A prefix group's namespace per KV-cache group (cached; a bad name raises)."""
        ns = self._group_namespaces.get(name)
        if ns is None:
            ns = tuple(Namespace(name, self.model, g.layout, g.group, GROUP_NAMESPACE_SALT)
                       for g in self.groups)
            self._group_namespaces[name] = ns
        return ns

    def _namespace(self, scope: str | KeyScope, group: int, end_token: int) -> Namespace:
        """Where an object ending at ``end_token`` lives: a scoped request's shared part in
        its prefix group's namespace, everything else in the tenant's."""
        if isinstance(scope, str):
            return self.namespaces(scope)[group]
        if scope.group is not None and end_token <= scope.shared_tokens:
            return self.group_namespaces(scope.group)[group]
        return self.namespaces(scope.tenant)[group]

    def chunk_keys(self, scope: str | KeyScope, group: int, block_hashes: Sequence[bytes],
                   first: int, stop: int) -> list[ObjectKey]:
        """Keys of chunks ``[first, stop)`` of ``group`` for a request's hash list."""
        g = self.groups[group]
        if not g.chunked:
            raise ValueError(f"group {group} stores states, not chunks")
        if stop > g.num_chunks(len(block_hashes)):
            raise ValueError(f"chunk {stop - 1} of group {group} is not complete yet")
        ct, at = g.chunk_tokens, g.hash_index
        if isinstance(scope, str) or scope.group is None:  # one namespace for all of them
            key = self._namespace(scope, group, 0).key
            return [key(block_hashes[at(c)]) for c in range(first, stop)]
        return [self._namespace(scope, group, (c + 1) * ct).key(block_hashes[at(c)])
                for c in range(first, stop)]

    def state_key(self, scope: str | KeyScope, group: int, block_hashes: Sequence[bytes],
                  boundary: int) -> ObjectKey:
        """The key of ``group``'s state at ``boundary`` tokens of a request's hash list."""
        if self.groups[group].chunked:
            raise ValueError(f"group {group} stores chunks, not states")
        n = boundary // self.hash_block_size
        if boundary <= 0 or boundary % self.hash_block_size or n > len(block_hashes):
            raise ValueError(f"no block hash ends at token {boundary}")
        return self._namespace(scope, group, boundary).key(block_hashes[n - 1], "mamba_state")


def _fingerprint(shape: GroupShape, chunk_blocks: int) -> str:
    """What makes a group's stored bytes (in)compatible: its kind's name and the fields
    its registry entry names (:mod:`kvplugin.aio.group_kinds`). Full attention keeps slice
    1's fields exactly, so objects stored before hybrid support still match."""
    kind = shape.group_kind
    return layout_fingerprint(kind=kind.name, **kind.fingerprint(shape, chunk_blocks))
