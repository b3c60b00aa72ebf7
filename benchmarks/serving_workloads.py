"""The fixed traces of the serving benchmark (benchmarks/serving.py): token-id prompts, and how
their requests arrive. Pure: the same arguments give the same trace, so every configuration
serves the same prompts.

- **chat**: ``users`` x ``rounds``. Every prompt starts with one shared system prompt, then the
  user's own context, then the earlier rounds (a question and a fixed answer each, fixed so the
  prompts do not depend on what a configuration generated), then this round's question. Closed
  loop: a user's round is sent when its previous round's answer came back.
- **docqa**: ``docs`` documents longer than a chunk, each asked ``questions`` times, in a seeded
  random order, ``concurrency`` requests in flight.
- **noreuse**: unique prompts, ``concurrency`` in flight (the cost of having tierkv on).
- **hot**: one long prefix, stored once, then one request alone and ``concurrent`` requests on it
  at once (the convoy probe: every request waits behind one in-flight load?).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

VOCAB = 1000


@dataclass(frozen=True)
class Request:
    """One request of a trace: its prompt, its label for the tables, and ``after``: the index of
    the request whose answer it waits for (closed loop), or -1."""

    name: str
    prompt: tuple[int, ...]
    group: str = ""  # chat: "round N"; hot: "alone" / "concurrent"; else the workload
    after: int = -1


@dataclass
class Trace:
    """A workload's requests and how many may be in flight at once (0: as the ``after`` links allow)."""

    workload: str
    requests: list[Request]
    concurrency: int = 0
    warmup: list[Request] = field(default_factory=list)  # sent first, one by one, not measured

    @property
    def prompt_tokens(self) -> int:
        return sum(len(request.prompt) for request in self.requests)


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(count)]


def chat(users: int, rounds: int, system: int = 512, context: int = 512, question: int = 64, answer: int = 64,
         seed: int = 1) -> Trace:
    shared = tokens(seed, system)
    requests: list[Request] = []
    for user in range(users):
        history = shared + tokens(seed * 1000 + user, context)
        previous = -1
        for round_ in range(rounds):
            asked = tokens(seed * 100_000 + user * 100 + round_, question)
            requests.append(Request(f"chat-u{user}-r{round_}", tuple(history + asked), f"round {round_}", previous))
            previous = len(requests) - 1
            history = history + asked + tokens(seed * 200_000 + user * 100 + round_, answer)
    return Trace("chat", requests)


def docqa(docs: int, questions: int, doc_tokens: int = 2048, question: int = 48, concurrency: int = 2,
          seed: int = 2) -> Trace:
    documents = [tokens(seed * 1000 + d, doc_tokens) for d in range(docs)]
    asked = [(d, q) for d in range(docs) for q in range(questions)]
    random.Random(seed).shuffle(asked)
    requests = [Request(f"doc{d}-q{q}", tuple(documents[d] + tokens(seed * 100_000 + d * 100 + q, question)), "docqa")
                for d, q in asked]
    return Trace("docqa", requests, concurrency)


def noreuse(count: int, prompt_tokens: int = 1024, concurrency: int = 2, seed: int = 3) -> Trace:
    requests = [Request(f"unique-{i}", tuple(tokens(seed * 1000 + i, prompt_tokens)), "noreuse") for i in range(count)]
    return Trace("noreuse", requests, concurrency)


def hot(concurrent: int = 8, prefix_tokens: int = 2048, question: int = 32, seed: int = 4) -> Trace:
    """The prefix is stored by a warm-up request; then one request on it alone, then
    ``concurrent`` at once (each its own question). Before each of the two, a filler prompt of
    the same length pushes the prefix out of vLLM's own (small) KV space, so the prefix comes
    from wherever else it is cached: every concurrent request wants the same load at once."""
    prefix = tokens(seed, prefix_tokens)
    warm = Request("hot-warm", tuple(prefix + tokens(seed * 1000, question)), "warm")
    first_filler = Request("hot-filler-0", tuple(tokens(seed * 1000 + 900, prefix_tokens)), "filler")
    alone = Request("hot-alone", tuple(prefix + tokens(seed * 1000 + 1, question)), "alone", after=0)
    second_filler = Request("hot-filler-1", tuple(tokens(seed * 1000 + 901, prefix_tokens)), "filler", after=1)
    together = [Request(f"hot-{i}", tuple(prefix + tokens(seed * 1000 + 2 + i, question)), "concurrent", after=2)
                for i in range(concurrent)]
    return Trace("hot", [first_filler, alone, second_filler, *together], concurrency=concurrent, warmup=[warm])


def traces(short: bool) -> list[Trace]:
    """The benchmark's workloads: the short form (``tox -e bench``) or the full one."""
    if short:
        return [chat(users=6, rounds=3), docqa(docs=4, questions=2), noreuse(8), hot(concurrent=4)]
    return [chat(users=12, rounds=5), docqa(docs=8, questions=4), noreuse(24), hot(concurrent=8)]
