"""Issue 11 point 10's measurement against a real `hybridlm serve --cache-ram 16M` (demo model):
/metrics polled back to back while twelve ~6.3k-token prompts run, four at once; prints the peak
RAM-tier bytes during requests and the share of polls over the budget.

    python benchmarks/cache_ram_during_requests.py float32|bf16 [PYTHONPATH of another checkout]
"""

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

dtype = sys.argv[1]
src = sys.argv[2] if len(sys.argv) > 2 else None
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDLM_LOG_LEVEL": "WARNING"}
if src:
    env["PYTHONPATH"] = src
proc = subprocess.Popen(
    [
        sys.executable,
        "-m",
        "hybridlm.cli",
        "serve",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--cache-ram",
        "16M",
        "--context-length",
        "8192",
        "--max-running",
        "4",
    ],
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
)
url = f"http://127.0.0.1:{port}"
while True:
    try:
        if httpx.get(url + "/health").status_code == 200:
            break
    except httpx.HTTPError:
        time.sleep(0.2)
budget = 16 << 20
samples, running, stop = [], [0], threading.Event()


def poll():
    with httpx.Client() as c:
        while not stop.is_set():
            text = c.get(url + "/metrics").text
            for line in text.splitlines():
                if line.startswith('hybridlm_prefix_cache_bytes{tier="ram"}'):
                    samples.append((float(line.split()[-1]), running[0]))


rng = random.Random(0)
words = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]
base = " ".join(rng.choice(words) for _ in range(1200))
prompts = [base + " " + " ".join(rng.choice(words) for _ in range(1200)) for _ in range(8)]


def one(p):
    running[0] += 1
    try:
        return httpx.post(
            url + "/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0}, timeout=600
        ).status_code
    finally:
        running[0] -= 1


t = threading.Thread(target=poll)
t.start()
t0 = time.time()
with ThreadPoolExecutor(4) as ex:
    codes = list(ex.map(one, prompts + prompts[:4]))
stop.set()
t.join()
proc.send_signal(signal.SIGTERM)
proc.wait(60)
during = [b for b, r in samples if r]
over = sum(b > budget for b in during)
print(
    f"{dtype}{' (other checkout)' if src else ''}: codes={set(codes)} polls={len(samples)} "
    f"during_requests={len(during)} peak={max(during) / 2**20:.2f} MiB over_budget={over} "
    f"({100 * over / max(len(during), 1):.1f}%) wall={time.time() - t0:.0f}s"
)
