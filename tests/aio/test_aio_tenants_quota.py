"""Tenants (kvplugin.aio.tenants): isolation against adversarial tenants, shared prefix
groups, the three quotas with exact counts, quotas off changing nothing, stats, misuse."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
from aio_testlib import MIB, FakeModel, clean, evict_device_cache, layout, serve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.tenants import PrefixGroup, TenantPolicy, TenantQuota, TenantStats
from kvplugin.aio.values import LoadStatus, OffloadConfig, OffloadStats
from kvplugin.connectors.keys import InvalidName
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.connectors.tiered import TieredConnector
from kvplugin.core.manager import KVCacheManager
from kvplugin.core.request import Request, RequestStatus

BS = 4
PAGE = 256  # bytes of one block (and one chunk) of the test layout
SYS = list(range(500, 516))  # a 16-token system prompt
USER = list(range(900, 912))


def _tier(name: str, capacity: int) -> MemoryConnector:
    conn = MemoryConnector(capacity_bytes=capacity, name=name)
    conn.capabilities = dataclasses.replace(conn.capabilities, tier=name)
    return conn


def make(policy: TenantPolicy | None = None, *, num_blocks: int = 32,
         host: int = 16 * MIB, remote: int | None = None, **config: Any) -> AsyncKVManager:
    kv = layout(num_blocks)
    core = KVCacheManager(kv, max_model_len=1024, scheduler_block_size=BS, hash_block_size=BS,
                          log_stats=True)
    conn: Any = _tier("memory", host)
    if remote is not None:
        conn = TieredConnector([conn, _tier("redis", remote)])
    return AsyncKVManager(core, conn, OffloadConfig(model="org/tiny-model", **config),
                          tenants=policy)


class GroupModel(FakeModel):
    """The fake model with prefix groups: a scoped request's first S tokens have the KV of
    the group (every member computes the same bytes), the rest its tenant's own."""

    def __init__(self, mgr: AsyncKVManager) -> None:
        super().__init__(mgr)
        self.shared: dict[str, tuple[str, int]] = {}  # request id -> (group, S)
        self._rid = ""

    def step(self, req: Request, n: int) -> None:
        self._rid = req.request_id
        super().step(req, n)

    def check_pages(self, req: Request, upto: int) -> int:
        self._rid = req.request_id
        return super().check_pages(req, upto)

    def _digests(self, tenant: str, group: int, tokens: Sequence[int]) -> list[bytes]:  # type: ignore[override]
        scope = self.shared.get(self._rid)
        if scope is None:
            return FakeModel._digests(tenant, group, tokens)
        name, s = scope
        head = FakeModel._digests(f"group:{name}", group, tokens[:s])
        if len(tokens) <= s:
            return head
        return head + FakeModel._digests(f"{tenant}+{head[-1].hex()}", group, tokens[s:])[1:]


def cached_ids(mgr: AsyncKVManager) -> list[int]:
    """Free-but-cached blocks, in the core's eviction order."""
    return [b.block_id for b in mgr.core.block_pool.free_block_queue if b.block_hash is not None]


def queue(mgr: AsyncKVManager) -> list[int]:
    return [b.block_id for b in mgr.core.block_pool.free_block_queue]


def table(mgr: AsyncKVManager, req: Request) -> list[int]:
    return [i for i in mgr.core.get_block_ids(req.request_id)[0] if i]


SUMMED = ("loads", "loads_failed", "loads_cancelled", "loaded_bytes", "stores", "stored_chunks",
          "stored_bytes", "stores_failed", "stores_shed", "stores_shed_quota",
          "stores_deduplicated", "quota_refusals", "quota_evictions")


def assert_sums(mgr: AsyncKVManager) -> dict[str, TenantStats]:
    """Every per-tenant counter sums to the global one."""
    g: OffloadStats = mgr.stats()
    ts = mgr.tenant_stats()
    for name in SUMMED:
        assert sum(getattr(t, name) for t in ts.values()) == getattr(g, name), name
    assert sum(t.hit_tokens["device"] for t in ts.values()) == g.local_hit_tokens
    for tier in mgr.tiers:
        assert sum(t.hit_tokens[tier] for t in ts.values()) \
            == g.hit_tokens_by_tier.get(tier, 0), tier
    return ts


# --------------------------------------------------------------------------- isolation


@pytest.mark.asyncio
async def test_identical_prompts_get_no_cross_tenant_hit_at_any_tier() -> None:
    prompt = SYS + USER
    async with make(remote=16 * MIB) as mgr:
        model = FakeModel(mgr)
        host, remote = mgr.connector.tiers  # type: ignore[attr-defined]
        a1 = mgr.new_request("a1", prompt, tenant="acme")
        await serve(mgr, model, a1)
        await mgr.drain()
        evil = mgr.new_request("e1", prompt, tenant="evil")
        found = await mgr.lookup(evil)  # acme's blocks are on the device and in both tiers
        assert (found.local_tokens, found.external_tokens, found.present) == (0, 0, (0,))
        await serve(mgr, model, evil, finish=False)
        assert model.check_pages(evil, 28) == 7  # its own KV, computed
        mgr.finish(evil)
        await mgr.drain()
        a_keys = mgr.keyspace.chunk_keys("acme", 0, a1.block_hashes, 0, 7)
        assert await host.lookup(a_keys, timeout=1) == await remote.lookup(a_keys, timeout=1) == 7
        evict_device_cache(mgr)
        for level, tier in enumerate(("memory", "redis")):
            e = mgr.new_request(f"e-{tier}", prompt, tenant="evil2")
            assert (await mgr.lookup(e)).external_tokens == 0  # nothing at this tier either
            mgr.finish(e)
            a = mgr.new_request(f"a-{tier}", prompt, tenant="acme")
            adm = await serve(mgr, model, a, finish=False)  # the owner does hit, verified
            assert adm.external_by_tier == {tier: 24} and model.check_pages(a, 24) == 6
            mgr.finish(a)
            await mgr.drain()
            evict_device_cache(mgr)
            if level == 0:
                await host.delete(a_keys, timeout=1)  # next round: only the remote has them
        ts = assert_sums(mgr)
        assert ts["evil"].hit_tokens == {"device": 0, "memory": 0, "redis": 0}
        assert ts["evil2"].hit_tokens == {"device": 0, "memory": 0, "redis": 0}
        assert ts["acme"].hit_tokens == {"device": 0, "memory": 24, "redis": 24}
        clean(mgr)


PROMPTS = [SYS + USER, SYS + USER[:4], SYS[:8] + USER, list(range(300, 324))]


def _aligned_common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return min(n, len(b) - 1) // BS * BS


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, len(PROMPTS) - 1),
                          st.booleans()), min_size=1, max_size=10))
def test_adversarial_tenants_hit_only_their_own_prefixes(steps: list[tuple[str, int, bool]]
                                                         ) -> None:
    async def run() -> None:
        async with make(num_blocks=24, host=6 * 1024, remote=16 * MIB) as mgr:
            model = FakeModel(mgr)
            served: dict[str, list[list[int]]] = {}
            for i, (tenant, p, evict) in enumerate(steps):
                prompt = PROMPTS[p]
                bound = max((_aligned_common(s, prompt) for s in served.get(tenant, [])),
                            default=0)
                req = mgr.new_request(f"r{i}", prompt, tenant=tenant)
                adm = await serve(mgr, model, req, finish=False)
                got = adm.local_tokens + adm.external_tokens
                assert got <= bound, (tenant, p, got, bound)  # never another tenant's
                model.check_pages(req, got)  # and the bytes are this tenant's
                mgr.finish(req)
                await mgr.drain()
                served.setdefault(tenant, []).append(prompt)
                if evict:
                    evict_device_cache(mgr)
            assert_sums(mgr)
            clean(mgr)

    asyncio.run(run())


# --------------------------------------------------------------------------- prefix groups

GROUPS = TenantPolicy({t: TenantQuota() for t in ("a", "b", "c", "e")},
                      groups=[PrefixGroup("sys", frozenset({"a", "b", "e"}), 20)])


@pytest.mark.asyncio
async def test_prefix_group_shares_its_declared_prefix_and_nothing_else() -> None:
    prompt = SYS + USER  # every tenant sends exactly the same tokens
    async with make(GROUPS) as mgr:
        model = GroupModel(mgr)

        def new(rid: str, tenant: str, shared: int | None = 16) -> Request:
            if shared is None:
                return mgr.new_request(rid, prompt, tenant=tenant)
            model.shared[rid] = ("sys", 16)
            return mgr.new_request(rid, prompt, tenant=tenant, prefix_group="sys",
                                   shared_prefix_tokens=shared)

        await serve(mgr, model, new("a1", "a"))
        b1 = new("b1", "b", 18)  # cut down to 16, the last restorable boundary
        assert (await mgr.lookup(b1)).local_tokens == 16  # the system prompt, not 24
        await serve(mgr, model, b1, finish=False)
        assert model.check_pages(b1, 28) == 7  # shared blocks hold the group's KV
        mgr.finish(b1)
        for rid, tenant in (("c1", "c"), ("a2", "a")):  # not a member / not opted in
            r = new(rid, tenant, None)
            assert (await mgr.lookup(r)).local_tokens == 0
            mgr.finish(r)
        await mgr.drain()
        evict_device_cache(mgr)
        e1 = new("e1", "e")  # a member that never sent it: the group's tier objects only
        adm = await serve(mgr, model, e1, finish=False)
        assert (adm.local_tokens, adm.external_tokens) == (0, 16)
        assert model.check_pages(e1, 28) == 7
        mgr.finish(e1)
        c2 = new("c2", "c", None)
        assert (await mgr.lookup(c2)).external_tokens == 0
        mgr.finish(c2)
        with pytest.raises(ValueError, match="not a member of prefix group 'sys'"):
            mgr.new_request("c3", prompt, tenant="c", prefix_group="sys",
                            shared_prefix_tokens=16)
        await mgr.drain()
        assert_sums(mgr)
        clean(mgr)


@pytest.mark.asyncio
async def test_prefix_group_misuse_is_refused() -> None:
    async with make(GROUPS) as mgr:
        p = SYS + USER
        with pytest.raises(ValueError, match=r"unknown prefix group 'nope'.*declares sys"):
            mgr.new_request("x", p, tenant="a", prefix_group="nope", shared_prefix_tokens=8)
        with pytest.raises(ValueError, match="go together"):
            mgr.new_request("x", p, tenant="a", prefix_group="sys")
        with pytest.raises(ValueError, match="go together"):
            mgr.new_request("x", p, tenant="a", shared_prefix_tokens=8)
        for bad in (0, 21, 8.0):  # over max_prefix_tokens (20), not an int
            with pytest.raises(ValueError, match=r"must be an int in \[1, 20\]"):
                mgr.new_request("x", p, tenant="a", prefix_group="sys",
                                shared_prefix_tokens=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"in \[1, 6\]"):  # longer than the prompt
            mgr.new_request("x", p[:6], tenant="a", prefix_group="sys", shared_prefix_tokens=8)
        # Less than one restorable unit: nothing to share, a private request.
        r = mgr.new_request("x", p, tenant="a", prefix_group="sys", shared_prefix_tokens=3)
        assert mgr.tenant_of(r) == "a" and type(mgr.tenant_of(r)) is str
        assert r.cache_salt == "tenant=a"
        mgr.finish(r)


# --------------------------------------------------------------------------- quotas


@pytest.mark.asyncio
async def test_in_use_quota_refuses_admissions_exactly_and_takes_nothing() -> None:
    policy = TenantPolicy({"a": TenantQuota(max_blocks_in_use=8), "b": TenantQuota()})
    async with make(policy) as mgr:
        model = FakeModel(mgr)
        a1 = mgr.new_request("a1", list(range(20)), tenant="a")  # 5 blocks
        await serve(mgr, model, a1, outputs=0, finish=False)
        a2 = mgr.new_request("a2", list(range(100, 116)), tenant="a")  # 4 more: 9 > 8
        free, q = mgr.core.block_pool.get_num_free_blocks(), queue(mgr)
        assert mgr.allocate(a2, await mgr.lookup(a2)) is None
        assert mgr.core.block_pool.get_num_free_blocks() == free and queue(mgr) == q
        assert mgr.core.get_block_ids("a2") == ([],)
        b1 = mgr.new_request("b1", list(range(100, 116)), tenant="b")  # b has no quota
        await serve(mgr, model, b1, outputs=0, finish=False)
        a3 = mgr.new_request("a3", list(range(200, 212)), tenant="a")  # 3 more: 8 <= 8
        await serve(mgr, model, a3, outputs=0, finish=False)
        a4 = mgr.new_request("a4", [*range(20), 7], tenant="a")  # a1's 5 + 1 new
        assert mgr.allocate(a4, await mgr.lookup(a4)) is None  # 8 in use: nothing more
        ts = mgr.tenant_stats()
        assert (ts["a"].quota_refusals, ts["a"].blocks_in_use) == (2, 8)
        assert (ts["b"].quota_refusals, mgr.stats().quota_refusals) == (0, 2)
        mgr.finish(a3)  # 5 in use: a4 adopts a1's 5 blocks (held by a1: free of charge)
        adm = mgr.allocate(a4, await mgr.lookup(a4))
        assert adm is not None and adm.local_tokens == 20
        assert mgr.tenant_stats()["a"].blocks_in_use == 6
        for r in (a1, a2, a4, b1):
            mgr.finish(r)
        await mgr.drain()
        assert_sums(mgr)
        clean(mgr)


@pytest.mark.asyncio
async def test_cached_quota_evicts_only_the_offenders_oldest_blocks() -> None:
    quota = TenantPolicy({"a": TenantQuota(max_cached_blocks=3), "b": TenantQuota()})
    plain, limited = make(num_blocks=40), make(quota, num_blocks=40)
    async with plain, limited:
        traces = []
        for mgr in (plain, limited):
            model = FakeModel(mgr)
            steps = []
            for rid, tenant, prompt in (("b1", "b", list(range(24))),
                                        ("a1", "a", list(range(100, 128))),
                                        ("a2", "a", list(range(200, 220)))):
                req = mgr.new_request(rid, prompt, tenant=tenant)
                await serve(mgr, model, req, finish=False)
                ids = table(mgr, req)
                mgr.finish(req)
                steps.append((ids, queue(mgr), cached_ids(mgr)))
            await mgr.drain()
            traces.append(steps)
        for (ids, q, _), (ids2, q2, _) in zip(*traces, strict=True):
            assert ids == ids2 and q == q2  # same blocks, same eviction order: ids only lose
        (_, _, b_cached), (a1_ids, _, after_a1), (a2_ids, _, after_a2) = traces[1]
        plain_after_a1 = traces[0][1][2]
        a1_order = [i for i in plain_after_a1 if i in a1_ids]  # a1's cached, oldest first
        assert len(a1_order) == 7
        assert after_a1 == [i for i in plain_after_a1 if i not in a1_order[:4]]
        assert set(b_cached) <= set(after_a2)  # b untouched throughout
        a_order = [i for i in traces[0][2][2] if i in a1_order[4:] or i in a2_ids]
        assert [i for i in after_a2 if i in a1_ids or i in a2_ids] == a_order[-3:]
        ts = limited.tenant_stats()
        assert (ts["a"].quota_evictions, ts["b"].quota_evictions) == (4 + 5, 0)
        assert ts["a"].cached_blocks == 3 and ts["b"].cached_blocks == 6  # b's all kept
        # a1's kept blocks went in the second round: a2's were released later.
        again = limited.new_request("a3", list(range(100, 128)), tenant="a")
        assert (await limited.lookup(again)).local_tokens == 0
        limited.finish(again)
        assert_sums(limited)
        clean(limited)


@pytest.mark.asyncio
async def test_cached_quota_keeps_the_prefix() -> None:
    policy = TenantPolicy({"a": TenantQuota(max_cached_blocks=3)})
    async with make(policy) as mgr:
        model = FakeModel(mgr)
        await serve(mgr, model, mgr.new_request("a1", SYS + USER, tenant="a"))
        again = mgr.new_request("a2", SYS + USER, tenant="a")
        assert (await mgr.lookup(again)).local_tokens == 12  # its first three blocks
        mgr.finish(again)
        assert mgr.stats().quota_evictions == 4


@pytest.mark.asyncio
async def test_tier_byte_quota_sheds_whole_offers_in_flight_counted() -> None:
    policy = TenantPolicy({"a": TenantQuota(max_tier_bytes={"memory": 9 * PAGE}),
                           "b": TenantQuota()})
    async with make(policy) as mgr:
        model = FakeModel(mgr)
        a1 = mgr.new_request("a1", list(range(28)), tenant="a")  # 7 chunks
        a2 = mgr.new_request("a2", list(range(100, 112)), tenant="a")  # 3 chunks
        for r in (a1, a2):
            adm = mgr.allocate(r, await mgr.lookup(r))
            assert adm is not None
            model.step(r, adm.num_new_tokens)
        # One step offers both: a1's 7 start (in flight), a2's 3 would make 10 > 9: shed.
        assert mgr.after_step([a1, a2]) == 7
        await mgr.drain()
        a3 = mgr.new_request("a3", list(range(200, 208)), tenant="a")  # 2 more: 9 <= 9
        await serve(mgr, model, a3)
        b1 = mgr.new_request("b1", list(range(300, 340)), tenant="b")
        await serve(mgr, model, b1)
        a4 = mgr.new_request("a4", [*range(400, 404), 1], tenant="a")  # 1 more: shed
        await serve(mgr, model, a4)
        for r in (a1, a2):
            mgr.finish(r)
        await mgr.drain()
        ts = assert_sums(mgr)
        a = ts["a"]
        assert (a.stored_chunks, a.stored_bytes, a.stored_bytes_by_tier) == (9, 9 * PAGE,
                                                                            {"memory": 9 * PAGE})
        assert (a.stores_shed, a.stores_shed_quota) == (3 + 1, 3 + 1)
        assert (ts["b"].stored_chunks, ts["b"].stores_shed) == (10, 0)
        assert len(mgr.connector) == 9 + 10  # type: ignore[arg-type]
        evict_device_cache(mgr)
        again = mgr.new_request("a5", list(range(100, 112)), tenant="a")
        assert (await mgr.lookup(again)).external_tokens == 0  # shed means not stored
        mgr.finish(again)
        clean(mgr)


# --------------------------------------------------------------------------- quotas off

WORKLOAD = [SYS + USER, SYS + USER[:6], SYS[:8] + list(range(40, 60)), list(range(60, 75))]


async def _drive(mgr: AsyncKVManager, ops: list[tuple[int, int, int]]) -> list[Any]:
    """A scheduler-ish sequence on a small pool: admissions (hits, loads, refusals),
    chunked steps, finishes; returns every allocation's block ids and the queue."""
    model = FakeModel(mgr)
    active: list[Request] = []
    trace: list[Any] = []
    for i, (op, x, y) in enumerate(ops):
        if op == 0 or not active:
            req = mgr.new_request(f"r{i}", WORKLOAD[x], tenant="abc"[y])
            adm = mgr.allocate(req, await mgr.lookup(req), num_new_tokens=8)
            trace.append(None if adm is None else adm.blocks.get_block_ids())
            if adm is None:
                mgr.finish(req)
                continue
            if adm.loading:
                trace.append((await mgr.wait_load(req)).status)
                if req.status is RequestStatus.FINISHED_ERROR:
                    mgr.finish(req)
                    continue
            else:
                model.step(req, adm.num_new_tokens)
                mgr.after_step([req])
            active.append(req)
        else:
            req = active[x % len(active)]
            if op == 1 and req.num_output_tokens < 3 and req.status is not RequestStatus.WAITING:
                nxt = mgr.allocate(req, num_new_tokens=8)
                trace.append(None if nxt is None else nxt.blocks.get_block_ids())
                if nxt is not None:
                    model.step(req, nxt.num_new_tokens)
                    mgr.after_step([req])
                    continue
            active.remove(req)
            mgr.finish(req)
        await mgr.drain()
        trace.append(queue(mgr))
    for req in active:
        mgr.finish(req)
    await mgr.drain()
    trace.append(queue(mgr))
    return trace


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 2)),
                min_size=1, max_size=25))
def test_quotas_off_change_no_block_id(ops: list[tuple[int, int, int]]) -> None:
    never = TenantQuota(max_blocks_in_use=10_000, max_cached_blocks=10_000,
                        max_tier_bytes={"memory": 1 << 40})
    policies = [None, TenantPolicy(), TenantPolicy(default_quota=never),
                TenantPolicy({t: TenantQuota() for t in "abc"})]

    async def run() -> list[list[Any]]:
        out = []
        for policy in policies:
            async with make(policy, num_blocks=14) as mgr:
                out.append(await _drive(mgr, ops))
                if policy is not None:
                    assert_sums(mgr)
                clean(mgr)
        return out

    first, *rest = asyncio.run(run())
    for other in rest:
        assert other == first


@pytest.mark.asyncio
async def test_tier_byte_quota_bounds_bytes_held_through_evictions() -> None:
    # A memory tier that holds 5 chunks and a quota of 9 chunks there (a request offers 3:
    # 5 held + 3 fit): the tenant writes 4x its quota over the run, the tier evicting what
    # it wrote before, and what it holds stays within both the quota and the tier. Counted
    # by bytes written, it was refused from its fourth request on.
    quota = 9 * PAGE
    policy = TenantPolicy({"a": TenantQuota(max_tier_bytes={"memory": quota})})
    async with make(policy, host=1 * MIB) as sizing:  # one chunk's size in the tier
        await serve(sizing, FakeModel(sizing), sizing.new_request("s", [7, 8, 9, 10],
                                                                  tenant="a"))
        await sizing.drain()
        one: int = sizing.connector.used_bytes  # type: ignore[union-attr]
    async with make(policy, host=5 * one + one // 2) as mgr:
        model = FakeModel(mgr)
        conn: Any = mgr.connector
        holdings = mgr.offloads.holdings
        assert holdings is not None
        for i in range(12):
            await serve(mgr, model, mgr.new_request(f"a{i}", list(range(100 * i, 100 * i + 12)),
                                                    tenant="a"))
            await mgr.drain()
            mgr.apply_tier_events()  # what the tier did since the last store ended
            held = holdings.held("a", "memory")
            assert held == len(conn) * PAGE <= min(quota, 5 * PAGE), (i, held, len(conn))
        ts = assert_sums(mgr)
        # Written: 3 chunks a request, all stored (none shed: evictions made room).
        assert (ts["a"].stored_chunks, ts["a"].stores_shed_quota) == (36, 0)
        assert ts["a"].stored_bytes_by_tier["memory"] == 36 * PAGE > quota
        assert conn.stats().evicted == 36 - len(conn)
        assert len(holdings) == len(conn)  # nothing kept for objects the tier dropped


@pytest.mark.asyncio
async def test_tier_byte_quota_binds_on_held_bytes_and_frees_with_deletes() -> None:
    # A tier that never evicts (16 MiB): the quota (9 chunks) is what binds. Three requests
    # of 3 chunks fill it, the fourth's offer is shed whole; once the first request's
    # objects are deleted from the tier the fifth request's 3 chunks are stored (written
    # 12 chunks > quota, held 9 == quota). Counted by bytes written, the fifth is shed too.
    quota = 9 * PAGE
    policy = TenantPolicy({"a": TenantQuota(max_tier_bytes={"memory": quota})})
    async with make(policy) as mgr:
        model = FakeModel(mgr)
        conn: Any = mgr.connector
        holdings = mgr.offloads.holdings
        assert holdings is not None
        reqs = [mgr.new_request(f"a{i}", list(range(100 * i, 100 * i + 12)), tenant="a")
                for i in range(5)]
        for r in reqs[:4]:
            await serve(mgr, model, r)
            await mgr.drain()
        assert (holdings.held("a", "memory"), len(conn)) == (quota, 9)
        assert mgr.tenant_stats()["a"].stores_shed_quota == 3  # the fourth's 3 chunks
        gone = mgr.keyspace.chunk_keys("a", 0, reqs[0].block_hashes, 0, 3)
        assert await conn.delete(gone, timeout=1) == 3
        mgr.apply_tier_events()
        assert (holdings.held("a", "memory"), len(conn)) == (6 * PAGE, 6)
        await serve(mgr, model, reqs[4])
        await mgr.drain()
        mgr.apply_tier_events()
        assert (holdings.held("a", "memory"), len(conn)) == (quota, 9)
        a = assert_sums(mgr)["a"]
        assert (a.stored_chunks, a.stores_shed_quota) == (12, 3)
        assert a.stored_bytes_by_tier["memory"] == 12 * PAGE > quota
        evict_device_cache(mgr)
        # shed means not stored; a lookup leaves the prompt's last block to compute (8 of 12)
        for r, stored in ((reqs[3], 0), (reqs[4], 8)):
            again = mgr.new_request(f"{r.request_id}-again", list(r.prompt_token_ids),
                                    tenant="a")
            assert (await mgr.lookup(again)).external_tokens == stored
            mgr.finish(again)
        clean(mgr)


# --------------------------------------------------------------------------- stats, misuse


@pytest.mark.asyncio
async def test_per_tenant_stats_count_and_sum_including_failed_loads() -> None:
    async with make(TenantPolicy()) as mgr:  # open: any valid name
        model = FakeModel(mgr)
        await serve(mgr, model, mgr.new_request("a1", SYS + USER, tenant="acme"))
        await serve(mgr, model, mgr.new_request("b1", SYS, tenant="globex.eu"))
        await mgr.drain()
        evict_device_cache(mgr)
        a2 = mgr.new_request("a2", SYS + USER, tenant="acme")
        found = await mgr.lookup(a2)
        keys = mgr.keyspace.chunk_keys("acme", 0, a2.block_hashes, 3, 4)
        await mgr.connector.delete(keys, timeout=1)  # chunk 3 vanishes before the load
        adm = mgr.allocate(a2, found)
        assert adm is not None and adm.loading
        assert (await mgr.wait_load(a2)).status is LoadStatus.PARTIAL
        mgr.finish(a2)
        await mgr.drain()
        ts = assert_sums(mgr)
        a, b = ts["acme"], ts["globex.eu"]
        assert (a.requests, a.prompt_tokens, b.requests, b.prompt_tokens) == (2, 56, 1, 16)
        assert (a.loads, a.loads_failed, a.loaded_bytes) == (1, 1, 3 * PAGE)
        assert (a.stored_chunks, b.stored_chunks, b.loads) == (7, 4, 0)
        assert a.hit_tokens == {"device": 0, "memory": 24}
        assert a.blocks_in_use == b.blocks_in_use == 0 and a.cached_blocks is None
        with pytest.raises(dataclasses.FrozenInstanceError):
            a.loads = 0  # type: ignore[misc]
        clean(mgr)


@pytest.mark.asyncio
async def test_unknown_and_invalid_tenants_are_clear_errors() -> None:
    async with make(TenantPolicy({"acme": TenantQuota(), "globex": TenantQuota()})) as mgr:
        with pytest.raises(ValueError, match="unknown tenant 'initech': this deployment "
                                             "declares acme, globex"):
            mgr.new_request("x", SYS, tenant="initech")
        with pytest.raises(InvalidName, match=r"invalid tenant 'no spaces': must match"):
            mgr.new_request("x", SYS, tenant="no spaces")
        assert mgr.tenant_stats().keys() == {"acme", "globex"}
    async with make() as mgr:  # open
        mgr.finish(mgr.new_request("x", SYS, tenant="anyone-at.all_1"))
        with pytest.raises(InvalidName, match="invalid tenant"):
            mgr.new_request("y", SYS, tenant="group:sys")
    with pytest.raises(InvalidName, match="invalid tenant"):
        TenantPolicy({"bad;name": TenantQuota()})
    with pytest.raises(InvalidName, match="prefix group: invalid"):
        PrefixGroup("a/b", frozenset({"a"}), 8)
    with pytest.raises(ValueError, match="unknown tenant 'z'"):
        TenantPolicy({"a": TenantQuota()}, groups=[PrefixGroup("g", frozenset({"a", "z"}), 8)])
    with pytest.raises(ValueError, match="repeat"):
        TenantPolicy(groups=[PrefixGroup("g", frozenset({"a"}), 8)] * 2)
    with pytest.raises(ValueError, match="max_blocks_in_use"):
        TenantQuota(max_blocks_in_use=-1)
    with pytest.raises(ValueError, match="no tenants"):
        PrefixGroup("g", frozenset(), 8)
    with pytest.raises(ValueError, match=r"unknown tiers \['disk'\].*\['memory'\]"):
        make(TenantPolicy(default_quota=TenantQuota(max_tier_bytes={"disk": 1})))
