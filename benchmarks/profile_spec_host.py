"""Where a speculative step's host time goes: the engine's step phases timed by the wall clock.

For plain decoding and each proposer (``--proposers``: draft model, EAGLE-3 head), one engine of
``bench_gpu_e2e``'s models (8B- and 1B-shaped random checkpoints, ``--tiny`` for a CPU smoke run)
decodes a batch of ``--batch`` prompts (synthetic acceptance 2.5, k = 3, greedy) twice: the
second run with each phase of the step wrapped in a timer (the scheduler, the proposer's
``propose`` / ``on_commit`` / ``draft_ahead``, the verify forward's host part, the rejection
sampler's launch, the read of the step's tokens and the wait in it, the commit). Per run: decode
tokens/s, the step time against the captured graphs it replays (``rest``: what the graphs leave
to the host), and the phases in microseconds a step, largest first. A phase that waits for the
device (``wait``: the event before the step's tokens are read) counts that wait.

    python benchmarks/profile_spec_host.py                     # GPU: 8B / 1B shapes, batch 64
    python benchmarks/profile_spec_host.py --tiny --device cpu --tokens 16

Prints a table per engine, then one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu_e2e as e2e  # noqa: E402

from verispec.bench.report import machine_description, print_table  # noqa: E402

PROPOSERS = {"draft": ("draft", "draft_model"), "eagle": ("eagle3", "eagle3")}


class PhaseTimer:
    """Wall-clock totals of wrapped methods (and of CUDA event waits); ``restore`` puts every
    wrapped method back."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self._wrapped: list[tuple[object, str, object]] = []  # (owner, name, its own attribute)

    def wrap(self, owner, name: str, label: str | None = None) -> None:
        method = getattr(owner, name)
        label = label or name
        self._wrapped.append((owner, name, vars(owner).get(name)))

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)

    def restore(self) -> None:
        """Every wrapped method back, last wrapped first (an instance's wrapper removed, so that
        its class's method shows through again)."""
        for owner, name, own in reversed(self._wrapped):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._wrapped.clear()

    def wrap_engine(self, llm) -> None:
        self.wrap(llm, "_step", "step")
        self.wrap(llm, "_commit_all", "commit")
        self.wrap(llm.scheduler, "schedule")
        self.wrap(llm.scheduler, "publish")
        spec = llm.spec
        if spec is None:
            return
        self.wrap(spec, "step", "spec step")
        self.wrap(spec, "_plan", "plan")
        self.wrap(spec, "_read_outputs", "read outputs")
        self.wrap(spec, "rejection_sampler", "rejection sampler")
        self.wrap(spec.proposer, "propose")
        self.wrap(spec.proposer, "on_commit", "proposer on_commit")
        self.wrap(spec.proposer, "draft_ahead", "draft ahead")
        self.wrap(spec.runner, "verify")
        self.wrap(spec.options, "process", "options")


def time_event_waits(timer: PhaseTimer):
    """Count every ``torch.cuda.Event.synchronize`` as ``wait``; returns the undo."""
    original = torch.cuda.Event.synchronize

    def synchronize(event):
        start = time.perf_counter()
        original(event)
        timer.seconds["wait"] += time.perf_counter() - start

    torch.cuda.Event.synchronize = synchronize
    return lambda: setattr(torch.cuda.Event, "synchronize", original)


def run_engine(name: str, dirs: dict, device: torch.device, prompts, tokens: int) -> dict:
    kwargs = {}
    if name != "plain":
        role, method = PROPOSERS[name]
        kwargs = dict(draft_dir=dirs[role], method=method)
    llm, _ = e2e.make_llm(dirs["target"], device, eager=False, **kwargs)
    try:
        e2e.warm_up(llm, prompts)
        row, _ = e2e.timed_generate(llm, prompts, tokens, device, name)
        timer = PhaseTimer()
        timer.wrap_engine(llm)
        undo = time_event_waits(timer) if device.type == "cuda" else (lambda: None)
        try:
            timed, _ = e2e.timed_generate(llm, prompts, tokens, device, name)
        finally:
            undo()
        steps = timed.get("spec_steps") or timed["decode_steps"]
        result = dict(engine=name, decode_tok_s=row["decode_tok_s"],
                      step_ms=1e3 * row["decode_s"] / (row.get("spec_steps")
                                                       or row["decode_steps"]))
        if name != "plain":
            costs = e2e.graph_costs(llm, (len(prompts),), name)
            if costs:
                graphs_ms = costs[0]["verify_graph_ms"] + costs[0]["draft_graph_ms"]
                result.update(graphs_ms=graphs_ms, rest_ms=result["step_ms"] - graphs_ms)
            result["accept_len"] = row.get("accept_len")
        # the timed run's first step is the batch's prefill: left out of the per-step phases
        result["phases_us"] = {k: 1e6 * v / steps for k, v in sorted(
            timer.seconds.items(), key=lambda kv: -kv[1])}
        return result
    finally:
        llm.close()
        del llm
        e2e.free_memory(device)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny models (smoke runs)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128, help="output tokens a request")
    parser.add_argument("--proposers", default="plain,draft,eagle",
                        help="engines to run: plain, draft, eagle (comma separated)")
    parser.add_argument("--workdir", help="where the checkpoints are kept (default: a "
                        "temporary directory)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    names = [n.strip() for n in args.proposers.split(",") if n.strip()]
    for n in names:
        if n != "plain" and n not in PROPOSERS:
            raise SystemExit(f"--proposers: unknown engine {n!r} (plain, draft, eagle)")
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or scratch
        dirs = e2e.checkpoints(workdir, args.tiny, device)
        dirs["eagle3"] = e2e.eagle_head(workdir, args.tiny, device)
        vocab = e2e.model_configs(args.tiny)["target"]["vocab_size"]
        prompts = e2e.random_prompts(args.batch, vocab, seed=1)
        results = [run_engine(n, dirs, device, prompts, args.tokens) for n in names]
    print(machine_description())
    plain = next((r for r in results if r["engine"] == "plain"), None)
    for r in results:
        if plain is not None and r is not plain:
            r["vs_plain"] = r["decode_tok_s"] / plain["decode_tok_s"]
        print(f"\n{r['engine']}: {r['decode_tok_s']:.0f} tok/s, step {r['step_ms']:.2f} ms"
              + (f", graphs {r['graphs_ms']:.2f} ms, rest {r['rest_ms']:.2f} ms"
                 if "graphs_ms" in r else "")
              + (f", {r['vs_plain']:.2f}x plain" if "vs_plain" in r else ""))
        print_table([dict(phase=k, us_per_step=v) for k, v in r["phases_us"].items()],
                    ["phase", "us_per_step"], float_format=".1f")
    summary = {"benchmark": "profile_spec_host", "machine": machine_description(),
               "batch": args.batch, "tokens": args.tokens, "results": results}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
