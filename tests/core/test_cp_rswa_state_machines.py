"""Issue 13: the model-based state machine of ``test_state_machine`` on a context-parallel
layout (DCP 2, full attention whose manager block spans 2 x its spec block, beside a
replicated full group and with PCP 2) and on an R-SWA layout (full + R-SWA, whose decode
frees the gap between prompt and window to null blocks).  The section-7 invariants are
checked after every step, as for the other layouts."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from core_testlib import Core, cdiv, full
from hypothesis.stateful import initialize
from test_state_machine import MAX_MODEL_LEN, STATE_SETTINGS, ManagerMachine

from kvplugin.core.hashing import BlockHasher
from kvplugin.core.manager import KVCacheManager
from kvplugin.core.specs import FullAttentionSpec, RSWASpec, resolve_kv_cache_block_sizes


class CpCore(Core):
    """``Core`` rebuilt with context parallelism (block sizes resolved under DCP)."""

    def __init__(self, groups: list[Any], *, block_size: int, num_blocks: int,
                 dcp: int = 1, pcp: int = 1, max_model_len: int = 8192) -> None:
        super().__init__(groups, block_size=block_size, num_blocks=num_blocks,
                         max_model_len=max_model_len)
        self.sbs, self.hbs = resolve_kv_cache_block_sizes(self.config, block_size,
                                                          dcp_world_size=dcp)
        self.manager = KVCacheManager(
            self.config, max_model_len=max_model_len, scheduler_block_size=self.sbs,
            hash_block_size=self.hbs, log_stats=True, enable_kv_cache_events=True,
            dcp_world_size=dcp, pcp_world_size=pcp)
        self.hasher = BlockHasher(self.ctx, self.hbs, 0)


class CpMachineBase(ManagerMachine):
    @initialize()
    def build(self) -> None:
        self.c = CpCore(max_model_len=MAX_MODEL_LEN, **self.layout)
        self.m = self.c.manager
        self.pool = self.m.block_pool
        self.managers = self.m.coordinator.single_type_managers
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.reqs = {}
        self.next_id = 0
        self.shadow: Counter[tuple[int, int]] = Counter()
        self.stats = [0, 0, 0, 0, 0, 0]
        self.stats_reset = False
        self.hybrid = len(self.managers) > 1


class RswaMachineBase(CpMachineBase):
    def check_window(self, rid: str, basis: int, before: list[int] | None) -> None:
        """R-SWA (spec: gap eviction): nulls only on blocks entirely inside the gap
        ``[cdiv(P, bs) * bs, max(P, basis - window))``; prompt and window blocks stay real.
        Other groups are full attention here: never a null."""
        prompt = self.reqs[rid].num_prompt_tokens
        tables = self.m.coordinator.get_blocks(rid)
        for m, table in zip(self.managers, tables, strict=True):
            spec = m.kv_cache_spec
            nulls = [i for i, b in enumerate(table) if b.is_null]
            if not isinstance(spec, RSWASpec):
                assert nulls == [], (m.kv_cache_group_id, nulls)
                continue
            window_start = max(prompt, basis - spec.rswa_window)
            for i in nulls:
                assert i >= cdiv(prompt, m.block_size), ("prompt block freed", i, prompt)
                assert (i + 1) * m.block_size <= window_start, ("window block freed", i)


def cp_machine(name: str, base: type[CpMachineBase] = CpMachineBase,
               **layout: Any) -> type[ManagerMachine]:
    return STATE_SETTINGS(type(name, (base,), {"layout": layout}))


DcpMachine = cp_machine(
    "DcpMachine", groups=[full(4), FullAttentionSpec(block_size=4, dcp_sharded=False,
                                                     dtype="bfloat16")],
    block_size=4, num_blocks=48, dcp=2, pcp=2)
DcpUnitaryMachine = cp_machine("DcpUnitaryMachine", groups=[full(4)], block_size=4,
                               num_blocks=32, dcp=2)
RswaMachine = cp_machine("RswaMachine", RswaMachineBase,
                         groups=[full(4), RSWASpec(block_size=4, rswa_window=6)],
                         block_size=4, num_blocks=48)

_slow_on_failure = pytest.mark.timeout(900)
TestContextParallelHybrid = _slow_on_failure(DcpMachine.TestCase)
TestContextParallelUnitary = _slow_on_failure(DcpUnitaryMachine.TestCase)
TestFullPlusRSWA = _slow_on_failure(RswaMachine.TestCase)


def test_layouts_are_what_they_claim() -> None:
    """The machines above really run DCP-scaled, zeroing and gap-freeing managers."""
    dcp = CpCore([full(4), FullAttentionSpec(block_size=4, dcp_sharded=False,
                                             dtype="bfloat16")],
                 block_size=4, num_blocks=48, dcp=2, pcp=2)
    assert [m.block_size for m in dcp.manager.coordinator.single_type_managers] == [8, 4]
    assert (dcp.sbs, dcp.hbs) == (8, 4)
    assert [m.records_new_block_ids for m in dcp.manager.coordinator.single_type_managers] \
        == [True, True]
    rswa = CpCore([full(4), RSWASpec(block_size=4, rswa_window=6)], block_size=4,
                  num_blocks=48)
    assert rswa.manager.coordinator.releases_blocks
