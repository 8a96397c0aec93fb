"""Serving benchmark (the shape of vLLM's): N concurrent streaming clients against ``verispec
serve``, with and without speculation, in one run.

For each configuration (``--configs``: ``none`` = no speculation, ``ngram``, or a vLLM
speculative_config JSON) the script starts ``verispec serve`` in a subprocess on a free port
(the bundled SmolLM2-135M-Instruct unless ``--model``), warms it up with one full batch of the
longest prompts, reads the server's RSS, then sends ``--num-prompts`` streaming chat (or
completion) requests at once (``--max-concurrency`` caps how many are in flight), each with
random sampling parameters: greedy or temperature 0.5-1.0, top-p, top-k, min-p, a seed, and
max_tokens in [max_tokens / 2, max_tokens]. Prompts cycle through the built-in ``grounded`` and
``free`` sets. It then reads the RSS again and ``/metrics`` (KV slots in use, requests running
and waiting, speculative counters) and stops the server.

Per configuration: completed requests and errors, request throughput, output tokens/s (tokens
from the usage each stream reports), time to first token and inter-token latency (the gap
between two streamed chunks; a speculative step may deliver several tokens in one chunk) p50 and
p99, the server's RSS before and after, the KV slots in use at the end and the mean acceptance
length. Prints a table, then one JSON line.

    python benchmarks/bench_serving.py --num-prompts 200 --max-tokens 32
    python benchmarks/bench_serving.py --configs none --num-prompts 20 --max-num-seqs 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from verispec.bench.prompts import FREE_PROMPTS, GROUNDED_PROMPTS
from verispec.bench.report import machine_description, print_table

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@dataclass
class Result:
    """One request as the client saw it."""

    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    finish_reason: str | None = None


def random_request(rng: random.Random, prompt: str, max_tokens: int, endpoint: str,
                   model: str) -> dict:
    body = {
        "model": model,
        "temperature": 0.0 if rng.random() < 0.3 else round(rng.uniform(0.5, 1.0), 3),
        "top_p": rng.choice([1.0, 0.95, 0.9]),
        "top_k": rng.choice([0, 20, 50]),
        "min_p": rng.choice([0.0, 0.05]),
        "seed": rng.randrange(2**31),
        "max_tokens": rng.randint(max(1, max_tokens // 2), max_tokens),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def send(http: httpx.AsyncClient, url: str, body: dict, chat: bool) -> Result:
    """One streaming request; the result records when each chunk with text arrived."""
    result = Result()
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    text = choice["delta"].get("content") if chat else choice["text"]
                    now = time.perf_counter()
                    if text:
                        if result.ttft_s is None:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last)
                        last = now
                    result.finish_reason = choice["finish_reason"] or result.finish_reason
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.ok = result.finish_reason in ("stop", "length")
    if not result.ok:
        result.error = f"stream ended without a finish_reason ({result.finish_reason!r})"
    return result


async def run_clients(base_url: str, bodies: list[dict], chat: bool,
                      max_concurrency: int | None) -> tuple[list[Result], float]:
    url = base_url + ("/v1/chat/completions" if chat else "/v1/completions")
    limit = asyncio.Semaphore(max_concurrency or len(bodies))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits,
                                 trust_env=False) as http:

        async def one(body: dict) -> Result:
            async with limit:
                return await send(http, url, body, chat)

        start = time.perf_counter()
        results = await asyncio.gather(*[one(b) for b in bodies])
        return list(results), time.perf_counter() - start


def read_metrics(base_url: str) -> dict[str, float]:
    """``/metrics`` as sample name (labels but model_name appended) -> value."""
    text = httpx.get(base_url + "/metrics", trust_env=False).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``verispec serve`` in a subprocess, its log in ``log_path``."""

    def __init__(self, args: argparse.Namespace, spec: str, log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "verispec.cli", "serve", "--port", str(self.port),
                   "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)]
        if args.model:
            command += ["--model", args.model]
        if spec == "none":
            command += ["--speculative-method", "none"]
        else:
            command += ["--speculative-config", json.dumps(NGRAM if spec == "ngram" else
                                                           json.loads(spec))]
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"verispec serve exited ({self.process.returncode}); see "
                                   f"{log_path}")
            try:
                if httpx.get(self.url + "/health", trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"verispec serve did not start in 600 s; see {log_path}")
            time.sleep(0.5)
        self.model = httpx.get(self.url + "/v1/models", trust_env=False).json()["data"][0]["id"]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def percentile_ms(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q) * 1000) if values else None


def bench_config(args: argparse.Namespace, spec: str, prompts: list[str]) -> dict:
    server = Server(args, spec, os.path.join(args.log_dir, f"bench_serving_{spec[:20]}.log"))
    chat = args.endpoint == "chat"
    try:
        # Warm-up: one full batch of the longest prompts (the largest prefill the run will see).
        longest = sorted(prompts, key=len)[-args.max_num_seqs:]
        warm = [random_request(random.Random(i), p, 8, args.endpoint, server.model)
                for i, p in enumerate(longest)]
        warm_results, _ = asyncio.run(run_clients(server.url, warm, chat, None))
        if not all(r.ok for r in warm_results):
            raise RuntimeError(f"warm-up failed: {[r.error for r in warm_results if r.error]}")
        rss_before = rss_mb(server.process.pid)
        before = read_metrics(server.url)
        rng = random.Random(args.seed)
        bodies = [random_request(rng, prompts[i % len(prompts)], args.max_tokens, args.endpoint,
                                 server.model) for i in range(args.num_prompts)]
        results, duration = asyncio.run(run_clients(server.url, bodies, chat,
                                                    args.max_concurrency))
        time.sleep(0.5)  # the engine thread updates its gauges after the last step
        after = read_metrics(server.url)
        rss_after = rss_mb(server.process.pid)
    finally:
        server.stop()
    done = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    itl = [x for r in done for x in r.itl_s]
    output_tokens = sum(r.output_tokens for r in done)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = grew("vllm:spec_decode_num_drafts_total")
    errors = [r.error for r in results if not r.ok]
    return {
        "config": spec,
        "requests": len(results),
        "completed": len(done),
        "errors": len(errors),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "output_tokens": output_tokens,
        "ttft_p50_ms": percentile_ms(ttft, 50),
        "ttft_p99_ms": percentile_ms(ttft, 99),
        "itl_p50_ms": percentile_ms(itl, 50),
        "itl_p99_ms": percentile_ms(itl, 99),
        "e2e_p50_s": float(np.percentile([r.e2e_s for r in done], 50)) if done else None,
        "rss_before_mb": rss_before,
        "rss_after_mb": rss_after,
        "rss_change_pct": 100 * (rss_after - rss_before) / rss_before,
        "kv_slots_in_use_end": after["verispec:kv_slots_in_use"],
        "running_end": after["vllm:num_requests_running"],
        "waiting_end": after["vllm:num_requests_waiting"],
        "server_generation_tokens": grew("vllm:generation_tokens_total"),
        "mean_acceptance_length": (1 + grew("vllm:spec_decode_num_accepted_tokens_total")
                                   / drafts) if drafts else None,
        "first_errors": errors[:3],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="none,ngram",
                        help="comma-separated: none, ngram, or one speculative_config JSON "
                        "(default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at once (default: all of them)")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="each request asks for a random max_tokens in [N/2, N]")
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-num-seqs", type=int, default=16,
                        help="KV slots of the server (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="of the random request parameters")
    parser.add_argument("--log-dir", default=".", help="where the servers' logs go")
    args = parser.parse_args()
    for flag in ("num_prompts", "max_tokens", "max_num_seqs"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    configs = [args.configs] if args.configs.lstrip().startswith("{") else [
        c.strip() for c in args.configs.split(",")]
    for c in configs:
        if c not in ("none", "ngram") and not c.startswith("{"):
            parser.error(f"--configs entries are none, ngram or a JSON object, got {c!r}")
    prompts = list(GROUNDED_PROMPTS) + list(FREE_PROMPTS)
    rows = [bench_config(args, c, prompts) for c in configs]
    print(f"hardware: {machine_description()}")
    print(f"{args.num_prompts} streaming {args.endpoint} requests, max_tokens <= "
          f"{args.max_tokens}, concurrency {args.max_concurrency or args.num_prompts}, "
          f"{args.dtype}, max_num_seqs {args.max_num_seqs}")
    columns = ["config", "completed", "errors", "request_throughput", "output_tokens_per_s",
               "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "rss_before_mb",
               "rss_after_mb", "rss_change_pct", "kv_slots_in_use_end", "mean_acceptance_length"]
    print_table([{c: r[c] for c in columns} for r in rows])
    print(json.dumps({"bench_serving": {"hardware": machine_description(), "args": vars(args),
                                        "rows": rows}}))
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
