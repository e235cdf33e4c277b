"""Reasoning splitting: text inside the template's thinking markers is reasoning, the rest content,
whatever the streamed piece boundaries; a block the prompt left open starts as reasoning."""

from __future__ import annotations

import pytest

from hybridlm.server.reasoning import CONTENT, REASONING, ReasoningFormat, ReasoningStream, detect

THINK = ReasoningFormat("<think>", "</think>")
GEMMA = ReasoningFormat("<|channel>thought\n", "<channel|>")


def split(fmt, text: str, inside: bool, pieces: list[str] | None = None) -> tuple[str, str]:
    stream = ReasoningStream(fmt, inside)
    parts = []
    for piece in pieces if pieces is not None else [text]:
        parts += stream.feed(piece)
    parts += stream.close()
    return "".join(t for k, t in parts if k == REASONING), "".join(t for k, t in parts if k == CONTENT)


CASES = [
    (THINK, "<think>\nstep one\nstep 2\n</think>\n\nAnswer.", False, ("step one\nstep 2", "Answer.")),
    (THINK, "step one\n</think>\n\nThe answer.", True, ("step one", "The answer.")),
    (THINK, "No thinking here </think> at all", False, ("", "No thinking here </think> at all")),
    (THINK, "<think>\nunfinished", False, ("unfinished", "")),
    (THINK, "  <thi", False, ("", "<thi")),
    (GEMMA, "<|channel>thought\nhmm<channel|>Yes.", False, ("hmm", "Yes.")),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_split_at_every_boundary_equals_whole(case):
    fmt, text, inside, expected = CASES[case]
    assert split(fmt, text, inside) == expected
    for i in range(len(text) + 1):
        assert split(fmt, text, inside, [text[:i], text[i:]]) == expected, i
    assert split(fmt, text, inside, list(text)) == expected


def test_markers_come_from_the_template(tokenizer):
    assert detect(tokenizer.chat_template) == THINK
    assert detect("{{ messages }}") is None
    assert THINK.open_in("<|im_start|>assistant\n<think>\n") and not THINK.open_in("<think>\n\n</think>\n\n")
