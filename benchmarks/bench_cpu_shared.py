"""Plain CPU decode on a shared machine: tokens/s idle and beside busy processes, per OpenMP
wait policy and thread count.

Each configuration runs in a fresh Python process (the OpenMP runtime reads its wait policy once,
when torch loads it): the bundled SmolLM2-135M-Instruct, greedy, batch 1, ``--tokens`` new tokens
(EOS ignored), median of ``--repeats`` timed runs after one warm-up, first on an idle machine,
then with ``--busy`` competing processes (``python -c "while True: pass"``) started beside it.
Reports both and their ratio (goal: >= 50 % of idle with one busy process on 2 cores). Prints a
table, then one JSON line.

    python benchmarks/bench_cpu_shared.py                       # verispec's default policy
    python benchmarks/bench_cpu_shared.py --configs default active threads1 --busy 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# name -> environment for the child (None = remove the variable); "default" is verispec's
# own choice, the others override it the way a user can.
CONFIGS = {
    "default": {},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},  # spin between parallel regions
    "gomp-default": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "300000"},  # libgomp's own
    "threads1": {"OMP_NUM_THREADS": "1"},
    "spin10k": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "10000"},  # spin briefly, then sleep
}

CHILD = r"""
import json, statistics, sys, time
import verispec, torch
from verispec import LLM, SamplingParams
dtype, tokens, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(dtype=dtype, max_model_len=512, max_num_seqs=1)
chat = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
llm.generate(chat, SamplingParams(max_tokens=8))  # warm-up
print("READY", flush=True)
sys.stdin.readline()  # the parent starts the busy processes, then says go
times = []
for _ in range(repeats):
    start = time.perf_counter()
    llm.generate(chat, params)
    times.append(time.perf_counter() - start)
print(json.dumps({"tok_s": tokens / statistics.median(times), "threads": torch.get_num_threads()}))
"""


def child_env(overrides: dict) -> dict:
    env = dict(os.environ)
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
        env.pop(key, None)  # start from verispec's default, not this shell's
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def measure(config: str, busy: int, args) -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, args.dtype, str(args.tokens), str(args.repeats)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(CONFIGS[config]))
    hogs = []
    try:
        for line in proc.stdout:
            if line.startswith("READY"):
                break
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(busy)]
        time.sleep(0.5 if busy else 0.0)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result = json.loads(proc.stdout.readline())
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        proc.wait()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["default"], choices=list(CONFIGS))
    parser.add_argument("--busy", nargs="+", type=int, default=[1],
                        help="numbers of competing busy processes to measure beside idle")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rows = []
    for config in args.configs:
        idle = measure(config, 0, args)
        for busy in args.busy:
            loaded = measure(config, busy, args)
            rows.append({"config": config, "threads": idle["threads"], "busy": busy,
                         "idle_tok_s": idle["tok_s"], "busy_tok_s": loaded["tok_s"],
                         "ratio": loaded["tok_s"] / idle["tok_s"]})
            print(f"  {config}: idle {idle['tok_s']:.1f} tok/s, {busy} busy "
                  f"{loaded['tok_s']:.1f} tok/s", flush=True)
    machine = f"{os.cpu_count()} cores, load average before: {os.getloadavg()[0]:.2f}"
    print(f"\nplain decode, bundled model, {args.dtype}, batch 1, {args.tokens} tokens, median of "
          f"{args.repeats}; {machine}\n")
    print("| config | threads | busy processes | idle tok/s | busy tok/s | busy / idle |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['threads']} | {r['busy']} | {r['idle_tok_s']:.1f} | "
              f"{r['busy_tok_s']:.1f} | {100 * r['ratio']:.0f} % |")
    print(json.dumps({"benchmark": "cpu_shared", "machine": machine, "results": rows}))


if __name__ == "__main__":
    main()
