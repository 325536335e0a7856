#!/usr/bin/env python3
"""Drive kvplugin's allocation core the way a scheduler does, in a few lines.

Two requests share a system prompt: the second one hits the first one's cached blocks,
allocates only its own suffix, and both release their blocks when they finish.

    python3 examples/quickstart.py
"""

from __future__ import annotations

from kvplugin.core.hashing import BlockHasher, HashContext
from kvplugin.core.manager import KVCacheManager
from kvplugin.core.request import Request, RequestStatus
from kvplugin.core.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

BLOCK = 16


def admit(manager: KVCacheManager, req: Request) -> int:
    """Lookup + allocation, as vLLM's scheduler admits a waiting request."""
    hits, num_hit, _ = manager.get_computed_blocks(req)
    blocks = manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
    if blocks is None:
        raise RuntimeError(f"no room for {req.request_id}")
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = num_hit
    manager.record_prefix_cache_stats(req, num_hit)
    return num_hit


def main() -> None:
    config = KVCacheConfig(num_blocks=64, kv_cache_groups=[
        KVCacheGroupSpec(["all_layers"], FullAttentionSpec(block_size=BLOCK))])
    manager = KVCacheManager(config, max_model_len=4096, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK, log_stats=True,
                             enable_kv_cache_events=True)
    hasher = BlockHasher(HashContext.create("sha256_cbor"), BLOCK)

    system = list(range(1000, 1064))  # a 64-token system prompt = 4 full blocks
    a = Request("a", [*system, 1, 2, 3, 4, 5], block_hasher=hasher)
    b = Request("b", [*system, 9, 9, 9], block_hasher=hasher)

    print(f"a: hit {admit(manager, a)} tokens, blocks {manager.get_block_ids('a')}")
    print(f"b: hit {admit(manager, b)} tokens, blocks {manager.get_block_ids('b')}")
    print(f"usage {manager.usage:.3f}, free blocks {manager.block_pool.get_num_free_blocks()}")
    for req in (a, b):
        req.status = RequestStatus.FINISHED_STOPPED
        manager.free(req)
    stats = manager.make_prefix_cache_stats()
    assert stats is not None
    print(f"prefix cache: {stats.hits} hit tokens of {stats.queries} queried; "
          f"{len(manager.take_events())} KV events")


if __name__ == "__main__":
    main()
