"""Grammar-aware drafting on CPU: acceptance on JSON-schema output with and without it.

The bundled SmolLM2-135M-Instruct answers chat prompts under a JSON schema
(``response_format`` / ``structured_outputs``), greedy, with each proposer twice: drafting
under the request's grammar (the default: the n-gram proposer keeps the continuation the
grammar accepts, a model-based proposer masks its own logits by the matcher walked along its
drafts, docs/design.md §15) and ignoring it (``Proposer.grammar_aware = False``). The
proposers: n-gram and early exit (the target's first ``--draft-layers`` layers, a weak draft
model that costs no second download). Every request drafts k tokens at every step (the planner's
per-request switch is off), so the mean acceptance length is the proposers' alone. Both runs
must emit exactly the plain greedy tokens, and every output must parse and validate against
the schema. Prints a table, then one JSON line.

    python benchmarks/bench_grammar_drafting.py
    python benchmarks/bench_grammar_drafting.py --k 3 --tokens 96 --draft-layers 12
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema

from verispec import LLM, SamplingParams, StructuredOutputsParams
from verispec.bench.report import machine_description, print_table

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "city", "hobbies", "employed"],
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 20},
        "hobbies": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 15}},
        "employed": {"type": "boolean"},
    },
}
PROMPTS = [
    "Describe a fictional person as JSON with name, age, city, hobbies and employed.",
    "Give me a JSON record of a retired teacher who lives in Lisbon.",
    "Invent a JSON profile for a young software engineer.",
    "Return JSON describing a chef from Paris: name, age, city, hobbies, employed.",
    "Make up a person who likes chess and hiking; answer in JSON.",
    "JSON only: a student in Tokyo with two hobbies.",
]


def run(llm: LLM, chats: list, params: SamplingParams) -> tuple[list, float]:
    start = time.perf_counter()
    outputs = llm.generate(chats, params)
    return outputs, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--draft-layers", type=int, default=12)
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    args = parser.parse_args()
    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:args.num_prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    engine = dict(dtype=args.dtype, max_model_len=1024, max_num_seqs=len(chats))
    plain = LLM(**engine)
    want, plain_s = run(plain, chats, params)
    for o in want:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    num_tokens = sum(len(o.token_ids) for o in want)
    del plain
    specs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 4},
        f"early_exit_{args.draft_layers}": {"method": "early_exit",
                                            "num_speculative_tokens": args.k,
                                            "num_draft_layers": args.draft_layers},
    }
    rows = []
    for name, spec in specs.items():
        llm = LLM(**engine, speculative_config=spec)
        llm.spec.adaptive = False  # draft k at every step: acceptance is the proposer's
        for aware in (False, True):
            llm.spec.proposer.grammar_aware = aware
            before = llm.get_metrics()["spec_decoding"]
            outputs, seconds = run(llm, chats, params)
            after = llm.get_metrics()["spec_decoding"]
            if [o.token_ids for o in outputs] != [o.token_ids for o in want]:
                raise AssertionError(f"{name} (grammar_aware={aware}): not the plain tokens")
            drafts = after["num_drafts"] - before["num_drafts"]
            drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
            accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
            rows.append({"proposer": name, "grammar_aware": aware, "k": args.k,
                         "mean_acceptance_length": 1 + accepted / max(drafts, 1),
                         "draft_acceptance_rate": accepted / max(drafted, 1),
                         "tok_s": num_tokens / seconds, "plain_tok_s": num_tokens / plain_s})
        del llm
    print(f"machine: {machine_description()}; bundled SmolLM2-135M-Instruct {args.dtype}, "
          f"{len(chats)} JSON-schema requests batched, greedy, up to {args.tokens} tokens "
          f"({num_tokens} generated), k={args.k}; outputs equal plain greedy and validate")
    print_table(rows)
    print(json.dumps({"bench": "grammar_drafting", "machine": machine_description(),
                      "rows": rows}))


if __name__ == "__main__":
    main()
