"""The CPU sampling ops, compiled against the torch twins, and where a speculative step goes.

Part 1 (``ops``): the exponential race over a draft vocabulary (8192 tokens, one row) and over
the bundled model's 49 152 tokens (k + 1 = 4 rows), the draft sampler (``sample_draft``) and the
rejection sampler at B = 1, k = 3 (full rule, temperature 0.7), each through the compiled CPU
kernels (``verispec.ops.cpu_kernels``: ``race_rows``, ``rejection_rows``) and through the
torch twins (the ops without ``kernels``). Each op is
timed back to back and "after a forward": right after a parallel bfloat16 product of the
bundled model's LM head size, as in a running engine, where the first call of each op pays
its cache misses again (median microseconds). The two paths' tokens are compared.

Part 2 (``engine``, with ``--head``): a speculative run of the ``free`` prompts with an EAGLE
head, with timers around the engine's phases (the verify forward, the proposer and within it
the head's forwards and draws, the rejection sampler), per step.

    python benchmarks/bench_cpu_sampling.py
    python benchmarks/bench_cpu_sampling.py --head heads/smollm2 --temperature 0.7

Prints tables, then one JSON line.
"""

from __future__ import annotations

# isort: off
import verispec  # noqa: F401  (before torch: the OpenMP wait policy the CLI runs with)
# isort: on
import argparse
import collections
import json
import statistics
import time

import torch

from verispec.ops import cpu_kernels, rejection, sampling

VOCAB = 49152  # the bundled model's
DRAFT_VOCAB = 8192  # its default head's
K = 3


def _time(fn, forward, repeats: int) -> float:
    """Median microseconds of ``fn``, each call after ``forward`` when it is given."""
    for _ in range(5):
        fn()
    samples = []
    for _ in range(repeats):
        if forward is not None:
            forward()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def _one_thread(fn):
    """``fn`` on one thread, as the torch backend runs the sampling ops of a few rows."""
    def run():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn()
        finally:
            torch.set_num_threads(threads)
    return run


def bench_ops(repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    seeds, positions = torch.tensor([5]), torch.tensor([100])
    draft_logits = torch.randn(1, DRAFT_VOCAB, generator=g) * 3
    temperature = torch.tensor([0.7])
    q_small = torch.softmax(draft_logits / 0.7, -1)
    rows = K + 1
    p_rows = torch.softmax(torch.randn(rows, VOCAB, generator=g) * 3, -1)
    row_seeds, row_positions = torch.arange(rows) + 5, torch.arange(rows) + 100
    # a verify batch of one request, k = 3: drafts from q, target logits near the draft's
    target_logits = torch.randn(rows, VOCAB, generator=g) * 3
    q = torch.softmax(target_logits[:K] + torch.randn(K, VOCAB, generator=g), -1)
    drafts = sampling.torch_race(q, torch.tensor([1, 2, 3]), torch.arange(K), 0)
    rejection_args = (target_logits, drafts, torch.tensor([0, K]), q, temperature, None, None,
                      None, seeds, positions, K)
    weight = torch.randn(VOCAB, 576, generator=g).to(torch.bfloat16)
    x = torch.randn(1, 576, generator=g).to(torch.bfloat16)

    def forward():
        torch.nn.functional.linear(x, weight)

    cases = [
        ("race, 1 x 8192", lambda: sampling.race(q_small, seeds, positions, 0, cpu_kernels),
         lambda: sampling.torch_race(q_small, seeds, positions, 0)),
        ("race, 4 x 49152",
         lambda: sampling.race(p_rows, row_seeds, row_positions, 3, cpu_kernels),
         lambda: sampling.torch_race(p_rows, row_seeds, row_positions, 3)),
        ("sample_draft, 1 x 8192",
         lambda: sampling.sample_draft(draft_logits, temperature, seeds, positions, cpu_kernels),
         lambda: sampling.sample_draft(draft_logits, temperature, seeds, positions)),
        ("rejection, B = 1, k = 3",
         lambda: rejection.rejection_sample(*rejection_args, kernels=cpu_kernels),
         lambda: rejection.rejection_sample(*rejection_args)),
    ]
    results = []
    for name, compiled, twin in cases:
        compiled, twin = _one_thread(compiled), _one_thread(twin)
        mine, theirs = compiled(), twin()
        same = all(torch.equal(a, b) for a, b in zip(
            mine if isinstance(mine, tuple) else (mine,),
            theirs if isinstance(theirs, tuple) else (theirs,)))
        results.append({
            "op": name, "same_tokens": same,
            "compiled_us": _time(compiled, None, repeats),
            "torch_us": _time(twin, None, repeats),
            "compiled_after_forward_us": _time(compiled, forward, repeats),
            "torch_after_forward_us": _time(twin, forward, repeats),
        })
    return results


def bench_engine(head: str, temperature: float, method: str, max_tokens: int) -> dict:
    from verispec import LLM, SamplingParams
    from verispec.bench.prompts import get_prompts
    from verispec.bench.run import prepare_prompts
    from verispec.config import SpeculativeConfig
    from verispec.engine.spec_decode import SpeculativeDecoder

    seconds, calls = collections.defaultdict(float), collections.Counter()

    def timed(obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - start
                calls[key] += 1
        setattr(obj, name, run)

    config = SpeculativeConfig(method="eagle3", model=head, num_speculative_tokens=K,
                               draft_sample_method=method)
    llm = LLM(speculative_config=config)
    decoder = next(v for v in vars(llm).values() if isinstance(v, SpeculativeDecoder))
    timed(decoder, "step", "speculative step")
    timed(decoder.runner, "verify", "verify forward")
    timed(decoder.proposer, "propose", "proposer")
    timed(decoder.proposer, "_head_forward", "head forwards")
    timed(decoder.proposer, "_choose", "draft draws")
    timed(decoder, "rejection_sampler", "rejection sampler")
    prompts = prepare_prompts(llm, get_prompts("free"), True)
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=temperature, seed=0, max_tokens=8))
    seconds.clear()
    calls.clear()
    start = time.perf_counter()
    num_tokens = sum(len(out.token_ids) for p in prompts for out in llm.generate([p], params))
    elapsed = time.perf_counter() - start
    steps = calls["speculative step"]
    return {"tokens": num_tokens, "tokens_per_s": num_tokens / elapsed, "steps": steps,
            "ms_per_step": {k: seconds[k] / steps * 1e3 for k in seconds},
            "calls_per_step": {k: calls[k] / steps for k in calls}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--head", help="an EAGLE-3 head directory: also time a running engine")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--draft-sample-method", default="probabilistic")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the compiled CPU kernels are not built here (cpu_kernels.available())")
    ops = bench_ops(args.repeats)
    print(f"{'op':26s} {'same':>5s} {'compiled us':>12s} {'torch us':>9s} "
          f"{'compiled after fwd':>19s} {'torch after fwd':>16s}")
    for r in ops:
        print(f"{r['op']:26s} {str(r['same_tokens']):>5s} {r['compiled_us']:12.1f} "
              f"{r['torch_us']:9.1f} {r['compiled_after_forward_us']:19.1f} "
              f"{r['torch_after_forward_us']:16.1f}")
    result = {"threads": torch.get_num_threads(), "ops": ops}
    if args.head:
        engine = bench_engine(args.head, args.temperature, args.draft_sample_method,
                              args.max_tokens)
        print(f"\nengine: {engine['tokens']} tokens, {engine['tokens_per_s']:.2f} tokens/s, "
              f"{engine['steps']} speculative steps")
        print(f"{'phase':20s} {'ms a step':>10s} {'calls a step':>13s}")
        for key, ms in engine["ms_per_step"].items():
            print(f"{key:20s} {ms:10.2f} {engine['calls_per_step'][key]:13.2f}")
        result["engine"] = engine
    print(json.dumps(result))


if __name__ == "__main__":
    main()
