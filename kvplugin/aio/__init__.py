"""The async layer: the only part of kvplugin that awaits.

* :mod:`kvplugin.aio.manager` — :class:`AsyncKVManager`, the engine-facing object
* :mod:`kvplugin.aio.admission` — lookups and admissions (claims, loads to start)
* :mod:`kvplugin.aio.offload_ledger` — the synchronous offload core both integrations
  execute: store cursors, plans, the byte budget, tier quotas, every offload counter
* :mod:`kvplugin.aio.offload_types` — its values: requests, store and load plans (tuples
  of objects with a state), results, tier quotas, per-tenant counters
* :mod:`kvplugin.aio.group_kinds` — the offload's group kinds, one entry each (page shape,
  null blocks, fingerprint, how a hit is restored, vLLM's classes)
* :mod:`kvplugin.aio.plans` — pure offload decisions (hybrid reconciliation: what to claim,
  load, store; which Mamba states make a complete checkpoint)
* :mod:`kvplugin.aio.probe` — the tier lookup behind a claim, within one deadline
* :mod:`kvplugin.aio.objects` — what a stored object is: its description (the metadata a
  store writes) and the acceptance check every load applies
* :mod:`kvplugin.aio.loads` — load jobs carried out: fetch, verify, copy in, publish
* :mod:`kvplugin.aio.stores` — offers and store jobs (chunks + states as one checkpoint),
  lazy copy-outs, blocks held for jobs after a request let go
* :mod:`kvplugin.aio.jobs` — job runners, deadlines, the loads-first I/O gate
* :mod:`kvplugin.aio.reqstate` — per-request bookkeeping shared by both sides
* :mod:`kvplugin.aio.ledger` — the token ledger: where each prompt token came from
* :mod:`kvplugin.aio.loadcost` — whether loading a claim beats recomputing it
* :mod:`kvplugin.aio.memory` — paged host KV memory (numpy)
* :mod:`kvplugin.aio.keys` — block hashes to namespaced connector keys
* :mod:`kvplugin.aio.tenants` — tenants: scopes, shared prefix groups, quotas, stats
* :mod:`kvplugin.aio.holdings` — tier bytes held per tenant (tier byte quotas)
* :mod:`kvplugin.aio.tier_events` — the tiers' stored / removed events as KV events
* :mod:`kvplugin.aio.values` — settings, results, counters and latency histograms
* :mod:`kvplugin.aio.loop` — uvloop when installed, the loop-thread adapter for engines that
  are not async

Modules are imported on demand; none from here.
"""
