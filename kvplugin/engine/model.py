"""A fake model runner: simulated step time, deterministic KV, and a check of every hit.

Token ``t`` of a request has the KV ``f(seed, tokens[:t + 1])``, where the seed names the
tenant and the LoRA adapter (what a real model's KV depends on besides the tokens). The bytes
come from a chain of 16-byte digests, one per token, so writing or recomputing a page costs
one hash per token. Because the function is known, every block a request gets for free (a
device hit, or bytes loaded from a tier) can be checked against what computing it would have
written: a difference is a ``kv_mismatch``, and one that equals another tenant's KV for the
same tokens is a ``cross_tenant_hit`` as well.

Hybrid layouts: a sliding-window group writes KV pages like a full one, but the blocks that
left the window are the core's null block, never written and never checked (a null block
*inside* the window a request resumes with is a mismatch: its KV is missing). A Mamba group
holds one recurrent state per request: a chunk ending at token ``n`` writes the state
``f(seed, tokens[:n])`` into the table slot of ``n`` (slot ``ceil(n / block_size) - 1``), and
every chunk first reads the state it resumes from and checks it, so a state that came from a
device hit, a loaded checkpoint or a restored lagging state is compared with recomputation
exactly when the model would use it.

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

from kvplugin.aio.memory import HostKVMemory, PageShape, StateShape

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
        # Per group, one byte per (K/V, layer) of a page, or per layer of a state, mixed
        # into the bytes, so a copy that swaps layers or groups cannot pass the check.
        self._mix = [self._mixer(g) for g in range(memory.num_groups)]
        self.steps = 0
        self.computed_tokens = 0
        self.busy_s = 0.0
        self.pages_checked = 0
        self.states_checked = 0
        self.state_mismatches = 0
        self.kv_mismatches = 0  # pages and states
        self.cross_tenant_hits = 0

    def _shape(self, group: int) -> PageShape:
        shape = self.memory.shapes[group]
        if not isinstance(shape, PageShape):
            raise TypeError(f"group {group} holds states, not attention pages")
        return shape

    def _is_state(self, group: int) -> bool:
        return isinstance(self.memory.shapes[group], StateShape)

    def _mixer(self, group: int) -> Pages:
        shape = self.memory.shapes[group]
        if isinstance(shape, StateShape):  # (layer, 1, byte): broadcast over a state page
            layer = np.arange(shape.num_layers, dtype=np.int64)
            return ((layer + group * 131) * 37 + 3).astype(np.uint8)[:, None, None]
        layers = shape.num_layers
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
            if self._is_state(g):
                self._advance_state(g, seq, ids, w.start, end)
            else:
                self._write_pages(g, ids, digests, w.start, end)
        self.computed_tokens += w.num_tokens
        if end < len(seq.tokens):
            return None
        return int.from_bytes(digests[end - 1][:4], "little") % self.vocab

    def _write_pages(self, group: int, ids: list[int], digests: list[bytes], start: int,
                     end: int) -> None:
        bs = self._shape(group).block_size
        kv = self._tokens_kv(group, digests[start:end])  # one array for the whole chunk
        for b in range(start // bs, math.ceil(end / bs)):
            lo, hi = max(start, b * bs), min(end, (b + 1) * bs)
            # A block a step writes is never null, not even in a window group: the core
            # frees blocks only once they left the window of the next token to compute.
            slots = self._slots(group, ids[b])
            slots[:, :, lo - b * bs:hi - b * bs, :] = kv[:, :, lo - start:hi - start]

    def _advance_state(self, group: int, seq: _Seq, ids: list[int], start: int,
                       end: int) -> None:
        """Read (and check) the state the chunk resumes from, write the state at its end."""
        bs = self.memory.shapes[group].block_size
        if start:
            self.check_state(seq, group, ids, start)
        row = self.memory.pages(group, [ids[-(end // -bs) - 1]])[0]
        row[:] = self._state(group, seq.upto(end)[end - 1]).reshape(-1)

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

    def _state(self, group: int, digest: bytes) -> Pages:
        """The state page after the tokens ``digest`` covers: (layer, bytes), the digest
        xor'ed with the layer's byte, repeated across the layer's bytes."""
        shape = self.memory.shapes[group]
        assert isinstance(shape, StateShape)
        reps = -(-shape.layer_bytes // _DIGEST)
        raw = np.frombuffer(digest, dtype=np.uint8).reshape(1, 1, _DIGEST) ^ self._mix[group]
        full = np.broadcast_to(raw, (shape.num_layers, reps, _DIGEST))
        out: Pages = full.reshape(shape.num_layers, reps * _DIGEST)[:, :shape.layer_bytes]
        return out

    # ------------------------------------------------------------------ checks
    def check(self, request_id: str, block_ids: tuple[list[int], ...], start: int,
              end: int) -> CheckResult:
        """Compare the request's full attention blocks covering tokens ``[start, end)``
        with what computing them writes; count (and remember) mismatches and cross-tenant
        bytes. A window group's null blocks before the window of token ``end`` are skipped;
        state groups are checked when a step reads them (:meth:`check_state`)."""
        seq = self._seqs[request_id]
        pages = bad = cross = 0
        for g, ids in enumerate(block_ids):
            if self._is_state(g):
                continue
            shape = self._shape(g)
            bs = shape.block_size
            first, stop = start // bs, end // bs
            if stop <= first:
                continue
            # Token `end` attends to [end - window + 1, end]: blocks wholly before that
            # may be null; every later one must hold its KV.
            needed = (end - shape.window + 1) // bs if shape.window else 0
            want = self._tokens_kv(g, seq.upto(stop * bs)[first * bs:])
            for b in range(first, stop):
                if ids[b] == 0 and b < needed:
                    continue
                pages += 1
                if ids[b] == 0:
                    bad += 1  # KV the next token attends to is missing
                    continue
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

    def check_state(self, seq: _Seq, group: int, ids: list[int], boundary: int) -> bool:
        """Compare the state a request resumes from at ``boundary`` with recomputation;
        count a mismatch (and a cross-tenant hit when it is another tenant's state)."""
        slot = -(boundary // -self.memory.shapes[group].block_size) - 1
        block = ids[slot] if slot < len(ids) else 0
        self.states_checked += 1
        got = self.memory.pages(group, [block])[0] if block else None  # null: no state
        if got is not None and np.array_equal(
                got, self._state(group, seq.upto(boundary)[boundary - 1]).reshape(-1)):
            return True
        self.state_mismatches += 1
        self.kv_mismatches += 1
        if got is not None and self._state_of_another(group, seq, boundary, got):
            self.cross_tenant_hits += 1
        return False

    def _page(self, group: int, digests: Sequence[bytes], block: int) -> Pages:
        bs = self._shape(group).block_size
        return self._tokens_kv(group, digests[block * bs:(block + 1) * bs])

    def _others(self, seq: _Seq, n: int) -> list[list[bytes]]:
        """The digests of ``seq``'s first ``n`` tokens for every other tenant seen (the same
        tenant's other adapter is a mismatch, not a leak)."""
        out = []
        for seed, tenant in self._tenants.items():
            if tenant != seq.tenant:
                other: list[bytes] = []
                _chain(seed, seq.tokens[:n], other)
                out.append(other)
        return out

    def _written_by_another(self, group: int, seq: _Seq, block: int, got: Pages) -> bool:
        bs = self._shape(group).block_size
        return any(np.array_equal(got, self._page(group, other, block))
                   for other in self._others(seq, (block + 1) * bs))

    def _state_of_another(self, group: int, seq: _Seq, boundary: int, got: Pages) -> bool:
        return any(np.array_equal(got, self._state(group, other[boundary - 1]).reshape(-1))
                   for other in self._others(seq, boundary))
