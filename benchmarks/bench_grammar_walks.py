"""Greedy grammar walks on CPU: the grammar masks a JSON-schema step computes while drafting
(on the critical path of every draft position) and at the verify step (beside the target
forward on a GPU), with greedy walks and with eager ones.

A greedy walk (``GrammarWalks(greedy=True)``, docs/design.md §15) reads each draft position's
argmaxes and computes a mask only where the grammar refuses one; the eager walk masks every
position's logits first. Both draft the same tokens. The bundled SmolLM2-135M-Instruct is the
target and its own greedy draft model (a trained draft: its argmaxes are mostly inside the
grammar; a random-weight draft's are mostly refused, and then both walks compute the same
masks), k = 3, ``--requests`` JSON-schema requests, greedy. Every request drafts k tokens at
every step. Both runs must emit the same tokens. Prints a table, then one JSON line.

    python benchmarks/bench_grammar_walks.py
"""

from __future__ import annotations

import argparse
import json
import time

from bench_grammar_drafting import SCHEMA

from verispec import LLM, SamplingParams, StructuredOutputsParams
from verispec.bench.report import machine_description, print_table
from verispec.models import gguf
from verispec.proposers import grammar_walk
from verispec.sample import grammar, options


class MaskCounter:
    """Counts the masks computed while drafting and at the verify step (``fill_chain_masks``),
    and switches the walks between greedy and eager (a context: the library as it was after)."""

    def __enter__(self) -> MaskCounter:
        self.counts = {"drafting": 0, "verify": 0}
        self.place = "drafting"
        self.greedy = True
        walks_class = grammar_walk.GrammarWalks
        self._saved = [(grammar, "compute_masks", grammar.compute_masks),
                       (grammar_walk, "compute_masks", grammar_walk.compute_masks),
                       (grammar, "fill_chain_masks", grammar.fill_chain_masks),
                       (options, "fill_chain_masks", options.fill_chain_masks),
                       (walks_class, "__init__", walks_class.__init__),
                       (walks_class, "argmax", walks_class.argmax)]
        compute, fill = grammar.compute_masks, grammar.fill_chain_masks
        init, apply, argmax = walks_class.__init__, walks_class.apply, walks_class.argmax

        def counted(grammars):
            self.counts[self.place] += len(grammars)
            return compute(grammars)

        def at_verify(*args):
            self.place = "verify"
            try:
                return fill(*args)
            finally:
                self.place = "drafting"

        def walks(walk, grammars, token_ids=None, greedy=False):
            init(walk, grammars, token_ids, greedy and self.greedy)

        def eager_or_greedy(walk, logits, rows, choose):
            if walk.greedy:
                return argmax(walk, logits, rows, choose)
            ids = choose(apply(walk, logits, rows))  # every row masked, then the argmax
            return ids, ids.tolist()

        grammar.compute_masks = grammar_walk.compute_masks = counted
        grammar.fill_chain_masks = options.fill_chain_masks = at_verify
        walks_class.__init__ = walks
        walks_class.argmax = eager_or_greedy
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, value in self._saved:
            setattr(owner, name, value)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    with MaskCounter() as counter:
        return _run(args, counter)


def _run(args, counter: MaskCounter) -> dict:
    llm = LLM(speculative_config={"method": "draft_model", "model": gguf.bundled_gguf_path(),
                                  "num_speculative_tokens": 3, "draft_sample_method": "greedy"},
              max_num_seqs=args.requests)
    llm.spec.adaptive = False  # every request drafts k at every step
    prompts = [f"Write a JSON record for person number {i}: name, age, city, hobbies, employed."
               for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    llm.generate(prompts[:1], params)  # compiles the grammar
    rows, tokens = [], {}
    for greedy in (False, True):
        counter.greedy, counter.counts = greedy, {"drafting": 0, "verify": 0}
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens[greedy] = [o.token_ids for o in outputs]
        rows.append(dict(walk="greedy" if greedy else "eager",
                         masks_drafting=counter.counts["drafting"],
                         masks_verify=counter.counts["verify"], seconds=seconds,
                         tokens=sum(len(t) for t in tokens[greedy])))
    if tokens[False] != tokens[True]:
        raise SystemExit("the greedy and eager walks emitted different tokens")
    print(f"{machine_description()}; bundled model drafting for itself, k = 3, "
          f"{args.requests} JSON-schema requests, {args.tokens} tokens, greedy")
    print_table(rows, ["walk", "masks_drafting", "masks_verify", "seconds", "tokens"])
    result = dict(device=machine_description(), rows=rows, same_tokens=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
