"""An engine's first run on a fresh machine: which Triton kernels compile after start-up, and
what the first run costs against the same run again.

A fresh Triton cache (``TRITON_CACHE_DIR`` set to a new directory before anything imports
Triton), an engine on a random-weight Llama-3.1-8B-shaped target (``load_format="dummy"``;
``--tiny``: a tiny one, for a smoke run), then ``--requests`` requests of
``bench_throughput``'s workload twice. Printed: start-up seconds, the kernels compiled at
start-up and during the first run (by kernel name), and both runs' seconds.

    python benchmarks/bench_first_run.py --requests 300

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time


def compiled_kernels(cache_dir: str) -> dict[str, str]:
    """Path -> kernel name of every compiled kernel in a Triton cache directory."""
    found = {}
    for path in glob.glob(os.path.join(cache_dir, "*", "*.json")):
        if os.path.basename(path).startswith("__grp__"):
            continue
        try:
            with open(path) as f:
                found[path] = json.load(f).get("name", os.path.basename(path))
        except (OSError, ValueError):
            continue
    return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--tiny", action="store_true", help="a tiny model and short requests")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--llm-kwargs", default="{}", help="JSON of LLM arguments")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        cache_dir = os.path.join(scratch, "triton")
        os.environ["TRITON_CACHE_DIR"] = cache_dir  # before Triton is imported
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_gpu_e2e
        import bench_throughput
        from transformers import LlamaConfig

        from verispec import LLM, SamplingParams
        from verispec.bench.report import machine_description, print_table

        model_dir = os.path.join(scratch, "model")
        LlamaConfig(**bench_gpu_e2e.model_configs(args.tiny)["target"],
                    architectures=["LlamaForCausalLM"]).save_pretrained(model_dir)
        start = time.perf_counter()
        llm = LLM(model_dir, device=args.device, dtype="bfloat16", load_format="dummy",
                  **json.loads(args.llm_kwargs))
        startup_s = time.perf_counter() - start
        at_start = compiled_kernels(cache_dir)
        prompts, max_tokens = bench_throughput.workload(
            args.requests, llm.model_config.vocab_size, 0, 0.1 if args.tiny else 1.0)
        params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0)
                  for m in max_tokens]
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            llm.generate(prompts, params)
            runs.append(time.perf_counter() - start)
            if len(runs) == 1:
                after_first = compiled_kernels(cache_dir)
        llm.close()
    mid_run = collections.Counter(name for path, name in after_first.items()
                                  if path not in at_start)
    result = {"benchmark": "first_run", "machine": machine_description(),
              "requests": args.requests, "startup_s": startup_s,
              "kernels_at_startup": len(at_start), "kernels_mid_run": dict(mid_run),
              "first_run_s": runs[0], "again_s": runs[1]}
    print_table([{"startup_s": startup_s, "kernels_at_startup": len(at_start),
                  "kernels_mid_run": sum(mid_run.values()), "first_run_s": runs[0],
                  "again_s": runs[1]}])
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
