"""The engine's traffic: tenants, shared system prompts, multi-turn chats, document QA,
resends. A pure function of the workload config and its seed.

* Every tenant uses the same system prompts (token for token, as one application deployed
  for several customers): the caches must still keep tenants apart.
* A chat is a system prompt and a user message; a follow-up resends the whole conversation
  so far (its parent's prompt and answer) plus a new message, a think time after the parent
  finished; a resend repeats an earlier prompt exactly (a retry, a regenerate).
* Document QA asks a question about one of the tenant's own documents, after a system prompt.

* Prefix groups: a tenant that belongs to a group (``prefix_groups``) declares the group and
  its system prompt's length with every request, so the members share that prefix's KV.

Follow-ups and resends depend on when their parent finishes, so a request spec says what
its prompt is made of rather than listing it; :func:`build_prompt` resolves it. A follow-up
or resend refers to one of the last :data:`HISTORY` requests, so :func:`stream` generates
the workload as it is consumed, in memory that does not grow with the number of requests.

Two more shapes, for benchmarks (and ``kvplugin run`` later): :func:`multi_round_qa`, the
shape of LMCache's multi-round QA benchmark (users chatting for several rounds over a long
history, each round resending the conversation), and :func:`no_reuse` (every prompt
unique: offload can only cost).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from kvplugin.engine.config import WorkloadConfig

__all__ = ["HISTORY", "Finished", "MultiRoundQA", "RequestSpec", "build_prompt", "generate",
           "kinds", "multi_round_qa", "no_reuse", "stream", "warm_up_tokens"]

HISTORY = 512  # a follow-up or a resend refers to one of this many latest requests

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
    prefix_group: str | None = None  # the tenant's group, whose prefix the request shares
    shared_prefix_tokens: int = 0  # that prefix (the system prompt): tokens [0, this)
    gap_s: float = 0.0  # a follow-up: how long after its parent was sent, at the earliest


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


def _tenancy(tenants: Sequence[str] | None, num_tenants: int,
             prefix_groups: Mapping[str, Sequence[str]] | None) -> tuple[list[str],
                                                                          dict[str, str]]:
    """(the tenant names, each grouped tenant's group: its first group in mapping order)."""
    names = [f"tenant{i}" for i in range(num_tenants)] if tenants is None else list(tenants)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"tenants must be distinct names, at least one, got {names!r}")
    group_of: dict[str, str] = {}
    for group, members in (prefix_groups or {}).items():
        for t in members:
            if t not in names:
                raise ValueError(f"prefix group {group!r}: {t!r} is not one of the workload's "
                                 f"tenants {names}")
            group_of.setdefault(t, group)
    return names, group_of


class _Gen:
    def __init__(self, w: WorkloadConfig, max_prompt_len: int, tenants: Sequence[str] | None,
                 prefix_groups: Mapping[str, Sequence[str]] | None) -> None:
        self.w = w
        self.rng = random.Random(w.seed)
        self.max_prompt_len = max_prompt_len
        self.tenants, self.group_of = _tenancy(tenants, w.num_tenants, prefix_groups)
        self.system = [self._fixed(("system", i), w.system_prompt_len)
                       for i in range(w.num_system_prompts)]
        self.docs = {t: [self._fixed(("doc", t, d), w.document_len)
                         for d in range(w.num_documents)] for t in self.tenants}
        self.specs: deque[RequestSpec] = deque(maxlen=HISTORY)  # what a resend may repeat
        self.open: dict[str, RequestSpec] = {}  # of those, conversations that may go on

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
            spec = self._follow_up(index, at_s, self.rng.choice(list(self.open.values())))
            if spec is not None:
                return spec
        return self._fresh(index, at_s)

    def _resend(self, index: int, at_s: float, src: RequestSpec) -> RequestSpec:
        return RequestSpec(f"r{index}", src.tenant, "resend", at_s, (), src.max_tokens,
                           src.prompt_len, src.request_id, self._think(), src.cache_salt,
                           src.lora, src.prefix_group, src.shared_prefix_tokens)

    def _follow_up(self, index: int, at_s: float, parent: RequestSpec) -> RequestSpec | None:
        new = self._tokens(self.w.user_len)
        n = parent.prompt_len + parent.max_tokens + len(new)
        if n > self.max_prompt_len:
            return None
        del self.open[parent.request_id]  # a conversation goes on from its latest turn
        return RequestSpec(f"r{index}", parent.tenant, "follow_up", at_s, new,
                           self.rng.randint(*self.w.output_len), n, parent.request_id,
                           self._think(), parent.cache_salt, parent.lora, parent.prefix_group,
                           parent.shared_prefix_tokens)

    def _fresh(self, index: int, at_s: float) -> RequestSpec:
        w, rng = self.w, self.rng
        tenant = rng.choice(self.tenants)
        system = self.system[rng.randrange(len(self.system))]
        kind: Kind = "doc_qa" if rng.random() < w.doc_qa_prob else "chat"
        body = rng.choice(self.docs[tenant]) if kind == "doc_qa" else ()
        tokens = (*system, *body, *self._tokens(w.user_len))[:self.max_prompt_len]
        salt = f"user{rng.randrange(3)}" if rng.random() < w.salt_prob else None
        lora = f"adapter{rng.randrange(2)}" if rng.random() < w.lora_prob else None
        group = self.group_of.get(tenant)
        shared = min(len(system), len(tokens)) if group is not None else 0
        return RequestSpec(f"r{index}", tenant, kind, at_s, tokens,
                           rng.randint(*w.output_len), len(tokens), cache_salt=salt, lora=lora,
                           prefix_group=group, shared_prefix_tokens=shared)


def generate(w: WorkloadConfig, *, max_prompt_len: int, tenants: Sequence[str] | None = None,
             prefix_groups: Mapping[str, Sequence[str]] | None = None) -> list[RequestSpec]:
    """``w.num_requests`` specs in arrival order (Poisson arrivals at ``requests_per_s``);
    no prompt is longer than ``max_prompt_len``. ``tenants`` names the tenants (default:
    ``tenant0`` .. for ``w.num_tenants``); a member of a group of ``prefix_groups`` (group ->
    members) declares the group and its system prompt as the shared prefix."""
    return list(stream(w, max_prompt_len=max_prompt_len, tenants=tenants,
                       prefix_groups=prefix_groups))


def stream(w: WorkloadConfig, *, max_prompt_len: int, tenants: Sequence[str] | None = None,
           prefix_groups: Mapping[str, Sequence[str]] | None = None) -> Iterator[RequestSpec]:
    """:func:`generate`'s specs one by one, holding only the last :data:`HISTORY`."""
    if max_prompt_len < 2:
        raise ValueError(f"max_prompt_len must be at least 2, got {max_prompt_len}")
    gen = _Gen(w, max_prompt_len, tenants, prefix_groups)
    at = 0.0
    for i in range(w.num_requests):
        spec = gen.spec(i, at)
        if len(gen.specs) == HISTORY:  # the oldest leaves the window: nothing refers to it
            gen.open.pop(gen.specs[0].request_id, None)
        gen.specs.append(spec)
        if spec.kind != "resend":
            gen.open[spec.request_id] = spec
        at += gen.rng.expovariate(w.requests_per_s)
        yield spec


def kinds(specs: Sequence[RequestSpec]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in specs:
        out[s.kind] = out.get(s.kind, 0) + 1
    return out


# --------------------------------------------------------------------------- benchmark shapes


@dataclass(frozen=True, slots=True)
class MultiRoundQA:
    """LMCache's multi-round QA benchmark (``benchmarks/multi-round-qa``), its arrival rule
    as implemented there. ``users`` users are in the system at once; a user's rounds are
    sent at most one every ``gap_s = users / qps`` seconds, and never before its previous
    answer is complete (open loop below saturation, closed loop per user above it). A user
    lives ``(rounds - 1) * gap_s`` seconds, so one joins every ``join_s = (rounds - 1) /
    qps`` (the rate at which they leave below saturation): at 0, ``join_s``, ... before
    ``duration_s``, when sending stops. At the start ``users - 1`` users are already
    mid-conversation, staggered as LMCache's ramp-up places them (user ``i`` ``i / users``
    of a life behind the oldest), so the run starts in steady state.

    Round ``r``'s prompt is the shared system prompt, the user's history, then every earlier
    round (its question and answer) and a new question: each round resends the whole
    conversation. A pre-seeded user's first prompt carries made-up earlier rounds (LMCache's
    starts from the history alone), so every prompt has its round's length. Users are spread
    over ``num_tenants`` tenants, round robin; the system prompt is one per tenant (per
    group for the members of a prefix group)."""

    users: int = 10
    rounds: int = 10
    qps: float = 1.0
    duration_s: float = 60.0
    system_prompt_len: int = 1000
    history_len: int = 20000
    question_len: int = 20
    answer_len: int = 100
    num_tenants: int = 1
    vocab: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("users", "system_prompt_len", "question_len", "answer_len",
                     "num_tenants"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if type(self.rounds) is not int or self.rounds < 2:
            raise ValueError(f"rounds must be an int >= 2, got {self.rounds!r}")
        if type(self.history_len) is not int or self.history_len < 0:
            raise ValueError(f"history_len must be an int >= 0, got {self.history_len!r}")
        if not (0 < self.qps < math.inf and 0 < self.duration_s < math.inf) or self.vocab < 2:
            raise ValueError("qps and duration_s must be finite and > 0, vocab >= 2")

    @property
    def gap_s(self) -> float:
        """A user's rounds: one sent every this many seconds, at most."""
        return self.users / self.qps

    @property
    def join_s(self) -> float:
        """A new user every this many seconds."""
        return (self.rounds - 1) / self.qps

    def prompt_len(self, round_: int) -> int:
        """Tokens of the prompt of round ``round_`` (0-based)."""
        return (self.system_prompt_len + self.history_len + self.question_len
                + round_ * (self.answer_len + self.question_len))

    @property
    def working_set_tokens(self) -> int:
        """The KV the users in the system at once may reuse: each one's conversation at
        its longest (the system prompts counted once per user)."""
        return self.users * (self.prompt_len(self.rounds - 1) + self.answer_len)

    def starts(self) -> list[tuple[str, int, float]]:
        """Every user's (name, first round, first send time), in time order: the
        pre-seeded ``p1`` .. ``p{users-1}``, then ``u0``, ``u1``, .. joining."""
        n, life = self.users, self.rounds - 1
        out: list[tuple[str, int, float]] = []
        for i in range(1, n):
            # LMCache's ramp-up: user i is life * (n - i) / n seconds into its life; the
            # rounds that fit in that time have been sent, the next is due a gap after the
            # last of them (exact in rationals: the float product may round down a round).
            behind = Fraction(life * (n - i), n)  # in gaps
            done = int(behind) + 1
            out.append((f"p{i}", done, float((done - behind) * self.gap_s)))
        k = 0
        while k * self.join_s < self.duration_s:
            out.append((f"u{k}", 0, k * self.join_s))
            k += 1
        return sorted(out, key=lambda x: x[2])


def _text(seed: int, *what: object, n: int, vocab: int) -> tuple[int, ...]:
    # Each text has a generator of its own: the same whatever else is generated.
    rng = random.Random(f"{seed}/{'/'.join(map(str, what))}")
    return tuple(rng.randrange(vocab) for _ in range(n))


def multi_round_qa(shape: MultiRoundQA, *, tenants: Sequence[str] | None = None,
                   prefix_groups: Mapping[str, Sequence[str]] | None = None,
                   warm_s: float | None = None) -> list[RequestSpec]:
    """Every user's rounds (:meth:`MultiRoundQA.starts`: a user's first round a ``chat``
    at its time, each later one a ``follow_up`` of the round before, ``gap_s`` after it
    was sent at the earliest), users in the order they start; serve with ``stop_at_s =
    duration_s``. ``tenants`` and ``prefix_groups`` as for :func:`generate`.

    ``warm_s``: first, at 0, every pre-seeded user's conversation so far (the prompt of
    its first round without the question, answered with one token: ``{user}w``), and
    everything else ``warm_s`` later (serve with ``stop_at_s = warm_s + duration_s``). A
    deployment that has been serving these users has their earlier rounds' KV somewhere;
    this puts it where the deployment's own policy puts it (the device's cache, the
    tiers), instead of starting every pre-seeded user cold. ``warm_s`` must leave the
    warm-up time to finish (a cost model's :meth:`~kvplugin.costs.ModelCost.prefill_s`
    of :func:`warm_up_tokens` is the least)."""
    names, group_of = _tenancy(tenants, shape.num_tenants, prefix_groups)
    s, v = shape, shape.vocab
    shift = warm_s or 0.0
    specs: list[RequestSpec] = []
    warm: list[RequestSpec] = []
    for n, (user, first, at) in enumerate(s.starts()):
        tenant = names[n % len(names)]
        group = group_of.get(tenant)
        shared = s.system_prompt_len if group else 0
        head = (*_text(s.seed, "system", group or tenant, n=s.system_prompt_len, vocab=v),
                *_text(s.seed, "history", user, n=s.history_len, vocab=v))
        for r in range(first):  # a pre-seeded user's earlier rounds, made up
            head += (*_text(s.seed, "question", user, r, n=s.question_len, vocab=v),
                     *_text(s.seed, "answer", user, r, n=s.answer_len, vocab=v))
        if first and warm_s is not None:
            warm.append(RequestSpec(f"{user}w", tenant, "chat", 0.0, head, 1, len(head),
                                    prefix_group=group, shared_prefix_tokens=shared))
        for r in range(first, s.rounds):
            question = _text(s.seed, "question", user, r, n=s.question_len, vocab=v)
            if r == first:
                specs.append(RequestSpec(f"{user}r{r}", tenant, "chat", shift + at,
                                         (*head, *question), s.answer_len, s.prompt_len(r),
                                         prefix_group=group,
                                         shared_prefix_tokens=shared))
            else:
                specs.append(RequestSpec(f"{user}r{r}", tenant, "follow_up", 0.0, question,
                                         s.answer_len, s.prompt_len(r), f"{user}r{r - 1}",
                                         prefix_group=group, shared_prefix_tokens=shared,
                                         gap_s=s.gap_s))
    return [*warm, *specs]


def warm_up_tokens(shape: MultiRoundQA) -> list[int]:
    """The prompt length of each warm-up request of :func:`multi_round_qa` (``warm_s``)."""
    return [shape.prompt_len(first) - shape.question_len
            for _, first, _ in shape.starts() if first]


def no_reuse(requests: int, *, prompt_len: int, answer_len: int, num_tenants: int = 3,
             seed: int = 0, vocab: int = 32000,
             tenants: Sequence[str] | None = None) -> list[RequestSpec]:
    """``requests`` chats arriving at once, every prompt unique from its first token pair
    on (the request's index), so no block is ever reused: offload can only cost here."""
    if requests < 1 or prompt_len < 2 or answer_len < 1 or vocab < 2:
        raise ValueError("no_reuse needs requests >= 1, prompt_len >= 2, answer_len >= 1")
    if requests > vocab * vocab:
        raise ValueError(f"{requests} requests cannot have unique first token pairs")
    names, _ = _tenancy(tenants, num_tenants, None)
    return [RequestSpec(f"n{i}", names[i % len(names)], "chat", 0.0,
                        (i % vocab, i // vocab,
                         *_text(seed, "unique", i, n=prompt_len - 2, vocab=vocab)),
                        answer_len, prompt_len)
            for i in range(requests)]
