"""The agent-facing APIs against a real `hybridlm serve` process, through the official clients:
`openai` (tool calls, streamed and not, forced tool choice, json_schema outputs), `anthropic`
(plain, streaming, tools, tool results), `ollama` (chat, generate, format). The demo model has
random weights: only the grammar makes its tool calls and JSON valid. Errors come in each API's
own shape, and one conversation reuses the prefix cache whichever API carried it."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from hybridlm.server.chat import plan_chat
from tests.server.conftest import API_KEY, MODEL, ServerProcess

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


# Anthropic's client no longer sends sampling parameters itself; hybridlm still reads them.
GREEDY = {"temperature": 0}


def unique(text: str) -> list[dict]:
    """A conversation no other test sent (so its cache hits are its own)."""
    return [{"role": "user", "content": f"{text} [{uuid.uuid4().hex[:8]}]"}]


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    """A server of this module's own (its prefix cache holds only these tests' conversations), in
    float32: a request served from the cache then picks the tokens a fresh one does."""
    process = ServerProcess(
        ["--model", str(demo_dir), "--model-name", MODEL, "--api-key", API_KEY, "--dtype", "float32"],
        {},
        tmp_path_factory.mktemp("agent-api") / "server.log",
    ).ready()
    yield process
    assert process.stop() == 0, process.log.read_text()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llama(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


# -- openai ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", "named"])
def test_openai_forced_tool_calls_streamed_accumulate_to_the_non_streamed(client, choice):
    messages = unique("What is the weather in Paris?")
    tool_choice = (
        "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    )
    kw = dict(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0)
    whole = client.chat.completions.create(max_tokens=200, parallel_tool_calls=False, **kw)
    choice0 = whole.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    calls = calls_of(choice0.message)
    assert len(calls) == 1 and choice0.message.tool_calls[0].id.startswith("call_")
    name, args = calls[0]
    assert choice == "required" or name == "get_time"
    jsonschema.validate(args, (WEATHER if name == "get_weather" else TIME)["function"]["parameters"])

    streamed: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(max_tokens=200, parallel_tool_calls=False, stream=True, **kw):
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            entry = streamed.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += tc.id or ""
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        assert not delta.content
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(e["name"], json.loads(e["arguments"])) for e in streamed.values()] == calls


def test_openai_auto_tool_choice_on_a_random_model_answers_without_error(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=unique("Hi"), tools=[WEATHER], temperature=0, max_tokens=24
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_openai_json_schema_output_validates(client):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=unique("A person, as JSON"),
            response_format=response_format,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    obj = client.chat.completions.create(
        model=MODEL,
        messages=unique("JSON"),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_openai_bad_schemas_and_tools_are_400s_naming_the_field(client):
    bad = [
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            ),
            "response_format",
        ),
        (dict(response_format={"type": "yaml"}), "response_format"),
        (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools"),
        (
            dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
            "tools",
        ),
        (
            dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}),
            "tool_choice",
        ),
        (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (
            dict(
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "strang"}}},
                        },
                    }
                ],
                tool_choice="required",
            ),
            "tools",
        ),
    ]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=unique("x"), max_tokens=4, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)


# -- anthropic -------------------------------------------------------------------------------------


def test_anthropic_plain_and_streaming_agree(claude):
    messages = unique("Say hello")
    kw = dict(model=MODEL, max_tokens=16, messages=messages, system="Be brief.", extra_body=GREEDY)
    reply = claude.messages.create(**kw)
    assert reply.type == "message" and reply.role == "assistant"
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.content[0].type == "text"
    assert reply.usage.output_tokens > 0
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == reply.content[0].text == final.content[0].text
    assert final.stop_reason == reply.stop_reason
    # The same request again: its prompt comes from the cache.
    assert (
        final.usage.cache_read_input_tokens
        == reply.usage.input_tokens + reply.usage.cache_read_input_tokens - 1
    )


def test_anthropic_tools_round_trip(claude):
    tools = [{"name": "get_weather", "description": "Weather.", "input_schema": WEATHER_PARAMS}]
    messages = unique("Weather in Oslo?")
    reply = claude.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=messages,
        tools=tools,
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    assert reply.stop_reason == "tool_use"
    use = [b for b in reply.content if b.type == "tool_use"]
    assert len(use) >= 1 and use[0].name == "get_weather"
    jsonschema.validate(use[0].input, WEATHER_PARAMS)
    with claude.messages.stream(
        model=MODEL,
        max_tokens=200,
        messages=messages,
        tools=tools,
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    ) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (b.name, b.input) for b in use
    ]
    history = [
        *messages,
        {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "sunny"}]},
    ]
    follow = claude.messages.create(
        model=MODEL, max_tokens=8, messages=history, tools=tools, extra_body=GREEDY
    )
    # Everything up to the tool result was cached: the history re-renders as it was generated.
    assert (
        follow.usage.cache_read_input_tokens >= reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    )
    count = claude.messages.count_tokens(model=MODEL, messages=history, tools=tools)
    assert count.input_tokens == follow.usage.input_tokens + follow.usage.cache_read_input_tokens


def test_anthropic_errors_have_anthropics_shape(claude, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "robot", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="other", max_tokens=8, messages=unique("x"))
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=unique("x")
        )
    bad_tool = [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "strang"}}}}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model=MODEL, max_tokens=8, messages=unique("x"), tools=bad_tool, tool_choice={"type": "any"}
        )
    assert e.value.body["error"]["message"].startswith("tools")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "ok"}, image]}
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    turns = [*unique("x"), {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    with pytest.raises(anthropic.BadRequestError) as e:  # a text model cannot read the image
        claude.messages.create(model=MODEL, max_tokens=8, messages=turns)
    assert "tool_result blocks of type image" in e.value.body["error"]["message"]


# -- ollama ----------------------------------------------------------------------------------------


def test_ollama_chat_generate_and_format(llama):
    reply = llama.chat(model=MODEL, messages=unique("Hi"), options={"temperature": 0, "num_predict": 12})
    assert reply.done and reply.message.role == "assistant" and reply.eval_count > 0
    parts = list(
        llama.chat(
            model=MODEL, messages=unique("Hi"), stream=True, options={"temperature": 0, "num_predict": 12}
        )
    )
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    gen = llama.generate(model=MODEL, prompt="Once upon", options={"temperature": 0, "num_predict": 8})
    assert gen.done and gen.done_reason in ("stop", "length")
    shaped = llama.chat(model=MODEL, messages=unique("A person"), format=PERSON, options={"temperature": 0})
    jsonschema.validate(json.loads(shaped.message.content), PERSON)
    shaped = llama.generate(
        model=MODEL, prompt="A person", format=PERSON, options={"temperature": 0.8, "seed": 1}
    )
    jsonschema.validate(json.loads(shaped.response), PERSON)


def test_ollama_tools_and_listing(llama):
    tool_reply = llama.chat(
        model=MODEL,
        messages=unique("Weather?"),
        tools=[WEATHER],
        options={"temperature": 0, "num_predict": 16},
    )
    assert tool_reply.done
    assert [m.model for m in llama.list().models] == [f"{MODEL}:latest"]
    assert "tools" in llama.show(MODEL).capabilities
    with pytest.raises(ollama.ResponseError) as e:
        llama.chat(model="other", messages=unique("x"))
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        llama.chat(model=MODEL, messages=unique("x"), options={"temperature": -1})
    assert e.value.status_code == 400 and "temperature" in e.value.error


@pytest.mark.parametrize(
    ("option", "value"),
    [("num_predict", "x"), ("num_predict", [4]), ("stop", 5), ("stop", {"a": 1}), ("temperature", "hot")],
)
@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
def test_ollama_option_of_the_wrong_type_is_a_400(server, auth, path, option, value):
    body = {"model": MODEL, "stream": False, "options": {option: value}}
    body |= {"messages": unique("x")} if path == "/api/chat" else {"prompt": "x"}
    r = httpx.post(server.url + path, headers=auth, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and f"options.{option}" in r.json()["error"]


def test_ollama_errors_and_version_are_plain_json(server, auth):
    r = httpx.post(server.url + "/api/chat", headers=auth, content=b"{", timeout=10)
    assert r.status_code == 400 and set(r.json()) == {"error"}
    assert httpx.get(server.url + "/api/version", headers=auth, timeout=10).json()["version"]


# -- one engine path -------------------------------------------------------------------------------


def test_a_conversation_reuses_the_cache_through_every_api(client, claude, llama, tokenizer):
    messages = unique("Shared conversation")
    prompt_tokens = len(tokenizer.encode(plan_chat(tokenizer, messages).prompt))
    first = llama.chat(model=MODEL, messages=messages, options={"temperature": 0, "num_predict": 4})
    assert first.prompt_eval_count == prompt_tokens
    second = claude.messages.create(model=MODEL, max_tokens=4, messages=messages, extra_body=GREEDY)
    assert second.usage.cache_read_input_tokens == prompt_tokens - 1
    third = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens == prompt_tokens - 1
    assert third.choices[0].message.content == second.content[0].text == first.message.content


# -- Claude Code's request shapes ------------------------------------------------------------------
# As Claude Code 2.1 sends them (recorded from `claude -p`): a billing header with a per-request
# nonce as the first system block, `system` entries among the messages, adaptive thinking with an
# effort, cache_control on blocks and tools, a deferred tool and a server tool (tool search), and
# beta headers. tests/server/test_agent_clients.py drives the program itself.

CLAUDE_BETAS = {"anthropic-beta": "claude-code-20250219,advanced-tool-use-2025-11-20,effort-2025-11-24"}
CLAUDE_TOOLS = [
    {
        "name": "Bash",
        "description": "Run a command.",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
        "cache_control": {"type": "ephemeral"},
    },
    {
        "name": "NotebookEdit",
        "description": "Edit a notebook.",
        "input_schema": {"type": "object", "properties": {"cell": {"type": "integer"}}},
        "defer_loading": True,
    },
    {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"},
]


def claude_code_request(text: str, nonce: str) -> dict:
    system = [
        {
            "type": "text",
            "text": f"x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=cli; cch={nonce};",
        },
        {"type": "text", "text": "You are Claude Code. " * 40, "cache_control": {"type": "ephemeral"}},
    ]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>No files.</system-reminder>"},
                {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}},
            ],
        },
        {"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]},
    ]
    extra = {
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": json.dumps({"session_id": nonce})},
        **GREEDY,
    }
    return dict(model=MODEL, system=system, messages=messages, tools=CLAUDE_TOOLS, extra_body=extra)


def test_claude_code_requests_differing_in_the_billing_nonce_share_the_cache(claude):
    text = unique("List the files")[0]["content"]
    first = claude.messages.create(
        max_tokens=4, extra_headers=CLAUDE_BETAS, **claude_code_request(text, "a1b2c")
    )
    with claude.messages.stream(
        max_tokens=4, extra_headers=CLAUDE_BETAS, **claude_code_request(text, "f9e8d")
    ) as s:
        second = s.get_final_message()
    prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert prompt == first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= 0.9 * prompt
    counts = [claude.messages.count_tokens(**claude_code_request(text, n)).input_tokens for n in ("1", "2")]
    assert counts == [prompt, prompt]


def test_claude_code_roles_thinking_and_tool_references(claude):
    def count(**kw) -> int:
        request = claude_code_request("Hi", "n") | kw
        return claude.messages.count_tokens(**request).input_tokens

    adaptive = count()
    extra = claude_code_request("Hi", "n")["extra_body"]
    assert count(extra_body={**extra, "thinking": {"type": "enabled", "budget_tokens": 1024}}) == adaptive
    # Thinking off: the template closes an empty thinking block after the prompt.
    assert count(extra_body={**extra, "thinking": {"type": "disabled"}}) > adaptive
    as_user = [{"role": "user", "content": "Hi"}]
    for role in ("ctx", "msg"):
        assert count(messages=[{"role": role, "content": "Hi"}]) == count(messages=as_user)
    # A system entry joins the system prompt: the same prompt as one system text.
    joined = claude_code_request("Hi", "n")
    joined["system"] = [joined["system"][1], {"type": "text", "text": "\n\nAnswer briefly."}]
    joined["messages"] = joined["messages"][:1]
    assert claude.messages.count_tokens(**joined).input_tokens == adaptive
    search = {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "search"}}
    found = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "tool_reference", "tool_name": "NotebookEdit"}],
    }
    history = [*as_user, {"role": "assistant", "content": [search]}, {"role": "user", "content": [found]}]
    reply = claude.messages.create(
        max_tokens=4, extra_headers=CLAUDE_BETAS, **(claude_code_request("Hi", "n") | {"messages": history})
    )
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
