"""The reference async serving engine (what ``kvplugin run``, the tests and the benchmarks
drive): vLLM's scheduling rules on an asyncio loop over
:class:`~kvplugin.aio.manager.AsyncKVManager`.

* :mod:`kvplugin.engine.scheduler` — :class:`Engine`: the serving loop and the scheduler
* :mod:`kvplugin.engine.model` — the fake model runner (simulated time, deterministic KV,
  checks of every hit)
* :mod:`kvplugin.engine.workload` — tenants, chats, follow-ups, document QA, resends
* :mod:`kvplugin.engine.config` — ``kvplugin run``'s config: the workload section's model
* :mod:`kvplugin.engine.build` — the deployment (core, tiers, manager) from a config
* :mod:`kvplugin.engine.loop` — the loop-lag probe
* :mod:`kvplugin.engine.threaded` — the engine for synchronous callers, on a loop thread
* :mod:`kvplugin.engine.run`, :mod:`kvplugin.engine.report` — ``kvplugin run`` and its report

Modules are imported on demand; none from here.
"""
