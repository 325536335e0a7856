"""Prefix-cache statistics (vLLM's ``PrefixCacheStats``).  Hit rate is derived, never stored."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefixCacheStats:
    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    hits_by_source: dict[str, int] = field(default_factory=dict)

    def record(self, num_tokens: int, num_hits: int, preempted: bool,
               hits_by_source: dict[str, int] | None = None) -> None:
        """Preempted requests count only in the ``preempted_*`` buckets."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
            return
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits
        if hits_by_source:
            if sum(hits_by_source.values()) != num_hits:
                hits_by_source = {"external_unspecified": num_hits}
            for source, n in hits_by_source.items():
                if n:
                    self.hits_by_source[source] = self.hits_by_source.get(source, 0) + n
