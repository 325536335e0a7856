"""KV connectors: storage backends that speak keys and bytes only.

Connectors never import ``kvplugin.core`` or the async layer, so a third party can write
one against :mod:`connectors.base` alone. Modules (imported on demand, none from here):

* :mod:`connectors.base` — the protocol, capabilities, stats, errors, deadlines, breaker
* :mod:`connectors.keys` — stable namespaced storage keys and chunking
* :mod:`connectors.memory`, :mod:`connectors.disk`, :mod:`connectors.redis` — the stores
* :mod:`connectors.redis_cluster` (options in :mod:`connectors.redis_cluster_options`) —
  Redis Cluster through redis-py's ``RedisCluster``, batches pipelined per node
* :mod:`connectors.tiered` — memory → disk → Redis composition
* :mod:`connectors.faults` — fault injection and a disposable ``redis-server`` for tests;
  :mod:`connectors.cluster_testing` — a disposable local Redis Cluster for tests

Objects are stored in the verified block format of :mod:`kvplugin.serde`.
"""
