"""The async layer: the only part of kvplugin that awaits.

* :mod:`kvplugin.aio.manager` — :class:`AsyncKVManager`, the engine-facing object
* :mod:`kvplugin.aio.plans` — pure offload decisions (hybrid reconciliation: what to claim,
  load, store; which Mamba states make a complete checkpoint)
* :mod:`kvplugin.aio.loads` — load jobs carried out: fetch, verify, copy in, publish
* :mod:`kvplugin.aio.stores` — offers, byte budget, store jobs (chunks + states as one
  checkpoint), blocks held for jobs after a request let go
* :mod:`kvplugin.aio.reqstate` — per-request bookkeeping shared by both sides
* :mod:`kvplugin.aio.jobs` — job runners, deadlines, the loads-first I/O gate
* :mod:`kvplugin.aio.memory` — paged host KV memory (numpy)
* :mod:`kvplugin.aio.keys` — block hashes to namespaced connector keys
* :mod:`kvplugin.aio.tenants` — tenants: scopes, shared prefix groups, quotas, stats
* :mod:`kvplugin.aio.values` — settings, results, counters and latency histograms
* :mod:`kvplugin.aio.loop` — uvloop when installed, the loop-thread adapter for engines that
  are not async

Modules are imported on demand; none from here.
"""
