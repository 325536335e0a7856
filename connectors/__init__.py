"""KV connectors: storage backends that speak keys and bytes only.

Connectors never import ``kvplugin.core`` or the async layer, so a third party can write
one against :mod:`kvplugin.connectors.base` alone. Modules (imported on demand, none from here):

* :mod:`kvplugin.connectors.base` — the protocol, capabilities, stats, errors, deadlines, breaker
* :mod:`kvplugin.connectors.keys` — stable namespaced storage keys and chunking
* :mod:`kvplugin.connectors.memory`, :mod:`kvplugin.connectors.disk`,
  :mod:`kvplugin.connectors.redis` — the stores
* :mod:`kvplugin.connectors.redis_cluster` (options in
  :mod:`kvplugin.connectors.redis_cluster_options`) —
  Redis Cluster through redis-py's ``RedisCluster``, batches pipelined per node
* :mod:`kvplugin.connectors.tiered` — memory → disk → Redis composition
* :mod:`kvplugin.connectors.faults` — fault injection and a disposable ``redis-server`` for tests;
  :mod:`kvplugin.connectors.cluster_testing` — a disposable local Redis Cluster for tests

Objects are stored in the verified block format of :mod:`kvplugin.serde`.
"""
