"""Property: however steps, finishes, new admissions (which take freed blocks at once) and
loop turns interleave, a deferred copy-out stores the bytes of hand-off time. Every prompt
seen is served again afterwards from the tier alone, and the fake model checks every byte
it attends to (and every loaded page) against recomputation."""

from __future__ import annotations

import asyncio

from aio_testlib import FakeModel, admit, all_blocks, free_blocks, make_manager
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import Lookup, StoreMode
from kvplugin.core.request import Request, RequestStatus

BASE = list(range(100, 116))  # a shared 16-token prefix: chunks of 8 tokens are shared
# 24-33 tokens: with 3 answer tokens a request takes up to all 9 usable blocks of 10.
PROMPTS = [BASE + [200 + i] * (8 + 3 * i) for i in range(4)] + [list(range(300, 328))]
ASKED = 12
OPS = st.lists(st.tuples(st.sampled_from(["start", "step", "step", "finish", "swap", "swap",
                                          "turn"]),
                         st.integers(0, 7)), min_size=4, max_size=40)


def _finish(mgr: AsyncKVManager, req: Request) -> None:
    req.status = RequestStatus.FINISHED_STOPPED
    mgr.finish(req)


async def _admit(mgr: AsyncKVManager, model: FakeModel, req: Request, found: Lookup,
                 budget: int) -> bool:
    """Allocate with a lookup made earlier: no await before the allocation, so it may take
    blocks whose store jobs have not run yet (the reuse hook's path)."""
    adm = mgr.allocate(req, found, num_new_tokens=budget)
    if adm is not None and adm.loading:
        await mgr.wait_load(req)
        adm = mgr.allocate(req, num_new_tokens=budget)
    if adm is None:  # no room: nothing (more) taken
        _finish(mgr, req)
        return False
    req.status = RequestStatus.RUNNING
    model.step(req, adm.num_new_tokens)
    mgr.after_step([req])
    return True


async def _script(mgr: AsyncKVManager, model: FakeModel,
                  ops: list[tuple[str, int]]) -> None:
    # Every lookup up front: the only awaits left are the script's turns and loads, so
    # store jobs often have not run when a finish frees their blocks for an admission.
    asked: list[tuple[Request, Lookup]] = []
    for i in range(ASKED):
        req = mgr.new_request(f"r{i}", PROMPTS[i % len(PROMPTS)], tenant="acme")
        asked.append((req, await mgr.lookup(req)))
    running: list[Request] = []
    for op, arg in ops:
        if op == "start" and asked:
            req, found = asked.pop(arg % len(asked))
            if await _admit(mgr, model, req, found, 4 + 2 * arg):
                running.append(req)
        elif op == "turn":  # let store jobs run part of their copies
            for _ in range(arg):
                await asyncio.sleep(0)
        elif op == "swap" and running and asked:  # a finish, then at once an admission
            _finish(mgr, running.pop(arg % len(running)))
            req, found = asked.pop(0)
            if await _admit(mgr, model, req, found, 16):
                running.append(req)
        elif op in ("step", "finish") and running:
            req = running[arg % len(running)]
            nxt = None if op == "finish" else mgr.allocate(req, num_new_tokens=1 + arg)
            if nxt is None or req.num_output_tokens >= 3:
                running.remove(req)
                _finish(mgr, req)
            else:
                model.step(req, nxt.num_new_tokens)
                mgr.after_step([req])
    for req in running:
        _finish(mgr, req)
    for req, _ in asked:  # never admitted: nothing to free
        _finish(mgr, req)


async def _reload_every_prompt(mgr: AsyncKVManager, model: FakeModel) -> int:
    checked = 0
    for i, prompt in enumerate(PROMPTS):
        await mgr.drain()
        assert mgr.core.reset_prefix_cache()  # only the tier can serve it now
        req = mgr.new_request(f"check{i}", prompt, tenant="acme")
        adm, step = await admit(mgr, req)
        model.step(req, step.num_new_tokens)  # checks what it attends to, loaded included
        checked += model.check_pages(req, adm.external_tokens)
        _finish(mgr, req)
    await mgr.drain()
    return checked


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_deferred_copies_store_the_bytes_of_hand_off_time(ops: list[tuple[str, int]]) -> None:
    async def main() -> None:
        # 10 blocks (9 usable, a prompt takes up to 8): admissions must take freed blocks.
        async with make_manager(num_blocks=10, store_mode=StoreMode.COPY,
                                chunk_blocks=2) as mgr:
            model = FakeModel(mgr)
            await _script(mgr, model, ops)
            await _reload_every_prompt(mgr, model)
            assert free_blocks(mgr) == all_blocks(mgr)
            assert mgr.num_pending_jobs == 0 and mgr.num_held_blocks == 0
            assert not mgr._stores.copies._watches  # type: ignore[union-attr]
            assert not mgr.core.block_pool._reuse_watchers
    asyncio.run(main())


def test_the_script_does_reuse_blocks_before_their_store_ran() -> None:
    """The property's interleavings include the hook's path (not only the job's)."""
    ops = [("start", 0), ("start", 3), ("start", 0), ("start", 0), ("start", 0),
           ("start", 0), ("swap", 1)]  # found by hypothesis.find

    async def main() -> int:
        async with make_manager(num_blocks=10, store_mode=StoreMode.COPY,
                                chunk_blocks=2) as mgr:
            model = FakeModel(mgr)
            await _script(mgr, model, ops)
            assert await _reload_every_prompt(mgr, model) > 0
            return mgr.stats().copies_on_reuse
    assert asyncio.run(main()) >= 1
