"""Tool-call parsers per format, on assistant turns rendered by templates that write each format:
the format is picked from the template, the calls come back as rendered (several per message),
streaming at every split point gives the same parts, malformed or unterminated calls come back as
content, and every forced-call grammar generates text its parser reads back as schema-valid calls."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from hybridlm.engine import Completion, Event, Usage
from hybridlm.engine.grammar import Grammar, GrammarCompiler
from hybridlm.models.tokenizer import Tokenizer
from hybridlm.server.chat import marker_ids, plan_chat, read_answer
from hybridlm.server.protocol import Responder
from hybridlm.server.tools import FORMATS, ToolCall, ToolCallStream, detect, tool_functions
from tests.server.tool_templates import FAMILIES, family_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
                "units": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 12},
                "filters": {
                    "type": "object",
                    "properties": {"lang": {"type": "string", "maxLength": 4}, "safe": {"type": "boolean"}},
                    "required": ["lang", "safe"],
                    "additionalProperties": False,
                },
                "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            },
            "required": ["query", "filters", "tags"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, SEARCH]
CALLS = [
    ("get_weather", {"city": "Paris", "days": 3}),
    ("search", {"query": "a <b> & c", "filters": {"lang": "fr", "safe": True}, "tags": [1, 2]}),
]
ALL = ["qwen3", *FAMILIES]


@pytest.fixture(scope="module")
def tokenizers_by_family(demo_dir, tokenizer, tmp_path_factory):
    out = {"qwen3": tokenizer}
    for family in FAMILIES:
        out[family] = family_tokenizer(demo_dir, family, tmp_path_factory.mktemp(family))
    return out


def turn_markers(family: str) -> tuple[str, str]:
    if family == "qwen3":
        return "<|im_start|>assistant\n", "<|im_end|>"
    return FAMILIES[family][3], FAMILIES[family][4]


def assistant_text(tok: Tokenizer, family: str, calls, content: str = "") -> str:
    """What the template writes for an assistant turn with `calls` (the model's output for it)."""
    message = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)
        ],
    }
    plan = plan_chat(tok, [{"role": "user", "content": "hi"}, message], TOOLS, add_generation_prompt=False)
    begin, end = turn_markers(family)
    text = plan.prompt[plan.prompt.rindex(begin) + len(begin) :]
    text = text[: text.index(end)]
    if text.startswith("<think>"):  # the demo template replays an (empty) reasoning block
        text = text[text.index("</think>") + len("</think>") :].lstrip("\n")
    return text


def parse(fmt, text: str, pieces: list[str] | None = None) -> tuple[str, list[tuple[str, dict]]]:
    stream = ToolCallStream(fmt, tool_functions(TOOLS))
    parts = []
    for piece in pieces if pieces is not None else [text]:
        parts += stream.feed(piece)
    parts += stream.close()
    content = "".join(p for p in parts if isinstance(p, str))
    calls = [(p.name, json.loads(p.arguments)) for p in parts if isinstance(p, ToolCall)]
    return content, calls


@pytest.mark.parametrize("family", ALL)
def test_format_is_picked_from_the_template(tokenizers_by_family, family):
    expected = "hermes" if family == "qwen3" else FAMILIES[family][1]
    assert detect(tokenizers_by_family[family].chat_template).name == expected


@pytest.mark.parametrize("family", ALL)
def test_rendered_calls_parse_back(tokenizers_by_family, family):
    tok = tokenizers_by_family[family]
    fmt = detect(tok.chat_template)
    one = assistant_text(tok, family, CALLS[:1])
    assert parse(fmt, one) == ("", CALLS[:1])
    several = assistant_text(tok, family, CALLS)
    assert parse(fmt, several) == ("", CALLS)
    if family != "llama3":  # Llama 3 writes calls instead of content
        assert parse(fmt, assistant_text(tok, family, CALLS, "Checking.")) == ("Checking.", CALLS)


@pytest.mark.parametrize("family", ALL)
def test_streaming_at_every_split_point_equals_whole(tokenizers_by_family, family):
    tok = tokenizers_by_family[family]
    fmt = detect(tok.chat_template)
    text = assistant_text(tok, family, CALLS)
    if family != "llama3":  # Llama 3 calls are whole messages
        text = "Sure: " + text
    whole = parse(fmt, text)
    for i in range(len(text) + 1):
        assert parse(fmt, text, [text[:i], text[i:]]) == whole, i
    assert parse(fmt, text, list(text)) == whole


@pytest.mark.parametrize("family", ALL)
def test_unterminated_calls_come_back_as_content(tokenizers_by_family, family):
    tok = tokenizers_by_family[family]
    fmt = detect(tok.chat_template)
    text = assistant_text(tok, family, CALLS[1:])
    for cut in range(1, len(text) - 1):
        assert parse(fmt, text[:cut]) == (text[:cut], []), cut


MALFORMED = {
    "hermes": [
        '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>',
        "<tool_call>\n[1, 2]\n</tool_call>",
    ],
    "qwen3_xml": [
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",
        "<tool_call>\nnot xml\n</tool_call>",
    ],
    "glm45": [
        "<tool_call>f\n<arg_key>a</arg_key>\n1\n</tool_call>",
        "<tool_call>f\n<arg_value>1</arg_value>\n</tool_call>",
        "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
    ],
    "pythonic": [
        "<|tool_call_start|>[f(1, 2)]<|tool_call_end|>",
        "<|tool_call_start|>[f(a=os.system)]<|tool_call_end|>",
    ],
    "gemma4": ['<|tool_call>call:f{a:<|"|>x}<tool_call|>', "<|tool_call>f{a:1}<tool_call|>"],
    "llama3_json": ['{"name": "f", "parameters": {"a": 1}', '{"name": 3}'],
    "kimi": [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        '{"a": }<|tool_call_end|><|tool_calls_section_end|>',
        "<|tool_calls_section_begin|><|tool_call_begin|>f<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>",
        "<|tool_calls_section_begin|>prose<|tool_calls_section_end|>",
    ],
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_calls_come_back_as_content(name):
    fmt = FORMATS[name]
    for text in MALFORMED[name]:
        for pieces in ([text], list(text)):
            assert parse(fmt, text, pieces) == (text, [])
        if name != "llama3_json":  # content before a call; Llama 3 calls are whole messages
            assert parse(fmt, "ok " + text) == ("ok " + text, [])


def test_kimi_calls_keep_the_ids_the_model_wrote():
    """Kimi's template writes a call's `functions.NAME:INDEX` id back into the history: the id the
    client gets is that one, so the next turn shows the model its own ids."""
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3<|tool_call_argument_begin|>"
        '{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    stream = ToolCallStream(FORMATS["kimi"], tool_functions(TOOLS))
    (call,) = [p for p in stream.feed(text) + stream.close() if isinstance(p, ToolCall)]
    assert (call.id, call.name) == ("functions.get_weather:3", "get_weather")
    assert json.loads(call.arguments) == {"city": "Oslo"}


def test_a_malformed_call_beside_good_ones_keeps_the_good_ones():
    fmt = FORMATS["hermes"]
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    bad = "<tool_call>\n{oops}\n</tool_call>"
    assert parse(fmt, good + "\n" + bad) == (bad, [("get_weather", {"city": "Oslo"})])


@pytest.mark.parametrize("newline", ["\n", ""])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_glm45_forced_call_grammar_takes_either_layout(tokenizers_by_family, newline, parallel):
    """GLM-4.5 and Ling 3.0 write a newline before each key, value and the end of a call and between
    parallel calls, GLM-4.7 and later none: the forced-call grammar takes both, so the model writes its
    own layout."""
    tok, fmt = tokenizers_by_family["ling3"], FORMATS["glm45"]
    compiler = GrammarCompiler(tok, tok.vocab_size)
    rules = fmt.grammar(tool_functions(TOOLS), parallel, marker_ids(tok, fmt.markers()))
    matcher = compiler.matcher(Grammar("lark", rules, "tools"))
    cities = ["Paris", "Oslo"] if parallel else ["Paris"]
    calls = []
    for city in cities:
        pairs = [("city", city), ("days", "3"), ("units", "c")]
        nl = newline
        body = "".join(f"{nl}<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>" for k, v in pairs)
        calls.append(f"<tool_call>get_weather{body}{newline}</tool_call>")
    text = newline.join(calls)
    for token in tok.encode(text):
        matcher.advance(token)
    # Parallel calls may go on: the grammar is complete where it lets the message end
    assert matcher.done or matcher.allowed()[sorted(tok.eos_token_ids)].any()
    expected = [("get_weather", {"city": city, "days": 3, "units": "c"}) for city in cities]
    assert parse(fmt, text) == ("", expected)


@pytest.mark.parametrize("family", ALL)
def test_forced_call_grammar_output_parses_to_valid_calls(tokenizers_by_family, family):
    """Random logits under the grammar (the worst a model can do) still give calls that parse and
    validate against the tool schemas; markers are the family's special tokens."""
    tok = tokenizers_by_family[family]
    fmt = detect(tok.chat_template)
    functions = tool_functions(TOOLS)
    special = marker_ids(tok, fmt.markers())
    compiler = GrammarCompiler(tok, tok.vocab_size)
    grammar = Grammar("lark", fmt.grammar(functions, False, special), "tools")
    compiler.check(grammar)
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        matcher = compiler.matcher(grammar)
        ids = []
        while not matcher.done and len(ids) < 400:
            token = int(matcher.mask(torch.randn(1, tok.vocab_size, generator=gen)).argmax())
            if token in tok.eos_token_ids:
                break
            matcher.advance(token)
            ids.append(token)
        content, calls = parse(fmt, tok.decode(ids, skip_special_tokens=False))
        assert content == "" and calls, (family, seed, tok.decode(ids, skip_special_tokens=False))
        for name, args in calls:
            jsonschema.validate(args, functions[name])


def test_answers_split_reasoning_from_content_and_calls(tokenizer):
    plan = plan_chat(tokenizer, [{"role": "user", "content": "hi"}], TOOLS)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    text = "<think>\nplan it\n</think>\n\nOn it.\n" + call
    answer = read_answer(plan, text)
    assert (answer.reasoning, answer.content) == ("plan it", "On it.")
    assert [(c.name, json.loads(c.arguments)) for c in answer.calls] == [("get_weather", {"city": "Rome"})]
    hi = [{"role": "user", "content": "hi"}]
    off = plan_chat(tokenizer, hi, None, template_kwargs={"enable_thinking": False})
    assert read_answer(off, "plain").content == "plain"


def test_openai_deltas_carry_reasoning_content_and_tool_calls(tokenizer):
    plan = plan_chat(tokenizer, [{"role": "user", "content": "hi"}], TOOLS)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    text = "<think>\nhm\n</think>\n\nOk.\n" + call
    for cut in range(1, len(text)):
        responder = Responder("chat", "demo", tokenizer, plan)
        events = [Event((1,), text[:cut]), Event((2,), text[cut:], finish_reason="stop")]
        choices = [c for e in events if (c := responder.delta_choice(e, False, 0)) is not None]
        deltas = [c["delta"] for c in choices]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "hm"
        assert "".join(d.get("content", "") for d in deltas) == "Ok."
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
        assert choices[-1]["finish_reason"] == "tool_calls"


def test_an_empty_reply_is_empty_content_and_null_only_beside_calls(tokenizer):
    """A chat answer with no text is `"content": ""` (as OpenAI and vLLM answer); `null` only when
    tool calls carry the answer."""
    plan = plan_chat(tokenizer, [{"role": "user", "content": "hi"}], TOOLS)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    for text, content in [("", ""), (call, None), ("Ok.", "Ok.")]:
        result = Completion(text=text, finish_reason="stop", usage=Usage(3, 1))
        body = Responder("chat", "demo", tokenizer, plan).response([result], False)
        assert body["choices"][0]["message"]["content"] == content, text


def test_tool_choice_none_leaves_calls_unparsed(tokenizer):
    plan = plan_chat(tokenizer, [{"role": "user", "content": "hi"}], TOOLS, "none")
    assert plan.tool_format is None and plan.grammar is None and "get_weather" in plan.prompt
