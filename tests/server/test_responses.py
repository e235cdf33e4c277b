"""OpenAI's Responses API (`/v1/responses`) against a real `hybridlm serve`, through the official
`openai` client: text, streamed events in OpenAI's order, forced tool calls, structured output,
stored responses and `previous_response_id`, a Codex-shaped session whose second turn prefills only
its new items, errors in OpenAI's shape, and fuzzed bodies that never get a 5xx. Also the other
agent-facing additions: `reasoning_effort` on chat completions and vLLM's `/tokenize` and
`/detokenize`."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseOutputItem, ResponseStreamEvent
from pydantic import TypeAdapter

import hybridlm
from hybridlm.engine import Engine
from hybridlm.server.app import create_app
from hybridlm.server.chat import Part, plan_chat
from hybridlm.server.response_store import ResponseStore
from hybridlm.server.responses import Output, ResponsesRequest, input_messages, prepare, seal
from hybridlm.server.tools import ToolCall
from tests.server.conftest import API_KEY, CONTEXT, MODEL, ServerProcess
from tests.server.test_agent_api import PERSON, WEATHER_PARAMS, unique

WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS, "strict": True}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
HOSTED = [{"type": "web_search"}, {"type": "local_shell"}, {"type": "custom", "name": "apply_patch"}]


def text_of(response) -> str:
    return "".join(c.text for item in response.output if item.type == "message" for c in item.content)


def test_text_answer_streamed_matches_the_non_streamed(client):
    kw = dict(model=MODEL, input=unique("Say hi")[0]["content"], instructions="Be brief.", temperature=0)
    whole = client.responses.create(max_output_tokens=12, **kw)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == MODEL
    assert whole.status in ("completed", "incomplete") and whole.output[0].type == "message"
    usage = whole.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    events = list(client.responses.create(max_output_tokens=12, stream=True, **kw))
    kinds = [e.type for e in events]
    final = "response.completed" if whole.status == "completed" else "response.incomplete"
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == text_of(whole) == events[-4].text == events[-1].response.output_text
    assert events[-2].item.content[0].text == streamed
    # The same prompt again: read from the cache (all but the last token, which is run for logits).
    assert events[-1].response.usage.input_tokens_details.cached_tokens == usage.input_tokens - 1
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_streamed_and_not(client, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "name": "get_time"}
    kw = dict(
        model=MODEL,
        input=unique("Weather in Oslo?"),
        tools=[WEATHER, TIME, *HOSTED],
        tool_choice=tool_choice,
        temperature=0,
        max_output_tokens=200,
    )
    whole = client.responses.create(**kw)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and calls and calls[0].call_id.startswith("call_")
    for call in calls:
        assert choice == "required" or call.name == "get_time"
        jsonschema.validate(
            json.loads(call.arguments), (WEATHER if call.name == "get_weather" else TIME)["parameters"]
        )
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in added] == [i.type for i in done] == [i.type for i in whole.output]
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == [c.arguments for c in calls] and deltas == "".join(args)


def test_json_schema_and_json_object_formats(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    for seed in range(2):
        reply = client.responses.create(
            model=MODEL,
            input=unique("A person, as JSON"),
            text={"format": fmt},
            temperature=1.0,
            extra_body={"seed": seed},
            max_output_tokens=200,
        )
        assert reply.status == "completed"
        jsonschema.validate(json.loads(reply.output_text), PERSON)
    bad = {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", text={"format": bad}, max_output_tokens=4)
    assert e.value.body["param"] == "text"


def test_stored_responses_chain_through_the_cache(client):
    first = client.responses.create(
        model=MODEL,
        input=unique("Weather in Rome?"),
        instructions="Use the tools.",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=200,
        metadata={"session": "a"},
        user="tester",
        prompt_cache_key="k",
        reasoning={"effort": "low"},
    )
    assert first.store is True and first.metadata == {"session": "a"} and first.reasoning.effort == "low"
    call = next(item for item in first.output if item.type == "function_call")
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        instructions="Use the tools.",
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=6,
        reasoning={"effort": "low"},
        stream=True,
    )
    final = [e for e in second if e.type in ("response.completed", "response.incomplete")][0].response
    assert final.previous_response_id == first.id
    # Everything the first turn read and wrote came from the cache: only the tool result is new.
    cached = final.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens + first.usage.output_tokens - 1
    assert client.responses.retrieve(final.id).status == final.status
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=first.id, input="more", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_codex_shaped_session_prefills_only_the_new_items(client):
    """Codex sends the whole history every turn (store: false), reasoning items included, with
    hosted tools among its function tools; the second turn's prompt comes from the cache up to the
    items it adds."""
    history = [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "Sandbox: none."}],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": unique("ls")[0]["content"]}],
        },
    ]
    kw = dict(
        model=MODEL,
        instructions="You are a coding agent.",
        tools=[WEATHER, *HOSTED],
        parallel_tool_calls=False,
        store=False,
        include=["reasoning.encrypted_content"],
        reasoning={"effort": "medium", "summary": "auto"},
        prompt_cache_key="session-1",
        temperature=0,
        stream=True,
    )
    events = list(client.responses.create(input=history, tool_choice="required", max_output_tokens=200, **kw))
    first = events[-1].response
    items = [e.item.model_dump(exclude_none=True) for e in events if e.type == "response.output_item.done"]
    call = next(i for i in items if i["type"] == "function_call")
    history += [*items, {"type": "function_call_output", "call_id": call["call_id"], "output": "a.txt"}]
    events = list(client.responses.create(input=history, max_output_tokens=4, **kw))
    second = events[-1].response
    assert (
        second.usage.input_tokens_details.cached_tokens
        >= first.usage.input_tokens + first.usage.output_tokens - 1
    )


def test_reasoning_items_render_the_text_they_carry(tokenizer):
    """A reasoning item re-sent with its text (or only the sealed copy, as Codex re-sends them)
    renders as the chat message it was read from."""
    chat = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "thought\nmore", "tool_calls": None},
    ]
    chat[1].pop("tool_calls")
    sent = [
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "thought\nmore"}]}
    ]
    sealed = [{"type": "reasoning", "summary": [], "encrypted_content": seal("thought\nmore")}]
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]}
    for reasoning in (sent, sealed):
        messages = input_messages([{"role": "user", "content": "q"}, *reasoning, answer])
        assert messages == chat
        assert plan_chat(tokenizer, messages).prompt == plan_chat(tokenizer, chat).prompt
    foreign = [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}], "encrypted_content": "x"}
    ]
    assert input_messages([*foreign, answer]) == [{"role": "assistant", "content": "a"}]


def test_reasoning_effort_sets_the_thinking_switch(client, server):
    base = dict(model=MODEL, input=unique("Think")[0]["content"], max_output_tokens=1)
    plain = client.responses.create(**base).usage.input_tokens
    off = client.responses.create(reasoning={"effort": "none"}, **base).usage.input_tokens
    assert off > plain  # the template closes an empty thinking block itself
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(reasoning={"effort": "extreme"}, **base)
    assert e.value.body["param"] == "reasoning.effort"
    messages = [{"role": "user", "content": base["input"]}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, reasoning_effort="none"
    )
    assert chat.usage.prompt_tokens == off
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, reasoning_effort="x")
    assert e.value.body["param"] == "reasoning_effort"


def test_errors_have_openais_shape(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="other", input="x")
    assert e.value.body["code"] == "model_not_found"
    bad = [
        (dict(input=[{"type": "message", "role": "robot", "content": "x"}]), "input"),
        (dict(input=[{"type": "input_image", "image_url": "x"}]), "input"),
        (dict(input="x", max_output_tokens=0), "max_output_tokens"),
        (dict(input="x", temperature=-1), "temperature"),
        (dict(input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "other"}), "tool_choice"),
        (dict(input=[]), "input"),
        (dict(input="x", metadata={"a": 1}), "metadata"),
    ]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="word " * CONTEXT)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).responses.create(
            model=MODEL, input="x"
        )


def test_response_store_is_bounded_by_count_and_bytes():
    store = ResponseStore(max_count=2, max_bytes=400)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert len(store) == 2 and store.get("r0") is None
    store.get("r1")  # now the most recently used
    store.put({"id": "r3"}, [])
    assert store.get("r2") is None and store.get("r1") is not None
    store.put({"id": "big"}, [{"role": "user", "content": "y" * 340}])
    assert store.bytes <= 400 and store.get("big") is not None and len(store) == 1
    store.put({"id": "huge"}, [{"role": "user", "content": "z" * 1000}])
    assert store.get("huge") is None and store.get("big") is not None
    assert store.delete("big") and not store.delete("big") and store.bytes == 0


def test_replicas_share_stored_responses_through_the_store(tmp_path):
    """Two servers' stores on one real redis-server (`--cache-store`): what one stores the other
    finds, a delete on either deletes it for both, and with the store down each serves its own."""
    from hybridlm.cluster import StoreServer
    from hybridlm.prefix.store import StoreTier

    server = StoreServer(tmp_path).start()
    tiers = [StoreTier(server.url, "model-a", retry_s=0.0) for _ in range(2)]
    try:
        a, b = (ResponseStore(shared=t) for t in tiers)
        history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        a.put({"id": "resp_1", "output": []}, history)
        got = b.get("resp_1")
        assert got is not None and got.history == history and got.response["id"] == "resp_1"
        assert ResponseStore(shared=StoreTier(server.url, "model-b")).get("resp_1") is None  # per model
        assert b.delete("resp_1") and a.get("resp_1") is None and not a.delete("resp_1")
        a.put({"id": "resp_2"}, history)
        server.stop()
        assert a.get("resp_2") is not None  # its own copy, while the store does not answer
        assert b.get("resp_2") is None
    finally:
        server.stop()


def test_tokenize_and_detokenize_in_vllms_shapes(server, auth, tokenizer):
    messages = unique("Count me")
    r = httpx.post(
        server.url + "/tokenize", headers=auth, json={"model": MODEL, "messages": messages}, timeout=30
    )
    body = r.json()
    assert r.status_code == 200 and set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == tokenizer.encode(plan_chat(tokenizer, messages).prompt)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    text = httpx.post(
        server.url + "/tokenize",
        headers=auth,
        json={"prompt": "hello world", "return_token_strs": True},
        timeout=30,
    ).json()
    assert "".join(text["token_strs"]) == "hello world"
    back = httpx.post(server.url + "/detokenize", headers=auth, json={"tokens": text["tokens"]}, timeout=30)
    assert back.json() == {"prompt": "hello world"}
    r = httpx.post(server.url + "/detokenize", headers=auth, json={"tokens": [-1]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


_text = st.text(max_size=20)
_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image", "x"]), "text": _text}
)
_item = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "developer", "tool", ""]),
            "content": st.one_of(_text, st.lists(_part, max_size=3), st.integers()),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": _text,
            "name": _text,
            "arguments": st.one_of(_text, st.none()),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": _text, "output": st.one_of(_text, st.none())}
    ),
    st.fixed_dictionaries({"type": st.just("reasoning"), "encrypted_content": _text, "content": st.just([])}),
    st.dictionaries(_text, st.one_of(_text, st.integers()), max_size=3),
)
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False)
    | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)
_body = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, None, "other"])},
    optional={
        "input": st.one_of(_text, st.lists(_item, max_size=4), _json),
        "instructions": st.one_of(_text, _json),
        "tools": st.one_of(
            st.lists(st.one_of(st.just(WEATHER), st.just(HOSTED[0]), _json), max_size=2), _json
        ),
        "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "sometimes"]), _json),
        "text": st.one_of(st.just({"format": {"type": "json_object"}}), _json),
        "reasoning": st.one_of(st.just({"effort": "high"}), _json),
        "temperature": st.one_of(st.floats(-1, 3, allow_subnormal=False), _json),
        "top_p": st.one_of(st.floats(-1, 2, allow_subnormal=False), _json),
        "metadata": _json,
        "store": _json,
        "stream": st.booleans(),
        "previous_response_id": st.one_of(_text, _json),
    },
).map(lambda body: {**body, "max_output_tokens": 2})


@given(body=_body)
@settings(
    max_examples=60, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
def test_fuzzed_bodies_get_no_server_error_and_errors_in_openais_shape(server, auth, body):
    r = httpx.post(server.url + "/v1/responses", headers=auth, json=body, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    elif body.get("stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[0]["type"] == "response.created"
        assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
    else:
        assert r.json()["object"] == "response"


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    """A server of this module's own, in float32 (a request served from the cache picks the tokens
    a fresh one does)."""
    args = ["--model", str(demo_dir), "--model-name", MODEL, "--api-key", API_KEY, "--dtype", "float32"]
    process = ServerProcess(
        [*args, "--context-length", str(CONTEXT)],
        {},
        tmp_path_factory.mktemp("responses") / "server.log",
    ).ready()
    yield process
    assert process.stop() == 0, process.log.read_text()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_reasoning_text_and_calls_stream_in_openais_order_and_shapes():
    """Every event and item validates against the `openai` package's own types (the client itself
    parses leniently); output items re-sent as input are the assistant turn they were read from."""
    output = Output()
    call = ToolCall("get_time", '{"zone": "utc"}')
    parts = [
        Part("reasoning", "I "),
        Part("reasoning", "think"),
        Part("content", "Hi"),
        Part("tool_call", call=call),
    ]
    events = [e for part in parts for e in output.add(part)] + output.finish("completed")
    assert [e["type"].removeprefix("response.") for e in events] == [
        *("output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.delta"),
        *("reasoning_text.done", "content_part.done", "output_item.done"),
        *("output_item.added", "content_part.added", "output_text.delta", "output_text.done"),
        *("content_part.done", "output_item.done"),
        *(
            "output_item.added",
            "function_call_arguments.delta",
            "function_call_arguments.done",
            "output_item.done",
        ),
    ]
    assert [e["output_index"] for e in events] == [0] * 7 + [1] * 6 + [2] * 4
    stream_event = TypeAdapter(ResponseStreamEvent)
    for number, event in enumerate(events):
        stream_event.validate_python({**event, "sequence_number": number})
    for item in output.items:
        TypeAdapter(ResponseOutputItem).validate_python(item)
    assert output.reasoning == "I think"
    function = {"name": "get_time", "arguments": call.arguments}
    assert input_messages(output.items) == [
        {
            "role": "assistant",
            "content": "Hi",
            "reasoning_content": "I think",
            "tool_calls": [{"id": call.id, "type": "function", "function": function}],
        }
    ]


def test_whole_responses_validate_against_openais_types(client):
    """Greedy, with room to spare: sampled, the random demo model's call ran past 80 tokens in 4 of
    40 requests, which made the status `incomplete` and the test flaky."""
    raw = client.responses.with_raw_response.create(
        model=MODEL,
        input=unique("Weather?"),
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=200,
    )
    response = Response.model_validate(raw.http_response.json())
    assert response.status == "completed" and response.output[-1].type == "function_call"


def test_a_disconnect_cancels_the_response(server, auth):
    """Streamed or not, a client that goes away cancels its request (as on every endpoint)."""
    body = {
        "model": MODEL,
        "input": unique("Write a lot")[0]["content"],
        "max_output_tokens": 3000,
        "temperature": 0,
    }
    before = server.metrics(auth)
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, headers=auth) as r,
    ):
        lines = r.iter_lines()
        while "response.output_text.delta" not in next(lines):
            pass
    try:
        httpx.post(server.url + "/v1/responses", json=body, headers=auth, timeout=0.5)
        raise AssertionError("3000 tokens cannot be ready in 0.5 s")
    except httpx.ReadTimeout:
        pass
    deadline = time.monotonic() + 10
    while (after := server.metrics(auth))["hybridlm_requests_running"]:
        assert time.monotonic() < deadline, after
        time.sleep(0.01)
    cancelled = 'hybridlm_requests_finished_total{reason="cancelled"}'
    assert after[cancelled] == before.get(cancelled, 0) + 2
    assert after["hybridlm_generation_tokens_total"] - before["hybridlm_generation_tokens_total"] < 1000


def test_call_items_become_one_assistant_turn_and_tool_messages():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'}
    parts = [{"type": "input_text", "text": "sun"}, {"type": "input_text", "text": "ny"}]
    items = [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "input_text", "text": "Go"}]},
        call,
        {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": parts},
        {"type": "function_call_output", "call_id": "c2", "output": {"ok": True}},
    ]
    function = {"name": "f", "arguments": '{"a": 1}'}
    assert input_messages(items) == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": function},
                {"id": "c2", "type": "function", "function": function},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": '{"ok": true}'},
    ]


def test_leading_system_turns_render_as_one_system_prompt(tokenizer):
    """Instructions and Codex's two developer messages: one system prompt, as templates that
    refuse a later system turn need (a system item after the conversation began stays a turn)."""
    items = [
        {"role": "developer", "content": "Sandbox."},
        {"role": "user", "content": "Go"},
        {"role": "developer", "content": "Later."},
    ]
    body = ResponsesRequest(
        instructions="Agent.", input=[{"role": "developer", "content": "Skills."}, *items]
    )
    prepared = prepare(tokenizer, body, [])
    chat = [{"role": "system", "content": "Agent.\n\nSkills.\n\nSandbox."}, *input_messages(items)[1:]]
    assert prepared.plan.prompt == plan_chat(tokenizer, chat).prompt
    assert prepared.history[0] == {"role": "system", "content": "Skills."}  # stored as sent


def test_stored_responses_outlive_a_restart_over_the_same_cache_dir(demo_dir, tmp_path):
    args = ["--model", str(demo_dir), "--model-name", MODEL, "--cache-dir", str(tmp_path / "cache")]
    first = ServerProcess(args, {}, tmp_path / "first.log").ready()
    try:
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="none", max_retries=0, timeout=60)
        kept = client.responses.create(model=MODEL, input="Remember me", max_output_tokens=4, temperature=0)
    finally:
        assert first.stop() == 0, first.log.read_text()
    second = ServerProcess(args, {}, tmp_path / "second.log").ready()
    try:
        client = openai.OpenAI(base_url=second.url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert client.responses.retrieve(kept.id).output_text == kept.output_text
        follow = client.responses.create(
            model=MODEL, previous_response_id=kept.id, input="And now?", max_output_tokens=2
        )
        # The conversation came back from the store, its prompt from the prefix cache's disk tier.
        assert follow.usage.input_tokens_details.cached_tokens >= kept.usage.input_tokens
    finally:
        assert second.stop() == 0, second.log.read_text()


def test_an_engine_failure_is_a_500_or_a_failed_response(demo_dir, monkeypatch):
    """In-process (ASGI transport): a forward that fails answers server_error, as a 500 or as the
    stream's `response.failed`, and the engine goes on serving."""
    model = hybridlm.load_model(demo_dir)
    with Engine(model.lm, model.tokenizer) as engine:
        failures = iter([RuntimeError("device lost")] * 2)
        real = engine.step._prefill

        def flaky(running):
            if (error := next(failures, None)) is not None:
                raise error
            return real(running)

        monkeypatch.setattr(engine.step, "_prefill", flaky)

        async def main():
            transport = httpx.ASGITransport(app=create_app(engine, MODEL))
            async with httpx.AsyncClient(transport=transport, base_url="http://hybridlm") as http:
                body = {"input": "x", "max_output_tokens": 2}
                r = await http.post("/v1/responses", json=body)
                assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
                streamed = await http.post("/v1/responses", json={**body, "stream": True})
                events = [
                    json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")
                ]
                assert [e["type"] for e in events] == [
                    "response.created",
                    "response.in_progress",
                    "response.failed",
                ]
                failed = events[-1]["response"]
                assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
                assert "device lost" in failed["error"]["message"]
                assert (await http.post("/v1/responses", json=body)).json()["status"] in (
                    "completed",
                    "incomplete",
                )

        asyncio.run(main())
