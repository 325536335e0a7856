"""The shipped configs, ``kvplugin validate-config``, environment overrides, and the config
reference (docs/config.md is generated from the models and must be up to date)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from kvplugin import cli
from kvplugin.config import ConfigError, KVPluginConfig, load_config, validate
from kvplugin.engine.build import workload_tenancy
from kvplugin.engine.config import RunConfig, WorkloadConfig

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").iterdir())


def validate_cli(argv: list[str]) -> int:
    """``kvplugin validate-config ...`` through kvplugin.cli.main."""
    return cli.main(argv)


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVPLUGIN_"):
            monkeypatch.delenv(name)


# ----------------------------------------------------------------------------- shipped


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert validate_cli(["validate-config", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == f"OK {path}\n" and err == ""


def test_the_issue_configs_are_shipped() -> None:
    names = {p.name for p in CONFIGS}
    assert {"redis.yaml", "tiered.yaml", "multi_tenant.yaml", "hybrid_mamba.yaml",
            "multi_tenant.toml", "tiered.toml"} <= names


@pytest.mark.parametrize("stem", ["multi_tenant", "tiered"])
def test_toml_twins_validate_to_the_same_config(stem: str) -> None:
    y = load_config(REPO / "configs" / f"{stem}.yaml", env={}, schema=RunConfig)
    t = load_config(REPO / "configs" / f"{stem}.toml", env={}, schema=RunConfig)
    assert y == t
    assert y.model_dump() == t.model_dump()


def test_shipped_tier_layouts() -> None:
    kinds = {n: load_config(REPO / "configs" / n, env={}).offload.tier_kinds()
             for n in ("redis.yaml", "tiered.yaml", "multi_tenant.yaml")}
    assert kinds == {"redis.yaml": ["memory", "redis"], "tiered.yaml": ["memory", "disk", "redis"],
                     "multi_tenant.yaml": ["memory", "disk"]}
    default = load_config(env={})
    assert default.offload.tier_kinds() == ["memory", "disk"] and default.offload.remote_url is None


def test_multi_tenant_declares_quotas_and_a_shared_prefix() -> None:
    cfg = load_config(REPO / "configs" / "multi_tenant.yaml", env={}, schema=RunConfig)
    t = cfg.tenants
    assert list(t.declared or {}) == ["acme", "globex", "initech"]
    assert cfg.workload.num_tenants == 3  # defaulted to the declared tenants
    policy = t.policy()
    assert policy.quota("acme").max_blocks_in_use == 160
    assert dict(policy.quota("initech").max_tier_bytes) == {"memory": 4194304}
    (group,) = policy.groups
    assert (group.name, group.tenants, group.max_prefix_tokens) == (
        "shared-system", frozenset({"acme", "globex"}), 512)
    with pytest.raises(ValueError, match="unknown tenant 'tenant0'"):
        policy.quota("tenant0")


def test_hybrid_mamba_offloads_boundary_states_and_partial_tails() -> None:
    cfg = load_config(REPO / "configs" / "hybrid_mamba.yaml", env={})
    lay = cfg.layout
    mamba = [g for g in lay.groups if g.kind == "mamba"]
    assert len(mamba) == 1 and mamba[0].mode == "align"
    # Partial tails: prefixes match below the Mamba block, and the tail state is kept.
    assert lay.enable_mamba_shared_prefix_checkpoint
    assert lay.prefix_match_unit is not None and mamba[0].block_size is not None
    assert lay.prefix_match_unit < mamba[0].block_size
    assert cfg.offload.enabled and cfg.offload.tier_kinds()
    assert not cfg.offload.store_prompt_only


# ----------------------------------------------------------------------------- invalid

QUOTA = "tenants:\n  declared:\n    acme: {%s}\n"
INVALID: list[tuple[str, str, str, str, str]] = [
    # (case, file name, content, key path, reason)
    ("unknown top-level key", "a.yaml", "bogus: 1\n", "bogus", "Extra inputs are not permitted"),
    ("unknown nested key", "a.yaml", "offload:\n  max_local_cpu_szie: 1\n",
     "offload.max_local_cpu_szie", "Extra inputs are not permitted"),
    ("unknown key in a list item", "a.yaml", "layout:\n  groups:\n    - {kind: full, windw: 3}\n",
     "layout.groups.0.windw", "Extra inputs are not permitted"),
    ("unknown quota key", "a.yaml", QUOTA % "max_blocks: 3",
     "tenants.declared.acme.max_blocks", "Extra inputs are not permitted"),
    ("wrong type", "a.yaml", "layout:\n  num_blocks: lots\n", "layout.num_blocks",
     "Input should be a valid integer"),
    ("negative size", "a.yaml", "offload:\n  max_local_cpu_size: -1\n",
     "offload.max_local_cpu_size", "Input should be greater than 0"),
    ("bad URL scheme", "a.yaml", "offload:\n  remote_url: http://cache:6379\n",
     "offload.remote_url", "must be a redis://, rediss://, unix:// or redis-cluster:// URL"),
    ("bad URL port", "a.yaml", "offload:\n  remote_url: redis://cache:99999/0\n",
     "offload.remote_url", "Port out of range"),
    ("bad URL database", "a.yaml", "offload:\n  remote_url: redis://cache:6379/zero\n",
     "offload.remote_url", "the database ('zero') must be a number"),
    ("bad cluster URL", "a.yaml", "offload:\n  remote_url: redis-cluster://a:x\n",
     "offload.remote_url", "bad port in node 'a:x'"),
    ("unknown fault kind", "a.yaml", "faults:\n  kinds: [error, meteor]\n", "faults.kinds.1",
     "Input should be 'error', 'latency', 'drop' or 'corrupt'"),
    ("bad tenant quota", "a.yaml", QUOTA % "max_blocks_in_use: -1",
     "tenants.declared.acme.max_blocks_in_use", "Input should be greater than or equal to 0"),
    ("quota too small for one request", "a.yaml", QUOTA % "max_blocks_in_use: 8",
     "tenants.declared.acme.max_blocks_in_use", "cannot hold one request"),
    ("quota on a tier not built", "a.yaml", QUOTA % "max_tier_bytes: {redis: 1024}",
     "tenants.declared.acme.max_tier_bytes.redis", "no 'redis' tier"),
    ("quota on a tier's old name", "a.yaml", QUOTA % "max_tier_bytes: {host: 1024}",
     "tenants.declared.acme.max_tier_bytes.host", "the 'host' tier is now named 'memory'"),
    ("quota on an unknown tier", "a.yaml", QUOTA % "max_tier_bytes: {gpu: 1024}",
     "tenants.declared.acme.max_tier_bytes.gpu", "this deployment's tiers are ['memory', 'disk']"),
    ("group with undeclared tenant", "a.yaml",
     "tenants:\n  declared: {acme: {}}\n  prefix_groups:\n"
     "    - {name: g, tenants: [acme, bob], max_prefix_tokens: 512}\n",
     "tenants.prefix_groups.0.tenants", "tenant 'bob' of prefix group 'g' is not declared"),
    ("group prefix shorter than the system prompts", "a.yaml",
     "tenants:\n  prefix_groups:\n    - {name: g, tenants: [a, b], max_prefix_tokens: 100}\n",
     "tenants.prefix_groups.0.max_prefix_tokens", "below workload.system_prompt_len"),
    ("group members the workload does not serve", "a.yaml",
     "tenants:\n  prefix_groups:\n    - {name: g, tenants: [tenant0, zed], "
     "max_prefix_tokens: 512}\n",
     "tenants.prefix_groups.0.tenants", "['zed'] are not the workload's tenants"),
    ("bad tenant name", "a.yaml", "tenants:\n  declared:\n    'a b': {}\n",
     "tenants.declared.a b", "invalid tenant 'a b'"),
    ("workload disagrees with the declared tenants", "a.yaml",
     "tenants:\n  declared: {acme: {}}\nworkload:\n  num_tenants: 2\n",
     "workload.num_tenants", "num_tenants 2 disagrees"),
    ("chunk size across sections", "a.yaml", "offload:\n  chunk_size: 24\n",
     "offload.chunk_size", "is not a multiple of layout.block_size 16"),
    ("no tier", "a.yaml", "offload:\n  local_cpu: false\n  local_disk: null\n", "offload",
     "no tier"),
    ("unknown connector kind", "a.yaml", "offload:\n  connectors:\n    - {kind: nope}\n",
     "offload.connectors.0.kind", "unknown connector kind 'nope'; known kinds: disk"),
    ("connector options", "a.yaml",
     "offload:\n  connectors:\n    - {kind: memory, options: {size: 3}}\n",
     "offload.connectors.0.options", "it takes: capacity_bytes"),
    ("manager refuses", "a.yaml", "offload:\n  store_budget_mb: 0.001\n",
     "store_budget_bytes", "is below one chunk"),
    ("malformed YAML", "a.yaml", "layout: [\n", "line 2", "cannot parse"),
    ("malformed TOML", "a.toml", "[layout\nnum_blocks = 3\n", "line 1", "cannot parse"),
    ("TOML value", "a.toml", "[layout]\nnum_blocks = 1\n", "layout.num_blocks",
     "greater than or equal to 2"),
    ("not a mapping", "a.yaml", "- 1\n", "top level", "must be a mapping"),
]


@pytest.mark.parametrize(("case", "name", "content", "key", "reason"), INVALID,
                         ids=[c[0] for c in INVALID])
def test_invalid_configs_fail_with_file_key_and_reason(
        case: str, name: str, content: str, key: str, reason: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / name
    path.write_text(content)
    assert validate_cli(["validate-config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert str(path) in err and key in err and reason in err


def test_missing_file_and_local_disk_file(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.yaml"
    assert validate_cli(["validate-config", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"{missing}: cannot read: No such file or directory" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    for disk, why in ((blocker, "exists and is not a directory"),
                      (blocker / "sub", "is not a directory")):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"offload:\n  local_disk: {disk}\n")
        assert validate_cli(["validate-config", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert f"{cfg}: invalid configuration\n  offload.local_disk: " in err and why in err
    ok = tmp_path / "ok.yaml"
    ok.write_text(f"offload:\n  local_disk: file://{tmp_path}/not/yet\n")
    assert validate_cli(["validate-config", str(ok)]) == 0
    assert not (tmp_path / "not").exists()  # validating creates nothing


def test_every_file_is_checked_and_each_valid_one_says_ok(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("layout: {num_blocks: 0}\n")
    good = REPO / "configs" / "tiered.yaml"
    assert validate_cli(["validate-config", str(bad), str(good), str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == f"OK {good}\n"
    assert err.count(f"{bad}: invalid configuration\n  layout.num_blocks: ") == 2


def test_environment_applies_unless_no_env(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    good = str(REPO / "configs" / "redis.yaml")
    monkeypatch.setenv("KVPLUGIN_OFFLOAD__REMOTE_URL", "ftp://nope")
    assert validate_cli(["validate-config", good]) == 2
    err = capsys.readouterr().err
    assert "offload.remote_url: " in err
    assert "(set by environment variable KVPLUGIN_OFFLOAD__REMOTE_URL)" in err
    assert validate_cli(["validate-config", "--no-env", good]) == 0


def test_workload_rules_bind_kvplugin_run_not_the_plugin() -> None:
    """A deployment may share a short prefix among tenants the reference workload does not
    know: valid for an engine loading the plugin, refused by the workload (kvplugin run)."""
    cfg = validate({"tenants": {"prefix_groups": [
        {"name": "g", "tenants": ["ann", "bob"], "max_prefix_tokens": 100}]}}, schema=RunConfig)
    assert cfg.tenants.policy().groups[0].max_prefix_tokens == 100
    with pytest.raises(ConfigError) as e:
        workload_tenancy(cfg)
    assert str(e.value).splitlines() == [
        "<config>: the workload (kvplugin run) cannot serve this configuration",
        "  tenants.prefix_groups.0.tenants: ['ann', 'bob'] are not the workload's tenants "
        "['tenant0', 'tenant1', 'tenant2']: declare the tenants, or name workload tenants",
        "  tenants.prefix_groups.0.max_prefix_tokens: 100 is below "
        "workload.system_prompt_len's upper bound 256: the workload declares whole system "
        "prompts shared"]
    declared = validate({"tenants": {"declared": {"ann": {}}}, "workload": {"num_tenants": 2}},
                        schema=RunConfig)
    with pytest.raises(ConfigError, match="num_tenants 2 disagrees"):
        workload_tenancy(declared)


# ----------------------------------------------------------------------------- environment


def test_nested_overrides_reach_every_level() -> None:
    env = {"KVPLUGIN_TENANTS__DEFAULT_QUOTA__MAX_BLOCKS_IN_USE": "8",
           "KVPLUGIN_LAYOUT__MAX_MODEL_LEN": "128",
           "KVPLUGIN_LAYOUT__GROUPS__0__BLOCK_SIZE": "32",
           "KVPLUGIN_OFFLOAD__CHUNK_SIZE": "32",
           "KVPLUGIN_FAULTS__KINDS": "[error, drop]"}
    cfg = load_config(env=env)
    assert cfg.tenants.default_quota.max_blocks_in_use == 8
    assert cfg.layout.groups[0].block_size == 32 and cfg.layout.max_model_len == 128
    assert cfg.faults.kinds == ("error", "drop")


def test_declared_tenants_from_the_environment() -> None:
    path = REPO / "configs" / "multi_tenant.yaml"
    cfg = load_config(path, env={"KVPLUGIN_TENANTS__DECLARED__ACME__MAX_CACHED_BLOCKS": "7",
                                 "KVPLUGIN_TENANTS__PREFIX_GROUPS__0__MAX_PREFIX_TOKENS": "300"})
    assert cfg.tenants.declared is not None
    assert cfg.tenants.declared["acme"].max_cached_blocks == 7  # matched case-insensitively
    assert cfg.tenants.prefix_groups[0].max_prefix_tokens == 300
    # A whole mapping replaces the declared tenants; num_tenants follows them.
    other = load_config(REPO / "configs" / "redis.yaml",
                        env={"KVPLUGIN_TENANTS__DECLARED": "{alpha: {}, beta: {}}"},
                        schema=RunConfig)
    assert list(other.tenants.declared or {}) == ["alpha", "beta"]
    assert other.workload.num_tenants == 2


def test_the_workload_is_the_engines_and_the_library_keeps_it_as_given(
        tmp_path: Path) -> None:
    """load_plugin's schema keeps the workload section unread; kvplugin run's (RunConfig)
    validates it: unknown keys, bounds and environment overrides, with the same errors."""
    f = tmp_path / "w.yaml"
    f.write_text("workload: {num_requests: 5, bogus: 1}\n")
    assert load_config(f, env={}).workload == {"num_requests": 5, "bogus": 1}
    with pytest.raises(ConfigError) as e:
        load_config(f, env={}, schema=RunConfig)
    assert str(e.value).splitlines() == [f"{f}: invalid configuration",
                                         "  workload.bogus: Extra inputs are not permitted"]
    f.write_text("workload: {num_requests: 5}\n")
    env = {"KVPLUGIN_WORKLOAD__SEED": "9", "KVPLUGIN_WORKLOAD__OUTPUT_LEN": "[2, 4]"}
    cfg = load_config(f, env=env, schema=RunConfig)
    assert isinstance(cfg.workload, WorkloadConfig)
    assert (cfg.workload.num_requests, cfg.workload.seed, cfg.workload.output_len) == (
        5, 9, (2, 4))
    assert load_config(f, env=env).workload == {"num_requests": 5, "seed": 9,
                                                "output_len": [2, 4]}
    with pytest.raises(ConfigError, match=r"workload\.seed: .*\(set by environment variable "
                                          r"KVPLUGIN_WORKLOAD__SEED\)"):
        load_config(f, env={"KVPLUGIN_WORKLOAD__SEED": "x"}, schema=RunConfig)
    assert isinstance(load_config(env={}), KVPluginConfig)


def test_string_keys_keep_their_text() -> None:
    cfg = load_config(env={"KVPLUGIN_MODEL__NAME": "123", "KVPLUGIN_LAYOUT__NONE_HASH_SEED": "42",
                           "KVPLUGIN_OFFLOAD__REMOTE_URL": "redis://10.0.0.1:6380/1"})
    assert cfg.model.name == "123" and cfg.layout.none_hash_seed == "42"
    assert cfg.offload.remote_url == "redis://10.0.0.1:6380/1"
    assert load_config(env={"KVPLUGIN_OFFLOAD__LOCAL_DISK": "null"}).offload.local_disk is None


@pytest.mark.parametrize(("env", "parts"), [
    ({"KVPLUGIN_TENANTS__DEFAULT_QUOTA__MAX_BLOCKS_IN_USE": "many"},
     ["KVPLUGIN_TENANTS__DEFAULT_QUOTA__MAX_BLOCKS_IN_USE", "tenants.default_quota."
      "max_blocks_in_use: Input should be a valid integer"]),
    ({"KVPLUGIN_TENANTS__DEFAULT_QUOTA__MAX_BLOCKS_IN_USE": "8"},
     ["KVPLUGIN_TENANTS__DEFAULT_QUOTA__MAX_BLOCKS_IN_USE",
      "tenants.default_quota.max_blocks_in_use: 8 blocks cannot hold one request"]),
    ({"KVPLUGIN_LAYOUT__BOGUS": "1"},
     ["KVPLUGIN_LAYOUT__BOGUS", "layout.bogus: Extra inputs are not permitted"]),
    ({"KVPLUGIN_OFFLOAD__CHUNK_SIZE": "24"},
     ["KVPLUGIN_OFFLOAD__CHUNK_SIZE", "offload.chunk_size: offload.chunk_size 24 is not a "
      "multiple"]),
    ({"KVPLUGIN_LAYOUT__GROUPS__3__KIND": "full"},
     ["environment variable KVPLUGIN_LAYOUT__GROUPS__3__KIND: layout.groups is a list of 1; "
      "'3' is not an index in it"]),
    ({"KVPLUGIN_LAYOUT__BLOCK_SIZE__X": "1"},
     ["environment variable KVPLUGIN_LAYOUT__BLOCK_SIZE__X: layout.block_size is a value, "
      "not a section"]),
    ({"KVPLUGIN_FAULTS__KINDS": "[error"},
     ["environment variable KVPLUGIN_FAULTS__KINDS (faults.kinds): cannot parse '[error'"]),
])
def test_a_bad_environment_value_names_the_variable_key_and_reason(
        env: dict[str, str], parts: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(env=env)
    for part in parts:
        assert part in str(e.value)


def test_config_file_variable_selects_the_file(tmp_path: Path) -> None:
    f = tmp_path / "mine.toml"
    f.write_text("[layout]\nnum_blocks = 77\n")
    assert load_config(env={"KVPLUGIN_CONFIG_FILE": str(f)}).layout.num_blocks == 77
    # An explicit path wins; without the variable the embedded default is loaded.
    assert load_config(REPO / "configs" / "redis.yaml",
                       env={"KVPLUGIN_CONFIG_FILE": str(f)}).layout.num_blocks == 160
    assert load_config(env={}).layout.num_blocks == 160
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read"):
        load_config(env={"KVPLUGIN_CONFIG_FILE": str(tmp_path / "missing.yaml")})


# ----------------------------------------------------------------------------- reference


def _gen_doc() -> Any:
    spec = importlib.util.spec_from_file_location("gen_config_doc",
                                                  REPO / "tools" / "gen_config_doc.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_config_reference_is_generated_and_current() -> None:
    doc = (REPO / "docs" / "config.md").read_text()
    assert doc == _gen_doc().render(), "docs/config.md is stale: python3 tools/gen_config_doc.py"


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> None:
    seen.add(model)
    for field in model.model_fields.values():
        sub = _gen_doc()._model(field.annotation)
        if sub is not None and sub[0] not in seen:
            _models(sub[0], seen)


def test_every_key_is_described_in_the_reference() -> None:
    models: set[type[BaseModel]] = set()
    _models(RunConfig, models)  # what the reference documents: every key kvplugin run reads
    assert len(models) == 14
    doc = (REPO / "docs" / "config.md").read_text()
    for model in models:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            assert f"| `{name}` |" in doc or f"| [`{name}`](#{name}) |" in doc
