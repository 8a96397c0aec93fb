"""lm-evaluation-harness against ``verispec serve``: loglikelihoods identical with and without
speculation.

Starts ``verispec serve`` on the bundled SmolLM2-135M-Instruct twice (this checkout's code:
``PYTHONPATH`` is set to it), plain (``--speculative-method none``) and with n-gram speculation
(``--speculative-config``), and runs ``lm_eval --model local-completions`` against each on two
local tasks under ``benchmarks/lm_eval_tasks/`` (JSONL data, no download): ``verispec_mc``,
multiple choice (loglikelihood requests: token-id prompts, ``echo``, ``logprobs=1``,
``max_tokens=1``, batched prompt lists) and ``verispec_gen``, generate until a newline (greedy,
``stop``). It then compares the per-sample results of the two servers: every loglikelihood must
be identical (bit for bit, as lm-eval logs them) and every generation equal (greedy speculation
emits the plain greedy tokens). Prints a table, then one JSON line; exits 1 on a difference.

lm-eval is not a dependency of verispec: ``pip install "lm-eval[api]"`` first.

    python benchmarks/run_lm_eval.py
    python benchmarks/run_lm_eval.py --batch-size 8 --limit 10 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from verispec.bench.report import machine_description, print_table
from verispec.models.loader import resolve_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ("verispec_mc", "verispec_gen")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(flags: list[str], port: int, log_path: str) -> subprocess.Popen:
    """``verispec serve`` of this checkout on ``port``, once ``/health`` answers."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(
        [sys.executable, "-m", "verispec.cli", "serve", "--port", str(port), *flags],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"verispec serve exited ({process.returncode}); see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(process)
    raise RuntimeError(f"verispec serve did not start in 300 s; see {log_path}")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)  # the server's own shut-down stops its engine
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_lm_eval(port: int, model_name: str, out_dir: str, args) -> float:
    """Runs both tasks; returns the seconds lm_eval took."""
    model_args = ",".join([
        f"model={model_name}", f"base_url=http://127.0.0.1:{port}/v1/completions",
        "tokenizer_backend=huggingface", f"tokenizer={resolve_model_path(args.model)}",
        "num_concurrent=1", "max_retries=1"])
    command = ["lm_eval", "--model", "local-completions", "--model_args", model_args,
               "--batch_size", str(args.batch_size), "--tasks", ",".join(TASKS),
               "--include_path", os.path.join(ROOT, "benchmarks", "lm_eval_tasks"),
               "--output_path", out_dir, "--log_samples"]
    if args.limit:
        command += ["--limit", str(args.limit)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"lm_eval failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return time.perf_counter() - start


def read_results(out_dir: str) -> tuple[dict, dict]:
    """(metrics per task, per-sample responses per task: doc_id -> resps)."""
    [results_path] = glob.glob(os.path.join(out_dir, "*", "results_*.json"))
    with open(results_path) as f:
        metrics = json.load(f)["results"]
    samples = {}
    for task in TASKS:
        [path] = glob.glob(os.path.join(out_dir, "*", f"samples_{task}_*.jsonl"))
        with open(path) as f:
            samples[task] = {d["doc_id"]: d["resps"] for d in map(json.loads, f)}
    return metrics, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--dtype", default=None, help="default: the server's")
    parser.add_argument("--batch-size", type=int, default=4,
                        help="lm-eval's: prompts per request")
    parser.add_argument("--limit", type=int, default=None, help="samples per task")
    parser.add_argument("--speculative-config", default=json.dumps(NGRAM))
    args = parser.parse_args()
    flags = ["--max-model-len", "1024"]
    if args.model:
        flags += ["--model", args.model]
    if args.dtype:
        flags += ["--dtype", args.dtype]
    model_name = "verispec-lm-eval"
    flags += ["--served-model-name", model_name]
    configs = {"plain": ["--speculative-method", "none"],
               "speculative": ["--speculative-config", args.speculative_config]}
    rows, samples = [], {}
    with tempfile.TemporaryDirectory() as work:
        for name, extra in configs.items():
            port = free_port()
            server = start_server(flags + extra, port, os.path.join(work, f"{name}.log"))
            try:
                seconds = run_lm_eval(port, model_name, os.path.join(work, name), args)
            finally:
                stop_server(server)
            metrics, samples[name] = read_results(os.path.join(work, name))
            mc, gen = metrics["verispec_mc"], metrics["verispec_gen"]
            rows.append({"server": name, "mc_acc": mc["acc,none"],
                         "mc_acc_norm": mc["acc_norm,none"],
                         "gen_exact_match": gen["exact_match,strip"],
                         "lm_eval_s": seconds})
    plain, spec = samples["plain"], samples["speculative"]
    loglikelihoods = [(float(a[0][0]), float(b[0][0]))
                      for doc in plain["verispec_mc"]
                      for a, b in zip(plain["verispec_mc"][doc], spec["verispec_mc"][doc])]
    num_ll_differ = sum(a != b for a, b in loglikelihoods)
    max_ll_diff = max(abs(a - b) for a, b in loglikelihoods)
    num_gen_differ = sum(plain["verispec_gen"][d] != spec["verispec_gen"][d]
                         for d in plain["verispec_gen"])
    print(f"machine: {machine_description()}; model {args.model or 'bundled SmolLM2-135M'}, "
          f"lm-eval local-completions, batch size {args.batch_size}, speculative config "
          f"{args.speculative_config}")
    print_table(rows)
    summary = {"num_loglikelihoods": len(loglikelihoods), "num_loglikelihoods_differ":
               num_ll_differ, "max_abs_loglikelihood_diff": max_ll_diff,
               "num_generations": len(plain["verispec_gen"]),
               "num_generations_differ": num_gen_differ}
    print_table([summary])
    print(json.dumps({"bench": "lm_eval", "machine": machine_description(), "rows": rows,
                      **summary}))
    if num_ll_differ or num_gen_differ:
        sys.exit(1)


if __name__ == "__main__":
    main()
