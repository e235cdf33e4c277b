"""A coding-agent session as token ids: two agents sharing a preamble, each calling tools whose results
grow, one compacting its history half-way. `bench multiturn --trace agents` replays it through the
engine; `benchmarks/llama_cpp.py agent` replays the same trace through llama-server.

Every request's prompt is the agent's history plus the step's new tokens; what the model answers
(greedy, EOS ignored, `gen` tokens: a tool call) joins the history, so each engine's session holds
its own outputs. A compaction step asks for a summary; the agent then starts over from the preamble
and that summary, as Claude Code and Codex do when the context fills up.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridlm.prefix.session import common_prefix


@dataclass(frozen=True)
class Step:
    """One request of an agent: `kind` "task" (the preamble, then `tokens`), "tool_result" (the
    history, then `tokens`) or "compact" (the history, then `tokens` asking for a summary)."""

    kind: str
    tokens: list[int]


@dataclass(frozen=True)
class Session:
    preamble: list[int]
    agents: list[list[Step]]

    @property
    def requests(self) -> int:
        return sum(len(a) for a in self.agents)


def agent_session(
    seed: int,
    vocab: int,
    agents: int = 2,
    requests: int = 8,
    preamble: int = 3000,
    task: int = 150,
    tool: int = 300,
    growth: int = 120,
    compact_at: int = 6,
) -> Session:
    """`agents` agents of `requests` requests each behind a shared `preamble` (tokens: system prompt
    and tool definitions); request 0 states a `task`, request i > 0 returns a tool result of
    `tool + growth·(i - 1)` tokens, and request `compact_at` (if < requests) asks for a summary."""
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    shared = words(preamble)
    sessions = []
    for _ in range(agents):
        steps = [Step("task", words(task))]
        for i in range(1, requests):
            if i == compact_at:
                steps.append(Step("compact", words(40)))
            else:
                steps.append(Step("tool_result", words(tool + growth * (i - 1))))
        sessions.append(steps)
    return Session(shared, sessions)


@dataclass
class Replay:
    """What a replay measured: per request (agent, prompt tokens, tokens the engine prefilled, the
    oracle's fewest), and the wall time of the whole session in seconds."""

    requests: list[tuple[int, int, int, int]] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        prompt = sum(r[1] for r in self.requests)
        prefilled = sum(r[2] for r in self.requests)
        minimum = sum(r[3] for r in self.requests)
        return {
            "requests": len(self.requests),
            "prompt_tokens": prompt,
            "prefilled_tokens": prefilled,
            "oracle_min_prefilled_tokens": minimum,
            "prefilled_vs_oracle": prefilled / max(minimum, 1),
            "wall_s": self.wall_s,
        }


def replay(session: Session, send: Callable[[list[int]], tuple[list[int], int]]) -> Replay:
    """Run the agents at once, one thread each, every agent waiting for its previous answer.

    `send(prompt ids) -> (generated ids, prompt tokens prefilled)` is one request to the engine under
    test. The oracle's fewest prefilled tokens of a request is its prompt less the longest prefix
    it shares with a sequence the engine has seen complete (a prompt plus its output but the last
    token, which no engine has run yet) when the request is sent."""
    lock = threading.Lock()
    seen: list[list[int]] = []
    result = Replay()
    errors: list[BaseException] = []

    def agent(index: int, steps: list[Step]) -> None:
        history: list[int] = []
        try:
            for step in steps:
                base = session.preamble if step.kind == "task" else history
                prompt = base + step.tokens
                with lock:
                    best = min(len(prompt) - 1, max((common_prefix(s, prompt) for s in seen), default=0))
                out, prefilled = send(prompt)
                with lock:
                    seen.append(prompt + out[:-1])
                    result.requests.append((index, len(prompt), prefilled, len(prompt) - best))
                history = session.preamble + out if step.kind == "compact" else prompt + out
        except BaseException as e:  # reported by the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(i, s)) for i, s in enumerate(session.agents)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.wall_s = time.perf_counter() - start
    if errors:
        raise errors[0]
    return result
