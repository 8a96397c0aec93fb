"""``verispec serve`` for the serving benchmark: the server in a subprocess (started on a free
port, its ``/metrics`` and RSS read, stopped), and a streaming completions client that notes when
each chunk arrived and how many tokens it carried."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT_S = 1200  # an 8B target's load and CUDA-graph capture fit well within it


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


def mean_acceptance_length(before: dict[str, float], after: dict[str, float]) -> float | None:
    """1 + accepted / drafts between two ``read_metrics`` (None: nothing was drafted)."""
    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = grew("vllm:spec_decode_num_drafts_total")
    return 1 + grew("vllm:spec_decode_num_accepted_tokens_total") / drafts if drafts else None


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
    """``verispec serve <flags>`` on a free local port, its output in ``log_path``; ready (its
    ``/health`` answers) when the constructor returns."""

    def __init__(self, flags: list[str], log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "verispec.cli", "serve", "--port", str(self.port),
                   *flags]
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                self.log.close()
                raise RuntimeError(f"verispec serve exited ({self.process.returncode}); see "
                                   f"{log_path}")
            try:
                if httpx.get(self.url + "/health", trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"verispec serve did not start in {START_TIMEOUT_S} s; see "
                                   f"{log_path}")
            time.sleep(0.5)
        served = httpx.get(self.url + "/v1/models", trust_env=False).json()["data"][0]
        self.model: str = served["id"]
        self.max_model_len: int = served["max_model_len"]

    @property
    def rss_mb(self) -> float:
        return rss_mb(self.process.pid)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@dataclass
class Result:
    """One request as the client saw it (perf_counter seconds)."""

    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0  # usage.completion_tokens
    start: float = 0.0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks with tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of them


async def send(http: httpx.AsyncClient, url: str, body: dict) -> Result:
    """One streaming completion; records when each chunk with tokens arrived and how many."""
    result = Result(prompt_tokens=len(body["prompt"]))
    result.start = time.perf_counter()
    finish_reason = None
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    num_tokens = len((choice.get("logprobs") or {}).get("tokens") or ())
                    if num_tokens:
                        if result.ttft_s is None:
                            result.ttft_s = now - result.start
                        result.chunk_times.append(now)
                        result.chunk_tokens.append(num_tokens)
                    finish_reason = choice["finish_reason"] or finish_reason
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - result.start
    result.ok = finish_reason in ("stop", "length") and result.ttft_s is not None
    if not result.ok:
        result.error = f"stream ended without tokens or a finish_reason ({finish_reason!r})"
    elif sum(result.chunk_tokens) != result.output_tokens:
        result.ok = False
        result.error = (f"chunks carried {sum(result.chunk_tokens)} tokens, usage says "
                        f"{result.output_tokens}")
    return result


async def run_pass(base_url: str, bodies: list[dict],
                   offsets: list[float]) -> tuple[list[Result], list[float]]:
    """Send ``bodies[i]`` at ``offsets[i]`` seconds after the start: every result, and how late
    the client's event loop woke a 5 ms timer meanwhile (seconds; a busy client delays the
    chunks it reads, and every time it measures)."""
    url = base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    lags: list[float] = []

    async def watch_lag() -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - before - 0.005)

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits,
                                 trust_env=False) as http:
        start = time.perf_counter()

        async def one(body: dict, offset: float) -> Result:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await send(http, url, body)

        watcher = asyncio.ensure_future(watch_lag())
        results = list(await asyncio.gather(*[one(b, o) for b, o in zip(bodies, offsets)]))
        watcher.cancel()
        return results, lags
