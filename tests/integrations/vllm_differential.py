"""Differential test of the two executors: vLLM 0.33.0's real Scheduler with
``KVPluginConnector``, and the native ``AsyncKVManager``, given the same requests, the same
scheduling steps and the same tier contents, must claim and store the same objects.

Run under the side virtualenv's python (vLLM + CPU torch), with this checkout on PYTHONPATH:

    PYTHONPATH=. PYTHONHASHSEED=0 $PY tests/integrations/vllm_differential.py full swa mamba

Prints one JSON object per run (one line each); test_vllm_differential.py asserts on them.
A run is a layout (``full``, ``swa``, ``mamba``; ``LAYOUT:mutant`` also deletes one object
from the native side's copy of the tier, so the two must disagree):

1. Warm-up: vLLM serves the plan's ``warm`` requests into an empty disk tier.
2. The tier directory is copied twice, so each executor starts from identical contents.
3. vLLM (fresh Scheduler and connector, :func:`vllm_scenarios.engine`) serves ``work`` on
   copy 1. Every ``allocate_slots`` and ``free`` of vLLM's KVCacheManager is logged in
   order, with the request's status and the arguments the scheduler passed: the schedule.
4. A fresh native manager (same config, same pool) on copy 2 replays that schedule: a
   request vLLM admits is looked up and admitted (its load awaited), one vLLM grows is
   grown by the same tokens, the fake forward of :mod:`vllm_fake` is written into host
   memory, ``after_step`` runs, the tokens vLLM sampled are appended; vLLM's frees are its
   ``finish`` (or ``preempt``) at the same point of the same step (a finished request with
   stores is freed by vLLM one step later, once they ended: both pools then free the same
   blocks between the same allocations). The native core is configured as vLLM's (pool
   size, sparse prefix-cache retention).

Both tiers are a :class:`RecordingDisk` (a connector kind registered here): every object
each executor asks the tier to store or to load is logged with its step, key, group and
token range or boundary, whatever code took the decision. Each step's stores are settled
before the next step (vLLM: ``wait_for_stores``; native: ``drain``) and an async load is
reported in the step that started it, so both sides' lookups meet the same tier.

Compared (:func:`compare`): per request, the admissions' claims (local and external tokens,
the Mamba state boundary); the stored objects and the loaded objects (step, key, group,
chunk tokens or state boundary; shown under the live requests whose tokens name the key,
:func:`owner`); and where the native manager could not follow vLLM's schedule.

Only :func:`compare` and the recording tier are importable without torch (the pytest side
imports :func:`compare`); everything else imports vLLM, torch and the fakes lazily.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvplugin.connectors.base import PutItem
from kvplugin.connectors.disk import DiskConnector
from kvplugin.connectors.keys import ObjectKey
from kvplugin.serde import Block

if TYPE_CHECKING:
    from kvplugin.aio.manager import AsyncKVManager
    from kvplugin.core.request import Request

Rec = dict[str, Any]
KIND = "kvdiff-recording-disk"  # the recording tier's connector kind
TENANT = "acme"
SALT = "tenant=acme"  # what the native manager salts tenant acme's requests with
MAX_STEPS = 2000


# --------------------------------------------------------------------- recording tier
@dataclass
class Recorder:
    """What one executor asked its tier to store and load, by step."""

    step: int = -1
    puts: list[Rec] = field(default_factory=list)
    gets: list[Rec] = field(default_factory=list)


RECORDERS: dict[str, Recorder] = {}


def _key_fields(key: ObjectKey) -> Rec:
    return {"key": key.id, "kind": key.kind, "group": key.namespace.group}


def _put_record(step: int, key: ObjectKey, block: Block | None) -> Rec:
    """A stored or loaded object: step, key, group, kind, and its token range or state
    boundary (``missing``: a load the tier could not serve)."""
    out = {"step": step, **_key_fields(key)}
    if block is None:
        out["missing"] = True
    elif block.meta.boundary is None:
        out["tokens"] = [block.meta.token_start, block.meta.token_end]
    else:
        out["boundary"] = block.meta.boundary
    return out


class RecordingDisk(DiskConnector):
    """A disk tier that logs every object it is asked to store or load (before the tier
    drops a duplicate of its own): the executor's decisions."""

    def __init__(self, root: str, *, capacity_bytes: int, recorder: Recorder) -> None:
        super().__init__(root, capacity_bytes=capacity_bytes, io_threads=2)
        self._kvdiff = recorder

    async def put(self, items: Sequence[PutItem], *, timeout: float) -> int:
        rec = self._kvdiff
        rec.puts.extend(_put_record(rec.step, key, block) for key, block in items)
        return await super().put(items, timeout=timeout)

    async def get(self, keys: Sequence[ObjectKey], *, timeout: float) -> list[Block | None]:
        rec = self._kvdiff
        step = rec.step  # the load's step (both harnesses wait for it within the step)
        got = await super().get(keys, timeout=timeout)
        rec.gets.extend(_put_record(step, k, b) for k, b in zip(keys, got, strict=True))
        return got


def recording_disk(root: str, tag: str, capacity_mb: float = 64.0) -> RecordingDisk:
    """The ``kvdiff-recording-disk`` kind: a disk tier at ``root`` logging into
    ``RECORDERS[tag]``."""
    return RecordingDisk(root, capacity_bytes=int(capacity_mb * (1 << 20)),
                         recorder=RECORDERS.setdefault(tag, Recorder()))


# ---------------------------------------------------------------------------- compare
def label(rec: Rec) -> str:
    """One stored / loaded object, readable: step, group, chunk tokens or state boundary,
    the key's last 10 hex digits."""
    what = (f"kv[{rec['tokens'][0]},{rec['tokens'][1]})" if "tokens" in rec
            else f"{rec['kind']}@{rec['boundary']}" if "boundary" in rec
            else f"{rec['kind']} (missing)")
    return f"step {rec['step']} g{rec['group']} {what} ..{rec['key'][-10:]}"


def owner(rec: Rec, owners: Rec) -> str:
    """The requests an object belongs to: those whose tokens name its key and that were
    live (arrived, not yet freed) at its step; every request naming it when none was; "?"
    when none names it. ``owners``: ``names`` (key -> requests, in arrival order) and
    ``live`` (request -> [first step, last step])."""
    names: list[str] = owners["names"].get(rec["key"], [])
    live = [r for r in names
            if owners["live"].get(r, [0, -1])[0] <= rec["step"] <= owners["live"][r][1]]
    return "|".join(live or names) or "?"


def _by_request(recs: list[Rec], owners: Rec) -> dict[str, list[str]]:
    def order(r: Rec) -> tuple[int, int, int]:
        return r["step"], r["group"], r["tokens"][0] if "tokens" in r else r.get("boundary", 0)

    out: dict[str, list[str]] = {}
    for r in sorted(recs, key=order):
        out.setdefault(owner(r, owners), []).append(label(r))
    return dict(sorted(out.items()))


def _multiset(recs: list[Rec]) -> Counter[str]:
    return Counter(json.dumps(r, sort_keys=True) for r in recs)


def compare(vllm: Rec, native: Rec, owners: Rec) -> Rec:
    """What differs between the two sides' records (``{}``: nothing). ``claims``: per
    request, both sides' admissions where they differ; ``stores`` / ``loads``: per owning
    request (:func:`owner`), the objects only one side stored (loaded), an object stored
    twice by one side counting twice; ``schedule``: where the native manager could not
    follow vLLM."""
    diff: Rec = {}
    claims: Rec = {}
    vc, nc = vllm["claims"], native["claims"]
    for rid in sorted(set(vc) | set(nc)):
        if vc.get(rid, []) != nc.get(rid, []):
            claims[rid] = {"vllm": vc.get(rid, []), "native": nc.get(rid, [])}
    if claims:
        diff["claims"] = claims
    for what in ("stores", "loads"):
        v, n = _multiset(vllm[what]), _multiset(native[what])
        only: dict[str, Rec] = {}
        for side, extra in (("only_vllm", v - n), ("only_native", n - v)):
            recs = [json.loads(s) for s in extra.elements()]
            for rid, labels in _by_request(recs, owners).items():
                only.setdefault(rid, {})[side] = labels
        if only:
            diff[what] = dict(sorted(only.items()))
    vb, nb = vllm.get("books", {}), native.get("books", {})
    books = {f"{t}.{k}": {"vllm": vb.get(t, {}).get(k), "native": nb.get(t, {}).get(k)}
             for t in sorted(set(vb) | set(nb)) for k in BOOK_FIELDS
             if vb.get(t, {}).get(k) != nb.get(t, {}).get(k)}
    if books:
        diff["books"] = books
    if native.get("schedule"):
        diff["schedule"] = native["schedule"]
    return diff


# The ledger's per-tenant counters both executors book the same way. Hit tokens: the device's,
# and the tiers' together (vLLM asks the tiers as one).
BOOK_FIELDS = ("requests", "prompt_tokens", "queries", "queried_tokens", "device_hit_tokens",
               "tier_hit_tokens", "loads", "loads_failed", "loaded_bytes", "stores",
               "stored_chunks", "stored_bytes", "stored_bytes_by_tier", "stores_failed",
               "stores_shed", "stores_deduplicated", "store_bytes_in_flight")


def book_of(ledger: Any) -> Rec:
    """An offload ledger's per-tenant counters, as :data:`BOOK_FIELDS` names them."""
    out: Rec = {}
    for tenant, c in ledger.tenants().items():
        hits = dict(c.hit_tokens)
        row = {k: getattr(c, k) for k in BOOK_FIELDS if hasattr(c, k)}
        row["stored_bytes_by_tier"] = dict(c.stored_bytes_by_tier)
        row["device_hit_tokens"] = hits.pop("device", 0)
        row["tier_hit_tokens"] = sum(hits.values())
        out[tenant] = row
    return out


# ------------------------------------------------------------------------ workloads
@dataclass(frozen=True)
class Plan:
    """A layout's pool (blocks, the null block included), warm-up and workload. Workload
    items: ``id``, ``prompt``, ``arrival`` (step), ``max_tokens``."""

    layout: str
    pool: int
    warm: list[Rec]
    work: list[Rec]


def plan(layout: str) -> Plan:
    """Per layout: a warm-up ``w`` that stores a prefix ``A``; then ``a`` claims part of
    it from the tier and prefills a long tail in chunks; ``d`` shares more of ``A`` (full
    attention: ``a``'s device blocks plus the tier's next chunks; with a window or Mamba
    group vLLM's sparse retention kept no usable device hit, so d claims from the tier, or
    nothing); fillers push ``a``'s blocks off the device; ``c`` re-asks what ``a`` computed
    (from the tier: the chunks ``a`` stored in this very run); ``L``, a prompt of most of
    the pool, evicts every cached block it does not hit (with Mamba: a diverged device hit,
    attention deeper than any device state)."""
    from vllm_scenarios import prompt

    if layout == "mamba":
        # Mamba blocks of 64 tokens; the warm-up stores A's chunks and the state at 128.
        A = prompt(1, 144)
        Q = prompt(2, 60)
        warm = [{"id": "w", "prompt": A, "arrival": 0, "max_tokens": 2}]
        work = [
            {"id": "a", "prompt": A + Q, "arrival": 0, "max_tokens": 3},
            {"id": "d", "prompt": A[:100] + prompt(3, 40), "arrival": 6, "max_tokens": 2},
            *({"id": f"f{i}", "prompt": prompt(10 + i, 128), "arrival": 12 + 4 * i,
               "max_tokens": 2} for i in range(3)),
            {"id": "c", "prompt": A + Q[:48] + prompt(4, 10), "arrival": 40, "max_tokens": 2},
            {"id": "L", "prompt": A[:128] + prompt(5, 200), "arrival": 56, "max_tokens": 2},
        ]
        return Plan(layout, 30, warm, work)
    A = prompt(1, 112)
    Q = prompt(2, 100)
    warm = [{"id": "w", "prompt": A, "arrival": 0, "max_tokens": 2}]
    work = [
        {"id": "a", "prompt": A[:80] + Q, "arrival": 0, "max_tokens": 3},
        {"id": "d", "prompt": A + prompt(3, 24), "arrival": 4, "max_tokens": 2},
        *({"id": f"f{i}", "prompt": prompt(10 + i, 128), "arrival": 10 + 4 * i,
           "max_tokens": 2} for i in range(3)),
        {"id": "c", "prompt": A[:80] + Q[:64] + prompt(4, 10), "arrival": 36, "max_tokens": 2},
        {"id": "L", "prompt": A[:80] + prompt(5, 240), "arrival": 50, "max_tokens": 2},
    ]
    return Plan(layout, 26 if layout == "full" else 30, warm, work)


# ------------------------------------------------------------------------ vLLM side
@dataclass
class VllmTrace:
    """vLLM's schedule (``events``, in order: ``step`` markers, ``arrive``, ``alloc``,
    ``free``, ``forward``), its admissions' claims, the tokens of every request."""

    events: list[Rec]
    claims: dict[str, list[Rec]]
    tokens: dict[str, list[int]]
    steps: int
    load_mismatches: int
    finished: list[str]
    books: Rec = field(default_factory=dict)  # the scheduler connector's ledger, per tenant


def config(workdir: str, layout: str, root: str, tag: str, pool: int) -> str:
    """vllm_fake's config of ``layout`` with the recording tier at ``root`` as the only
    tier, and the native core configured as vLLM's: a pool of ``pool`` blocks (vLLM's is
    built with as many) and vLLM's prefix-cache retention."""
    import yaml
    from vllm_fake import write_config

    os.makedirs(workdir)
    path = write_config(workdir, disk=False, remote_url=None, layout=layout)
    with open(path) as f:
        cfg = yaml.safe_load(f)
    cfg["offload"]["local_disk"] = None
    cfg["offload"]["connectors"] = [{"kind": KIND, "options": {"root": root, "tag": tag}}]
    cfg["layout"]["num_blocks"] = pool
    # vLLM's CacheConfig default (sparse retention: window and Mamba groups keep only the
    # replay boundaries cached); kvplugin's layout default is dense (null).
    cfg["layout"]["prefix_cache_retention_interval"] = 0
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def run_vllm(workdir: str, config_file: str, p: Plan, workload: list[Rec],
             recorder: Recorder) -> VllmTrace:
    """``workload`` through vLLM's Scheduler and the connector, every step's stores settled
    before the next, logging the schedule."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request as VRequest
    from vllm_scenarios import engine

    scheduler, runner = engine(workdir, config_file, p.pool, layout=p.layout)
    conn, worker = scheduler.get_kv_connector(), runner.w
    kvm = scheduler.kv_cache_manager
    events: list[Rec] = []
    claims: dict[str, list[Rec]] = {}
    held: set[str] = set()
    step = 0
    allocate, free = kvm.allocate_slots, kvm.free
    signature = inspect.signature(allocate)

    def spy_allocate(request: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(request, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        status = request.status.name
        out = allocate(request, *args, **kwargs)
        rid = request.request_id
        ev = {"ev": "alloc", "step": step, "req": rid, "n": a["num_new_tokens"],
              "status": status, "lookahead": a["num_lookahead_tokens"],
              "reserved": a["reserved_blocks"], "has_scheduled": a["has_scheduled_reqs"],
              "ok": out is not None}
        if out is not None and rid not in held:
            held.add(rid)
            claim = {"step": step, "local": a["num_new_computed_tokens"],
                     "external": a["num_external_computed_tokens"], "state": None}
            claims.setdefault(rid, []).append(claim)
        events.append(ev)
        return out

    def spy_free(request: Any) -> None:
        held.discard(request.request_id)
        events.append({"ev": "free", "step": step, "req": request.request_id,
                       "status": request.status.name, "finished": request.is_finished(),
                       "computed": request.num_computed_tokens})
        free(request)

    kvm.allocate_slots, kvm.free = spy_allocate, spy_free
    results = worker.get_transfer_results

    def in_step_results(finished_req_ids: set[str]) -> Any:
        # An async load is reported in the step that started it (not on the tier's clock):
        # the native manager's load is awaited at admission, so the loaded blocks reach
        # both prefix caches at the same step.
        res = results(finished_req_ids)
        deadline = time.monotonic() + 10.0
        while set(runner.pending) - res.finished_recving and time.monotonic() < deadline:
            time.sleep(0.001)
            more = results(set())
            res.finished_sending |= more.finished_sending
            res.finished_recving |= more.finished_recving
            res.failed_recving |= more.failed_recving
        return res

    worker.get_transfer_results = in_step_results
    arrivals: dict[int, list[Rec]] = {}
    for w in workload:
        arrivals.setdefault(w["arrival"], []).append(w)
    last_arrival = max(arrivals)
    reqs: dict[str, Any] = {}
    finished: list[str] = []
    bp = kvm.block_pool
    try:
        for step in range(MAX_STEPS):
            runner.settle_stores()
            recorder.step = step
            events.append({"ev": "step", "step": step})
            for w in arrivals.get(step, []):
                sp = SamplingParams(max_tokens=w["max_tokens"], ignore_eos=True)
                req = VRequest(request_id=w["id"], prompt_token_ids=w["prompt"],
                               sampling_params=sp, pooling_params=None,
                               block_hasher=runner.hasher, cache_salt=SALT)
                reqs[w["id"]] = req
                scheduler.add_request(req)
                events.append({"ev": "arrive", "step": step, "req": w["id"]})
            if step > last_arrival and not scheduler.has_requests() and not runner.pending \
                    and bp.get_num_free_blocks() == bp.num_gpu_blocks - 1:
                break
            so = scheduler.schedule()
            for spec in so.kv_connector_metadata.loads:
                states = [pc.first_token for pc in spec.pieces if pc.state]
                if states and claims.get(spec.req_id):
                    claims[spec.req_id][-1]["state"] = states[0]
            events.append({"ev": "forward", "step": step,
                           "sched": [[r, n] for r, n in so.num_scheduled_tokens.items()],
                           "status": {r: reqs[r].status.name for r in so.num_scheduled_tokens}})
            if not so.total_num_scheduled_tokens:
                time.sleep(0.002)
            out = scheduler.update_from_output(so, runner.step(so))
            for outs in out.values():
                finished += [o.request_id for o in outs.outputs if o.finish_reason is not None]
        books = book_of(conn.scheduler_side.ledger)
    finally:
        worker.shutdown()
        conn.shutdown()
    return VllmTrace(events, claims, {r: list(q.all_token_ids) for r, q in reqs.items()},
                     step, sum(ld.mismatched for ld in runner.loads), sorted(finished), books)


# ---------------------------------------------------------------------- native side
@dataclass
class NativeRun:
    claims: dict[str, list[Rec]]
    schedule: list[Rec]  # where the native manager could not follow vLLM's schedule
    names: dict[str, list[str]]  # key -> the requests whose tokens name it (arrival order)
    load_outcomes: list[str]
    books: Rec = field(default_factory=dict)  # the native manager's ledger, per tenant


def _names(mgr: AsyncKVManager, reqs: dict[str, Request]) -> dict[str, list[str]]:
    """Every chunk key and state key each request's tokens name -> the requests naming it,
    in arrival order (a shared prefix is named by every request that shares it)."""
    keys = mgr.keyspace
    hbs = keys.hash_block_size
    out: dict[str, list[str]] = {}
    for rid, req in reqs.items():
        hashes = req.block_hashes
        for g in keys.groups:
            if g.kind == "state":
                named = [keys.state_key(TENANT, g.group, hashes, b * hbs)
                         for b in range(1, len(hashes) + 1)]
            else:
                named = keys.chunk_keys(TENANT, g.group, hashes, 0, g.num_chunks(len(hashes)))
            for k in named:
                out.setdefault(k.id, []).append(rid)
    return out


def _live(events: list[Rec]) -> dict[str, list[int]]:
    """Per request, the steps from its arrival to its last free."""
    out: dict[str, list[int]] = {}
    for ev in events:
        if ev["ev"] == "arrive":
            out[ev["req"]] = [ev["step"], MAX_STEPS]
        elif ev["ev"] == "free" and ev["finished"]:
            out[ev["req"]][1] = ev["step"]
    return out


def redundant(puts: list[Rec], held: set[str]) -> list[Rec]:
    """The puts of objects the tier already held (``held``: the warm-up's) or that an
    earlier put of the same side stored."""
    seen = set(held)
    out = []
    for r in puts:
        if r["key"] in seen:
            out.append(r)
        seen.add(r["key"])
    return out


async def run_native(config_file: str, p: Plan, trace: VllmTrace, recorder: Recorder
                     ) -> NativeRun:
    """Replay vLLM's schedule on a fresh native manager."""
    from vllm_fake import BS
    from vllm_scenarios import _native_forward

    from kvplugin.core.request import RequestStatus
    from kvplugin.plugin import load_plugin

    items = {w["id"]: w for w in p.work}
    reqs: dict[str, Request] = {}
    held: set[str] = set()
    claims: dict[str, list[Rec]] = {}
    notes: list[Rec] = []
    outcomes: list[str] = []
    async with load_plugin(config_file) as plugin:
        mgr = plugin.manager
        granted: dict[str, int] = {}  # this step: tokens the native manager scheduled
        for ev in trace.events:
            kind, step = ev["ev"], ev["step"]
            if kind == "step":
                await mgr.drain()  # every store of the steps before is in the tier
                recorder.step = step
                granted = {}
            elif kind == "arrive":
                w = items[ev["req"]]
                reqs[w["id"]] = mgr.new_request(w["id"], w["prompt"], tenant=TENANT)
            elif kind == "alloc" and ev["ok"]:  # a refused allocation took nothing
                req = reqs[ev["req"]]
                req.status = RequestStatus[ev["status"]]
                args = {"num_lookahead_tokens": ev["lookahead"],
                        "reserved_blocks": ev["reserved"],
                        "has_scheduled_reqs": ev["has_scheduled"]}
                n = ev["n"]
                if req.request_id not in held:
                    found = await mgr.lookup(req)
                    adm = mgr.allocate(req, found, num_new_tokens=n, **args)
                    if adm is None:
                        notes.append({"step": step, "req": req.request_id,
                                      "what": "admission refused", "vllm_tokens": n})
                        continue
                    held.add(req.request_id)
                    claims.setdefault(req.request_id, []).append(
                        {"step": step, "local": adm.local_tokens,
                         "external": adm.external_tokens, "state": adm.state_boundary})
                    if adm.loading:
                        outcome = await mgr.wait_load(req)
                        outcomes.append(f"{req.request_id}: {outcome.status.value} "
                                        f"{outcome.loaded_tokens}/{outcome.claimed_tokens}")
                        adm = mgr.allocate(req, num_new_tokens=n, **args) if n else adm
                else:
                    adm = mgr.allocate(req, num_new_tokens=n, **args)
                if adm is None or adm.num_new_tokens != n:
                    notes.append({"step": step, "req": req.request_id, "vllm_tokens": n,
                                  "native_tokens": None if adm is None else adm.num_new_tokens})
                if adm is not None:
                    granted[req.request_id] = adm.num_new_tokens
            elif kind == "free":
                req = reqs[ev["req"]]
                held.discard(req.request_id)
                req.status = RequestStatus[ev["status"]]
                if req.num_computed_tokens != ev["computed"]:
                    notes.append({"step": step, "req": req.request_id, "what": "freed",
                                  "vllm_computed": ev["computed"],
                                  "native_computed": req.num_computed_tokens})
                if ev["finished"]:
                    mgr.finish(req)
                else:
                    mgr.preempt(req)
            elif kind == "forward":
                stepped = []
                for rid, _ in ev["sched"]:
                    req, n = reqs[rid], granted.get(rid, 0)
                    if not n:
                        continue
                    tokens = trace.tokens[rid]
                    tokens = tokens + [0] * (-len(tokens) % BS)
                    start = req.num_computed_tokens
                    _native_forward(mgr, rid, tokens, start, start + n, p.layout)
                    req.num_computed_tokens = start + n
                    req.status = RequestStatus[ev["status"][rid]]
                    stepped.append(req)
                mgr.after_step(stepped)
                for req in stepped:  # the token vLLM sampled, where it sampled one
                    final = trace.tokens[req.request_id]
                    if req.num_computed_tokens >= req.num_tokens and req.num_tokens < len(final):
                        req.append_output_token_ids(final[req.num_tokens])
        await mgr.drain()
        if held:
            notes.append({"what": "still held at the end", "reqs": sorted(held)})
        return NativeRun(claims, notes, _names(mgr, reqs), outcomes, book_of(mgr.offloads))


# ----------------------------------------------------------------------------- a run
def _remove_object(root: str, key: str) -> None:
    """Delete one object's file from a disk tier directory (the mutant's harm)."""
    name = key[32:] + ".kvb"
    hits = [os.path.join(d, name) for d, _, files in os.walk(root) if name in files]
    assert len(hits) == 1, f"object {key} is not one file under {root}: {hits}"
    os.remove(hits[0])


def _coverage(trace: VllmTrace, stores: list[Rec], loads: list[Rec], p: Plan) -> Rec:
    """What the run exercised (the vLLM side's counts)."""
    claims = [c for cs in trace.claims.values() for c in cs]
    prefill_steps: dict[str, int] = {}
    for ev in trace.events:
        if ev["ev"] == "forward":
            for rid, n in ev["sched"]:
                prefill_steps[rid] = prefill_steps.get(rid, 0) + (n > 1)
    kinds = Counter(f"g{r['group']} {r['kind']}" for r in stores)
    return {
        "tier_claims": sum(c["external"] > 0 for c in claims),
        "local_plus_tier_claims": sum(c["external"] > 0 and c["local"] > 0 for c in claims),
        "state_claims": sorted(c["state"] for c in claims if c["state"] is not None),
        "max_prefill_steps": max(prefill_steps.values()),
        "longest_prompt_blocks": max(-(len(w["prompt"]) // -16) for w in p.work),
        "pool_blocks": p.pool - 1,
        "stored": dict(sorted(kinds.items())),
        "state_boundaries_stored": sorted(r["boundary"] for r in stores if "boundary" in r),
        "loaded_by_group": dict(sorted(Counter(str(r["group"]) for r in loads).items())),
        "finished": trace.finished,
        "vllm_load_mismatches": trace.load_mismatches,
    }


def run(name: str, workdir: str) -> Rec:
    started = time.perf_counter()
    layout, _, variant = name.partition(":")
    p = plan(layout)
    tag = name.replace(":", "-")
    tiers = {side: os.path.join(workdir, f"tier-{side}") for side in ("warm", "vllm", "native")}
    recs = {side: RECORDERS.setdefault(f"{tag}-{side}", Recorder()) for side in tiers}
    cfgs = {side: config(os.path.join(workdir, side), layout, tiers[side], f"{tag}-{side}",
                         p.pool) for side in tiers}
    run_vllm(os.path.join(workdir, "warm"), cfgs["warm"], p, p.warm, recs["warm"])
    shutil.copytree(tiers["warm"], tiers["vllm"])
    shutil.copytree(tiers["warm"], tiers["native"])
    if variant == "mutant":  # the native side misses the warm-up's last chunk
        last = max((r for r in recs["warm"].puts if r["group"] == 0 and "tokens" in r),
                   key=lambda r: r["tokens"][1])
        _remove_object(tiers["native"], last["key"])
    elif variant:
        raise ValueError(f"unknown variant {variant!r}")
    trace = run_vllm(os.path.join(workdir, "vllm"), cfgs["vllm"], p, p.work, recs["vllm"])
    native = asyncio.run(run_native(cfgs["native"], p, trace, recs["native"]))
    owners = {"names": native.names, "live": _live(trace.events)}
    warm = {r["key"] for r in recs["warm"].puts}
    sides = {
        "vllm": {"claims": trace.claims, "stores": recs["vllm"].puts,
                 "loads": recs["vllm"].gets, "books": trace.books},
        "native": {"claims": native.claims, "stores": recs["native"].puts,
                   "loads": recs["native"].gets, "schedule": native.schedule,
                   "books": native.books},
    }
    return {
        "run": name, "layout": layout, "steps": trace.steps,
        "diff": compare(sides["vllm"], sides["native"], owners),
        "coverage": _coverage(trace, recs["vllm"].puts, recs["vllm"].gets, p),
        "claims": trace.claims,
        "stores_by_request": _by_request(recs["vllm"].puts, owners),
        # Objects a side put although the tier already held them (the tier keeps one).
        "redundant_stores": {side: [label(r) for r in redundant(recs[side].puts, warm)]
                             for side in ("vllm", "native")},
        "native_load_outcomes": native.load_outcomes,
        "books": {"vllm": trace.books, "native": native.books},
        "seconds": round(time.perf_counter() - started, 2),
    }


def main(argv: list[str]) -> int:
    from kvplugin.registry import register

    register(KIND, recording_disk)
    with tempfile.TemporaryDirectory(prefix="kvplugin-vllm-diff-") as workdir:
        for name in argv or ["full", "swa", "mamba"]:
            rundir = os.path.join(workdir, name.replace(":", "-"))
            os.makedirs(rundir)
            print(json.dumps(run(name, rundir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
