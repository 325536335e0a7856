"""One description and one acceptance check of stored objects (kvplugin.aio.objects):
the exact metadata a store writes, every way a valid object can still be the wrong one,
and the native manager refusing such an object on its load (the vLLM worker's side is
tests/integrations/test_vllm_connector.py's ``mislabelled`` scenario)."""

from __future__ import annotations

import dataclasses

import pytest
from aio_testlib import (
    BS,
    FakeModel,
    admit,
    all_blocks,
    clean,
    evict_device_cache,
    free_blocks,
    make_hybrid,
    make_manager,
    proceed,
    serve,
)

from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.memory import PageShape, StateShape
from kvplugin.aio.objects import Refusal, chunk_spec, state_spec
from kvplugin.aio.values import LoadStatus
from kvplugin.connectors.keys import Namespace, ObjectKey
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.core.request import RequestStatus
from kvplugin.serde import Block, BlockMeta

PROMPT = list(range(100, 130))  # 7 full blocks below the one-token cap
PAGE = PageShape(num_layers=2, num_kv_heads=2, head_size=4, dtype="float16", block_size=4)
STATE = StateShape(num_layers=2, layer_bytes=34, block_size=16)


def _key(kind: str = "kv", n: int = 0) -> ObjectKey:
    ns = Namespace(tenant="acme", model="org/m", layout="0123abcd", group=0)
    return ns.key(n.to_bytes(32, "big"), kind)


def test_a_chunk_is_described_exactly() -> None:
    key = _key()
    spec = chunk_spec(key, PAGE, 8, 2)
    assert spec.meta() == BlockMeta(key=key.id, tenant="acme", model="org/m", layout="0123abcd",
                                    group=0, kind="kv", token_start=8, token_end=16,
                                    dtype="float16", shape=(2, 2, 2, 4, 2, 4), boundary=None)
    assert spec.nbytes == 2 * PAGE.page_bytes == 2 * 256
    assert spec.refusal(Block(spec.meta(), bytes(spec.nbytes))) is None


def test_a_state_is_described_exactly() -> None:
    key = _key("mamba_state")
    spec = state_spec(key, STATE, 28)
    assert spec.meta() == BlockMeta(key=key.id, tenant="acme", model="org/m", layout="0123abcd",
                                    group=0, kind="mamba_state", token_start=0, token_end=28,
                                    dtype="uint8", shape=(1, 2, 34), boundary=28)
    assert spec.refusal(Block(spec.meta(), bytes(68))) is None


@pytest.mark.parametrize(("field", "value"), [
    ("key", _key(n=1).id),  # an object stored under another chunk's key
    ("token_start", 12), ("token_end", 20),  # another chunk's range
    ("dtype", "bfloat16"),  # same size, another type
    ("shape", (2, 2, 2, 4, 4, 2)),  # same bytes, another page shape (heads x head size)
    ("shape", (1, 2, 2, 4, 2, 4)),  # one block
    ("boundary", 16),  # a chunk labelled as a state
    ("tenant", "other"), ("model", "org/x"), ("layout", "0123abce"), ("group", 1),
    ("kind", "mamba_state"),
])
def test_every_mislabelled_field_is_refused(field: str, value: object) -> None:
    spec = chunk_spec(_key(), PAGE, 8, 2)
    meta = dataclasses.replace(spec.meta(), **{field: value})
    assert spec.refusal(Block(meta, bytes(meta.nbytes))) is Refusal.METADATA


def test_a_state_at_another_boundary_is_refused() -> None:
    spec = state_spec(_key("mamba_state"), STATE, 28)
    for meta in (dataclasses.replace(spec.meta(), boundary=24, token_end=24),
                 dataclasses.replace(spec.meta(), boundary=24),
                 dataclasses.replace(spec.meta(), token_start=4)):
        assert spec.refusal(Block(meta, bytes(68))) is Refusal.METADATA


def test_a_payload_of_another_size_is_truncated_and_nothing_is_missing() -> None:
    spec = chunk_spec(_key(), PAGE, 8, 2)
    assert spec.refusal(Block(spec.meta(), bytes(spec.nbytes - 1))) is Refusal.TRUNCATED
    assert spec.refusal(Block(spec.meta(), bytes(spec.nbytes + 2))) is Refusal.TRUNCATED
    assert spec.refusal(None) is Refusal.MISSING


def test_a_description_outside_the_grid_is_misuse() -> None:
    with pytest.raises(ValueError, match="block boundary"):
        chunk_spec(_key(), PAGE, 6, 2)
    with pytest.raises(ValueError, match="block boundary"):
        chunk_spec(_key(), PAGE, 8, 0)
    with pytest.raises(ValueError, match="positive"):
        state_spec(_key("mamba_state"), STATE, 0)


# ------------------------------------------------------------------ the native executor
async def _relabel(mem: MemoryConnector, key: ObjectKey, **changes: object) -> None:
    """Store the object under ``key`` again, valid (checksummed, the key's namespace)
    but with ``changes`` to its metadata and a payload of the size those give."""
    (block,) = await mem.get([key], timeout=1)
    assert block is not None
    meta = dataclasses.replace(block.meta, **changes)
    payload = bytes(memoryview(block.payload).cast("B"))
    payload = (payload * 2)[:meta.nbytes]
    assert await mem.delete([key], timeout=1) == 1
    assert await mem.put([(key, Block(meta, payload))], timeout=1) == 1


async def _stored(mgr: AsyncKVManager, model: FakeModel) -> list[ObjectKey]:
    await serve(mgr, model, mgr.new_request("a", PROMPT, tenant="acme"))
    await mgr.drain()
    evict_device_cache(mgr)
    probe = mgr.new_request("probe", PROMPT, tenant="acme")
    keys = mgr.keyspace.chunk_keys("acme", 0, probe.block_hashes, 0, 7)
    mgr.finish(probe)
    return keys


@pytest.mark.asyncio
@pytest.mark.parametrize("changes", [
    {"token_start": 2 * BS, "token_end": 3 * BS},  # chunk 2's range under chunk 3's key
    {"dtype": "bfloat16"},
    {"shape": (1, 2, 2, 4, 4, 2)},  # a writer of another page shape, same bytes
    {"shape": (2, 2, 2, 4, 2, 4)},  # twice the pages
], ids=["range", "dtype", "page-shape", "size"])
async def test_native_load_refuses_a_valid_object_that_is_not_the_planned_one(
        changes: dict[str, object]) -> None:
    mem = MemoryConnector(capacity_bytes=16 << 20)
    async with make_manager(connector=mem) as mgr:
        model = FakeModel(mgr)
        keys = await _stored(mgr, model)
        await _relabel(mem, keys[3], **changes)
        b = mgr.new_request("b", PROMPT, tenant="acme")
        found = await mgr.lookup(b)
        assert found.external_tokens == 28  # present: only the load can tell
        assert mgr.allocate(b, found) is not None
        outcome = await mgr.wait_load(b)
        # The verified prefix (chunks 0..2) is kept, the mislabelled chunk is refused.
        assert (outcome.status, outcome.loaded_tokens) == (LoadStatus.PARTIAL, 3 * BS)
        assert b.num_computed_tokens == 3 * BS and b.status is RequestStatus.WAITING
        assert model.check_pages(b, 3 * BS) == 3
        stats = mgr.stats()
        assert (stats.objects_refused, stats.loads_failed, stats.recomputed_tokens) == (1, 1,
                                                                                         16)
        assert mem.stats().corrupt_detected == 0  # the connector saw nothing wrong
        mgr.finish(b)
        await mgr.drain()
        assert free_blocks(mgr) == all_blocks(mgr)


@pytest.mark.asyncio
async def test_native_load_refuses_a_state_labelled_for_another_boundary() -> None:
    mem = MemoryConnector(capacity_bytes=16 << 20)
    async with make_hybrid("mamba", other_block_size=16, prefix_match_unit=4,
                           connector=mem) as mgr:
        model = FakeModel(mgr)
        a = mgr.new_request("a", PROMPT, tenant="acme")
        _, step = await admit(mgr, a)
        model.step(a, step.num_new_tokens)
        mgr.after_step([a])
        nxt = mgr.allocate(a)
        assert nxt is not None and nxt.num_new_tokens == 12  # stops at the tail, 28
        model.step(a, nxt.num_new_tokens)
        mgr.after_step([a])
        a.status = RequestStatus.FINISHED_ABORTED
        mgr.finish(a)  # its partial tail at 28 is stored
        await mgr.drain()
        assert mgr.stats().partial_tails == 1
        evict_device_cache(mgr)
        b = mgr.new_request("b", [*PROMPT, 7, 8], tenant="acme")
        state_key = mgr.keyspace.state_key("acme", 1, b.block_hashes, 28)
        await _relabel(mem, state_key, boundary=24, token_end=24)
        found = await mgr.lookup(b)
        assert (found.external_tokens, found.state_boundary) == (28, 28)
        assert mgr.allocate(b, found) is not None
        outcome = await mgr.wait_load(b)
        # Not a checkpoint at 28 without its state: a hybrid load starts over.
        assert (outcome.status, outcome.loaded_tokens) == (LoadStatus.PARTIAL, 0)
        stats = mgr.stats()
        assert (stats.objects_refused, stats.loads_failed, stats.loaded_states) == (1, 1, 0)
        proceed(mgr, model, b)  # recomputed from 0, every input checked by the model
        mgr.finish(b)
        await mgr.drain()
        clean(mgr)
