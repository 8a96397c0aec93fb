"""The server under hostile and odd input (issue 48): fuzz corpus, disconnect storm, /health
while a 10 MB prompt is refused.

Starts ``verispec serve`` as a subprocess on 127.0.0.1 (the bundled model unless ``--model``) and
drives it with raw sockets:

1. fuzz: a corpus of hostile bodies (huge, deeply nested JSON, wrong content types, invalid
   Unicode, negative and enormous numbers, unknown fields, 10 MB prompts); every answer must be
   JSON with the expected status, then a normal request must work;
2. storm: ``--storm-requests`` requests from ``--storm-clients`` clients, streaming and not, each
   disconnecting at a random point (mid-body, before the first response byte, mid-response,
   after the last chunk); then every KV slot must be free, the server log must have no ERROR
   line and its RSS must be within 5 % of the RSS before the storm;
3. latency: a stream runs while 10 MB prompts are sent and refused; /health is polled
   throughout. Reported: /health p50 / p99 / max and the stream's worst inter-chunk gap over its
   median, beside the same stream with no huge prompt (the baseline, same run).

The server's pid is checked at the end (it never restarted). Prints a table, then one JSON line.

    PYTHONPATH=$PWD python benchmarks/bench_server_robustness.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "The cat sat on the mat. The cat sat on the"
TEN_MB = 10 * 1024 * 1024


# ----------------------------------------------------------------------------- raw HTTP


def http_request(method: str, path: str, body: bytes = b"", content_type: str | None =
                 "application/json", extra_headers: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n"
    head += f"Content-Length: {len(body)}\r\n{extra_headers}\r\n"
    return head.encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one HTTP/1.1 response (Content-Length or chunked)."""
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                await reader.readline()
                return status, headers, body
            body += await reader.readexactly(size)
            await reader.readline()
    return status, headers, await reader.readexactly(int(headers.get("content-length", 0)))


async def exchange(host: str, port: int, raw: bytes, timeout_s: float = 60.0
                   ) -> tuple[int, dict, bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(read_response(reader), timeout_s)
    finally:
        writer.close()


# ----------------------------------------------------------------------------- 1. fuzz corpus


def hostile_corpus(max_request_bytes: int, prompt_bytes: int = TEN_MB) -> list[tuple]:
    """(name, path, body, content type, expected status) of each hostile request."""
    completions, chat = "/v1/completions", "/v1/chat/completions"
    json_type = "application/json"

    def body(**fields) -> bytes:
        return json.dumps(fields).encode()

    deep = 100_000
    corpus = [
        ("lone surrogate", completions, b'{"prompt": "\\ud800 x", "max_tokens": 2}', json_type,
         400),
        ("surrogate in stop", completions,
         b'{"prompt": "hi", "stop": ["\\udc00"], "max_tokens": 2}', json_type, 400),
        ("surrogate in message", chat,
         b'{"messages": [{"role": "user", "content": "\\udfff"}]}', json_type, 400),
        ("invalid escape", completions, b'{"prompt": "\\x41"}', json_type, 400),
        ("invalid UTF-8", completions, b'{"prompt": "\xff\xfe"}', json_type, 400),
        ("nested arrays", completions, b"[" * deep + b"]" * deep, json_type, 400),
        ("nested in a field", completions,
         b'{"prompt": ' + b"[" * deep + b"]" * deep + b"}", json_type, 400),
        ("nested objects", completions, b'{"a":' * deep + b"1" + b"}" * deep, json_type, 400),
        ("text/plain", completions, body(prompt="hi", max_tokens=2), "text/plain", 400),
        ("no content type", completions, body(prompt="hi", max_tokens=2), None, 400),
        ("form", completions, b"prompt=hi&max_tokens=2", "application/x-www-form-urlencoded",
         400),
        ("not JSON", completions, b"{not json", json_type, 400),
        ("empty body", completions, b"", json_type, 400),
        ("null", completions, b"null", json_type, 400),
        ("a string", completions, b'"hello"', json_type, 400),
        ("a list", chat, b"[1, 2]", json_type, 400),
        ("negative max_tokens", completions, body(prompt="hi", max_tokens=-5), json_type, 400),
        ("enormous max_tokens", completions,
         b'{"prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}", json_type, 400),
        ("max_tokens 2**70", completions, body(prompt="hi", max_tokens=2 ** 70), json_type, 400),
        ("temperature 1e400", completions, b'{"prompt": "hi", "temperature": 1e400}', json_type,
         400),
        ("temperature NaN", completions, b'{"prompt": "hi", "temperature": NaN}', json_type,
         400),
        ("seed 10**23", completions, body(prompt="hi", seed=10 ** 23), json_type, 400),
        ("top_k 10**20", completions, body(prompt="hi", top_k=10 ** 20), json_type, 400),
        ("token id 10**23", completions, body(prompt=[10 ** 23]), json_type, 400),
        ("token id -1", completions, body(prompt=[-1]), json_type, 400),
        ("stop_token_ids 10**9", completions, body(prompt="hi", stop_token_ids=[10 ** 9]),
         json_type, 400),
        ("unknown field", completions, body(prompt="hi", mirostat=1), json_type, 400),
        ("role wizard", chat, body(messages=[{"role": "wizard", "content": "hi"}]), json_type,
         400),
        ("over max_request_bytes", completions,
         b'{"prompt": "' + b"a" * (max_request_bytes + 1) + b'"}', json_type, 413),
        ("10 MB prompt", completions,
         b'{"prompt": "' + b"word " * (prompt_bytes // 5) + b'", "max_tokens": 2}', json_type,
         400 if prompt_bytes + 100 <= max_request_bytes else 413),
        ("10 MB chat message", chat, json.dumps({"messages": [
            {"role": "user", "content": "word " * (prompt_bytes // 5)}]}).encode(), json_type,
         400 if prompt_bytes + 100 <= max_request_bytes else 413),
        ("unknown route", "/v1/embeddings", body(input="hi"), json_type, 404),
    ]
    return corpus


async def run_corpus(host: str, port: int, corpus: list[tuple]) -> list[dict]:
    """One row per hostile request: its status, whether the answer was JSON with an error."""
    rows = []
    for name, path, payload, content_type, expected in corpus:
        start = time.perf_counter()
        status, headers, answer = await exchange(host, port,
                                                 http_request("POST", path, payload, content_type))
        try:
            error = json.loads(answer)["error"]
            is_json = isinstance(error["message"], str) and "type" in error
        except (ValueError, KeyError, TypeError):
            is_json = False
        rows.append({"name": name, "status": status, "expected": expected, "json": is_json,
                     "ok": status == expected and is_json,
                     "seconds": time.perf_counter() - start})
    return rows


# ----------------------------------------------------------------------------- 2. storm

STREAM_MODES = ("mid_body", "before_first_byte", "mid_response", "after_last")


async def storm_request(host: str, port: int, rng: random.Random, stream: bool, mode: str,
                        max_tokens: int) -> str:
    """One request that disconnects at ``mode``; returns the mode (or 'refused')."""
    chat = rng.random() < 0.3
    fields = {"max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
              "temperature": 1.0}
    if chat:
        path, fields["messages"] = "/v1/chat/completions", [{"role": "user", "content": PROMPT}]
    else:
        path, fields["prompt"] = "/v1/completions", f"{PROMPT} {rng.randrange(1000)}"
    payload = http_request("POST", path, json.dumps(fields).encode())
    reader, writer = await asyncio.open_connection(host, port)
    try:
        if mode == "mid_body":
            writer.write(payload[: rng.randrange(10, len(payload) - 1)])
            await writer.drain()
            await asyncio.sleep(rng.random() * 0.02)
            return mode
        writer.write(payload)
        await writer.drain()
        if mode == "before_first_byte":
            await asyncio.sleep(rng.random() * 0.02)
        elif mode == "mid_response" and stream:  # after some bytes of the stream
            await asyncio.wait_for(reader.read(rng.randrange(1, 600)), 600)
            await asyncio.sleep(rng.random() * 0.05)
        elif mode == "mid_response":  # while it queues or generates, as a client timeout
            await asyncio.sleep(rng.random())
        else:  # after the last chunk: read it all
            status, _, _ = await asyncio.wait_for(read_response(reader), 600)
            if status != 200:
                return "refused"
        return mode
    finally:
        if rng.random() < 0.5:
            writer.transport.abort()  # a reset, not a close
        else:
            writer.close()


async def run_storm(host: str, port: int, num_requests: int, num_clients: int, seed: int,
                    max_tokens: int) -> dict[str, int]:
    """``num_requests`` requests from ``num_clients`` concurrent clients; counts per mode."""
    rng = random.Random(seed)
    plan = [(rng.random() < 0.5, rng.choice(STREAM_MODES), rng.randint(1, max_tokens))
            for _ in range(num_requests)]
    counts: dict[str, int] = {}
    next_index = 0

    async def client(client_seed: int) -> None:
        nonlocal next_index
        client_rng = random.Random(client_seed)
        while next_index < len(plan):
            stream, mode, tokens = plan[next_index]
            next_index += 1
            outcome = await storm_request(host, port, client_rng, stream, mode, tokens)
            key = f"{'stream' if stream else 'plain'}:{outcome}"
            counts[key] = counts.get(key, 0) + 1

    await asyncio.gather(*[client(seed * 1000 + i) for i in range(num_clients)])
    return counts


async def metrics(host: str, port: int) -> dict[str, float]:
    _, _, text = await exchange(host, port, http_request("GET", "/metrics", content_type=None))
    values = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0] if "finished_reason" not in name else name] = float(value)
    return values


async def wait_idle(host: str, port: int, timeout_s: float = 60.0) -> dict[str, float]:
    """The metrics once no request runs or waits and every KV slot is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = await metrics(host, port)
        if (m.get("verispec:kv_slots_in_use") == 0 and m.get("vllm:num_requests_running") == 0
                and m.get("vllm:num_requests_waiting") == 0):
            return m
        if time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.05)


# ----------------------------------------------------------------------------- 3. latency


async def latency_under_huge_prompts(host: str, port: int, prompt_bytes: int, num_huge: int,
                                     max_tokens: int) -> dict:
    """/health latencies and the stream's chunk gaps while ``num_huge`` huge prompts are sent."""
    health_s: list[float] = []
    chunk_times: list[float] = []
    huge_status: list[int] = []
    huge = http_request("POST", "/v1/completions", json.dumps(
        {"prompt": "word " * (prompt_bytes // 5), "max_tokens": 4}).encode())
    stream_body = http_request("POST", "/v1/completions", json.dumps(
        {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
         "temperature": 0.0}).encode())
    done = asyncio.Event()

    async def stream() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(stream_body)
        await writer.drain()
        while line := await reader.readline():
            if line.startswith(b"data: "):
                chunk_times.append(time.perf_counter())
                if line.startswith(b"data: [DONE]"):
                    break
        writer.close()
        done.set()

    async def poll_health() -> None:
        reader, writer = await asyncio.open_connection(host, port)  # one keep-alive connection
        while not done.is_set():
            start = time.perf_counter()
            writer.write(http_request("GET", "/health", content_type=None))
            await writer.drain()
            await read_response(reader)
            health_s.append(time.perf_counter() - start)
            await asyncio.sleep(0.01)
        writer.close()

    async def send_huge() -> None:
        while len(chunk_times) < 5:  # the stream runs first
            await asyncio.sleep(0.01)
        for _ in range(num_huge):
            status, _, _ = await exchange(host, port, huge)
            huge_status.append(status)

    await asyncio.gather(stream(), poll_health(), send_huge())
    gaps = [b - a for a, b in zip(chunk_times[1:], chunk_times[2:])]  # after the first token
    health_sorted = sorted(health_s)
    return {
        "huge_statuses": huge_status,
        "health_requests": len(health_s),
        "health_p50_ms": 1e3 * statistics.median(health_s),
        "health_p99_ms": 1e3 * health_sorted[min(len(health_sorted) - 1,
                                                 int(0.99 * len(health_sorted)))],
        "health_max_ms": 1e3 * health_sorted[-1],
        "stream_chunks": len(chunk_times),
        "gap_median_ms": 1e3 * statistics.median(gaps),
        "gap_max_ms": 1e3 * max(gaps),
        "gap_max_over_median": max(gaps) / statistics.median(gaps),
    }


# ----------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def start_server(args, port: int, log_path: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "verispec.cli", "serve", "--port", str(port),
               "--max-num-seqs", str(args.max_num_seqs)]
    if args.model:
        command += ["--model", args.model]
    log = open(log_path, "w")
    # The root logger's format (run_server's), which shows each line's level.
    env = dict(os.environ, VERISPEC_CONFIGURE_LOGGING="0")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {open(log_path).read()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the server did not start")


async def run_all(args, port: int, pid: int) -> dict:
    host = "127.0.0.1"
    normal = http_request("POST", "/v1/completions", json.dumps(
        {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0}).encode())
    status, _, _ = await exchange(host, port, normal)  # warm-up
    assert status == 200, status

    start = time.perf_counter()
    corpus = await run_corpus(host, port, hostile_corpus(args.max_request_bytes))
    fuzz_s = time.perf_counter() - start
    after_fuzz, _, _ = await exchange(host, port, normal)

    await run_storm(host, port, 50, 10, args.seed + 1, args.max_tokens)  # warm the allocator
    await wait_idle(host, port)
    rss_before = rss_bytes(pid)
    start = time.perf_counter()
    counts = await run_storm(host, port, args.storm_requests, args.storm_clients, args.seed,
                             args.max_tokens)
    storm_s = time.perf_counter() - start
    idle = await wait_idle(host, port)
    rss_after = rss_bytes(pid)
    after_storm, _, _ = await exchange(host, port, normal)

    baseline = await latency_under_huge_prompts(host, port, TEN_MB, 0, args.stream_tokens)
    latency = await latency_under_huge_prompts(host, port, TEN_MB, args.num_huge,
                                               args.stream_tokens)
    latency.update({f"baseline_{key}": baseline[key] for key in (
        "health_p99_ms", "gap_median_ms", "gap_max_ms", "gap_max_over_median")})
    return {"corpus": corpus, "fuzz_s": fuzz_s, "after_fuzz_status": after_fuzz,
            "storm_counts": counts, "storm_s": storm_s,
            "slots_in_use_after": idle.get("verispec:kv_slots_in_use"),
            "running_after": idle.get("vllm:num_requests_running"),
            "rss_before_mb": rss_before / 2 ** 20, "rss_after_mb": rss_after / 2 ** 20,
            "rss_change": rss_after / rss_before - 1, "after_storm_status": after_storm,
            **latency}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--storm-requests", type=int, default=1000)
    parser.add_argument("--storm-clients", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=8,
                        help="storm requests ask for 1..this many tokens")
    parser.add_argument("--num-huge", type=int, default=3, help="10 MB prompts sent")
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.max_request_bytes = 16 * 1024 * 1024  # the server's default

    port = free_port()
    log_path = os.path.join(tempfile.mkdtemp(prefix="verispec-robustness-"), "server.log")
    server = start_server(args, port, log_path)
    try:
        result = asyncio.run(run_all(args, port, server.pid))
        alive = server.poll() is None
    finally:
        server.terminate()
        server.wait(30)
    log = open(log_path).read().splitlines()
    errors = [line for line in log if line.startswith("ERROR") or "Traceback" in line]
    result.update(server_alive=alive, error_lines=len(errors), log_lines=len(log),
                  disconnect_info_lines=sum("disconnected" in line for line in log))

    print(f"server: verispec serve ({args.model or 'bundled model'}), max_num_seqs="
          f"{args.max_num_seqs}, {os.cpu_count()} CPU cores; log {log_path}")
    print(f"{'fuzz case':28s} {'status':>6s} {'expect':>6s} {'JSON':>5s} {'s':>6s}")
    for row in result["corpus"]:
        print(f"{row['name']:28s} {row['status']:6d} {row['expected']:6d} "
              f"{str(row['json']):>5s} {row['seconds']:6.2f}")
    print(f"storm: {args.storm_requests} requests, {args.storm_clients} clients in "
          f"{result['storm_s']:.1f} s: {result['storm_counts']}")
    print(f"  slots in use after {result['slots_in_use_after']:.0f}, ERROR lines "
          f"{result['error_lines']}, RSS {result['rss_before_mb']:.0f} -> "
          f"{result['rss_after_mb']:.0f} MB ({100 * result['rss_change']:+.1f} %)")
    print(f"10 MB prompts {result['huge_statuses']}: /health p50 {result['health_p50_ms']:.1f} "
          f"ms, p99 {result['health_p99_ms']:.1f} ms, max {result['health_max_ms']:.1f} ms "
          f"({result['health_requests']} polls); stream gap max/median "
          f"{result['gap_max_ms']:.0f}/{result['gap_median_ms']:.0f} ms = "
          f"{result['gap_max_over_median']:.2f}x")
    print(f"the same without huge prompts: /health p99 {result['baseline_health_p99_ms']:.1f} ms;"
          f" stream gap max/median {result['baseline_gap_max_ms']:.0f}/"
          f"{result['baseline_gap_median_ms']:.0f} ms = "
          f"{result['baseline_gap_max_over_median']:.2f}x")
    ok = (all(r["ok"] for r in result["corpus"]) and result["error_lines"] == 0
          and result["slots_in_use_after"] == 0 and abs(result["rss_change"]) <= 0.05
          and result["health_p99_ms"] <= 50 and result["gap_max_over_median"] <= 3
          and alive and result["after_fuzz_status"] == result["after_storm_status"] == 200)
    result["pass"] = ok
    print(json.dumps({"bench_server_robustness": result}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
