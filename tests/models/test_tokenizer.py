"""Tokenizer, chat templates and streaming decode, checked against transformers as the oracle."""

from __future__ import annotations

import json
import unicodedata
from importlib import resources
from pathlib import Path

import jinja2
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.demo import write_demo_model
from hybridlm.models.tokenizer import IncrementalDecoder, Tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

DEMO_TOKENIZER = resources.files("hybridlm.demo").joinpath("tokenizer.json").read_bytes()
ENDOFTEXT, IM_START, IM_END = 4087, 4088, 4089

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x: int) -> int:\n\treturn x ** 2  # square\n\n\nprint(f(3))\r\n",
    "Ünïcödé façade, naïve café, Straße, Ελληνικά, Русский текст, עברית, العربية",
    "中文分词测试：你好，世界！日本語のテキスト、한국어 텍스트",
    "emoji 🙂👍🏽 family 👩‍👩‍👧‍👦 flag 🇫🇷 keycap 1️⃣ math 𝔘𝔫𝔦 ✓",
    "special tokens inline: <|im_start|>user\nhi<|im_end|> <think>hm</think> <tool_call>{}</tool_call>",
    "   leading and trailing spaces   ",
    "",
]
# Valid text the way the tokenizer's NFC normalizer leaves it; unassigned code points are excluded because the
# Rust and Python Unicode tables can be of different versions.
VALID_TEXT = st.text(st.characters(exclude_categories=("Cs", "Cn")), max_size=80).map(
    lambda s: unicodedata.normalize("NFC", s)
)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def tok(demo_dir) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="module")
def hf_tok(demo_dir):
    return transformers.PreTrainedTokenizerFast.from_pretrained(demo_dir)


def make_dir(
    path: Path, tokenizer_config: dict, files: dict | None = None, tokenizer_json: bytes = DEMO_TOKENIZER
) -> Path:
    """A checkpoint directory: a tokenizer.json, its tokenizer_config.json and extra files (relative path ->
    text, or a dict written as JSON)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_bytes(tokenizer_json)
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, content in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def render_both(ours: Tokenizer, hf, messages, **kwargs) -> str:
    kwargs.setdefault("add_generation_prompt", True)
    expected = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    got = ours.apply_chat_template(messages, **kwargs)
    assert got == expected
    return got


# --- encode / decode ----------------------------------------------------------------------------------------


def test_demo_vocab_and_special_ids(tok):
    assert tok.vocab_size == 4096
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        ENDOFTEXT,
        IM_START,
        IM_END,
    ]
    assert tok.bos_token_id is None and not tok.add_bos_token
    # tokenizer eos (<|im_end|>) united with generation_config's [<|im_end|>, <|endoftext|>]
    assert tok.eos_token_ids == {IM_END, ENDOFTEXT}


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip_matches_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == ids  # the demo checkpoint has no BOS
    assert tok.decode(ids) == text
    skipped = tok.decode(ids, skip_special_tokens=True)
    assert skipped == hf_tok.decode(ids, skip_special_tokens=True)


def test_skip_special_tokens_keeps_markup_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\n<think>x</think>y<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>x</think>y"


@settings(max_examples=60, deadline=None)
@given(text=VALID_TEXT)
def test_roundtrip_property(tok, text):
    assert tok.decode(tok.encode(text)) == text


# --- incremental decoding -----------------------------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    decoder = IncrementalDecoder(tok, **kwargs)
    return [decoder.add(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_deltas_concatenate_to_decode(tok, text):
    ids = tok.encode(text)
    for skip in (False, True):
        deltas = stream(tok, ids, skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_holds_back_split_characters(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1  # byte-level BPE splits the 4-byte character across tokens
    assert stream(tok, ids) == [""] * (len(ids) - 1) + ["🙂", ""]


def test_incremental_flush_emits_truncated_character(tok):
    ids = tok.encode("ok🙂")[:-1]  # the stream stops mid-character
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[-1].endswith("\ufffd")


def test_incremental_batches_and_context(tok):
    context, ids = tok.encode("Hello"), tok.encode(" wörld 🙂!")
    decoder = IncrementalDecoder(tok, context=context)
    text = decoder.add(ids[:3]) + decoder.add(ids[3:]) + decoder.flush()
    assert text == " wörld 🙂!"


def sentencepiece_style_tokenizer() -> Tokenizer:
    """A small Llama-2/Gemma-style tokenizer: "▁" for spaces, byte fallback, a decoder that strips a space."""
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(byte_fallback=True))
    backend.normalizer = tokenizers.normalizers.Sequence(
        [tokenizers.normalizers.Prepend("▁"), tokenizers.normalizers.Replace(" ", "▁")]
    )
    backend.decoder = tokenizers.decoders.Sequence(
        [
            tokenizers.decoders.Replace("▁", " "),
            tokenizers.decoders.ByteFallback(),
            tokenizers.decoders.Fuse(),
            tokenizers.decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", *byte_tokens], show_progress=False
    )
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20, "hello world"], trainer)
    return Tokenizer(backend, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def test_incremental_sentencepiece_style():
    sp = sentencepiece_style_tokenizer()
    ids = sp.encode("hello world 🙂 and 中文, the  fox")
    deltas = stream(sp, ids)
    assert "".join(deltas) == sp.decode(ids) and not any("\ufffd" in d for d in deltas)
    # With the preceding ids as context the first token keeps its leading space, which decoding alone strips.
    for k in range(1, len(ids)):
        if not sp.decode(ids[:k]).endswith("\ufffd"):
            decoder = IncrementalDecoder(sp, context=ids[:k])
            text = decoder.add(ids[k:]) + decoder.flush()
            assert text == sp.decode(ids)[len(sp.decode(ids[:k])) :]


@settings(max_examples=60, deadline=None)
@given(text=VALID_TEXT)
def test_incremental_property(tok, text):
    ids = tok.encode(text)
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


# --- the demo chat template ---------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city — in °C.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}

TOOL_CHAT = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and Zürich?"},
    {
        "role": "assistant",
        "content": None,  # OpenAI clients send null content with tool calls; dropped like transformers does
        "reasoning_content": "Two cities, two calls.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"temp": 17}'},
    {"role": "assistant", "content": "Paris is 21 °C, Zürich 17 °C.", "reasoning_content": "Both answered."},
    {"role": "user", "content": "And Rome?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [{"name": "get_weather", "arguments": {}}],
    },
    {"role": "tool", "content": "sunny"},
]

DEMO_CASES = {
    "single_turn": ([{"role": "user", "content": "Hi!"}], {}),
    "multi_turn": (
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello. How can I help?"},
            {"role": "user", "content": "Write a haiku about 🍂."},
        ],
        {},
    ),
    "system_prompt": (
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
        {"add_generation_prompt": False},
    ),
    "content_parts": (
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}],
            }
        ],
        {},
    ),
    "tools_no_system": ([{"role": "user", "content": "Search cats"}], {"tools": [SEARCH_TOOL]}),
    "tools_and_calls": (TOOL_CHAT, {"tools": [WEATHER_TOOL, SEARCH_TOOL]}),
    "tool_calls_no_generation_prompt": (TOOL_CHAT, {"tools": [WEATHER_TOOL], "add_generation_prompt": False}),
    "reasoning": (
        [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "old thoughts"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>\ninline thoughts\n</think>\n\na2"},
        ],
        {"add_generation_prompt": False},
    ),
    "reasoning_aliases": (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "thinking": "via thinking"},
            {"role": "tool", "content": "r"},
            {"role": "assistant", "content": "b", "reasoning": "via reasoning"},
        ],
        {},
    ),
    "enable_thinking_false": ([{"role": "user", "content": "quick answer"}], {"enable_thinking": False}),
    "enable_thinking_true": ([{"role": "user", "content": "think hard"}], {"enable_thinking": True}),
}


@pytest.mark.parametrize("case", list(DEMO_CASES))
def test_demo_template_matches_transformers(tok, hf_tok, case):
    messages, kwargs = DEMO_CASES[case]
    render_both(tok, hf_tok, messages, **kwargs)


def test_demo_template_semantics(tok):
    plain = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    reasoning = tok.apply_chat_template(DEMO_CASES["reasoning"][0], add_generation_prompt=False)
    assert "old thoughts" not in reasoning  # reasoning before the last user query is dropped
    assert reasoning.endswith("<|im_start|>assistant\n<think>\ninline thoughts\n</think>\n\na2<|im_end|>\n")
    tools = tok.apply_chat_template(TOOL_CHAT, tools=[WEATHER_TOOL])
    assert tools.startswith("<|im_start|>system\nYou are a weather bot.\n\n# Tools\n")
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in tools
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>' in tools
    # the last query is "And Rome?": the reasoning of the earlier tool-calling turns is dropped
    assert "Two cities" not in tools and "Both answered" not in tools


def test_bad_role_raises_like_transformers(tok, hf_tok):
    messages = [{"role": "narrator", "content": "Once upon a time"}]
    with pytest.raises(jinja2.TemplateError) as expected:
        hf_tok.apply_chat_template(messages, tokenize=False)
    with pytest.raises(jinja2.TemplateError) as got:
        tok.apply_chat_template(messages)
    assert type(got.value) is type(expected.value) and str(got.value) == str(expected.value)


def test_empty_conversation_rejected(tok):
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([])


# --- other template styles ----------------------------------------------------------------------------------

LLAMA3_STYLE = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\nToday Date: " + date_string + "\n\n" }}
{%- if tools is not none %}
    {{- "Call a function by answering with JSON {\"name\": ..., \"parameters\": {...}}.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception("Unknown role: " + message.role) }}
    {%- endif %}
    {%- if message.tool_calls is defined %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception("Only one tool call per turn is supported.") }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + call.name + '", "parameters": ' }}
        {{- call.arguments | tojson(separators=(",", ":"), sort_keys=true) + "}<|eot_id|>" }}
    {%- elif message.role == 'tool' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping %}
            {{- message.content | tojson(ensure_ascii=true) }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' }}
        {{- message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

GEMMA_STYLE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ boi_token }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

BOS_CONFIG = {
    # AddedToken-dict form, as transformers serialises it
    "bos_token": {
        "__type": "AddedToken",
        "content": "<|endoftext|>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    },
    "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
    "add_bos_token": True,
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_dir(tmp_path_factory.mktemp("llama"), {**BOS_CONFIG, "chat_template": LLAMA3_STYLE})


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> Path:
    config = {**BOS_CONFIG, "chat_template": GEMMA_STYLE, "boi_token": "<start_of_image>"}
    return make_dir(tmp_path_factory.mktemp("gemma"), config)


LLAMA_CASES = {
    "system_and_turns": (
        [
            {"role": "system", "content": "  Be nice.  "},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ],
        {"date_string": "26 Jul 2024"},
    ),
    "strftime_now_and_tools": (
        [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"unit": "c", "city": "Köln"}}}
                ],
            },
            {"role": "tool", "content": {"temp": "21°"}},
        ],
        {"tools": [WEATHER_TOOL]},
    ),
}


@pytest.mark.parametrize("case", list(LLAMA_CASES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_llama3_style_template(llama_dir, case, add_generation_prompt):
    messages, kwargs = LLAMA_CASES[case]
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(llama_dir)
    text = render_both(
        Tokenizer.from_dir(llama_dir), hf, messages, add_generation_prompt=add_generation_prompt, **kwargs
    )
    assert text.startswith("<|endoftext|><|start_header_id|>system")


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([{"role": "robot", "content": "beep"}], "Unknown role: robot"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": {}}}] * 2}],
            "Only one tool call",
        ),
    ],
)
def test_llama3_style_exceptions(llama_dir, messages, error):
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(llama_dir)
    with pytest.raises(jinja2.TemplateError, match=error) as expected:
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(jinja2.TemplateError, match=error) as got:
        Tokenizer.from_dir(llama_dir).apply_chat_template(messages)
    assert str(got.value) == str(expected.value)


def test_gemma_style_template(gemma_dir):
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(gemma_dir)
    ours = Tokenizer.from_dir(gemma_dir)
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is this? "}]},
        {"role": "assistant", "content": "Un chat."},
        {"role": "user", "content": "Merci"},
    ]
    for add_generation_prompt in (True, False):
        text = render_both(ours, hf, messages, add_generation_prompt=add_generation_prompt)
        assert text.startswith("<|endoftext|><start_of_turn>user\nAnswer in French.\n\n<start_of_image>")

    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError) as expected:
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(jinja2.TemplateError) as got:
        ours.apply_chat_template(bad)
    assert (
        str(got.value)
        == str(expected.value)
        == "Conversation roles must alternate user/assistant/user/assistant/..."
    )


def test_named_templates_and_jinja_precedence(tmp_path):
    default, tool_use = "{{ 'default:' + messages[0].content }}", "{{ 'tools:' + tools | length | string }}"
    listed = [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]
    named = make_dir(tmp_path / "named", {"chat_template": listed})
    # chat_template.jinja and additional_chat_templates/ replace the config's templates entirely
    files = make_dir(
        tmp_path / "files",
        {"chat_template": "{{ 'config template' }}"},
        {
            "chat_template.jinja": "{{ 'file:' + messages[0].content }}",
            "additional_chat_templates/tool_use.jinja": tool_use,
        },
    )
    single = make_dir(
        tmp_path / "single", {"chat_template": "{{ 'config' }}"}, {"chat_template.jinja": default}
    )
    messages = [{"role": "user", "content": "x"}]
    for path, plain in ((named, "default:x"), (files, "file:x"), (single, "default:x")):
        hf, ours = transformers.PreTrainedTokenizerFast.from_pretrained(path), Tokenizer.from_dir(path)
        assert render_both(ours, hf, messages) == plain
        expected_tools = "tools:1" if path != single else plain
        assert render_both(ours, hf, messages, tools=[SEARCH_TOOL]) == expected_tools
        assert render_both(ours, hf, messages, chat_template="{{ 'inline' }}") == "inline"
    assert (
        Tokenizer.from_dir(named).apply_chat_template(messages, chat_template="tool_use", tools=[])
        == "tools:0"
    )


JINJA_EXTRAS = r"""{%- set ns = namespace(count=0) %}
{%- for message in messages %}
    {%- if loop.index > 2 %}{% break %}{% endif %}
    {%- set ns.count = ns.count + 1 %}
    {%- if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}
    {%- else %}{{ dict(role=message.role, n=ns.count) | tojson(sort_keys=true) }}{% endif %}
{%- endfor %}
{{- dict.fromkeys(['a', 'b'], 0) | tojson }}"""


def test_jinja_extensions_and_globals(tmp_path):
    path = make_dir(tmp_path, {"chat_template": JINJA_EXTRAS})
    hf, ours = transformers.PreTrainedTokenizerFast.from_pretrained(path), Tokenizer.from_dir(path)
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}, {"role": "user"}]
    assert render_both(ours, hf, messages) == '{"n": 1, "role": "user"}a{"a": 0, "b": 0}'
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(messages, chat_template="{% set ns = namespace(_private=1) %}")


# --- BOS / EOS and loading errors ---------------------------------------------------------------------------


def with_bos_post_processor() -> bytes:
    """The demo tokenizer.json with a Llama/Gemma-style post-processor that prepends <|endoftext|> as BOS."""
    backend = tokenizers.Tokenizer.from_str(DEMO_TOKENIZER.decode())
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", ENDOFTEXT)]
    )
    return backend.to_str().encode()


@pytest.mark.parametrize("explicit", [True, False])
def test_bos_from_config_or_post_processor(tmp_path, explicit):
    config = dict(BOS_CONFIG) if explicit else {k: v for k, v in BOS_CONFIG.items() if k != "add_bos_token"}
    path = make_dir(tmp_path, config, tokenizer_json=with_bos_post_processor())
    ours, hf = Tokenizer.from_dir(path), transformers.PreTrainedTokenizerFast.from_pretrained(path)
    text = "Hello there"
    assert ours.bos_token_id == ENDOFTEXT and ours.add_bos_token
    assert ours.encode(text, add_special_tokens=True) == hf.encode(text) == [ENDOFTEXT, *ours.encode(text)]
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)


def test_bos_off_when_config_says_so(tmp_path):
    path = make_dir(
        tmp_path, {**BOS_CONFIG, "add_bos_token": False}, tokenizer_json=with_bos_post_processor()
    )
    ours = Tokenizer.from_dir(path)
    assert ours.bos_token_id == ENDOFTEXT and not ours.add_bos_token
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi")


def test_eos_ids_are_united(tmp_path):
    path = make_dir(
        tmp_path,
        {"eos_token": {"content": "<|im_end|>"}},
        {
            "generation_config.json": {"eos_token_id": [ENDOFTEXT, IM_START]},
            "config.json": {"text_config": {"eos_token_id": 7}},
        },
    )
    assert Tokenizer.from_dir(path).eos_token_ids == {IM_END, ENDOFTEXT, IM_START, 7}
    (path / "generation_config.json").unlink()
    (path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert Tokenizer.from_dir(path).eos_token_ids == {IM_END, 5}


def test_special_tokens_map_is_legacy_fallback(tmp_path):
    path = make_dir(tmp_path, {}, {"special_tokens_map.json": {"eos_token": {"content": "<|endoftext|>"}}})
    assert Tokenizer.from_dir(path).eos_token_ids == {ENDOFTEXT}


def test_loading_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(DEMO_TOKENIZER)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json is not valid JSON"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_template"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
