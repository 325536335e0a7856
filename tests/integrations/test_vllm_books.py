"""The vLLM connector's books without vLLM: the workers' reports gathered per plan
(:mod:`kvplugin.integrations._outcomes`), the per-tenant stats the scheduler reports
(:mod:`kvplugin.integrations._stats`), the rate-limited log, ``kv_role`` and the config
keys refused under vLLM. The real Scheduler and engine runs are test_vllm_tenancy.py and
test_vllm_engine.py."""

from __future__ import annotations

import logging

import pytest

from kvplugin.aio.holdings import TierHoldings
from kvplugin.config import KVPluginConfig
from kvplugin.connectors.events import TierEvent
from kvplugin.integrations._outcomes import KVPluginWorkerMeta, LoadOutcome, Outcomes, StoreOutcome
from kvplugin.integrations._scheduler import KVRole
from kvplugin.integrations._stats import KVPluginStats, RateLimitedLog, TenantBook, key
from kvplugin.integrations.vllm import refuse_unenforceable


def test_a_plan_ends_when_every_worker_reported_its_part() -> None:
    out = Outcomes(workers=2)
    assert out.store_ended(StoreOutcome(7, True, (3, 3))) is None
    # Done only if every part is; a tier holds what every worker's part put there.
    assert out.store_ended(StoreOutcome(7, False, (3, 1))) == StoreOutcome(7, False, (3, 1))
    assert out.store_ended(StoreOutcome(7, True, (2, 2))) is None  # a new round for id 7
    one = Outcomes(workers=1)
    assert one.store_ended(StoreOutcome(1, True, (4,))) == StoreOutcome(1, True, (4,))


def test_a_load_verifies_what_every_worker_verified() -> None:
    out = Outcomes(workers=2)
    assert out.load_ended(LoadOutcome("r", 0, 96, 96, ((0, 10, False),))) is None
    got = out.load_ended(LoadOutcome("r", 0, 96, 32, ()))
    assert got == LoadOutcome("r", 0, 96, 32, ((0, 10, False),))


def test_worker_metadata_aggregates_every_workers_reports() -> None:
    ev = TierEvent("stored", "disk", ("a",))
    one = KVPluginWorkerMeta([StoreOutcome(1, True, (1,))], [], [ev], tiers=("disk",))
    two = KVPluginWorkerMeta([StoreOutcome(1, True, (1,))], [LoadOutcome("r", 0, 16, 16)])
    both = one.aggregate(two)
    assert both is one
    assert both.stores == [StoreOutcome(1, True, (1,))] * 2
    assert both.loads == [LoadOutcome("r", 0, 16, 16)] and both.events == [ev]
    assert both.tiers == ("disk",)


class _Ledger:
    """What TenantBook reads of an offload ledger."""

    def __init__(self) -> None:
        from kvplugin.aio.offload_ledger import TenantCounters

        self.c = {"a": TenantCounters(), "b": TenantCounters()}
        self.holdings: TierHoldings | None = TierHoldings()
        self.loaded_states = 0  # global: Mamba states restored

    def tenants(self) -> dict[str, object]:
        return self.c  # type: ignore[return-value]


def test_the_scheduler_reports_each_tenants_change_and_held_bytes_now() -> None:
    ledger, book = _Ledger(), TenantBook()
    assert book.delta(ledger) is None  # nothing booked yet: nothing to report
    a = ledger.c["a"]
    a.stores, a.stored_chunks = 2, 5
    a.stored_bytes_by_tier["disk"] = 4096
    a.hit_tokens["offload"] = 64
    assert ledger.holdings is not None
    ledger.holdings.expect("a", [("x", 4096)])
    ledger.holdings.apply([TierEvent("stored", "disk", ("x",))])
    got = book.delta(ledger)  # type: ignore[arg-type]
    assert got is not None and got.data == {
        "stores|a": 2, "stored_chunks|a": 5, "stored_bytes|a|disk": 4096,
        "hit_tokens|a|offload": 64, "tier_bytes_held|a|disk": 4096}
    a.stores = 3
    ledger.loaded_states = 2
    ledger.holdings.apply([TierEvent("removed", "disk", ("x",), "evicted")])
    got = book.delta(ledger)  # type: ignore[arg-type]
    # The change only; a gauge whose bytes are gone reports 0 once.
    assert got is not None and got.data == {"stores|a": 1, "loaded_states": 2,
                                             "tier_bytes_held|a|disk": 0}
    assert book.delta(ledger) is None  # type: ignore[arg-type]


def test_stats_sum_counters_keep_the_latest_gauge_and_refuse_unknown_names() -> None:
    s = KVPluginStats({key("stores", "a"): 1, key("tier_bytes_held", "a", "disk"): 10})
    s.aggregate(KVPluginStats({key("stores", "a"): 2, key("stores", "b"): 1,
                               key("tier_bytes_held", "a", "disk"): 7, "bogus": 5}))
    assert s.data == {"stores|a": 3, "stores|b": 1, "tier_bytes_held|a|disk": 7}
    assert s.reduce() == {"stores": 4, "tier_bytes_held": 7}
    s.add("tier_errors", 2, tier="redis")
    assert s.data["tier_errors||redis"] == 2
    with pytest.raises(KeyError, match="unknown kvplugin figure 'loads_failed'"):
        s.add("loads_failed")


def test_a_repeated_warning_is_one_line_per_interval_with_the_count(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("kvplugin.integrations._stats.time.monotonic", lambda: now[0])
    log = RateLimitedLog(interval=30.0)
    with caplog.at_level(logging.WARNING):
        for i in range(5):
            log.warn("tier:redis", "tier %s failed (%d)", "redis", i)
        log.warn("tier:disk", "tier %s failed", "disk")
        now[0] += 31.0
        log.warn("tier:redis", "tier %s failed (%d)", "redis", 5)
        log.logged("tier:memory")  # its line was written elsewhere (the start's check)
        log.warn("tier:memory", "tier %s failed", "memory")
        now[0] += 31.0
        log.warn("tier:memory", "tier %s failed", "memory")
    assert [r.getMessage() for r in caplog.records] == [
        "kvplugin: tier redis failed (0)", "kvplugin: tier disk failed",
        "kvplugin: tier redis failed (5) (4 more like it in the last 30 s)",
        "kvplugin: tier memory failed (1 more like it in the last 30 s)"]


@pytest.mark.parametrize(("value", "loads", "stores"), [
    ("kv_producer", False, True), ("kv_consumer", True, False), ("kv_both", True, True),
    (None, True, True)])
def test_kv_role(value: str | None, loads: bool, stores: bool) -> None:
    role = KVRole.of(value)
    assert (role.loads, role.stores) == (loads, stores)


def test_an_unknown_kv_role_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_role must be one of kv_producer, kv_consumer, "
                                         "kv_both, got 'kv_sideways'"):
        KVRole.of("kv_sideways")


@pytest.mark.parametrize(("tenants", "offload", "message"), [
    ({"declared": {"a": {"max_blocks_in_use": 1000}}}, {},
     "tenants.declared.a.max_blocks_in_use: device block quotas belong to vLLM's scheduler"),
    ({"default_quota": {"max_cached_blocks": 5}}, {},
     "tenants.default_quota.max_cached_blocks: device block quotas"),
    ({"declared": {"a": {}, "b": {}},
      "prefix_groups": [{"name": "g", "tenants": ["a", "b"], "max_prefix_tokens": 64}]}, {},
     "tenants.prefix_groups: vLLM hashes each request's blocks with its cache_salt"),
    ({"declared": {"a": {"max_tier_bytes": {"extra": 10}}}},
     {"connectors": [{"kind": "memory", "name": "extra",
                      "options": {"capacity_bytes": 1 << 20}}]},
     "tenants.declared.a.max_tier_bytes: tier byte quotas apply to the built-in tiers"),
])
def test_keys_vllm_cannot_enforce_fail_the_start_naming_the_key(
        tenants: dict[str, object], offload: dict[str, object], message: str) -> None:
    cfg = KVPluginConfig.model_validate({"tenants": tenants, "offload": offload})
    with pytest.raises(ValueError, match="^KVPluginConnector: " + message.replace(".", r"\.")):
        refuse_unenforceable(cfg)


def test_tier_quotas_and_declared_tenants_are_accepted() -> None:
    cfg = KVPluginConfig.model_validate({"tenants": {"declared": {
        "a": {"max_tier_bytes": {"memory": 1 << 20}}, "b": {}}}})
    refuse_unenforceable(cfg)  # nothing raised


def test_every_vllm_figure_is_defined_once_in_the_metrics_doc() -> None:
    """docs/metrics.md ("Under vLLM") defines every figure the connector exports, each on
    one row, with the labels it carries."""
    from pathlib import Path

    from kvplugin.integrations._stats import COUNTERS, GAUGES

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    for table, suffix, kind in ((COUNTERS, "_total", "counter"), (GAUGES, "", "gauge")):
        for name, (labels, _) in table.items():
            rows = [r for r in doc.splitlines()
                    if r.startswith(f"| `vllm:kvplugin_{name}{suffix}` |")]
            assert len(rows) == 1, name
            assert rows[0].split("|")[2].strip() == kind, name
            assert rows[0].split("|")[3].strip() == (", ".join(labels) or "\u2013"), name
