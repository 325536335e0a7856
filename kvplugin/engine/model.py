"""A fake model runner: simulated step time, deterministic KV, and a check of every hit.

Token ``t`` of a request has a KV value ``f(identity, tokens[:t + 1])``, where the identity
names what a real model's KV depends on besides the tokens: the tenant and the LoRA adapter
(a stand-in: it makes a leak between tenants visible in the bytes). A request that declares a
shared prefix of a group (``prefix_group``, ``shared_prefix_tokens=K``) computes its first
``K`` tokens as the group, not as the tenant: those are the bytes every member may share.

How a value is made, cheaply (the model runs on the event loop, so its CPU time is loop
lag): the tokens are cut into segments of :data:`SEGMENT` tokens, and a chain of 8-byte
BLAKE2b digests, one per segment, covers the identity and every token before the segment
(the tenant is mixed into the link of every segment holding a private token). Within a
segment a token's value mixes the segment's digest with a polynomial rolling sum of the
segment's tokens up to it (a numpy ``cumsum``), through the splitmix64 finalizer: one hash
per segment in Python, the rest vectorized (a decode's single token in Python ints, bit for
bit the same), and still a function of the whole prefix. The digests are the model's own,
not the core's block hashes: a check derived from the cache's hashes could not see a cache
that keys blocks wrongly.

A page's slot (one token of one K/V layer) holds the token's 16-byte value xor'ed into the
first bytes of a per-(group, K/V, layer) template, and the rest of the template as is:
every byte of the page is written and checked, but only the value part is per-token work.

Because the function is known, every block a request gets for free (a device hit, or bytes
loaded from a tier) can be checked against what computing it would have written: a
difference is a ``kv_mismatch``, and one that equals another tenant's KV for the same tokens
(any identity seen so far: plain, or a group's shared prefix) is a ``cross_tenant_hit`` as
well. A group member hitting the group's shared prefix gets exactly its own expected bytes:
neither a mismatch nor a cross-tenant hit.

Hybrid layouts: a sliding-window group writes KV pages like a full one, but the blocks that
left the window are the core's null block, never written and never checked (a null block
*inside* the window a request resumes with is a mismatch: its KV is missing). A Mamba group
holds one recurrent state per request: a chunk ending at token ``n`` writes the state
``f(identity, tokens[:n])`` (token ``n - 1``'s value) into the table slot of ``n`` (slot
``ceil(n / block_size) - 1``), and every chunk first reads the state it resumes from and
checks it, so a state that came from a device hit, a loaded checkpoint or a restored lagging
state is compared with recomputation exactly when the model would use it.

A step awaits ``asyncio.sleep`` for its simulated cost, the way an engine awaits the GPU: the
event loop, and so every load and store in flight, keeps running meanwhile. The model's own
CPU work stands in for the GPU's, so it overlaps that time, in slices (see :class:`FakeModel`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np

from kvplugin.aio.memory import HostKVMemory, PageShape, StateShape
from kvplugin.costs import ModelCost, WorkShape
from kvplugin.engine.clock import Clock, RealClock

__all__ = ["SEGMENT", "SLICE_BYTES", "CheckResult", "FakeModel", "KVIdentity", "StepCosts",
           "Work"]

T = TypeVar("T")

SLICE_BYTES = 1 << 20  # page bytes written or compared per slice of loop time (~0.2-0.5 ms)
SEGMENT = 32  # tokens per link of the digest chain: one Python hash per SEGMENT tokens
_VALUE = 16  # bytes of a token's value
_SCALAR = 4  # up to this many tokens (decodes), Python ints beat numpy's per-call overhead
Pages = np.ndarray[Any, np.dtype[np.uint8]]
U64 = np.ndarray[Any, np.dtype[np.uint64]]

# Odd multipliers: the rolling sum's base, splitmix64's constants, the two words' tweaks.
_MASK = (1 << 64) - 1
_BASE, _GOLDEN = 0x100000001B3, 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_TWEAKS = (0x243F6A8885A308D3, 0x13198A2E03707344)
_POWERS = [pow(_BASE, i + 1, 1 << 64) for i in range(SEGMENT)]
_NP_POWERS = np.array(_POWERS, dtype=np.uint64)
_NP_TWEAKS = np.array(_TWEAKS, dtype=np.uint64)
_ROOT = b"kvplugin/fake-model/v2"


def _digest8(*parts: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(b"".join(parts), digest_size=8).digest(), "little")


def _mix64(x: U64) -> U64:
    """splitmix64's finalizer, elementwise (uint64 arrays wrap: no overflow warnings)."""
    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
    out: U64 = x ^ (x >> np.uint64(31))
    return out


def _mix64_int(x: int) -> int:
    """:func:`_mix64` on one Python int, bit for bit."""
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * _M1) & _MASK
    x = ((x ^ (x >> 27)) * _M2) & _MASK
    return x ^ (x >> 31)


@dataclass(frozen=True, slots=True)
class KVIdentity:
    """Whose KV a request computes: the tenant's (and its adapter's), except the first
    ``shared`` tokens, the prefix group's."""

    tenant: str
    lora: str | None = None
    group: str | None = None
    shared: int = 0
    root: int = field(init=False, repr=False)  # the chain's first link
    tenant_key: int = field(init=False, repr=False)  # mixed into every private token

    def __post_init__(self) -> None:
        if (self.group is None) != (self.shared == 0) or self.shared < 0:
            raise ValueError(f"a prefix group and a positive shared length go together, got "
                             f"group={self.group!r}, shared={self.shared!r}")
        lora = (self.lora or "").encode()
        root = _digest8(_ROOT, b"\x00group\x00", self.group.encode(), b"\x00", lora) \
            if self.group is not None else _digest8(_ROOT)
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "tenant_key",
                           _digest8(_ROOT, b"\x00tenant\x00", self.tenant.encode(), b"\x00",
                                    lora))


@dataclass(eq=False, slots=True)
class _Chain:
    """The digest chain of one identity over one token list (which may grow)."""

    ident: KVIdentity
    tokens: list[int]  # a request's token list itself: it grows as outputs are sampled
    links: list[int] = field(default_factory=list)  # links[s]: before segment s

    def __post_init__(self) -> None:
        self.links.append(self.ident.root)

    def _extend(self, segment: int) -> None:
        """Links up to ``links[segment]`` (needs the tokens of every segment before it)."""
        s = len(self.links) - 1
        if segment <= s:
            return
        raw = np.asarray(self.tokens[s * SEGMENT:segment * SEGMENT], dtype="<i8").tobytes()
        mark = self.ident.tenant_key.to_bytes(8, "little")
        for i in range(segment - s):
            private = (s + i + 1) * SEGMENT > self.ident.shared  # holds a private token
            chunk = raw[i * SEGMENT * 8:(i + 1) * SEGMENT * 8]
            self.links.append(_digest8(self.links[-1].to_bytes(8, "little"),
                                       mark if private else b"", chunk))

    def values(self, lo: int, hi: int) -> Pages:
        """(hi - lo, 16) bytes: the values of tokens ``[lo, hi)``."""
        if not 0 <= lo < hi <= len(self.tokens):
            raise ValueError(f"tokens [{lo}, {hi}) of {len(self.tokens)}")
        self._extend((hi - 1) // SEGMENT)
        if hi - lo <= _SCALAR:
            raw = b"".join(self._value(t) for t in range(lo, hi))
            return np.frombuffer(raw, dtype=np.uint8).reshape(hi - lo, _VALUE)
        return self._values(lo, hi)

    def _value(self, t: int) -> bytes:
        """Token ``t``'s value with Python ints (the links are there)."""
        s = t // SEGMENT
        a = s * SEGMENT
        seg = self.tokens[a:t + 1]
        roll = sum((tok + 1) * p for tok, p in zip(seg, _POWERS[:len(seg)], strict=True)) & _MASK
        key = self.links[s] ^ (self.ident.tenant_key if t >= self.ident.shared else 0)
        v = _mix64_int(key ^ roll)
        return b"".join(_mix64_int(v ^ k).to_bytes(8, "little") for k in _TWEAKS)

    def _values(self, lo: int, hi: int) -> Pages:
        """:meth:`_value` for every token of ``[lo, hi)``, in numpy."""
        first, last = lo // SEGMENT, (hi - 1) // SEGMENT
        a = first * SEGMENT
        tok = np.asarray(self.tokens[a:hi], dtype=np.uint64)
        pos = np.arange(hi - a)
        seg, off = pos // SEGMENT, pos % SEGMENT
        sums = np.cumsum((tok + np.uint64(1)) * _NP_POWERS[off], dtype=np.uint64)
        # The rolling sum restarts at every segment: take away the sum before it.
        before = np.concatenate((np.zeros(1, np.uint64), sums))[np.arange(last - first + 1)
                                                                  * SEGMENT]
        keys = np.array(self.links[first:last + 1], dtype=np.uint64)[seg]
        keys[pos >= self.ident.shared - a] ^= np.uint64(self.ident.tenant_key)
        v = _mix64(keys ^ (sums - before[seg]))[lo - a:]
        words = _mix64(v[:, None] ^ _NP_TWEAKS[None, :]).astype("<u8", copy=False)
        out: Pages = words.view(np.uint8).reshape(hi - lo, _VALUE)
        return out


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Simulated time: per prefill token, and once per step that decodes."""

    prefill_token_s: float = 0.0
    decode_step_s: float = 0.0

    def of(self, prefill_tokens: int, decodes: int) -> float:
        return prefill_tokens * self.prefill_token_s + (self.decode_step_s if decodes else 0.0)

    def step_s(self, work: Sequence[WorkShape]) -> float:
        return self.of(sum(w.num_tokens for w in work if not w.decode),
                       sum(w.decode for w in work))


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


def _drain(gen: Generator[None, None, T]) -> T:
    """Run a sliced computation to its end at once."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return cast(T, stop.value)


async def _adrain(gen: Generator[None, None, T]) -> T:
    """Run a sliced computation, letting the loop run between slices."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return cast(T, stop.value)
        await asyncio.sleep(0)


class FakeModel:
    """Writes KV for the scheduled tokens, checks what a request got for free, and takes
    the simulated time of a step.

    Its CPU work stands in for the GPU's, so it is kept off the loop's critical path: pages
    are written and compared in slices of at most :data:`SLICE_BYTES` with the loop running
    in between, and a step's simulated time runs from its start, so the writes and the
    step's checks (``execute(then=...)``) overlap it instead of adding to it, as a GPU
    computes while the host waits."""

    def __init__(self, memory: HostKVMemory, costs: StepCosts | ModelCost | None = None,
                 vocab: int = 32000, clock: Clock | None = None) -> None:
        self.memory = memory
        self.costs = costs or StepCosts()
        self.clock = clock or RealClock()  # a step's cost is slept, or simulated
        self.vocab = vocab
        self._seqs: dict[str, _Chain] = {}
        self._identities: dict[KVIdentity, None] = {}  # of every request seen, in order
        # Per group, bytes that differ per (K/V, layer) (and per group), xor'ed into every
        # slot, so a copy that swaps layers or groups cannot pass the check.
        self._templates = [self._template(g) for g in range(memory.num_groups)]
        self._per_slice = [max(1, SLICE_BYTES // memory.page_bytes(g))
                           for g in range(memory.num_groups)]
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

    def _state_shape(self, group: int) -> StateShape:
        shape = self.memory.shapes[group]
        if not isinstance(shape, StateShape):
            raise TypeError(f"group {group} holds attention pages, not states")
        return shape

    def _is_state(self, group: int) -> bool:
        return isinstance(self.memory.shapes[group], StateShape)

    def _template(self, group: int) -> Pages:
        """An attention page's slot is its token's value xor'ed into the first bytes of
        the (K/V, layer)'s template, and the template's other bytes as they are (writing
        and checking those is a broadcast, not per-token work): (K/V, layer, 1, slot) for
        a page, (layer, 1, 16) for a state, whose value repeats across the layer."""
        rng = np.random.default_rng([0x6B76, group])  # fixed: the same in every process
        shape = self.memory.shapes[group]
        if isinstance(shape, StateShape):
            return rng.integers(0, 256, (shape.num_layers, 1, _VALUE), dtype=np.uint8)
        width = shape.page_bytes // (shape.kv_parts * shape.num_layers * shape.block_size)
        return rng.integers(0, 256, (shape.kv_parts, shape.num_layers, 1, width),
                            dtype=np.uint8)

    # ------------------------------------------------------------------ requests
    def add(self, request_id: str, tokens: list[int], tenant: str, lora: str | None, *,
            prefix_group: str | None = None, shared_prefix_tokens: int = 0) -> None:
        """Serve ``request_id``, whose token list is ``tokens`` (it may grow); with a prefix
        group, its first ``shared_prefix_tokens`` tokens are computed as the group's."""
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already in the model")
        ident = KVIdentity(tenant, lora, prefix_group, shared_prefix_tokens)
        self._identities[ident] = None
        self._seqs[request_id] = _Chain(ident, tokens)

    def remove(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)

    # ------------------------------------------------------------------ a step
    async def execute(self, work: Sequence[Work],
                      then: Callable[[], Awaitable[None]] | None = None) -> list[int | None]:
        """Write the KV of every scheduled token, run ``then`` (what must follow the
        writes: the engine's checks of hits on blocks this very step computes), and return
        once the step's simulated time (counted from the start) is over: a token for each
        request whose last token was computed (None otherwise)."""
        t0 = self.clock.now()
        cost = self.costs.step_s(work)
        sampled: list[int | None] = []
        for i, w in enumerate(work):
            if i:
                await asyncio.sleep(0)  # the GPU's work: let the loop run I/O in between
            sampled.append(await _adrain(self._compute(w)))
        if then is not None:
            await then()
        self.steps += 1
        self.busy_s += cost
        await self.clock.elapse(t0, cost)
        return sampled

    def _compute(self, w: Work) -> Generator[None, None, int | None]:
        seq = self._seqs[w.request_id]
        end = w.start + w.num_tokens
        if w.num_tokens < 1 or end > len(seq.tokens):
            raise ValueError(f"{w.request_id}: cannot compute tokens [{w.start}, {end}) of "
                             f"{len(seq.tokens)}")
        values = seq.values(w.start, end)
        for g, ids in enumerate(w.block_ids):
            if self._is_state(g):
                self._advance_state(g, seq, ids, w.start, end, values[-1])
            else:
                yield from self._write_pages(g, ids, values, w.start, end)
        self.computed_tokens += w.num_tokens
        if end < len(seq.tokens):
            return None
        return int.from_bytes(values[-1, :4].tobytes(), "little") % self.vocab

    def _write_pages(self, group: int, ids: list[int], values: Pages, start: int,
                     end: int) -> Generator[None, None, None]:
        bs = self._shape(group).block_size
        tpl = self._templates[group]
        v = min(_VALUE, tpl.shape[-1])
        mixed = values[None, None, :, :v] ^ tpl[..., :v]  # one array for the whole chunk
        per = self._per_slice[group]
        for i, b in enumerate(range(start // bs, -(-end // bs))):
            if i and not i % per:
                yield
            lo, hi = max(start, b * bs), min(end, (b + 1) * bs)
            # A block a step writes is never null, not even in a window group: the core
            # frees blocks only once they left the window of the next token to compute.
            slots = self._slots(group, ids[b])[:, :, lo - b * bs:hi - b * bs]
            slots[..., :v] = mixed[:, :, lo - start:hi - start]
            slots[..., v:] = tpl[..., v:]

    def _advance_state(self, group: int, seq: _Chain, ids: list[int], start: int,
                       end: int, last: Pages) -> None:
        """Read (and check) the state the chunk resumes from, write the state at its end."""
        bs = self.memory.shapes[group].block_size
        if start:
            self.check_state(seq, group, ids, start)
        row = self.memory.pages(group, [ids[-(end // -bs) - 1]])[0]
        row[:] = self._state(group, last).reshape(-1)

    def _slots(self, group: int, block_id: int) -> Pages:
        """The page of ``block_id`` as (K/V, layer, token slot, bytes per slot): a view."""
        shape = self._shape(group)
        row: Pages = self.memory.pages(group, [block_id])[0]
        return row.reshape(shape.kv_parts, shape.num_layers, shape.block_size, -1)

    def _pages_ok(self, group: int, got: Pages, values: Pages) -> np.ndarray[Any, Any]:
        """Per page of ``got`` (pages, K/V, layer, slot, bytes), whether it holds what
        computing ``values`` (pages * block_size, 16) writes: every byte compared (the
        template's part 8 bytes at a time when the slot allows)."""
        tpl = self._templates[group][None]
        width = tpl.shape[-1]
        v = min(_VALUE, width)
        k, bs = got.shape[0], got.shape[3]
        want = values.reshape(k, 1, 1, bs, _VALUE)[..., :v] ^ tpl[..., :v]
        ok: np.ndarray[Any, Any] = (got[..., :v] == want).reshape(k, -1).all(axis=1)
        if v == width:
            return ok
        if width % 8 == 0 and got.flags.c_contiguous:
            got, tpl, v = got.view(np.uint64), tpl.view(np.uint64), v // 8
        ok &= (got[..., v:] == tpl[..., v:]).reshape(k, -1).all(axis=1)
        return ok

    def _state(self, group: int, value: Pages) -> Pages:
        """The state page after the token whose value is ``value``: (layer, bytes), the
        value xor'ed with the layer's template, repeated across the layer's bytes."""
        shape = self._state_shape(group)
        reps = -(-shape.layer_bytes // _VALUE)
        raw = value.reshape(1, 1, _VALUE) ^ self._templates[group]
        full = np.broadcast_to(raw, (shape.num_layers, reps, _VALUE))
        out: Pages = full.reshape(shape.num_layers, reps * _VALUE)[:, :shape.layer_bytes]
        return out

    # ------------------------------------------------------------------ checks
    def check(self, request_id: str, block_ids: tuple[list[int], ...], start: int,
              end: int) -> CheckResult:
        """Compare the request's full attention blocks covering tokens ``[start, end)``
        with what computing them writes; count (and remember) mismatches and cross-tenant
        bytes. A window group's null blocks before the window of token ``end`` are skipped;
        state groups are checked when a step reads them (:meth:`check_state`)."""
        return _drain(self._check(request_id, block_ids, start, end))

    async def acheck(self, request_id: str, block_ids: tuple[list[int], ...], start: int,
                     end: int) -> CheckResult:
        """:meth:`check`, in slices with the loop running in between (the blocks must stay
        the request's meanwhile)."""
        return await _adrain(self._check(request_id, block_ids, start, end))

    def _check(self, request_id: str, block_ids: tuple[list[int], ...], start: int,
               end: int) -> Generator[None, None, CheckResult]:
        seq = self._seqs[request_id]
        pages = bad = cross = 0
        for g, ids in enumerate(block_ids):
            if self._is_state(g):
                continue
            n, wrong, foreign = yield from self._check_group(seq, g, ids, start, end)
            pages, bad, cross = pages + n, bad + wrong, cross + foreign
        self.pages_checked += pages
        self.kv_mismatches += bad
        self.cross_tenant_hits += cross
        return CheckResult(pages, bad, cross)

    def _check_group(self, seq: _Chain, g: int, ids: list[int], start: int,
                     end: int) -> Generator[None, None, tuple[int, int, int]]:
        """(pages checked, mismatches, cross-tenant) of one attention group: pages compared
        a slice at a time, the costly search for the writer only for wrong ones."""
        shape = self._shape(g)
        bs = shape.block_size
        first, stop = start // bs, end // bs
        # Token `end` attends to [end - window + 1, end] (chunked local: to its own chunk,
        # [end // C * C, end]): blocks wholly before that may be null (what the group's
        # kind says the core skips); every later one must hold its KV.
        needed = shape.skipped_blocks(end)
        blocks = [b for b in range(first, stop) if ids[b] or b >= needed]
        live = [b for b in blocks if ids[b]]
        bad = len(blocks) - len(live)  # a null block inside the window: KV nobody wrote
        cross = 0
        if not live:
            return len(blocks), bad, cross
        values = seq.values(first * bs, stop * bs).reshape(stop - first, bs, _VALUE)
        per = self._per_slice[g]
        for i in range(0, len(live), per):
            if i:
                yield
            part = live[i:i + per]
            got = self.memory.pages(g, [ids[b] for b in part])
            got = got.reshape(len(part), shape.kv_parts, shape.num_layers, bs, -1)
            ok = self._pages_ok(g, got, values[[b - first for b in part]])
            for j in np.flatnonzero(~ok).tolist():
                bad += 1
                cross += self._written_by_another(g, seq, part[j], got[j:j + 1])
        return len(blocks), bad, cross

    def check_state(self, seq: _Chain, group: int, ids: list[int], boundary: int) -> bool:
        """Compare the state a request resumes from at ``boundary`` with recomputation;
        count a mismatch (and a cross-tenant hit when it is another tenant's state)."""
        slot = -(boundary // -self.memory.shapes[group].block_size) - 1
        block = ids[slot] if slot < len(ids) else 0
        self.states_checked += 1
        got = self.memory.pages(group, [block])[0] if block else None  # null: no state
        want = self._state(group, seq.values(boundary - 1, boundary)[0])
        if got is not None and np.array_equal(got, want.reshape(-1)):
            return True
        self.state_mismatches += 1
        self.kv_mismatches += 1
        if got is not None and self._state_of_another(group, seq, boundary, got):
            self.cross_tenant_hits += 1
        return False

    def _others(self, seq: _Chain) -> list[_Chain]:
        """``seq``'s tokens computed as every identity seen of another tenant (the same
        tenant's other adapter is a mismatch, not a leak)."""
        return [_Chain(ident, seq.tokens) for ident in self._identities
                if ident.tenant != seq.ident.tenant]

    def _written_by_another(self, group: int, seq: _Chain, block: int, got: Pages) -> bool:
        bs = self._shape(group).block_size
        return any(bool(self._pages_ok(group, got, other.values(block * bs, (block + 1) * bs))[0])
                   for other in self._others(seq))

    def _state_of_another(self, group: int, seq: _Chain, boundary: int, got: Pages) -> bool:
        return any(np.array_equal(got, self._state(
            group, other.values(boundary - 1, boundary)[0]).reshape(-1))
                   for other in self._others(seq))
