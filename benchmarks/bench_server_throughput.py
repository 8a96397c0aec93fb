"""Server throughput against the offline engine on the same requests, and /health under the load.

Starts ``verispec serve`` in a subprocess on a free port, warms it up, then sends
``--num-prompts`` completions from ``--concurrency`` clients at once: prompts of random token ids
with lengths drawn uniformly from [``--min-prompt-tokens``, ``--max-prompt-tokens``], each asking
for exactly ``--output-tokens`` tokens (``ignore_eos``), streamed (``--no-stream``: one JSON
answer each). Meanwhile a separate process polls ``GET /health`` every 10 ms over one keep-alive
connection (a process of its own, so the clients' own work does not delay its measurements).
Then the server is stopped and ``LLM.generate`` runs the same prompts with the same sampling
parameters and engine arguments in this process (after the same warm-up).

Reported: output tokens/s through the server (tokens from the usage each response reports, over
the time from the first request sent to the last response read) and offline, their ratio,
/health latency p50 / p99 / max during the load, and the CPU time each process used meanwhile
(the server's API process, its engine process if it has one, the clients; offline: this
process). A third row feeds the engine as the clients do, at most ``--concurrency`` requests in
flight: what the arrival pattern alone costs, without the server. Where the CPU time is
concerned: on a machine with fewer free cores than busy processes the ratio measures their sum,
where a GPU host's cores let them run side by side. The goal the server is built for: ratio >= 0.9
and /health p99 <= 50 ms with 128 clients. Prints a table, then one JSON line.

``--engine-cpus`` pins the engine (and the offline run) to those CPUs and everything else to the
rest: on a small machine this shows what a GPU host's spare cores give, the engine's work done
beside the HTTP side's instead of taking turns with it (set ``OMP_NUM_THREADS`` to the number of
engine CPUs).

``--tiny-random`` serves a random Llama (``--hidden-size``, ``--num-layers``) with the bundled
model's tokenizer instead of ``--model``: its steps take milliseconds, so the server's own work
per token weighs as much as it does beside a large model on a GPU.

    python benchmarks/bench_server_throughput.py --tiny-random --no-batch-invariant \
        --num-prompts 256 --concurrency 128 --min-prompt-tokens 16 --max-prompt-tokens 64 \
        --output-tokens 64 --max-num-seqs 128
    python benchmarks/bench_server_throughput.py --device cuda --model DIR --num-prompts 256 \
        --concurrency 128 --min-prompt-tokens 64 --max-prompt-tokens 512 --output-tokens 128 \
        --max-num-seqs 256
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tiny_model(path: str, hidden_size: int, num_layers: int, max_len: int) -> str:
    """A random Llama with the bundled model's tokenizer and chat template, saved to ``path``."""
    import torch
    import transformers

    from verispec.models.loader import resolve_model_path

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=hidden_size, intermediate_size=hidden_size * 3 // 2,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_len, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer_dir = resolve_model_path(None)
    for name in os.listdir(tokenizer_dir):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    return path


def make_requests(args) -> list[tuple[list[int], dict]]:
    """(prompt token ids, sampling fields) per request; ids avoid the special tokens."""
    rng = random.Random(args.seed)
    requests = []
    for i in range(args.num_prompts):
        length = rng.randint(args.min_prompt_tokens, args.max_prompt_tokens)
        ids = [rng.randrange(1000, 48000) for _ in range(length)]
        requests.append((ids, dict(temperature=args.temperature, seed=args.seed + i,
                                   max_tokens=args.output_tokens, ignore_eos=True)))
    return requests


# ----------------------------------------------------------------------------- the server


def engine_flags(args) -> list[str]:
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
             "--device", args.device, "--speculative-method", "none"]
    if args.model:
        flags += ["--model", args.model]
    if args.dtype:
        flags += ["--dtype", args.dtype]
    if not args.batch_invariant:
        flags.append("--no-batch-invariant")
    return flags


def start_server(args, port: int, log_path: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "verispec.cli", "serve", "--port", str(port),
               *engine_flags(args)]
    log = open(log_path, "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {open(log_path).read()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return server
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not start")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_processes(pid: int) -> dict[str, int]:
    """The server's processes: ``api`` (``pid``) and ``engine`` (its spawned child, if it has
    one; not multiprocessing's resource tracker)."""
    processes = {"api": pid}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    command = f.read()
            except OSError:
                continue
            if parent == pid and b"spawn_main" in command:
                processes["engine"] = int(entry)
    return processes


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` onto ``cpus``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def poll_health(port: int, ready, stop, results) -> None:
    """In a process of its own: GET /health every 10 ms until ``stop`` is set (``ready`` once
    polling); the latencies (seconds) and the non-200 count go to ``results``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    latencies, failures = [], 0
    ready.set()
    while not stop.is_set():
        start = time.perf_counter()
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        latencies.append(time.perf_counter() - start)
        failures += response.status != 200
        time.sleep(0.01)
    results.put((latencies, failures))


async def one_request(port: int, ids: list[int], fields: dict, stream: bool) -> int:
    """Send one completion; the output tokens its usage reports."""
    body = dict(prompt=ids, **fields)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(payload)).encode()
                 + b"\r\nConnection: close\r\n\r\n" + payload)
    await writer.drain()
    data = await reader.read()  # the server closes the connection after the response
    writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"request failed: {head[:200]!r} {rest[:300]!r}")
    if not stream:
        return json.loads(rest)["usage"]["completion_tokens"]
    usage = [json.loads(line[6:]) for line in rest.split(b"\n")
             if line.startswith(b"data: {") and b'"usage": {' in line]
    return usage[-1]["usage"]["completion_tokens"]


async def drive(port: int, requests: list, concurrency: int, stream: bool) -> tuple[float, int]:
    """(seconds, output tokens) for all ``requests`` with ``concurrency`` in flight."""
    pending = list(reversed(requests))
    total = 0

    async def client() -> None:
        nonlocal total
        while pending:
            ids, fields = pending.pop()
            tokens = await one_request(port, ids, fields, stream)
            total += tokens  # (not ``total += await``: it would read total before waiting)

    start = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(concurrency)])
    return time.perf_counter() - start, total


def run_server_load(args, requests: list, warm_up: list) -> dict:
    port = free_port()
    log_path = os.path.join(tempfile.mkdtemp(prefix="verispec-throughput-"), "server.log")
    server = start_server(args, port, log_path)
    ctx = multiprocessing.get_context("spawn")
    if args.engine_cpus:
        # The engine gets its cores; everything else (the API process where the engine runs
        # in a process of its own, the clients, the /health poller) the others.
        processes = server_processes(server.pid)
        pin(processes.get("engine", server.pid), args.engine_cpus)
        if "engine" in processes:
            pin(server.pid, args.other_cpus)
        os.sched_setaffinity(0, args.other_cpus)
    try:
        asyncio.run(drive(port, warm_up, args.concurrency, args.stream))
        ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
        poller = ctx.Process(target=poll_health, args=(port, ready, stop, results))
        poller.start()
        ready.wait(120)
        processes = server_processes(server.pid)
        cpu_before = {name: cpu_seconds(pid) for name, pid in processes.items()}
        clients_before = time.process_time()
        seconds, tokens = asyncio.run(drive(port, requests, args.concurrency, args.stream))
        cpu = {f"cpu_s_{name}": cpu_seconds(pid) - cpu_before[name]
               for name, pid in processes.items()}
        cpu["cpu_s_clients"] = time.process_time() - clients_before
        stop.set()
        latencies, failures = results.get(timeout=60)
        poller.join(30)
    finally:
        server.terminate()
        server.wait(60)
        if args.engine_cpus:
            os.sched_setaffinity(0, args.engine_cpus)  # the offline run's engine, alike
    latencies.sort()
    return {"server_s": seconds, "server_tokens": tokens, "server_tok_s": tokens / seconds, **cpu,
            "health_polls": len(latencies), "health_failures": failures,
            "health_p50_ms": 1e3 * statistics.median(latencies),
            "health_p99_ms": 1e3 * latencies[min(len(latencies) - 1,
                                                 int(0.99 * len(latencies)))],
            "health_max_ms": 1e3 * latencies[-1], "server_log": log_path}


def run_offline(args, requests: list, warm_up: list) -> dict:
    from verispec import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, device=args.device,
              batch_invariant=args.batch_invariant)

    def generate(batch):
        return llm.generate([ids for ids, _ in batch],
                            [SamplingParams(**fields) for _, fields in batch])

    generate(warm_up)
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = generate(requests)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    result = {"offline_s": seconds, "offline_tokens": tokens, "offline_tok_s": tokens / seconds,
              "cpu_s_offline": time.process_time() - cpu_start}
    # The clients' arrival pattern without the server: at most --concurrency requests in
    # flight, the next one added when one finishes. The prefix cache forgets the run above
    # (it holds every prompt now); it keeps the warm-up's, as the server's run did.
    llm.reset_prefix_cache()
    generate(warm_up)
    pending = list(requests)
    start = time.perf_counter()
    for _ in range(min(args.concurrency, len(pending))):
        ids, fields = pending.pop(0)
        llm.add_request(ids, SamplingParams(**fields))
    tokens = 0
    while llm.has_unfinished_requests:
        for done in llm.step():
            tokens += len(llm.get_output(done).token_ids)
            if pending:
                ids, fields = pending.pop(0)
                llm.add_request(ids, SamplingParams(**fields))
    seconds = time.perf_counter() - start
    result.update(closed_loop_s=seconds, closed_loop_tok_s=tokens / seconds)
    return result


def main() -> int:
    # Here, not at the top: the /health poller's process imports this file and needs no torch.
    from verispec.bench.report import machine_description, print_table

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--tiny-random", action="store_true",
                        help="serve a random Llama with the bundled tokenizer instead")
    parser.add_argument("--hidden-size", type=int, default=64, help="of --tiny-random")
    parser.add_argument("--num-layers", type=int, default=2, help="of --tiny-random")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                        help="torch's own matmuls (faster steps), in the server and offline")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--min-prompt-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-stream", dest="stream", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-cpus", default=None,
                        help="comma-separated CPUs for the engine (the server's engine process, "
                        "or its API process where the engine runs inside it; the offline run); "
                        "the clients and the rest of the server get the others")
    args = parser.parse_args()
    if args.engine_cpus:
        args.engine_cpus = {int(c) for c in args.engine_cpus.split(",")}
        args.other_cpus = os.sched_getaffinity(0) - args.engine_cpus
        if not args.other_cpus:
            raise SystemExit(f"--engine-cpus {sorted(args.engine_cpus)} leaves no CPU for the "
                             "clients and the API process")
    if args.tiny_random:
        if args.model:
            raise SystemExit("--tiny-random and --model exclude each other")
        args.model = write_tiny_model(tempfile.mkdtemp(prefix="verispec-tiny-"),
                                      args.hidden_size, args.num_layers, args.max_model_len)
        args.dtype = args.dtype or "float32"

    requests = make_requests(args)
    warm_up = [(ids, dict(fields, max_tokens=4, seed=None))
               for ids, fields in requests[: args.concurrency]]
    result = run_server_load(args, requests, warm_up)
    result.update(run_offline(args, requests, warm_up))
    result["ratio"] = result["server_tok_s"] / result["offline_tok_s"]
    print(f"{machine_description()}; model {args.model or 'bundled'}; {args.num_prompts} requests,"
          f" {args.concurrency} clients, prompts {args.min_prompt_tokens}-"
          f"{args.max_prompt_tokens} tokens, {args.output_tokens} output tokens, max_num_seqs "
          f"{args.max_num_seqs}, {'streamed' if args.stream else 'not streamed'}"
          f"{'' if args.batch_invariant else ', --no-batch-invariant'}")
    print_table([
        {"run": "verispec serve", "tokens": result["server_tokens"],
         "seconds": round(result["server_s"], 2), "tok/s": round(result["server_tok_s"], 1),
         "CPU s": " + ".join(f"{result[k]:.1f} {k[6:]}" for k in (
             "cpu_s_api", "cpu_s_engine", "cpu_s_clients") if k in result)},
        {"run": "LLM.generate", "tokens": result["offline_tokens"],
         "seconds": round(result["offline_s"], 2), "tok/s": round(result["offline_tok_s"], 1),
         "CPU s": f"{result['cpu_s_offline']:.1f}"},
        {"run": f"LLM, {args.concurrency} in flight", "tokens": result["offline_tokens"],
         "seconds": round(result["closed_loop_s"], 2),
         "tok/s": round(result["closed_loop_tok_s"], 1), "CPU s": "-"},
    ])
    result["ratio_same_concurrency"] = result["server_tok_s"] / result["closed_loop_tok_s"]
    print(f"server / offline: {result['ratio']:.2f}x (/ offline at {args.concurrency} in flight: "
          f"{result['ratio_same_concurrency']:.2f}x); /health during the load: p50 "
          f"{result['health_p50_ms']:.1f} ms, p99 {result['health_p99_ms']:.1f} ms, max "
          f"{result['health_max_ms']:.1f} ms ({result['health_polls']} polls, "
          f"{result['health_failures']} not 200)")
    result.update({k: getattr(args, k) for k in (
        "num_prompts", "concurrency", "min_prompt_tokens", "max_prompt_tokens", "output_tokens",
        "max_num_seqs", "stream", "device", "batch_invariant")},
                  engine_cpus=sorted(args.engine_cpus) if args.engine_cpus else None)
    print(json.dumps({"bench_server_throughput": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
