"""R-SWA (reference sliding window): full attention that keeps the prompt, and during
decode only the last ``rswa_window`` tokens; the gap between them goes to null blocks."""

from __future__ import annotations

from typing import Any, ClassVar

from kvplugin.core.single_type.full import FullAttentionManager
from kvplugin.core.specs import KVCacheSpec, RSWASpec, cdiv


class RSWAManager(FullAttentionManager):
    # Unlike plain full attention, decode frees the gap blocks.
    releases_window_blocks: ClassVar[bool] = True

    def __init__(self, kv_cache_spec: KVCacheSpec, **kwargs: Any) -> None:
        if not isinstance(kv_cache_spec, RSWASpec):
            raise TypeError(f"RSWAManager needs an RSWASpec, got {type(kv_cache_spec).__name__}")
        super().__init__(kv_cache_spec, **kwargs)
        self.rswa_window = kv_cache_spec.rswa_window

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free the blocks entirely inside ``[cdiv(P, bs) * bs, max(P, computed - window))``.

        Without a prompt length (the connector's finish-time call may omit it) nothing is
        freed, as for full attention.
        """
        if num_prompt_tokens is None:
            return
        bs = self.block_size
        window_start = max(num_prompt_tokens, processed_computed_tokens - self.rswa_window)
        self._remove_blocks_in_range(request_id, cdiv(num_prompt_tokens, bs),
                                     window_start // bs)
