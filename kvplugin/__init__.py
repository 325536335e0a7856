"""kvplugin: an asyncio, multi-tenant KV-cache manager plugin with KV connector offload.

The package is layered (see ARCHITECTURE.md): ``kvplugin.core`` is the synchronous,
I/O-free allocation core (behaviour-compatible with vLLM 0.33.0's ``KVCacheManager``);
``kvplugin.connectors`` (the ``connectors/`` folder, installed under kvplugin's name) speak
keys and bytes only.  This module
imports nothing heavy so that importing one layer never drags in another.
"""

__version__ = "0.1.0"
