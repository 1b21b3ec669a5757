"""Synthetic multi-tenant traces for ``prefixgate bench`` (seeded: the same sizes give the same trace).

A trace is a list of ``Session``s. A session belongs to one tenant and is a list of turns sent one
after the other; with ``carry_history`` each turn is sent with every earlier turn's messages and the
model's replies in front of it (a chat that appends to its history), otherwise each turn stands
alone. Sessions run concurrently (the runner bounds how many).

The five workloads and the prefix structure each one exercises::

    system_prompts  [long per-tenant system prompt | date line | question]        shared per tenant
    chat            [short system | u1 | a1 | u2 | a2 | ... | u_n]                 shared per session
    agents          [system + tools (order varies) | task | call | result..]  shared per tenant
    rag             [instructions | doc_a | doc_b | doc_c | question]              shared docs (Zipf)
    random          [unique text]                                                  nothing shared

Two realistic defects are planted where canonicalization can repair them: system prompts carry the
current date and time on their second line and sometimes stray edge whitespace from templating
(``reorder`` moves the date out of the prefix, ``safe`` strips the whitespace), and agent frameworks
send their tools in a varying order (``safe`` sorts them). With canonicalization off those requests
miss; that difference is what the ``cache`` vs ``cache+canon`` columns measure.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

WORKLOADS: tuple[str, ...] = ("system_prompts", "chat", "agents", "rag", "random")

_SYLLABLES = ("ka", "lo", "mi", "ren", "tor", "val", "se", "dun", "pra", "li", "mo", "ther", "an", "quo",
              "bel", "sti", "ver", "na", "gor", "fen", "ul", "ri", "cas", "don", "pe", "shi", "ma", "tek")


@dataclass(frozen=True)
class TraceSizes:
    """How big each workload is. Defaults suit the tiny CPU model (a couple of minutes for all)."""

    tenants: int = 3  # tenants of system_prompts, chat, rag and random
    agent_tenants: int = 1  # tenants of agents: a tenant's sessions share its tool set (in varying order)
    requests: int = 10  # single-turn requests of system_prompts, rag and random
    system_words: int = 250  # words of a long system prompt
    chat_sessions: int = 3
    chat_turns: int = 4
    agent_sessions: int = 3
    agent_steps: int = 2  # tool call + result rounds per agent session
    tools: int = 8
    rag_docs: int = 8  # shared document pool
    rag_top_k: int = 3
    doc_words: int = 100
    user_words: int = 20
    max_tokens: int = 4  # completion tokens per request

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if value < 1:
                raise ValueError(f"trace size {name} must be >= 1, got {value}")
        if self.rag_top_k > self.rag_docs:
            raise ValueError("rag_top_k must be <= rag_docs")


@dataclass
class Turn:
    messages: list[dict[str, Any]]  # new messages of this turn (history is prepended by the runner)
    tools: list[dict[str, Any]] | None = None


@dataclass
class Session:
    workload: str
    tenant: int  # index into the workload's tenants
    turns: list[Turn]
    carry_history: bool = False
    max_tokens: int = 4
    # agents: synthetic assistant tool-call turns are part of ``turns``; the model's reply is not kept
    keep_replies: bool = True
    meta: dict[str, Any] = field(default_factory=dict)


class _Text:
    """Seeded pseudo-words: deterministic, tokenizer-neutral filler of a given length."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.vocab = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(600)]

    def words(self, n: int) -> str:
        out = []
        for i in range(n):
            w = self.rng.choice(self.vocab)
            out.append(w + ("." if i % 12 == 11 else ""))
        return " ".join(out)


def _stamp(rng: random.Random) -> str:
    return f"2026-11-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"


def _edge_noise(rng: random.Random, text: str) -> str:
    """Stray whitespace a template leaves at the edges (a third of requests)."""
    return rng.choice([text, text, text + "\n", "  " + text + " \n"])


def system_prompts(sizes: TraceSizes, rng: random.Random) -> list[Session]:
    text = _Text(rng)
    bodies = [text.words(sizes.system_words) for _ in range(sizes.tenants)]
    sessions = []
    for i in range(sizes.requests):
        t = i % sizes.tenants
        system = f"You are the support assistant of company {t}.\nCurrent time: {_stamp(rng)}\n{bodies[t]}"
        msgs = [{"role": "system", "content": _edge_noise(rng, system)},
                {"role": "user", "content": text.words(sizes.user_words) + "?"}]
        sessions.append(Session("system_prompts", t, [Turn(msgs)], max_tokens=sizes.max_tokens))
    return sessions


def chat(sizes: TraceSizes, rng: random.Random) -> list[Session]:
    text = _Text(rng)
    system = "You are a helpful, concise assistant. " + text.words(40)
    sessions = []
    for s in range(sizes.chat_sessions):
        turns = [Turn([{"role": "user", "content": text.words(sizes.user_words * 2) + "?"}])
                 for _ in range(sizes.chat_turns)]
        turns[0].messages.insert(0, {"role": "system", "content": system})
        sessions.append(Session("chat", s % sizes.tenants, turns, carry_history=True, max_tokens=sizes.max_tokens))
    return sessions


def _tool(text: _Text, i: int) -> dict[str, Any]:
    props = {f"arg_{j}": {"type": "string", "description": text.words(4)} for j in range(2)}
    return {"type": "function", "function": {
        "name": f"tool_{i:02d}_{text.vocab[i]}", "description": text.words(10),
        "parameters": {"type": "object", "properties": props, "required": ["arg_0"]}}}


def agents(sizes: TraceSizes, rng: random.Random) -> list[Session]:
    text = _Text(rng)
    toolsets = [[_tool(text, i) for i in range(sizes.tools)] for _ in range(sizes.agent_tenants)]
    system = "You are an agent. Call tools to finish the task; answer when done. " + text.words(30)
    sessions = []
    for s in range(sizes.agent_sessions):
        t = s % sizes.agent_tenants
        tools = list(toolsets[t])
        rng.shuffle(tools)  # frameworks build the tool list from a dict/set: order varies per run
        turns = [Turn([{"role": "system", "content": system},
                       {"role": "user", "content": "Task: " + text.words(sizes.user_words)}], tools)]
        for k in range(sizes.agent_steps):
            name = rng.choice(tools)["function"]["name"]
            call_id = f"call_{s}_{k}"
            turns.append(Turn([
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": call_id, "type": "function",
                    "function": {"name": name, "arguments": json.dumps({"arg_0": text.words(3)})}}]},
                {"role": "tool", "tool_call_id": call_id, "content": text.words(sizes.doc_words // 2)},
            ], tools))
        sessions.append(Session("agents", t, turns, carry_history=True, max_tokens=sizes.max_tokens,
                                keep_replies=False))
    return sessions


def rag(sizes: TraceSizes, rng: random.Random) -> list[Session]:
    text = _Text(rng)
    docs = [f"[doc {d}] " + text.words(sizes.doc_words) for d in range(sizes.rag_docs)]
    weights = [1.0 / (rank + 1) for rank in range(sizes.rag_docs)]  # Zipf: a few documents are popular
    instructions = "Answer from the documents below and cite them by number. " + text.words(30)
    sessions = []
    for i in range(sizes.requests):
        picked: list[int] = []
        while len(picked) < sizes.rag_top_k:  # weighted sampling without replacement, in rank order
            d = rng.choices(range(sizes.rag_docs), weights)[0]
            if d not in picked:
                picked.append(d)
        context = "\n\n".join(docs[d] for d in picked)
        msgs = [{"role": "system", "content": instructions},
                {"role": "user", "content": f"Documents:\n{context}\n\nQuestion: {text.words(sizes.user_words)}?"}]
        sessions.append(Session("rag", i % sizes.tenants, [Turn(msgs)], max_tokens=sizes.max_tokens,
                                meta={"docs": picked}))
    return sessions


def random_control(sizes: TraceSizes, rng: random.Random) -> list[Session]:
    text = _Text(rng)
    sessions = []
    for i in range(sizes.requests):
        msgs = [{"role": "user", "content": f"{i} " + text.words(sizes.system_words // 2 + sizes.user_words)}]
        sessions.append(Session("random", i % sizes.tenants, [Turn(msgs)], max_tokens=sizes.max_tokens))
    return sessions


_BUILDERS = {"system_prompts": system_prompts, "chat": chat, "agents": agents, "rag": rag, "random": random_control}


def build_trace(workload: str, sizes: TraceSizes, seed: int = 0) -> list[Session]:
    """The sessions of one workload. Raises ValueError for an unknown workload name."""
    if workload not in _BUILDERS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    # one RNG per workload, seeded from its name, so adding a workload never changes the others
    return _BUILDERS[workload](sizes, random.Random(f"{seed}:{workload}"))
