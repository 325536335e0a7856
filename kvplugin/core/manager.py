"""``KVCacheManager``: the vLLM-0.33-compatible façade the scheduler calls every step.

Policy lives here (watermark, admission gates, what gets cached when, stats, event
annotation); per-family rules live in the single-type managers; the coordinator reconciles
groups.  "No room" is a value (``None``); misuse raises before any state changes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvplugin.core.blocks import KVCacheBlock
from kvplugin.core.coordinator import (
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
)
from kvplugin.core.events import BlockStored, KVCacheEvent
from kvplugin.core.hybrid import HybridKVCacheCoordinator
from kvplugin.core.metrics import KVCacheMetricsCollector
from kvplugin.core.request import Request, RequestStatus
from kvplugin.core.specs import (
    AttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    cdiv,
    get_kv_cache_spec_sliding_window,
)
from kvplugin.core.stats import PrefixCacheStats
from kvplugin.core.step_drains import StepDrains
from kvplugin.core.view import OffloadView

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KVCacheBlocks:
    """Per-group block lists: ``blocks[group][position]``."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([*a, *b] for a, b in zip(self.blocks, other.blocks,
                                                             strict=True)))

    def get_block_ids(self, allow_none: bool = False, *,
                      group_ids: Sequence[int] | None = None) -> tuple[list[int], ...] | None:
        groups = self.blocks if group_ids is None else tuple(self.blocks[g] for g in group_ids)
        if allow_none and all(len(g) == 0 for g in groups):
            return None
        return tuple([b.block_id for b in g] for g in groups)

    def get_unhashed_block_ids(self) -> list[int]:
        if len(self.blocks) != 1:
            raise ValueError("get_unhashed_block_ids supports one group only")
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [[b.block_id for b in g if b.block_hash is None and not b.is_null]
                for g in self.blocks]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int,
    use_eagle: bool, enable_caching: bool, enable_kv_cache_events: bool,
    scheduler_block_size: int, hash_block_size: int, num_hash_lookahead_tokens: int = 0,
    num_prefill_lookahead: int = 0, allow_partial_hash_hits: bool = True,
    dcp_world_size: int = 1, pcp_world_size: int = 1,
) -> KVCacheCoordinator:
    cp = {"dcp_world_size": dcp_world_size, "pcp_world_size": pcp_world_size}
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(
            kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle,
            enable_kv_cache_events, scheduler_block_size, hash_block_size,
            num_prefill_lookahead, num_hash_lookahead_tokens, **cp)
    args = (kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, True,
            enable_kv_cache_events, scheduler_block_size, hash_block_size,
            num_prefill_lookahead, num_hash_lookahead_tokens)
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(*args, **cp)
    return HybridKVCacheCoordinator(*args, allow_partial_hash_hits=allow_partial_hash_hits,
                                    **cp)


def _validate_config(config: KVCacheConfig, enable_caching: bool) -> None:
    if not config.kv_cache_groups:
        raise ValueError("KVCacheConfig has no KV-cache groups")
    for i, g in enumerate(config.kv_cache_groups):
        spec = g.kv_cache_spec
        if isinstance(spec, MambaSpec) and enable_caching and spec.mamba_cache_mode != "align":
            raise ValueError(
                f"group {i}: Mamba mode {spec.mamba_cache_mode!r} cannot prefix-cache; use "
                "mamba_cache_mode='align' or disable prefix caching")
        if isinstance(spec, CrossAttentionSpec) and enable_caching:
            raise ValueError(f"group {i}: cross-attention groups need prefix caching disabled")
        if isinstance(spec, EncoderOnlyAttentionSpec):
            raise ValueError(f"group {i}: encoder-only layers need no KV cache and are not "
                             "a scheduler group")


class KVCacheManager(StepDrains):
    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        if not watermark >= 0.0:
            raise ValueError(f"watermark must be non-negative, got {watermark}")
        _validate_config(kv_cache_config, enable_caching)
        self.max_model_len = max_model_len
        if max_in_flight_tokens is None:
            max_in_flight_tokens = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching,
            enable_kv_cache_events, scheduler_block_size, hash_block_size,
            num_hash_lookahead_tokens, num_prefill_lookahead,
            dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size)
        self.mamba_shared_prefix_checkpoint = (
            enable_mamba_shared_prefix_checkpoint and bool(self.coordinator.eagle_group_ids)
            and self.coordinator.enable_partial_hash_hits
            and self.coordinator.num_reprefillable_tokens == 0)
        if self.mamba_shared_prefix_checkpoint:
            for m in self.coordinator.single_type_managers:
                if isinstance(m.kv_cache_spec, MambaSpec):
                    m.shared_prefix_checkpoint = True
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        # Groups whose manager keeps a hit longer than the reconciled one (vLLM: HiSparse's
        # host tier); allocate_slots trims their hits to what the step actually reuses.
        self.retained_hit_group_ids = tuple(
            m.kv_cache_group_id for m in self.coordinator.single_type_managers
            if m.retains_longer_hit)
        self.metrics_collector = metrics_collector
        self.block_pool.metrics_collector = metrics_collector
        self.kv_cache_config = kv_cache_config
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.kv_cache_event_metadata = tuple(
            (g.kv_cache_spec.kind, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups)
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(
            self.num_kv_cache_groups)))
        self._offload_view = OffloadView.of(self)

    # ------------------------------------------------------------------ small members
    def offload_view(self) -> OffloadView:
        """The offload layer's narrow view of this manager (one, built once)."""
        return self._offload_view

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call (read-and-reset), or None when not logging."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # ------------------------------------------------------------------ lookup
    def get_computed_blocks(self, request: Request, max_cache_hit_length: int | None = None
                            ) -> tuple[KVCacheBlocks, int, int]:
        """(hit blocks, hit tokens, shared-prefix boundary); read-only.

        The default cap is ``T - 1``: with the whole prompt cached the last token must still
        be computed to produce logits.
        """
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        blocks, hit, uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length)
        if hit > 0 and self.enable_kv_cache_events and request.kv_cache_report_mode == "full":
            self.coordinator.emit_cached_block_events(request, blocks)
        boundary = hit + uncached if uncached else 0
        return self.create_kv_cache_blocks(blocks), hit, boundary

    def get_computed_blocks_for_connector(self, request: Request,
                                          max_cache_hit_length: int | None = None
                                          ) -> tuple[KVCacheBlocks, int, int, bool]:
        """Per-group lookup for Mamba hybrids: report the full-attention hit and whether a
        lagging group diverged (the caller reconciles when no external tokens arrive)."""
        coord = self.coordinator
        if not (self.kv_cache_config.has_mamba_layers
                and isinstance(coord, HybridKVCacheCoordinator)
                and coord.full_attention_group_id is not None):
            return (*self.get_computed_blocks(request, max_cache_hit_length), False)
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0, False
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        fa = coord.full_attention_group_id
        blocks, per_group = coord.find_longest_cache_hit_per_group(
            request.block_hashes, max_cache_hit_length)
        if any(h > per_group[fa] for h in per_group):
            return (*self.get_computed_blocks(request, max_cache_hit_length), False)
        local = per_group[fa]
        return self.create_kv_cache_blocks(blocks), local, 0, min(per_group) < local

    # ------------------------------------------------------------------ allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Give the request slots for its next step; None when there is no room.

        Only the blocks added by this call are returned (a copy-on-write block first);
        adopted hits are not.  On None nothing was adopted or allocated (window removal
        and Mamba checkpoint bookkeeping aside).
        """
        try:
            negative = (num_new_tokens | num_new_computed_tokens | num_lookahead_tokens
                        | num_external_computed_tokens | num_encoder_tokens
                        | reserved_blocks) < 0
        except TypeError:
            negative = True  # a non-integer count: named below
        if negative:
            _raise_bad_count(num_new_tokens=num_new_tokens,
                             num_new_computed_tokens=num_new_computed_tokens,
                             num_lookahead_tokens=num_lookahead_tokens,
                             num_external_computed_tokens=num_external_computed_tokens,
                             num_encoder_tokens=num_encoder_tokens,
                             reserved_blocks=reserved_blocks)
        if num_new_tokens == 0 and num_external_computed_tokens == 0 \
                and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no "
                             "computed tokens to adopt")
        empty = self.empty_kv_cache_blocks.blocks
        if new_computed_blocks is None:
            hits = empty
        else:
            hits = new_computed_blocks.blocks
            if len(hits) != self.num_kv_cache_groups:
                raise ValueError(f"new_computed_blocks has {len(hits)} groups, the manager "
                                 f"{self.num_kv_cache_groups}")
            if self.retained_hit_group_ids:
                hits = self._trim_retained_hits(
                    hits, num_new_computed_tokens + num_external_computed_tokens)
            if any(hits):
                self._check_can_adopt(request.request_id)
        coord = self.coordinator
        rid = request.request_id
        local = request.num_computed_tokens + num_new_computed_tokens
        total = local + num_external_computed_tokens
        if total > self.max_model_len:
            total = self.max_model_len
        wm = 0
        # Watermark: only waiting/preempted requests pay it, and only into a busy engine.
        if has_scheduled_reqs and (request.status is _WAITING or request.status is _PREEMPTED):
            wm = self.watermark_blocks
        num_tokens = len(request.all_token_ids)
        prefill_end = num_tokens - 1
        if request.num_prompt_tokens > prefill_end:
            prefill_end = request.num_prompt_tokens
        num_free = self.block_pool.free_block_queue.size
        if full_sequence_must_fit:
            full = min(num_tokens, self.max_model_len)
            need_full = coord.get_num_blocks_to_allocate(
                rid, full, hits, num_encoder_tokens, total, local, full,
                apply_admission_cap=True, prefill_end=prefill_end)
            if need_full + wm > num_free():
                return None
        main = total + num_new_tokens
        need_slot = main + num_lookahead_tokens
        if need_slot > self.max_model_len:
            need_slot = self.max_model_len
        # Free dead window blocks first (always safe) so the count below evicts less.  The
        # in-flight tokens of dispatched steps may still read theirs.
        if coord.releases_blocks:
            processed = total - request.num_in_flight_tokens
            coord.remove_skipped_blocks(rid, processed if processed > 0 else 0,
                                        request.num_prompt_tokens)
        need = coord.get_num_blocks_to_allocate(
            rid, need_slot, hits, num_encoder_tokens, local + num_external_computed_tokens,
            local, main, prefill_end=prefill_end)
        if need + wm > num_free() - reserved_blocks:
            return None
        if hits is not empty or num_external_computed_tokens > 0:
            coord.allocate_new_computed_blocks(rid, hits, local, num_external_computed_tokens,
                                               skip_zeroing_group_ids)
        new_blocks = coord.allocate_new_blocks(rid, need_slot, main, num_encoder_tokens)
        if not delay_cache_blocks and self.enable_caching:
            # Cache at scheduling time; capping at T leaves draft tokens out.
            coord.cache_blocks(request, main if main < num_tokens else num_tokens)
        return self.create_kv_cache_blocks(new_blocks)

    def _trim_retained_hits(self, hits: tuple[Sequence[KVCacheBlock], ...], reused: int
                            ) -> tuple[Sequence[KVCacheBlock], ...]:
        """Cut each retained-hit group's hits to the blocks covering the ``reused`` (local +
        external) tokens.  The blocks cut off are left untouched (no ref, no touch).

        Always a new tuple, as in vLLM: so even the empty singleton then counts as hits to
        adopt (which registers a new request in every group with an empty table).
        """
        groups = list(hits)
        managers = self.coordinator.single_type_managers
        for gid in self.retained_hit_group_ids:
            groups[gid] = groups[gid][:cdiv(reused, managers[gid].block_size)]
        return tuple(groups)

    # ------------------------------------------------------------------ reservations
    # What vLLM's Scheduler computes by reaching into the coordinator (its
    # ``_request_remaining_blocks`` / ``_inflight_prefill_reserved_blocks`` and
    # ``_spec_decode_step_blocks``), as public, read-only queries.
    @property
    def enable_partial_hash_hits(self) -> bool:
        """Whether fine-grained (sub-block) prefix hits are on (the scheduler then splits
        Mamba prefill chunks at the prompt's hash-aligned checkpoint)."""
        return bool(self.coordinator.enable_partial_hash_hits)

    def get_num_remaining_blocks(self, request: Request, num_spec_tokens: int = 0,
                                 num_lookahead_tokens: int = 0) -> int:
        """Blocks ``request`` still needs to hold its whole sequence (and, with speculative
        decoding, one more step of ``1 + num_spec_tokens + num_lookahead_tokens`` draft
        slots): the admission-capped count of ``allocate_slots``' full-sequence gate, with
        no hits.  Read-only."""
        full = min(request.num_tokens, self.max_model_len)
        num_tokens = full + (1 + num_spec_tokens + num_lookahead_tokens if num_spec_tokens
                             else 0)
        computed = request.num_computed_tokens
        return self.coordinator.get_num_blocks_to_allocate(
            request.request_id, num_tokens, self.empty_kv_cache_blocks.blocks, 0, computed,
            computed, full, apply_admission_cap=True,
            prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1))

    def get_num_spec_decode_step_blocks(self, num_spec_tokens: int,
                                        num_lookahead_tokens: int = 0) -> int:
        """Blocks one speculative-decoding step can take in the attention groups (Mamba
        groups already count their speculative state slots): 0 without drafts."""
        if not num_spec_tokens:
            return 0
        n = 1 + num_spec_tokens + num_lookahead_tokens
        return sum(cdiv(n, m.block_size) for m in self.coordinator.single_type_managers
                   if not isinstance(m.kv_cache_spec, MambaSpec))

    def get_num_reserved_blocks(self, inflight_prefills: Iterable[Request],
                                num_spec_tokens: int = 0, num_lookahead_tokens: int = 0) -> int:
        """The ``reserved_blocks`` vLLM's Scheduler passes when admitting an async KV load:
        what the in-flight prefills (prefill chunks and loads in progress) still need, plus
        one speculative-decoding step of the new request."""
        return (sum(self.get_num_remaining_blocks(r, num_spec_tokens, num_lookahead_tokens)
                    for r in inflight_prefills)
                + self.get_num_spec_decode_step_blocks(num_spec_tokens, num_lookahead_tokens))

    def _check_can_adopt(self, request_id: str) -> None:
        """Prefix hits are adopted only by a request that holds no blocks yet.  vLLM asserts
        this midway (after releasing out-of-window blocks); checking first keeps a misuse
        from changing anything."""
        for m in self.coordinator.single_type_managers:
            if request_id in m.num_cached_block or m.req_to_blocks.get(request_id):
                raise ValueError(
                    f"request {request_id!r} already holds blocks (it is running): prefix-cache "
                    "hits can only be adopted by a new request")

    # ------------------------------------------------------------------ freeing
    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first; unknown requests are a no-op."""
        self.coordinator.free(request.request_id)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if processed_computed_tokens < 0:
            raise ValueError("processed_computed_tokens must be >= 0")
        self.coordinator.remove_skipped_blocks(request_id, processed_computed_tokens,
                                               num_prompt_tokens)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request; the caller later frees ``reversed(blocks)`` on the pool."""
        return self.coordinator.pop_blocks_for_free(request.request_id)

    def free_popped_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Return blocks from :meth:`pop_blocks_for_free` to the pool, tail first (vLLM's
        scheduler does this on the pool once no in-flight step can still write them)."""
        self.block_pool.free_blocks(blocks[::-1])

    def free_retained_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Release the retained copy-on-write endpoints of :meth:`take_kv_cache_block_copies`
        once their copies ran (one ref each, in the order given)."""
        self.block_pool.free_blocks(blocks)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        if not self.coordinator.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated (cascade attention was removed): always zeros."""
        return [0] * self.num_kv_cache_groups

    def take_events(self) -> list[KVCacheEvent]:
        events = self.block_pool.take_events()
        meta = self.kv_cache_event_metadata
        for ev in events:
            if type(ev) is not BlockStored or ev.group_idx is None:
                continue
            if not 0 <= ev.group_idx < len(meta):
                logger.warning("Group index `%s` not in KV cache metadata", ev.group_idx)
                continue
            ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window = meta[ev.group_idx]
        return events

    # ------------------------------------------------------------------ queries
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in g] for g in self.coordinator.get_blocks(request_id))

    def get_block_ids_for_computed_tokens(self, request_id: str,
                                          num_computed_tokens: int) -> tuple[list[int], ...]:
        """Attention groups clipped to the computed tokens; others whole."""
        out = []
        for g, ids in zip(self.kv_cache_config.kv_cache_groups, self.get_block_ids(request_id),
                          strict=True):
            spec = g.kv_cache_spec
            if not isinstance(spec, AttentionSpec) or isinstance(
                    spec, CrossAttentionSpec | EncoderOnlyAttentionSpec):
                out.append(ids)
            else:
                out.append(ids[:cdiv(num_computed_tokens, spec.block_size)])
        return tuple(out)

    def estimate_cached_tokens(self, request: Request) -> int:
        result: int | None = None
        for g, blocks in zip(self.kv_cache_config.kv_cache_groups,
                             self.coordinator.get_blocks(request.request_id), strict=True):
            spec = g.kv_cache_spec
            if not spec.prefix_cacheable or isinstance(
                    spec, CrossAttentionSpec | EncoderOnlyAttentionSpec):
                continue
            n = max((b.block_hash_num_tokens or 0 for b in blocks), default=0)
            result = n if result is None else min(result, n)
        return result or 0

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def truncate_computed_blocks(self, blocks: KVCacheBlocks,
                                 num_computed_tokens: int) -> KVCacheBlocks:
        """A lookup result sliced at an aligned endpoint (no ref-count effects)."""
        out: list[list[KVCacheBlock]] = []
        for lst, m, g in zip(blocks.blocks, self.coordinator.single_type_managers,
                             self.kv_cache_config.kv_cache_groups, strict=True):
            if not g.kv_cache_spec.prefix_cacheable:
                if lst:
                    raise ValueError("a non-cacheable group cannot carry hits")
                out.append([])
                continue
            if num_computed_tokens % m.block_size:
                raise ValueError(f"{num_computed_tokens} tokens is not a multiple of group "
                                 f"block size {m.block_size}")
            n = num_computed_tokens // m.block_size
            if isinstance(g.kv_cache_spec, MambaSpec):
                n = min(n, len(lst))
            elif n > len(lst):
                raise ValueError(f"cannot truncate {len(lst)} blocks to {n}")
            out.append(list(lst[:n]))
        return self.create_kv_cache_blocks(tuple(out))

    def new_step_starts(self) -> None:
        self.coordinator.new_step_starts()


_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED


def _raise_bad_count(**counts: int) -> None:
    for name, value in counts.items():
        if not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
