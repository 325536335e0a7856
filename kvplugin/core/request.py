"""A small, engine-independent view of a request: exactly what the manager reads or writes."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplugin.core.blocks import BlockHash


class RequestStatus(enum.IntEnum):
    """vLLM's request states; everything after PREEMPTED counts as finished."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


@dataclass(frozen=True, slots=True)
class LoRAInfo:
    """The LoRA adapter of a request: name and path enter the hash, the id the events."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name


@dataclass(frozen=True, slots=True)
class MMFeature:
    """A multimodal placeholder: its content identifier and token range."""

    identifier: str
    offset: int
    length: int


BlockHasherFn = Callable[["Request"], list[BlockHash]]


@dataclass(slots=True, eq=False)
class Request:
    """What the KV-cache manager knows about one request.

    ``block_hashes`` grows incrementally: the hasher (if any) runs at construction and
    after every :meth:`append_output_token_ids`.  ``prompt_embeds`` is any object whose
    rows can be sliced and turned into bytes (a numpy array), never a torch tensor.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    block_hasher: BlockHasherFn | None = None
    lora_request: LoRAInfo | None = None
    cache_salt: str | None = None
    mm_features: list[MMFeature] = field(default_factory=list)
    prompt_embeds: Any = None
    skip_reading_prefix_cache: bool = False
    session_id: str | None = None
    kv_cache_report_mode: str = "incremental"
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_in_flight_tokens: int = 0
    num_preemptions: int = 0
    shared_prefix_boundary: int = 0
    all_token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    block_hashes: list[BlockHash] = field(init=False, default_factory=list)
    prompt_embeds_hashes: dict[tuple[int, int], bytes] = field(init=False, default_factory=dict)
    has_no_extra_keys: bool = field(init=False)
    _next_hash_at: int = field(init=False, default=0, repr=False)
    # Blocks after the first all carry the same extra keys (no multimodal items, no
    # prompt embeddings): only LoRA, and a cache salt on block 0.
    uniform_after_first_block: bool = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        if any(f.offset < 0 or f.length <= 0 for f in self.mm_features):
            raise ValueError("multimodal features need offset >= 0 and length > 0")
        self.mm_features = sorted(self.mm_features, key=lambda f: f.offset)
        varying = bool(self.mm_features) or self.prompt_embeds is not None
        self.has_no_extra_keys = not (varying or self.lora_request or self.cache_salt)
        self.uniform_after_first_block = not varying
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)
        if len(self.all_token_ids) >= self._next_hash_at:
            self.update_block_hashes()

    def update_block_hashes(self) -> None:
        if self.block_hasher is not None:
            self.block_hashes.extend(self.block_hasher(self))
            # The hasher only produces something once the next hash block is complete;
            # remember where that is so decode steps skip the call.
            bs = getattr(self.block_hasher, "block_size", None)
            if bs is not None:
                self._next_hash_at = ((len(self.block_hashes) + 1) * bs
                                      + getattr(self.block_hasher, "lookahead", 0))

    def prompt_embeds_bytes(self, start: int, end: int) -> bytes:
        rows = self.prompt_embeds[start:end]
        tobytes = getattr(rows, "tobytes", None)
        return bytes(tobytes()) if tobytes is not None else bytes(rows)
