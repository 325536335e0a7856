"""Integrations of kvplugin into other serving engines (optional extras).

``kvplugin.integrations.vllm``: a vLLM 0.33 KV connector (extra ``vllm``; vLLM and torch are
imported only when the connector is built).
"""
