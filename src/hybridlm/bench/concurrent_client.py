"""The streaming HTTP clients of `hybridlm bench concurrency` and `bench serve`, run as their own process.

Standard library only (no torch import), so the clients never hold the server's GIL. Each line on
stdin is one round: `{"port": P, "bodies": [...], "late": [...]}` — every body of `bodies` is sent at
once on its own thread; each of `late` is sent once every stream of `bodies` has received its first
text (a long prompt arriving while the others decode). Each line on stdout is the round's result:
per stream `start`, `first` (first text), `done` (final usage chunk), `arrivals` (time of every chunk
carrying text), `tokens` and `cached` (prompt tokens the server restored), times in seconds on one
clock, and `wall` (first request sent → last stream done).
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time


def stream(port: int, body: dict, firsts: threading.Semaphore | None) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    out = {
        "start": time.perf_counter(),
        "first": None,
        "done": None,
        "arrivals": [],
        "tokens": 0,
        "cached": 0,
    }
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        while line := response.readline():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk["choices"] and chunk["choices"][0]["text"]:
                out["arrivals"].append(now)
                if out["first"] is None:
                    out["first"] = now
                    if firsts is not None:
                        firsts.release()
            if usage := chunk.get("usage"):
                out["done"] = now
                out["tokens"] = usage["completion_tokens"]
                out["cached"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    finally:
        connection.close()
    if out["first"] is None or out["done"] is None:
        raise RuntimeError("a stream carried no text or no usage")
    return out


def round_(spec: dict) -> dict:
    port, bodies, late = spec["port"], spec["bodies"], spec.get("late", [])
    firsts = threading.Semaphore(0)
    results: list[dict | Exception | None] = [None] * (len(bodies) + len(late))

    def worker(i: int, body: dict, signal: bool) -> None:
        try:
            results[i] = stream(port, body, firsts if signal else None)
        except Exception as e:  # reported, never hidden
            results[i] = e
            if signal:
                firsts.release()

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i, b, True)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    if late:
        for _ in bodies:
            firsts.acquire()
        for j, body in enumerate(late):
            threads.append(threading.Thread(target=worker, args=(len(bodies) + j, body, False)))
            threads[-1].start()
    for t in threads:
        t.join()
    errors = [str(r) for r in results if isinstance(r, Exception)]
    if errors:
        raise RuntimeError("; ".join(errors))
    return {"wall": time.perf_counter() - start, "streams": results}


def main() -> None:
    for line in sys.stdin:
        print(json.dumps(round_(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
