"""The engine's traffic: tenants, shared system prompts, multi-turn chats, document QA,
resends. A pure function of the workload config and its seed.

* Every tenant uses the same system prompts (token for token, as one application deployed
  for several customers): the caches must still keep tenants apart.
* A chat is a system prompt and a user message; a follow-up resends the whole conversation
  so far (its parent's prompt and answer) plus a new message, a think time after the parent
  finished; a resend repeats an earlier prompt exactly (a retry, a regenerate).
* Document QA asks a question about one of the tenant's own documents, after a system prompt.

Follow-ups and resends depend on when their parent finishes, so a request spec says what
its prompt is made of rather than listing it; :func:`build_prompt` resolves it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvplugin.config import WorkloadConfig

__all__ = ["Finished", "RequestSpec", "build_prompt", "generate", "kinds"]

Kind = Literal["chat", "doc_qa", "follow_up", "resend"]


@dataclass(frozen=True, slots=True)
class RequestSpec:
    request_id: str
    tenant: str
    kind: Kind
    at_s: float  # arrival, seconds after the start
    new_tokens: tuple[int, ...]  # the tokens after the history
    max_tokens: int
    prompt_len: int  # known in advance: answers are exactly max_tokens long
    after: str | None = None  # a follow-up's or resend's parent
    think_s: float = 0.0  # and how long after the parent finished it arrives, at the earliest
    cache_salt: str | None = None
    lora: str | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """What the workload needs of a finished request to build its children's prompts."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]


def build_prompt(spec: RequestSpec, done: Mapping[str, Finished]) -> list[int]:
    """The spec's prompt, once its parent (if any) has finished."""
    if spec.after is None:
        return list(spec.new_tokens)
    parent = done[spec.after]
    if spec.kind == "resend":
        return list(parent.prompt)
    return [*parent.prompt, *parent.output, *spec.new_tokens]


class _Gen:
    def __init__(self, w: WorkloadConfig, max_prompt_len: int) -> None:
        self.w = w
        self.rng = random.Random(w.seed)
        self.max_prompt_len = max_prompt_len
        self.tenants = [f"tenant{i}" for i in range(w.num_tenants)]
        self.system = [self._fixed(("system", i), w.system_prompt_len)
                       for i in range(w.num_system_prompts)]
        self.docs = {t: [self._fixed(("doc", t, d), w.document_len)
                         for d in range(w.num_documents)] for t in self.tenants}
        self.specs: list[RequestSpec] = []
        self.open: list[RequestSpec] = []  # conversations a follow-up may continue

    def _fixed(self, what: tuple[object, ...], span: tuple[int, int]) -> tuple[int, ...]:
        # Shared text comes from its own generator so it is the same whatever came before.
        rng = random.Random(f"{self.w.seed}/{what}")
        return tuple(rng.randrange(self.w.vocab) for _ in range(rng.randint(*span)))

    def _tokens(self, span: tuple[int, int]) -> tuple[int, ...]:
        return tuple(self.rng.randrange(self.w.vocab) for _ in range(self.rng.randint(*span)))

    def _think(self) -> float:
        return self.rng.uniform(*self.w.think_time_ms) / 1000

    def spec(self, index: int, at_s: float) -> RequestSpec:
        w, roll = self.w, self.rng.random()
        if self.specs and roll < w.resend_prob:
            return self._resend(index, at_s, self.rng.choice(self.specs))
        if self.open and roll < w.resend_prob + w.follow_up_prob:
            spec = self._follow_up(index, at_s, self.rng.choice(self.open))
            if spec is not None:
                return spec
        return self._fresh(index, at_s)

    def _resend(self, index: int, at_s: float, src: RequestSpec) -> RequestSpec:
        return RequestSpec(f"r{index}", src.tenant, "resend", at_s, (), src.max_tokens,
                           src.prompt_len, src.request_id, self._think(), src.cache_salt,
                           src.lora)

    def _follow_up(self, index: int, at_s: float, parent: RequestSpec) -> RequestSpec | None:
        new = self._tokens(self.w.user_len)
        n = parent.prompt_len + parent.max_tokens + len(new)
        if n > self.max_prompt_len:
            return None
        self.open.remove(parent)  # a conversation goes on from its latest turn
        return RequestSpec(f"r{index}", parent.tenant, "follow_up", at_s, new,
                           self.rng.randint(*self.w.output_len), n, parent.request_id,
                           self._think(), parent.cache_salt, parent.lora)

    def _fresh(self, index: int, at_s: float) -> RequestSpec:
        w, rng = self.w, self.rng
        tenant = rng.choice(self.tenants)
        system = self.system[rng.randrange(len(self.system))]
        kind: Kind = "doc_qa" if rng.random() < w.doc_qa_prob else "chat"
        body = rng.choice(self.docs[tenant]) if kind == "doc_qa" else ()
        tokens = (*system, *body, *self._tokens(w.user_len))[:self.max_prompt_len]
        salt = f"user{rng.randrange(3)}" if rng.random() < w.salt_prob else None
        lora = f"adapter{rng.randrange(2)}" if rng.random() < w.lora_prob else None
        return RequestSpec(f"r{index}", tenant, kind, at_s, tokens,
                           rng.randint(*w.output_len), len(tokens), cache_salt=salt, lora=lora)


def generate(w: WorkloadConfig, *, max_prompt_len: int) -> list[RequestSpec]:
    """``w.num_requests`` specs in arrival order (Poisson arrivals at ``requests_per_s``);
    no prompt is longer than ``max_prompt_len``."""
    if max_prompt_len < 2:
        raise ValueError(f"max_prompt_len must be at least 2, got {max_prompt_len}")
    gen = _Gen(w, max_prompt_len)
    at = 0.0
    for i in range(w.num_requests):
        spec = gen.spec(i, at)
        gen.specs.append(spec)
        if spec.kind != "resend":
            gen.open.append(spec)
        at += gen.rng.expovariate(w.requests_per_s)
    return gen.specs


def kinds(specs: Sequence[RequestSpec]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in specs:
        out[s.kind] = out.get(s.kind, 0) + 1
    return out
