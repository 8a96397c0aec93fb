"""Serving benchmark in the shape of vLLM's ``benchmark_serving``: a seeded ShareGPT-shaped
workload sent to ``verispec serve`` with Poisson arrivals at several request rates, for several
speculative configurations side by side, in one run.

Workload. ``--num-prompts`` requests with prompt and output lengths drawn from log-normal
distributions of ShareGPT's shape (no dataset is downloaded): prompts median 250 tokens (sigma
1.0), outputs median 200 (sigma 0.8), both clipped to [4, 1024] as vLLM's ShareGPT sampler
filters them, outputs also to what ``max_model_len`` leaves; ``--scale`` multiplies medians and
bounds (small runs on CPU). Prompts are random token ids of the model's vocabulary sent to
``/v1/completions``, so a model without a tokenizer (a random-weight checkpoint) serves them;
``ignore_eos`` makes each output exactly as long as drawn; greedy unless ``--sampling random``
(per request a random temperature, top-p, top-k, min-p and seed). Seeded: every configuration
and every rate gets the same lengths and parameters; each rate's pass (and the warm-up) draws
its own token ids, the same for every configuration, so that no pass is served from the prefix
cache an earlier pass filled.

Arrivals. For each rate of ``--request-rates`` (requests/s; ``inf`` sends all at once) the
requests are sent at Poisson arrival times (exponential gaps of mean 1 / rate, seeded), each
rate a separate pass against the same server, after one warm-up of ``--num-warmup`` of the
longest prompts.

Configurations (``--configs``): ``none`` (plain decoding), ``ngram`` (k = 3), ``eagle3`` (a random
EAGLE-3 head for the target's shape, k = 3, synthetic acceptance with mean acceptance length 2.5),
or a vLLM ``speculative_config`` JSON object. Each runs on its own ``verispec serve`` subprocess.
The model is ``--model``, a random one (``--random-model 8b`` or ``tiny``, written under
``--workdir``), or the bundled SmolLM2-135M-Instruct.

Metrics per configuration and rate, as vLLM's serving table (times are the client's:
``perf_counter`` around a streaming request):

- completed requests; duration = first request sent -> last response finished;
- request throughput = completed / duration; output tokens/s = output tokens (each response's
  ``usage.completion_tokens``) / duration; total tokens/s = (prompt + output tokens) / duration;
- TTFT = request sent -> first streamed chunk that carries a token;
- TPOT, per request = (end-to-end latency - TTFT) / (output tokens - 1), over requests with more
  than one output token;
- ITL, per token: a streamed chunk that carries n tokens, arriving g seconds after the previous
  chunk, counts as n inter-token latencies of g / n each (with speculation one chunk carries a
  verify step's accepted tokens; counting per chunk would report a step's time as one token's,
  and ITL would no longer match output tokens/s). Tokens that arrive with the first chunk count
  in no ITL. A request's ITLs so sum to its decode time. The gaps between chunks themselves are
  in the JSON line (``chunk_gap_*``). Tokens per chunk come from the chunk's logprobs: every
  request asks for ``logprobs=0``, the one streamed field that lists each token, text or not
  (a model without a tokenizer streams no text), at the cost of one log-softmax row per output
  token on the server, the same for every configuration;
- means, medians and 99th percentiles (numpy, linear interpolation) in ms; the mean acceptance
  length from the server's ``/metrics``, and the server's RSS before the first pass and after
  the last;
- ``client_lag_*``: how late the client's event loop wakes a 5 ms timer during the pass. The
  client is one Python process; when it falls behind reading chunks (many streams on a fast
  GPU) every latency above grows with it, and this says so.

Prints one table per configuration, then one JSON line with everything. ``--plot FILE.png``
draws p50 and p99 TTFT and TPOT against request rate, one line per configuration
(matplotlib, ``pip install 'verispec[bench]'``).

    python benchmarks/bench_serving.py --device cuda --random-model 8b --configs none,ngram,eagle3 \
        --request-rates 1,4,16,64,inf --num-prompts 500 --plot docs/serving_latency.png
    python benchmarks/bench_serving.py --configs none,ngram --request-rates 1,inf --num-prompts 16 \
        --scale 0.1 --max-num-seqs 8                        # the bundled model on the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_checkpoints import (  # noqa: E402
    config_label,
    model_config,
    speculative_config,
    split_configs,
    target_checkpoint,
)
from serve_client import (  # noqa: E402
    Result,
    Server,
    mean_acceptance_length,
    read_metrics,
    run_pass,
)

from verispec.bench.report import machine_description, print_table  # noqa: E402

PROMPT_MEDIAN, PROMPT_SIGMA = 250, 1.0
OUTPUT_MEDIAN, OUTPUT_SIGMA = 200, 0.8
LENGTH_RANGE = (4, 1024)  # vLLM's ShareGPT filter: at least 4 tokens, prompts at most 1024


# ----------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    prompt_lens: list[int]
    output_lens: list[int]  # max_tokens of each request (ignore_eos: exactly this many)

    def prompts(self, vocab_size: int, seed: int, token_seed: int) -> list[list[int]]:
        """Random token ids of the prompt lengths. Each pass draws its own (``token_seed``), so
        that no pass finds its prompts in a prefix cache that an earlier pass filled."""
        rng = np.random.default_rng([seed, 2, token_seed])
        return [rng.integers(0, vocab_size, size=n).tolist() for n in self.prompt_lens]


def sharegpt_workload(num: int, seed: int, scale: float = 1.0,
                      max_model_len: int | None = None) -> Workload:
    """``num`` requests with log-normal prompt and output lengths of ShareGPT's shape.

    ``scale`` multiplies the medians and the clipping bounds; an output is cut so that prompt +
    output fits ``max_model_len``.
    """
    rng = np.random.default_rng(seed)
    lo, hi = (max(1, round(b * scale)) for b in LENGTH_RANGE)

    def lengths(median: float, sigma: float) -> np.ndarray:
        raw = rng.lognormal(math.log(median * scale), sigma, size=num)
        return np.clip(raw.round(), lo, hi).astype(int)

    prompt_lens, output_lens = lengths(PROMPT_MEDIAN, PROMPT_SIGMA), lengths(OUTPUT_MEDIAN,
                                                                             OUTPUT_SIGMA)
    if max_model_len is not None:
        prompt_lens = np.minimum(prompt_lens, max_model_len - 1)
        output_lens = np.maximum(1, np.minimum(output_lens, max_model_len - prompt_lens))
    return Workload(prompt_lens.tolist(), output_lens.tolist())


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson arrivals (exponential
    gaps of mean 1 / rate), the first at 0; all 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num
    gaps = np.random.default_rng([seed, 1]).exponential(1.0 / rate, size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def request_body(prompt: list[int], max_tokens: int, model: str, sampling: str,
                 rng: random.Random) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
    if sampling == "greedy":
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.0 if rng.random() < 0.3 else round(rng.uniform(0.5, 1.0), 3),
                    top_p=rng.choice([1.0, 0.95, 0.9]), top_k=rng.choice([0, 20, 50]),
                    min_p=rng.choice([0.0, 0.05]), seed=rng.randrange(2**31))
    return body


# ----------------------------------------------------------------- metrics


def _stats_ms(values: list[float], name: str) -> dict:
    """``{name}_mean_ms``, ``_p50_ms``, ``_p99_ms`` of seconds (None when there are none)."""
    arr = np.asarray(values, dtype=float) * 1000
    if not arr.size:
        return {f"{name}_mean_ms": None, f"{name}_p50_ms": None, f"{name}_p99_ms": None}
    return {f"{name}_mean_ms": float(arr.mean()), f"{name}_p50_ms": float(np.percentile(arr, 50)),
            f"{name}_p99_ms": float(np.percentile(arr, 99))}


def per_token_itls(result: Result) -> list[float]:
    """A chunk of n tokens arriving g after the previous chunk: n latencies of g / n."""
    itls = []
    for prev, now, n in zip(result.chunk_times, result.chunk_times[1:], result.chunk_tokens[1:]):
        itls += [(now - prev) / n] * n
    return itls


def serving_metrics(results: list[Result]) -> dict:
    """vLLM's serving metrics over one pass (see the module docstring)."""
    done = [r for r in results if r.ok]
    if done:
        duration = max(r.start + r.e2e_s for r in done) - min(r.start for r in results)
    else:  # nothing finished: no rates (and no NaN in the JSON line)
        duration = math.inf
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    gaps = [b - a for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    errors = [r.error for r in results if not r.ok]
    return {
        "completed": len(done),
        "failed": len(errors),
        "duration_s": duration if done else None,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        **_stats_ms([r.ttft_s for r in done], "ttft"),
        **_stats_ms(tpot, "tpot"),
        **_stats_ms([x for r in done for x in per_token_itls(r)], "itl"),
        **_stats_ms([r.e2e_s for r in done], "e2el"),
        **_stats_ms(gaps, "chunk_gap"),
        "mean_tokens_per_chunk": (sum(sum(r.chunk_tokens) for r in done)
                                  / max(1, sum(len(r.chunk_tokens) for r in done))),
        "first_errors": errors[:3],
    }


# ----------------------------------------------------------------- the run


def server_flags(args: argparse.Namespace, spec: dict | None) -> list[str]:
    flags = ["--device", args.device,
             "--speculative-config", json.dumps(spec or {"method": "none"})]
    for name in ("model", "dtype", "max_num_seqs", "max_model_len"):
        if getattr(args, name) is not None:
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return flags + shlex.split(args.server_args)


def bench_config(args: argparse.Namespace, name: str, rates: list[float]) -> dict:
    """Every rate's pass against one server of configuration ``name``."""
    spec = speculative_config(name, args.model, args.workdir, args.device)
    os.makedirs(args.log_dir, exist_ok=True)
    log_path = os.path.join(args.log_dir, f"bench_serving_{config_label(name)}.log")
    print(f"{config_label(name)}: starting verispec serve (log: {log_path})", flush=True)
    server = Server(server_flags(args, spec), log_path)
    try:
        vocab_size = model_config(args.model)["vocab_size"]
        workload = sharegpt_workload(args.num_prompts, args.seed, args.scale,
                                     server.max_model_len)

        def bodies(token_seed: int) -> list[dict]:
            rng = random.Random(args.seed)  # the same sampling parameters in every pass
            prompts = workload.prompts(vocab_size, args.seed, token_seed)
            return [request_body(p, n, server.model, args.sampling, rng)
                    for p, n in zip(prompts, workload.output_lens)]

        first = bodies(0)  # the warm-up: the longest prompts, with tokens of their own
        warm = [dict(first[i], max_tokens=min(32, first[i]["max_tokens"]))
                for i in np.argsort(workload.prompt_lens)[::-1][:args.num_warmup]]
        warm_results, _ = asyncio.run(run_pass(server.url, warm, [0.0] * len(warm)))
        if not all(r.ok for r in warm_results):
            raise RuntimeError(f"warm-up failed: {[r.error for r in warm_results if r.error]}")
        rss_before = server.rss_mb
        passes = []
        for index, rate in enumerate(rates):
            before = read_metrics(server.url)
            offsets = arrival_offsets(args.num_prompts, rate, args.seed)
            results, lags = asyncio.run(run_pass(server.url, bodies(index + 1), offsets))
            time.sleep(0.5)  # the engine thread updates its counters after the last step
            row = {"config": config_label(name), "request_rate": rate_label(rate),
                   **serving_metrics(results), **_stats_ms(lags, "client_lag"),
                   "mean_acceptance_length": mean_acceptance_length(
                       before, read_metrics(server.url))}
            print(f"{row['config']} at {rate} req/s: {row['completed']}/{args.num_prompts} in "
                  f"{row['duration_s']:.1f} s, {row['output_throughput']:.1f} output tok/s",
                  flush=True)
            passes.append(row)
        rss_after = server.rss_mb
    finally:
        server.stop()
    return {"config": config_label(name), "speculative_config": spec,
            "max_model_len": server.max_model_len,
            "num_prompt_tokens": sum(workload.prompt_lens),
            "num_output_tokens": sum(workload.output_lens), "rss_before_mb": rss_before,
            "rss_after_mb": rss_after, "passes": passes}


TABLE_COLUMNS = {  # JSON key -> table heading
    "request_rate": "req rate", "completed": "done", "request_throughput": "req/s",
    "output_throughput": "out tok/s", "total_token_throughput": "total tok/s",
    "ttft_mean_ms": "TTFT mean", "ttft_p50_ms": "TTFT p50", "ttft_p99_ms": "TTFT p99",
    "tpot_mean_ms": "TPOT mean", "tpot_p50_ms": "TPOT p50", "tpot_p99_ms": "TPOT p99",
    "itl_mean_ms": "ITL mean", "itl_p50_ms": "ITL p50", "itl_p99_ms": "ITL p99",
    "mean_acceptance_length": "accept len",
}


def print_tables(configs: list[dict], num_prompts: int) -> None:
    for config in configs:
        print(f"\n{config['config']} (latencies in ms; {num_prompts} requests per rate; "
              f"RSS {config['rss_before_mb']:.0f} -> {config['rss_after_mb']:.0f} MiB)")
        print_table([{heading: row[key] for key, heading in TABLE_COLUMNS.items()}
                     for row in config["passes"]])


def plot_latency(configs: list[dict], rates: list[float], path: str) -> None:
    """p50 (solid) and p99 (dashed) TTFT and TPOT against request rate, one colour per
    configuration; rates are evenly spaced categories (``inf`` last)."""
    from matplotlib.figure import Figure  # optional: only --plot needs it

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    x = list(range(len(rates)))
    for i, config in enumerate(configs):
        colour = f"C{i}"
        for ax, metric in zip(axes, ("ttft", "tpot")):
            for q, style in (("p50", "-"), ("p99", "--")):
                y = [row[f"{metric}_{q}_ms"] for row in config["passes"]]
                y = [math.nan if v is None else v for v in y]
                ax.plot(x, y, style, marker="o", color=colour, label=f"{config['config']} {q}")
    axes[0].set_yscale("log")  # TTFT grows by orders of magnitude once requests queue
    axes[1].set_ylim(bottom=0)
    for ax, title in zip(axes, ("time to first token", "time per output token")):
        ax.set(xlabel="request rate (req/s)", ylabel="ms", title=title)
        ax.set_xticks(x, [rate_text(r) for r in rates])
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)


def rate_label(rate: float) -> float | str:
    """A rate as JSON holds it: ``"inf"`` for all at once (JSON has no infinity)."""
    return "inf" if math.isinf(rate) else rate


def rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--request-rates must be positive numbers or inf, got {text!r}")
    return rates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="none,ngram,eagle3",
                        help="comma-separated: none, ngram, eagle3, or one speculative_config "
                        "JSON (default: %(default)s)")
    parser.add_argument("--request-rates", default="1,4,16,64,inf",
                        help="requests/s, comma-separated; inf = all at once "
                        "(default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests per rate")
    parser.add_argument("--num-warmup", type=int, default=32,
                        help="warm-up requests (the longest prompts, 32 tokens each)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply the length distributions (default: %(default)s)")
    parser.add_argument("--sampling", choices=["greedy", "random"], default="greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--random-model", choices=["8b", "tiny"], default=None,
                        help="serve a random-weight Llama target of this shape (written under "
                        "--workdir) instead of --model")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(),
                                                          "verispec_bench_models"),
                        help="where random models and EAGLE-3 heads are written (reused)")
    parser.add_argument("--device", default="cpu", help="passed to the server")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="passed to the server (an EAGLE-3 head needs a dense target)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="passed to the server")
    parser.add_argument("--max-model-len", type=int, default=None, help="passed to the server")
    parser.add_argument("--server-args", default="",
                        help="more verispec serve flags, e.g. '--enforce-eager'")
    parser.add_argument("--log-dir", default=".", help="where the servers' logs go")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw p50 / p99 TTFT and TPOT against request rate")
    args = parser.parse_args(argv)
    for flag in ("num_prompts", "num_warmup"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.random_model and args.model:
        parser.error("give --model or --random-model, not both")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rates = parse_rates(args.request_rates)
    names = split_configs(args.configs)
    if args.plot:
        import matplotlib  # noqa: F401  (fail before the runs, not after them)
    if args.random_model:
        args.model = target_checkpoint(args.workdir, args.random_model == "tiny",
                                       args.device)
    configs = [bench_config(args, name, rates) for name in names]
    print(f"\nhardware: {machine_description()}; server device {args.device}")
    print(f"model {args.model or 'bundled SmolLM2-135M-Instruct'}; {args.num_prompts} "
          f"ShareGPT-shaped requests (scale {args.scale}, {configs[0]['num_prompt_tokens']} "
          f"prompt / {configs[0]['num_output_tokens']} output tokens), {args.sampling}, "
          f"ignore_eos, {args.dtype}")
    print_tables(configs, args.num_prompts)
    if args.plot:
        plot_latency(configs, rates, args.plot)
        print(f"plot: {args.plot}")
    result = {"benchmark": "bench_serving", "hardware": machine_description(),
              "args": vars(args), "request_rates": [rate_label(r) for r in rates],
              "configs": configs}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    outcome = main()
    sys.exit(0 if all(p["failed"] == 0 for c in outcome["configs"] for p in c["passes"]) else 1)
