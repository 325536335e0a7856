"""A fake model runner: simulated step time, deterministic KV, and a check of every hit.

Token ``t`` of a request has the KV ``f(seed, tokens[:t + 1])``, where the seed names the
tenant and the LoRA adapter (what a real model's KV depends on besides the tokens). The bytes
come from a chain of 16-byte digests, one per token, so writing or recomputing a page costs
one hash per token. Because the function is known, every block a request gets for free (a
device hit, or bytes loaded from a tier) can be checked against what computing it would have
written: a difference is a ``kv_mismatch``, and one that equals another tenant's KV for the
same tokens is a ``cross_tenant_hit`` as well.

A step awaits ``asyncio.sleep`` for its simulated cost, the way an engine awaits the GPU: the
event loop, and so every load and store in flight, keeps running meanwhile.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvplugin.aio.memory import HostKVMemory, PageShape

__all__ = ["CheckResult", "FakeModel", "StepCosts", "Work", "kv_seed"]

_DIGEST = 16
Pages = np.ndarray[Any, np.dtype[np.uint8]]


def kv_seed(tenant: str, lora: str | None) -> bytes:
    """What a request's KV depends on besides its tokens. A cache salt is not part of it:
    a salt only splits the cache, the model computes the same KV."""
    return hashlib.blake2b(f"{tenant}\x00{lora or ''}".encode(), digest_size=_DIGEST).digest()


def _chain(seed: bytes, tokens: Sequence[int], out: list[bytes]) -> None:
    """Extend ``out`` (the digests of ``tokens[:len(out)]``) to cover every token."""
    d = out[-1] if out else seed
    for t in tokens[len(out):]:
        d = hashlib.blake2b(d + t.to_bytes(8, "little"), digest_size=_DIGEST).digest()
        out.append(d)


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Simulated time: per prefill token, and once per step that decodes."""

    prefill_token_s: float = 0.0
    decode_step_s: float = 0.0

    def of(self, prefill_tokens: int, decodes: int) -> float:
        return prefill_tokens * self.prefill_token_s + (self.decode_step_s if decodes else 0.0)


@dataclass(frozen=True, slots=True)
class Work:
    """Compute tokens ``[start, start + num_tokens)`` of a request into its blocks."""

    request_id: str
    start: int
    num_tokens: int
    block_ids: tuple[list[int], ...]  # per group, the request's block table
    decode: bool = False


@dataclass(frozen=True, slots=True)
class CheckResult:
    pages: int
    mismatches: int
    cross_tenant: int


@dataclass(eq=False, slots=True)
class _Seq:
    seed: bytes
    tokens: list[int]  # the request's token list itself: it grows as outputs are sampled
    tenant: str
    digests: list[bytes] = field(default_factory=list)

    def upto(self, n: int) -> list[bytes]:
        if len(self.digests) < n:
            _chain(self.seed, self.tokens[:n], self.digests)
        return self.digests


class FakeModel:
    def __init__(self, memory: HostKVMemory, costs: StepCosts | None = None,
                 vocab: int = 32000) -> None:
        self.memory = memory
        self.costs = costs or StepCosts()
        self.vocab = vocab
        self._seqs: dict[str, _Seq] = {}
        self._tenants: dict[bytes, str] = {}  # seed -> tenant, of every request seen
        # Per group, one byte per (K/V, layer) mixed into the token's bytes, so a copy that
        # swaps layers or groups cannot pass the check.
        self._mix = [self._mixer(g) for g in range(memory.num_groups)]
        self.steps = 0
        self.computed_tokens = 0
        self.busy_s = 0.0
        self.pages_checked = 0
        self.kv_mismatches = 0
        self.cross_tenant_hits = 0

    def _shape(self, group: int) -> PageShape:
        shape = self.memory.shapes[group]
        if not isinstance(shape, PageShape):
            raise TypeError(f"group {group}: the fake model writes attention pages only")
        return shape

    def _mixer(self, group: int) -> Pages:
        layers = self._shape(group).num_layers
        codes = np.arange(2 * layers, dtype=np.int64).reshape(2, layers)
        return ((codes + group * 131) * 37 + 1).astype(np.uint8)[:, :, None, None, None]

    # ------------------------------------------------------------------ requests
    def add(self, request_id: str, tokens: list[int], tenant: str, lora: str | None) -> None:
        seed = kv_seed(tenant, lora)
        self._tenants[seed] = tenant
        self._seqs[request_id] = _Seq(seed, tokens, tenant)

    def remove(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)

    # ------------------------------------------------------------------ a step
    async def execute(self, work: Sequence[Work]) -> list[int | None]:
        """Write the KV of every scheduled token, await the step's simulated time, and
        sample a token for each request whose last token was computed (None otherwise)."""
        sampled: list[int | None] = []
        prefill = decodes = 0
        for i, w in enumerate(work):
            if i:
                await asyncio.sleep(0)  # the GPU's work: let the loop run I/O in between
            sampled.append(self._compute(w))
            if w.decode:
                decodes += 1
            else:
                prefill += w.num_tokens
        cost = self.costs.of(prefill, decodes)
        self.steps += 1
        self.busy_s += cost
        await asyncio.sleep(cost)
        return sampled

    def _compute(self, w: Work) -> int | None:
        seq = self._seqs[w.request_id]
        end = w.start + w.num_tokens
        if w.num_tokens < 1 or end > len(seq.tokens):
            raise ValueError(f"{w.request_id}: cannot compute tokens [{w.start}, {end}) of "
                             f"{len(seq.tokens)}")
        digests = seq.upto(end)
        for g, ids in enumerate(w.block_ids):
            bs = self._shape(g).block_size
            kv = self._tokens_kv(g, digests[w.start:end])  # one array for the whole chunk
            for b in range(w.start // bs, math.ceil(end / bs)):
                lo, hi = max(w.start, b * bs), min(end, (b + 1) * bs)
                slots = self._slots(g, ids[b])
                slots[:, :, lo - b * bs:hi - b * bs, :] = kv[:, :, lo - w.start:hi - w.start]
        self.computed_tokens += w.num_tokens
        if end < len(seq.tokens):
            return None
        return int.from_bytes(digests[end - 1][:4], "little") % self.vocab

    def _slots(self, group: int, block_id: int) -> Pages:
        """The page of ``block_id`` as (K/V, layer, token slot, bytes per slot): a view."""
        shape = self._shape(group)
        row: Pages = self.memory.pages(group, [block_id])[0]
        return row.reshape(2, shape.num_layers, shape.block_size, -1)

    def _tokens_kv(self, group: int, digests: Sequence[bytes]) -> Pages:
        """(K/V, layer, token, bytes per slot): each token's digest, xor'ed with the
        (K/V, layer) byte, repeated across the slot. Mixed while the digests are small."""
        shape = self._shape(group)
        width = shape.page_bytes // (2 * shape.num_layers * shape.block_size)
        n, reps = len(digests), -(-width // _DIGEST)
        raw = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(1, 1, n, 1, _DIGEST)
        mixed = raw ^ self._mix[group]
        full = np.broadcast_to(mixed, (2, shape.num_layers, n, reps, _DIGEST))
        out: Pages = full.reshape(2, shape.num_layers, n, reps * _DIGEST)[..., :width]
        return out

    # ------------------------------------------------------------------ checks
    def check(self, request_id: str, block_ids: tuple[list[int], ...], start: int,
              end: int) -> CheckResult:
        """Compare the request's full blocks covering tokens ``[start, end)`` with what
        computing them writes; count (and remember) mismatches and cross-tenant bytes."""
        seq = self._seqs[request_id]
        pages = bad = cross = 0
        for g, ids in enumerate(block_ids):
            bs = self._shape(g).block_size
            first, stop = start // bs, end // bs
            if stop <= first:
                continue
            want = self._tokens_kv(g, seq.upto(stop * bs)[first * bs:])
            for b in range(first, stop):
                pages += 1
                got = self._slots(g, ids[b])
                if np.array_equal(got, want[:, :, (b - first) * bs:(b - first + 1) * bs]):
                    continue
                bad += 1
                if self._written_by_another(g, seq, b, got):
                    cross += 1
        self.pages_checked += pages
        self.kv_mismatches += bad
        self.cross_tenant_hits += cross
        return CheckResult(pages, bad, cross)

    def _page(self, group: int, digests: Sequence[bytes], block: int) -> Pages:
        bs = self._shape(group).block_size
        return self._tokens_kv(group, digests[block * bs:(block + 1) * bs])

    def _written_by_another(self, group: int, seq: _Seq, block: int, got: Pages) -> bool:
        bs = self._shape(group).block_size
        for seed, tenant in self._tenants.items():
            if tenant == seq.tenant:
                continue  # the same tenant's other adapter: a mismatch, not a leak
            other: list[bytes] = []
            _chain(seed, seq.tokens[:(block + 1) * bs], other)
            if np.array_equal(got, self._page(group, other, block)):
                return True
        return False
