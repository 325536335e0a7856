"""The tenants section (``tenants``): declared tenants, their quotas, shared prefix groups."""

from __future__ import annotations

from pydantic import Field, model_validator

from kvplugin.aio.tenants import PrefixGroup, TenantPolicy, TenantQuota, check_name
from kvplugin.config.base import Loc, _fail, _Strict, _surface


class TenantQuotaConfig(_Strict):
    """A tenant's limits (``tenants.declared.<name>``, ``tenants.default_quota``): null or
    left out means unlimited (kvplugin.aio.tenants.TenantQuota)."""

    max_blocks_in_use: int | None = Field(
        default=None, ge=0, description="device blocks its requests may hold; an admission "
                                        "over it waits")
    max_cached_blocks: int | None = Field(
        default=None, ge=0, description="free-but-cached device blocks it may keep; its own "
                                        "oldest lose their cache identity beyond it")
    max_tier_bytes: dict[str, int] = Field(
        default_factory=dict, description="bytes of its objects each tier may hold (learned "
                                          "from the tier's events: evicted and deleted objects "
                                          "no longer count), by tier name (memory, disk, "
                                          "redis, an offload.connectors[] tier's name); "
                                          "offers beyond it are shed")

    @model_validator(mode="after")
    def _runtime(self) -> TenantQuotaConfig:
        _fail("quota", [(("max_tier_bytes", t), f"must be an int >= 0, got {n}")
                        for t, n in self.max_tier_bytes.items() if n < 0])
        if self.model_fields_set:  # the default is valid: nothing to check
            self.quota()
        return self

    def quota(self) -> TenantQuota:
        q: TenantQuota = _surface("quota", (), lambda: TenantQuota(
            self.max_blocks_in_use, self.max_cached_blocks, dict(self.max_tier_bytes)))
        return q


class PrefixGroupConfig(_Strict):
    """Tenants that share a declared prefix, e.g. a system prompt (``tenants.prefix_groups[]``;
    kvplugin.aio.tenants.PrefixGroup)."""

    name: str = Field(description="the group's name (a tenant-name charset: letters, digits, "
                                  "_ . -)")
    tenants: list[str] = Field(min_length=1, description="its members (declared tenants, "
                                                        "when tenants.declared is given)")
    max_prefix_tokens: int = Field(gt=0, description="the longest prefix a request may "
                                                     "declare shared")
    max_cached_blocks: int | None = Field(default=None, ge=0, description="the group's own "
                                          "cached-block quota for its shared blocks")

    @model_validator(mode="after")
    def _runtime(self) -> PrefixGroupConfig:
        self.group()
        return self

    def group(self) -> PrefixGroup:
        g: PrefixGroup = _surface("prefix group", (), lambda: PrefixGroup(
            self.name, frozenset(self.tenants), self.max_prefix_tokens,
            self.max_cached_blocks))
        return g


class TenantsConfig(_Strict):
    """Whom requests belong to (kvplugin.aio.tenants.TenantPolicy): declared tenants, each
    with its quota, or (``declared`` left out) any tenant name with ``default_quota``; and
    the prefix groups whose members share a declared prefix."""

    declared: dict[str, TenantQuotaConfig] | None = Field(
        default=None, description="tenant name -> its quota (tenants.declared.<name>); "
                                  "any other tenant is refused. Null: open policy")
    default_quota: TenantQuotaConfig = Field(
        default_factory=TenantQuotaConfig, description="the quota of every tenant under the "
                                                       "open policy")
    prefix_groups: list[PrefixGroupConfig] = Field(
        default_factory=list, description="shared prefix groups (see tenants.prefix_groups[])")

    @model_validator(mode="after")
    def _runtime(self) -> TenantsConfig:
        if not self.model_fields_set:
            return self  # the open policy, no quota, no group: nothing to check
        problems: list[tuple[Loc, str]] = []
        for name in self.declared or {}:
            try:
                check_name(name)
            except ValueError as e:
                problems.append((("declared", name), str(e)))
        seen: set[str] = set()
        for i, g in enumerate(self.prefix_groups):
            if g.name in seen:
                problems.append((("prefix_groups", i, "name"),
                                 f"prefix group {g.name!r} is named twice"))
            seen.add(g.name)
            if self.declared is None:
                continue
            for t in g.tenants:
                if t not in self.declared:
                    problems.append((("prefix_groups", i, "tenants"), (
                        f"tenant {t!r} of prefix group {g.name!r} is not declared (declared: "
                        f"{', '.join(sorted(self.declared)) or 'none'})")))
        _fail("tenants", problems)
        self.policy()
        return self

    def policy(self, *, tier_quotas: bool = True) -> TenantPolicy:
        """The manager's tenant policy; ``tier_quotas=False`` (offload off: no tier to
        limit) leaves the tier byte quotas out."""
        def quota(q: TenantQuotaConfig) -> TenantQuota:
            return q.quota() if tier_quotas else q.model_copy(update={"max_tier_bytes": {}}
                                                              ).quota()

        declared = None if self.declared is None else {
            n: quota(q) for n, q in self.declared.items()}
        p: TenantPolicy = _surface("tenants", (), lambda: TenantPolicy(
            declared, quota(self.default_quota), [g.group() for g in self.prefix_groups]))
        return p


