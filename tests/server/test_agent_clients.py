"""The real agent programs, headless, against a real `hybridlm serve` on the demo model: Codex CLI
(`codex exec`, Responses API), Claude Code (`claude -p`, Messages API), opencode (`opencode run`,
chat completions) and the OpenAI Agents SDK (Responses and chat completions models).

The npm programs are installed once into `$XDG_CACHE_HOME/hybridlm/agent-clients/npm/` (default
`~/.cache/...`), outside the repository, so a CI run on a fresh clone reuses them. Where one cannot be
installed or started here, its test skips saying why. The demo
model has random weights: Codex is given an output schema, and the Agents SDK a required tool call
whose result ends the run, so that constrained decoding makes the answer end and the call valid;
Claude Code and opencode ask for no such thing, so their replies end at the output cap they are
given.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Literal

import agents
import pytest
from openai import AsyncOpenAI

from tests.server.conftest import API_KEY, MODEL, ServerProcess

CLIENTS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridlm" / "agent-clients"
NPM = CLIENTS / "npm"  # beside opencode's cache (below), which must not sit inside an npm project
PACKAGES = {"@openai/codex": "0.171.0", "@anthropic-ai/claude-code": "2.1.332", "opencode-ai": "1.18.33"}
BINARIES = {"codex": "@openai/codex", "claude": "@anthropic-ai/claude-code", "opencode": "opencode-ai"}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 8}},
    "required": ["answer"],
    "additionalProperties": False,
}


def _installed(package: str) -> str | None:
    manifest = NPM / "node_modules" / package / "package.json"
    return json.loads(manifest.read_text())["version"] if manifest.exists() else None


@pytest.fixture(scope="session")
def npm_clients() -> Path:
    """The `.bin` folder holding `codex`, `claude` and `opencode`, installed at the pinned versions."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not on PATH: Codex CLI and Claude Code are npm packages")
    if any(_installed(p) != v for p, v in PACKAGES.items()):
        specs = [f"{p}@{v}" for p, v in PACKAGES.items()]
        done = subprocess.run(
            [npm, "install", "--prefix", str(NPM), "--no-audit", "--no-fund", *specs],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if done.returncode != 0:
            pytest.skip(f"npm install {' '.join(specs)} failed here: {done.stderr[-1500:]}")
    return NPM / "node_modules" / ".bin"


def program(npm_clients: Path, name: str) -> str:
    """The program's path, once it has said its version (else the test skips with its words)."""
    path = npm_clients / name
    try:
        done = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        pytest.skip(f"{BINARIES[name]} cannot start here: {e}")
    if done.returncode != 0:
        pytest.skip(f"{BINARIES[name]} cannot start here: {(done.stderr or done.stdout)[-1500:]}")
    return str(path)


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    """Its own server: the prefix cache holds only these programs' prompts (tens of thousands of
    tokens each: Claude Code's system prompt and tools)."""
    process = ServerProcess(
        ["--model", str(demo_dir), "--model-name", MODEL, "--api-key", API_KEY, "--context-length", "65536"],
        {},
        tmp_path_factory.mktemp("agent-clients") / "server.log",
    ).ready()
    yield process
    assert process.stop() == 0, process.log.read_text()


def statuses(server: ServerProcess, endpoint: str) -> dict[int, float]:
    """HTTP responses the server counted on `endpoint`, by status."""
    prefix = f'hybridlm_http_requests_total{{endpoint="{endpoint}",status="'
    return {
        int(k[len(prefix) : -2]): v
        for k, v in server.metrics({"Authorization": f"Bearer {API_KEY}"}).items()
        if k.startswith(prefix)
    }


def last_json(text: str, kind: str) -> dict:
    """The last JSON line of `text` whose `type` is `kind`."""
    for line in reversed(text.splitlines()):
        if line.startswith("{") and (event := json.loads(line)).get("type") == kind:
            return event
    raise AssertionError(f"no {kind} line in:\n{text[-3000:]}")


def test_codex_exec_completes_and_its_second_run_reads_the_cache(npm_clients, server, tmp_path):
    codex = program(npm_clients, "codex")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\n'
        'model_provider = "hybridlm"\n'
        "[model_providers.hybridlm]\n"
        'name = "hybridlm"\n'
        f'base_url = "{server.url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "HYBRIDLM_TEST_KEY"\n'
    )
    (work / "schema.json").write_text(json.dumps(ANSWER))
    env = {**os.environ, "CODEX_HOME": str(home), "HYBRIDLM_TEST_KEY": API_KEY}
    command = [codex, "exec", "--skip-git-repo-check", "-s", "read-only", "--json"]
    command += ["--output-schema", "schema.json", "Say hi."]
    usages = []
    for _ in range(2):
        done = subprocess.run(
            command, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        message = last_json(done.stdout, "item.completed")["item"]
        assert message["type"] == "agent_message" and set(json.loads(message["text"])) == {"answer"}
        usages.append(last_json(done.stdout, "turn.completed")["usage"])
    seen = statuses(server, "/v1/responses")
    assert seen.get(200, 0) >= 2 and set(seen) == {200}, seen
    # The second run's prompt (instructions, tools, environment: the same) is read from the cache.
    assert usages[1]["cached_input_tokens"] >= 0.9 * usages[1]["input_tokens"], usages


def test_claude_code_print_mode_reads_its_prompt_from_the_cache(npm_clients, server, tmp_path):
    claude = program(npm_clients, "claude")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {
        **os.environ,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": server.url,
        "ANTHROPIC_API_KEY": API_KEY,
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # The random model never ends a reply by itself: a small cap keeps each one short.
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "32",
    }
    command = [claude, "-p", "Say hi.", "--model", MODEL, "--max-turns", "1", "--output-format", "json"]
    results = []
    for _ in range(2):
        done = subprocess.run(
            command, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300
        )
        result = last_json(done.stdout, "result")
        # A reply cut at the cap is the only failure a random model may cause.
        assert not result["is_error"] or result.get("api_error") == "max_output_tokens", result
        results.append(result["usage"])
    seen = statuses(server, "/v1/messages")
    assert seen.get(200, 0) >= 2 and set(seen) == {200}, seen
    # Its billing header (first system block) is kept out of the prompt, so a new session's requests
    # are read from the cache.
    second = results[1]
    assert second["cache_read_input_tokens"] >= 0.9 * (
        second["input_tokens"] + second["cache_read_input_tokens"]
    )


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_agents_sdk_agent_calls_its_required_tool_and_finishes(server, api):
    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    if api == "responses":
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    else:
        model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["oslo", "rome"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return "sunny"

    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        model=model,
        tools=[get_weather],
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=64, temperature=0),
        # The tool's answer is the agent's: a random model's own reply would run to the token cap.
        tool_use_behavior="stop_on_first_tool",
    )
    result = agents.Runner.run_sync(agent, "Weather in Oslo?", max_turns=2)
    assert asked and set(asked) <= {"oslo", "rome"}
    assert result.final_output == "sunny"


def test_opencode_run_answers_through_chat_completions(npm_clients, server, tmp_path):
    opencode = program(npm_clients, "opencode")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "hybridlm",
        "options": {"baseURL": server.url + "/v1", "apiKey": API_KEY},
        # The random model never ends a reply by itself: a small cap keeps it short.
        "models": {MODEL: {"name": MODEL, "limit": {"context": 65536, "output": 32}}},
    }
    config = {"provider": {"hybridlm": provider}, "model": f"hybridlm/{MODEL}"}
    (work / "opencode.json").write_text(json.dumps(config))
    env = {
        **os.environ,
        "HOME": str(home),
        "OPENCODE_CONFIG": str(work / "opencode.json"),
        # opencode installs the provider package from npm on first use: kept with the programs.
        "XDG_CACHE_HOME": str(CLIENTS / "cache"),
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
    }
    done = subprocess.run(
        [opencode, "run", "Say hi.", "-m", f"hybridlm/{MODEL}", "--print-logs"],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip(), done.stdout[-3000:] + done.stderr[-3000:]
    seen = statuses(server, "/v1/chat/completions")
    assert seen.get(200, 0) >= 1 and set(seen) == {200}, seen
