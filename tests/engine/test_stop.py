"""StopStrings: matches across arbitrary pieces, never releases text that could start a stop string."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hybridlm.engine.stop import StopStrings


def test_holds_back_a_possible_prefix():
    s = StopStrings(("abc",))
    assert s.feed("xa") == "x"
    assert s.feed("b") == ""
    assert s.feed("d") == "abd"
    assert s.feed("ab") == ""
    assert s.feed("c tail") == ""
    assert s.matched == "abc"
    assert s.feed("more") == "" and s.flush() == ""


def test_earliest_match_wins_and_flush_releases_the_rest():
    s = StopStrings(("world", "lo w"))
    assert s.feed("hello wor") == "hel"
    assert s.matched == "lo w"
    t = StopStrings(("xyz",))
    assert t.feed("abcxy") == "abc"
    assert t.flush() == "xy" and t.matched is None


def test_no_stops_passes_text_through():
    assert StopStrings(()).feed("anything") == "anything"


@given(
    text=st.text(alphabet="ab c", max_size=40),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_any_chunking_gives_the_text_before_the_first_match(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    # Generation stops at the first piece after which the text holds a stop string; the output ends where
    # the earliest-starting match begins.
    hits: list[tuple[int, str]] = []
    for b in bounds:
        if hits := [(text[:b].find(s), s) for s in stops if s in text[:b]]:
            break
    expected = text[: min(hits)[0]] if hits else text
    s = StopStrings(tuple(stops))
    out = ""
    for a, b in zip(bounds, bounds[1:], strict=False):
        out += s.feed(text[a:b])
        assert expected.startswith(out)  # never released past the match, even partially
    if s.matched is None:
        out += s.flush()
    assert out == expected
    assert (s.matched is not None) == bool(hits)
