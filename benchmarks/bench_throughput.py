"""Offline throughput, shaped like vLLM's ``benchmark_throughput``: many seeded requests submitted
at once, the engine drives them to the end, output tokens per second.

The workload: ``--num-requests`` (1 000) random token-id prompts with log-normal lengths (median
256, clipped to 32..3 000) and log-normal output lengths (median 192, clipped to 16..1 024),
``ignore_eos``, greedy, on a random-weight Llama-3.1-8B-shaped target (``--tiny``: a tiny one, for
a smoke run on CPU). Printed per engine: output tokens/s, time to first token p50 / p99, the
peak number of running requests, the peak fraction of the KV cache in use, preemptions, and
where the time went: steps with prefill (their count, seconds and tokens computed per second),
steps of decodes alone (count, seconds, mean batch, ms a step), and the tail after the last
prefill (requests finishing at shrinking batch sizes).

``--variants JSON`` runs this engine again with other arguments (e.g. chunked prefill off) on
the same requests. ``--baseline DIR`` also runs the engine of another source tree (DIR holds its
``verispec`` package, e.g. a checkout of the previous commit) in a subprocess, with
``--baseline-max-num-seqs`` tried from the largest down until one starts at
``--baseline-max-model-len``. Ratios are against the first row.

    python benchmarks/bench_throughput.py --workdir /tmp/bench [--baseline .baseline]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PROMPT_MEDIAN, PROMPT_RANGE = 256, (32, 3000)
OUTPUT_MEDIAN, OUTPUT_RANGE = 192, (16, 1024)
SIGMA = 0.8  # log-normal spread of both lengths


def workload(num: int, vocab_size: int, seed: int, scale: float = 1.0):
    """(prompts, max_tokens) of ``num`` requests; ``scale`` shrinks the lengths (tiny runs)."""
    rng = np.random.default_rng(seed)

    def lengths(median, bounds):
        lo, hi = (max(1, int(b * scale)) for b in bounds)
        raw = rng.lognormal(np.log(median * scale), SIGMA, size=num)
        return np.clip(raw.round().astype(int), lo, hi)

    prompt_lens, output_lens = lengths(PROMPT_MEDIAN, PROMPT_RANGE), lengths(OUTPUT_MEDIAN,
                                                                             OUTPUT_RANGE)
    prompts = [rng.integers(0, vocab_size, size=n).tolist() for n in prompt_lens]
    return prompts, output_lens.tolist()


# The profiler range around each step of a window. On the device it also appears as an
# annotation spanning the step's kernels: not a kernel, so left out of the device's busy time.
STEP_MARK = "engine_step"


class StepWindow:
    """The torch profiler (device kernels) and cProfile (host) over a window of steps: on the
    device, the window's wall time against its kernels' busy time and the costliest kernels; on
    the host, the costliest functions."""

    def __init__(self, first: int, host: bool) -> None:
        """``host``: cProfile only (its overhead would distort the device window's host
        times); otherwise the torch profiler only."""
        import cProfile

        self.first = first
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.torch_profiler = self.host = None
        if host:
            self.host = cProfile.Profile()
        else:
            self.torch_profiler = torch.profiler.profile(activities=[
                torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            self.torch_profiler.__enter__()
        self.start = time.perf_counter()
        if host:
            self.host.enable()

    def per_step(self, kinds: list) -> None:
        """Per kind of step (with prefill, decodes alone): wall time, the device's busy time,
        and the host's time before the step's first kernel and after its last one (a step
        ends with a synchronize, so its kernels run within it)."""
        events = self.torch_profiler.events()
        steps = sorted((e.time_range.start, e.time_range.end) for e in events
                       if e.name == STEP_MARK and e.device_type != torch.autograd.DeviceType.CUDA)
        device = sorted((e.time_range.start, e.time_range.end) for e in events
                        if e.device_type == torch.autograd.DeviceType.CUDA
                        and e.name != STEP_MARK
                        and e.time_range.end > e.time_range.start)
        rows: dict[str, list] = {"with prefill": [], "decodes alone": []}
        j = 0
        for (start, end), (prefill, _, _) in zip(steps, kinds):
            while j < len(device) and device[j][0] < start:
                j += 1
            mine = []
            while j < len(device) and device[j][0] < end:
                mine.append(device[j])
                j += 1
            busy, reach = 0.0, start  # union of the kernels' intervals
            for a, b in mine:
                busy += max(0.0, b - max(a, reach))
                reach = max(reach, b)
            first = mine[0][0] - start if mine else end - start
            last = end - max(b for _, b in mine) if mine else 0.0
            rows["with prefill" if prefill else "decodes alone"].append(
                (end - start, busy, first, last))
        for name, values in rows.items():
            if values:
                wall, busy, first, last = (np.mean([v[i] for v in values]) / 1e3
                                           for i in range(4))
                print(f"  {name}: {len(values)} steps, mean wall {wall:.2f} ms, device busy "
                      f"{busy:.2f} ms, host before the first kernel {first:.2f} ms, after "
                      f"the last {last:.2f} ms")

    def report(self, kinds: list) -> None:
        import io
        import pstats

        if self.host is not None:
            self.host.disable()
            text = io.StringIO()
            pstats.Stats(self.host, stream=text).sort_stats("cumulative").print_stats(
                r"verispec/(engine|runtime|sample|proposers)", 30)
            pstats.Stats(self.host, stream=text).sort_stats("tottime").print_stats(25)
            print(f"steps {self.first}..{self.first + len(kinds) - 1} on the host: the "
                  "engine's functions by cumulative time, then all by own time:")
            print("\n".join([line for line in text.getvalue().splitlines()
                             if line.strip()][2:]))
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.start
        self.torch_profiler.__exit__(None, None, None)
        kernels = [e for e in self.torch_profiler.key_averages()
                   if getattr(e, "self_device_time_total", 0) > 0 and e.key != STEP_MARK]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6
        print(f"steps {self.first}..{self.first + len(kinds) - 1}: "
              f"{sum(1 for p, _, _ in kinds if p)} with prefill "
              f"({sum(n for _, _, n in kinds)} prefill tokens), "
              f"{sum(d for _, d, _ in kinds)} decode rows; wall {1e3 * wall:.1f} ms, "
              f"device kernels {1e3 * busy:.1f} ms ({100 * busy / wall:.0f} % busy)")
        self.per_step(kinds)
        kernels.sort(key=lambda e: -e.self_device_time_total)
        for e in kernels[:25]:
            print(f"  {e.self_device_time_total / 1e3:9.2f} ms {e.count:6d}x  {e.key[:90]}")


def run_engine(model_dir: str, device: str, num_requests: int, seed: int, scale: float,
               llm_kwargs: dict, profile_window: tuple[int, int] | None = None) -> dict:
    """Start an engine, submit every request at once, step to the end: the measurements."""
    from verispec import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model_dir, device=device, dtype="bfloat16", **llm_kwargs)
    startup_s = time.perf_counter() - start
    prompts, max_tokens = workload(num_requests, llm.model_config.vocab_size, seed, scale)
    # warm-up: a few requests through prefill and decode
    llm.generate(prompts[:4], [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)] * 4)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    scheduler = llm.scheduler
    start = time.perf_counter()
    requests = [llm.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0))
                for p, m in zip(prompts, max_tokens)]
    peak_running, peak_usage = 0, 0.0
    kinds: list[tuple[bool, int, int]] = []  # per step: prefill?, decodes, prefill tokens
    schedule = scheduler.schedule

    def recorded_schedule():
        plan = schedule()
        if isinstance(plan, tuple):  # an engine without chunked prefill: (batch, is_prefill)
            kinds.append((plan[1], 0 if plan[1] else len(plan[0]),
                          sum(len(r.prompt_token_ids) for r in plan[0]) if plan[1] else 0))
        else:  # a StepPlan: a step with prefill chunks counts as a prefill step
            kinds.append((bool(plan.prefills), len(plan.decodes),
                          sum(n for _, n in plan.prefills)))
        return plan

    scheduler.schedule = recorded_schedule
    step_times = []
    window = None
    while llm.has_unfinished_requests:
        if profile_window and len(step_times) in (profile_window[0], sum(profile_window)):
            # the device's window, then the host's
            window = StepWindow(len(step_times), host=len(step_times) > profile_window[0])
        step_start = time.perf_counter()
        if window is not None:
            with torch.profiler.record_function(STEP_MARK):
                llm.step()
        else:
            llm.step()
        step_times.append(time.perf_counter() - step_start)
        if window is not None and len(step_times) == window.first + profile_window[1]:
            window.report(kinds[window.first:])
            window = None
        peak_running = max(peak_running, len(scheduler.running))
        usage = getattr(scheduler, "kv_cache_usage", None)
        if usage is None:  # one slot per request: slots in use
            usage = len(scheduler.running) / llm.max_num_seqs
        peak_usage = max(peak_usage, usage)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    outputs = [llm.get_output(r) for r in requests]
    num_out = sum(len(o.token_ids) for o in outputs)
    ttft = np.array([o.metrics.time_to_first_token_s for o in outputs])
    plan = getattr(llm, "kv_plan", None)
    prefill = [t for t, (p, _, _) in zip(step_times, kinds) if p]
    decode = [t for t, (p, _, _) in zip(step_times, kinds) if not p]
    decode_rows = [n for p, n, _ in kinds if not p]
    last_prefill = max((i for i, (p, _, _) in enumerate(kinds) if p), default=-1)
    return {
        "prefill_steps": len(prefill), "prefill_s": sum(prefill),
        # tokens a step with prefill computes per second (its chunks and its decodes)
        "prefill_step_tok_s": sum(n + d for p, d, n in kinds if p) / max(sum(prefill), 1e-9),
        "decode_steps": len(decode), "decode_s": sum(decode),
        "mean_decode_batch": float(np.mean(decode_rows)) if decode_rows else 0.0,
        "decode_step_ms": 1e3 * sum(decode) / max(len(decode), 1),
        # after the last prefill: the requests left finish at shrinking batch sizes
        "tail_s": sum(step_times[last_prefill + 1:]),
        "tail_steps": len(step_times) - last_prefill - 1,
        "max_num_seqs": llm.max_num_seqs, "max_model_len": llm.max_model_len,
        "requests": num_requests, "output_tokens": num_out,
        "prompt_tokens": int(sum(len(p) for p in prompts)), "seconds": elapsed,
        "output_tokens_per_s": num_out / elapsed, "ttft_p50_s": float(np.median(ttft)),
        "ttft_p99_s": float(np.quantile(ttft, 0.99)), "peak_running": peak_running,
        "peak_kv_usage": peak_usage,
        "preemptions": getattr(scheduler, "num_preemptions", 0),
        "kv_pool_tokens": None if plan is None else plan.num_tokens,
        "startup_s": startup_s,
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30
        if device.startswith("cuda") else None,
    }


def checkpoint(workdir: str, tiny: bool, device: str) -> str:
    """The random 8B-shaped (or tiny) target, built once under ``workdir``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_gpu_e2e

    path = os.path.join(workdir, "target")
    kwargs = bench_gpu_e2e.model_configs(tiny)["target"]
    os.makedirs(path, exist_ok=True)
    if not bench_gpu_e2e.has_checkpoint(path, kwargs):
        bench_gpu_e2e.build_checkpoint(kwargs, path, torch.device(device), seed=0)
    return path


def run_subprocess(args, model_dir: str, llm_kwargs: dict, tree: str | None) -> dict | None:
    """One engine in a process of its own (all its GPU memory back at exit): the engine of
    source tree ``tree`` (None: this one)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--engine-only", "--model", model_dir,
           "--device", args.device, "--num-requests", str(args.num_requests),
           "--seed", str(args.seed), "--scale", str(args.scale),
           "--llm-kwargs", json.dumps(llm_kwargs)]
    if args.profile_window and tree is None:
        cmd += ["--profile-window", args.profile_window]
    env = dict(os.environ)
    if tree is not None:
        env.update(PYTHONPATH=os.pathsep.join([os.path.abspath(tree)] + [
            p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]),
            VERISPEC_BENCH_NO_LOCAL="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if args.profile_window and tree is None:
        print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("{")))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
    print(f"{tree or 'this tree'} {llm_kwargs} did not run: {tail[0][:300]}", flush=True)
    return None


def run_baseline(args, model_dir: str) -> dict | None:
    """The other tree's engine, at the largest max_num_seqs that starts."""
    for max_num_seqs in args.baseline_max_num_seqs:
        print(f"baseline: trying max_num_seqs={max_num_seqs}", flush=True)
        row = run_subprocess(args, model_dir, {"max_num_seqs": max_num_seqs,
                                               "max_model_len": args.baseline_max_model_len},
                             args.baseline)
        if row is not None:
            return row
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/verispec_bench_throughput")
    parser.add_argument("--model", default=None, help="a model directory (default: build one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and short requests")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=None,
                        help="multiply the length distributions (default 1; 0.05 with --tiny)")
    parser.add_argument("--llm-kwargs", default="{}", help="JSON of LLM arguments (ours)")
    parser.add_argument("--variants", default="[]",
                        help="JSON list of LLM argument sets: this tree's engine again with each "
                        "(e.g. '[{\"enable_chunked_prefill\": false}]'), compared")
    parser.add_argument("--baseline", default=None, help="source tree of the engine to compare")
    parser.add_argument("--baseline-max-model-len", type=int, default=4096)
    parser.add_argument("--baseline-max-num-seqs", type=lambda s: [int(x) for x in s.split(",")],
                        default=[128, 112, 96, 80, 64])
    parser.add_argument("--profile-window", default=None, metavar="FIRST:COUNT",
                        help="profile COUNT steps of this tree's engine from step FIRST (device "
                        "kernels, per-step host and device time) and the COUNT after them "
                        "(host functions), printed before the table")
    parser.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scale is None:
        args.scale = 0.05 if args.tiny else 1.0
    if args.engine_only:  # a subprocess of run_baseline: one engine, one JSON line
        if os.environ.get("VERISPEC_BENCH_NO_LOCAL"):
            sys.path = [p for p in sys.path
                        if os.path.abspath(p) != os.path.abspath(os.path.join(
                            os.path.dirname(os.path.abspath(__file__)), ".."))]
        window = (tuple(int(x) for x in args.profile_window.split(":"))
                  if args.profile_window else None)
        print(json.dumps(run_engine(args.model, args.device, args.num_requests, args.seed,
                                    args.scale, json.loads(args.llm_kwargs), window)))
        return
    model_dir = args.model or checkpoint(args.workdir, args.tiny, args.device)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the checkpoint's build
    ours = run_subprocess(args, model_dir, json.loads(args.llm_kwargs), None)
    if ours is None:
        sys.exit("the engine of this tree did not run")
    rows = [dict(engine="verispec", **ours)]
    print("ours:", json.dumps(rows[0]), flush=True)
    for variant in json.loads(args.variants):
        row = run_subprocess(args, model_dir, dict(json.loads(args.llm_kwargs), **variant), None)
        if row is not None:
            rows.append(dict(engine=f"verispec {json.dumps(variant)}", **row))
            print("variant:", json.dumps(rows[-1]), flush=True)
    if args.baseline:
        base = run_baseline(args, model_dir)
        if base is not None:
            rows.append(dict(engine=f"baseline ({args.baseline})", **base))
    from verispec.bench.report import machine_description, print_table

    print(machine_description())
    columns = ["engine", "max_num_seqs", "max_model_len", "output_tokens_per_s", "ttft_p50_s",
               "ttft_p99_s", "peak_running", "peak_kv_usage", "preemptions", "kv_pool_tokens",
               "seconds", "prefill_steps", "prefill_s", "prefill_step_tok_s", "decode_steps",
               "decode_s", "mean_decode_batch", "decode_step_ms", "tail_steps", "tail_s",
               "startup_s"]
    print_table(rows, columns)
    result = {"benchmark": "throughput", "machine": machine_description(), "rows": rows}
    result["ratios"] = {}
    for row in rows[1:]:
        ratio = rows[0]["output_tokens_per_s"] / row["output_tokens_per_s"]
        result["ratios"][row["engine"]] = ratio
        print(f"output tokens/s ratio (verispec / {row['engine']}): {ratio:.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
