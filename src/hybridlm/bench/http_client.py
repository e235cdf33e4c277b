"""The streaming HTTP client of `hybridlm bench serve`, run as its own process.

A client in the server's process would parse every chunk while holding the server's GIL, which a
real client never does, so the benchmark runs this file (standard library only, no torch import)
with `python http_client.py PORT`: each line on stdin is one `/v1/completions` request body, each
line on stdout the timings of its streamed answer as JSON: `ttft_ms` (request sent → first text
received) and `decode_tok_s` ((completion tokens − 1) ÷ (first text → final usage chunk)).
"""

from __future__ import annotations

import http.client
import json
import sys
import time


def run(port: int, body: dict) -> dict[str, float]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    first = done = None
    tokens = 0
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        while line := response.readline():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter()
            if chunk.get("usage"):
                done = time.perf_counter()
                tokens = chunk["usage"]["completion_tokens"]
    finally:
        connection.close()
    if first is None or done is None or tokens < 2:
        raise RuntimeError("the stream carried no text or no usage")
    return {"ttft_ms": (first - start) * 1e3, "decode_tok_s": (tokens - 1) / (done - first)}


def main() -> None:
    port = int(sys.argv[1])
    for line in sys.stdin:
        print(json.dumps(run(port, json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
