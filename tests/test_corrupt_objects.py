"""Damaged objects through the real CLI: counted per tier and reason in the JSON, the
summary and the metrics, and told in a bounded number of warning lines that still add up to
every object refused."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from redis_fixture import clean_env

REPO = Path(__file__).resolve().parents[1]
DRILL = {"KVPLUGIN_FAULTS__RATE": "0.5", "KVPLUGIN_FAULTS__KINDS": '["corrupt"]'}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvplugin", "run", "--requests", "200", *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=clean_env(**DRILL))


def test_refused_objects_are_counted_by_reason_and_warned_about_in_sum() -> None:
    proc = _run("--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    refused = out["corrupt_objects"]
    assert list(refused) == ["memory", "disk"]
    for reasons in refused.values():
        assert list(reasons) == ["checksum", "metadata", "truncated", "format"]
    # Damaged in place by the drill: bad checksums and cut objects, nothing else forged.
    assert all(refused[t]["checksum"] > 0 and refused[t]["truncated"] > 0 for t in refused)
    assert all(refused[t]["metadata"] == 0 for t in refused)
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("WARNING")]
    total = sum(sum(r.values()) for r in refused.values())
    assert total > 100 and len(warnings) <= 20  # bounded, however many
    told: dict[str, int] = {}
    for line in warnings:
        one = re.search(r"base: (\w+): dropping corrupt object [0-9a-f]{96} \((\w+)\)", line)
        more = re.search(r"base: (\w+): (\d+) more corrupt objects dropped \((.*)\)$", line)
        assert one or more, line
        tier = (one or more).group(1)  # type: ignore[union-attr]
        told[tier] = told.get(tier, 0) + (1 if one else int(more.group(2)))  # type: ignore[union-attr]
    assert told == {t: sum(r.values()) for t, r in refused.items()}  # every one told


def test_the_summary_names_what_each_tier_refused() -> None:
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("corrupt "))
    by_tier = r"(memory|disk) \d+ \(checksum \d+, truncated \d+(, format \d+)?\)"
    assert re.fullmatch(rf"corrupt\s+: {by_tier}, {by_tier} \(damaged: dropped, "
                        r"recomputed\)", line), line
