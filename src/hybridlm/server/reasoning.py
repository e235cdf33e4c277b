"""Reasoning in model output: the text inside the chat template's thinking markers goes to
`reasoning_content`, the rest to `content`. The markers are read off the template (Qwen3-style
`<think>…</think>`, Gemma 4's thought channel), never from the model's name."""

from __future__ import annotations

from dataclasses import dataclass

from hybridlm.server.tools.base import partial_suffix

REASONING, CONTENT = "reasoning", "content"


@dataclass(frozen=True)
class ReasoningFormat:
    begin: str
    end: str

    def open_in(self, prompt: str) -> bool:
        """The prompt ends inside a reasoning block (the template opened it for the model)."""
        return prompt.rfind(self.begin) > prompt.rfind(self.end)


def detect(template: str | None) -> ReasoningFormat | None:
    """The thinking markers a chat template uses (None: it has none)."""
    if not template:
        return None
    if "<|channel>" in template:
        return ReasoningFormat("<|channel>thought\n", "<channel|>")
    if "<think>" in template and "</think>" in template:
        return ReasoningFormat("<think>", "</think>")
    return None


class ReasoningStream:
    """Splits model text, fed in any pieces, into (REASONING | CONTENT, text) parts; a reasoning
    block may open only at the start of the output (or be open already, `inside`). Newlines
    around the reasoning and right after its end are dropped, as templates add them."""

    def __init__(self, fmt: ReasoningFormat, inside: bool):
        self.fmt = fmt
        self._state = REASONING if inside else "start"
        self._buffer = ""
        self._lead = True  # strip leading whitespace of the current part
        self._pending = ""  # trailing newlines of reasoning, kept until more reasoning follows

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._buffer += text
        if self._state == "start":
            head = self._buffer.lstrip()
            if not head or (self.fmt.begin.startswith(head) and len(head) < len(self.fmt.begin)):
                return out
            if head.startswith(self.fmt.begin):
                self._state, self._buffer = REASONING, head[len(self.fmt.begin) :]
            else:
                self._state, self._lead = CONTENT, False
        if self._state == REASONING:
            end = self._buffer.find(self.fmt.end)
            if end < 0:
                keep = partial_suffix(self._buffer, self.fmt.end)
                self._reasoning(self._buffer[: len(self._buffer) - keep], out)
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return out
            self._reasoning(self._buffer[:end], out)
            self._state, self._lead, self._buffer = CONTENT, True, self._buffer[end + len(self.fmt.end) :]
        self._content(out)
        return out

    def close(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self._state == REASONING:
            self._reasoning(self._buffer, out)
        else:
            self._content(out)
        self._buffer = ""
        return out

    def _reasoning(self, text: str, out: list[tuple[str, str]]) -> None:
        if self._lead:
            text = text.lstrip("\n")
            if not text:
                return
            self._lead = False
        body = text.rstrip("\n")
        if body:
            out.append((REASONING, self._pending + body))
            self._pending = ""
        self._pending += text[len(body) :]

    def _content(self, out: list[tuple[str, str]]) -> None:
        text, self._buffer = self._buffer, ""
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        out.append((CONTENT, text))
