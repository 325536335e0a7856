"""KV connectors: storage backends that speak keys and bytes only.

Connectors never import ``kvplugin.core`` or the async layer, so a third party can write
one against :mod:`connectors.base` alone.
"""
