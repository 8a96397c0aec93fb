"""Structured output's grammars compiled for the model's vocabulary (docs/design.md §15).

The grammar engine is llguidance (PyPI ``llguidance``): one abi3 wheel with no dependencies
(xgrammar, the other well-kept choice, pulls Triton and a TVM runtime into a CPU install), a
mask in tens of microseconds computed lazily from the parser state (no per-grammar
precompilation, so a new JSON schema costs about a millisecond), JSON schema, regex, choice
lists and Lark / GBNF grammars from one compiler, and ``validate_tokens`` / ``rollback``,
which are what speculation needs. ``GrammarCompiler`` turns a request's
``StructuredOutputsParams`` into its ``GrammarMatcher`` (``verispec.sample.grammar``).
"""

from __future__ import annotations

import collections
import json
import os
import weakref

import llguidance

from verispec.sample.grammar import GrammarMatcher
from verispec.sampling_params import StructuredOutputsParams


def mask_threads(device_type: str) -> int:
    """Threads a batch's grammar masks are computed on beside an engine on a ``device_type``
    device: on a GPU the host is otherwise idle while it computes them (half its cores, at most
    8: 64 JSON masks 3.6 -> 1.5 ms on the H200's host, docs/benchmarks.md); on the CPU its cores
    run the model's kernels, and the masks stay on the engine's thread."""
    if device_type != "cuda":
        return 1
    return max(1, min(8, (os.cpu_count() or 1) // 2))


class LazyCompiler:
    """The compiler of a tokenizer, built at the first call (building llguidance's view of a
    vocabulary of 50k tokens takes about a second: only engines that see a grammar pay it);
    ``threads`` as ``GrammarCompiler``'s."""

    def __init__(self, tokenizer, vocab_size: int, threads: int = 1) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.threads = threads
        self._compiler: GrammarCompiler | None = None

    def __call__(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler.from_tokenizer(self.tokenizer, self.vocab_size,
                                                            self.threads)
        return self._compiler


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer (the model's vocabulary).

    A grammar is compiled once: the compiled matcher is kept (the last ``CACHED_GRAMMARS``
    grammars, by their text) and each request gets a copy of it (``LLMatcher.deep_copy``, ~2 us
    against ~1.7 ms a compilation). The copies share the grammar's lexer, whose states one
    request builds and the others reuse: 64 requests of one JSON schema computed their masks in
    2.1 ms against 3.6 ms as 64 compilations (2-core CPU, random walks through the schema).

    ``threads`` > 1: ``compute_masks`` computes a batch's masks on that many threads
    (llguidance's ``LLExecutor``). A shared lexer sits behind a lock held through a whole mask,
    so copies of one compilation compute their masks one at a time whatever the threads: a
    grammar is compiled up to ``threads`` times (its lanes) and a new matcher takes the lane
    with the fewest live matchers; a lane is compiled only when every lane has one (so a
    grammar whose requests come one at a time keeps one compilation and one lexer)."""

    CACHED_GRAMMARS = 64

    def __init__(self, ll_tokenizer: llguidance.LLTokenizer, vocab_size: int,
                 threads: int = 1) -> None:
        self.ll_tokenizer = ll_tokenizer
        self.vocab_size = vocab_size
        self.threads = max(1, int(threads))
        self.executor = llguidance.LLExecutor(self.threads) if self.threads > 1 else None
        # grammar text -> (its lanes' compiled matchers, the live matchers of each lane)
        self._compiled: collections.OrderedDict[str, tuple[list[llguidance.LLMatcher], list[int]]]
        self._compiled = collections.OrderedDict()

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, threads: int = 1) -> GrammarCompiler:
        """From a Hugging Face tokenizer; the masks cover ``vocab_size`` token ids (tokens past
        the tokenizer's are always masked)."""
        if tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer, and this model "
                             "has none")
        # imported here, not at the top: llguidance.hf imports transformers' model machinery
        # (torch.distributed.tensor, sympy: ~1 s, ~40 MB), which only engines that see a
        # grammar need
        import llguidance.hf

        # a GGUF's tokenizer without transformers (models.fast_tokenizer) hands over the
        # transformers one, which llguidance reads
        hf = getattr(tokenizer, "hf_tokenizer", tokenizer)
        return cls(llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size), vocab_size, threads)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher; ValueError naming the field when the grammar does not compile."""
        name, grammar = _grammar(params)
        entry = self._compiled.get(grammar)
        if entry is None:
            error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
            if error:
                raise ValueError(f"structured_outputs.{name} cannot be compiled: "
                                 f"{error.strip()[:500]}")
            entry = self._compiled[grammar] = ([self._compile(name, grammar)], [0])
            if len(self._compiled) > self.CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        if self.threads == 1:
            return GrammarMatcher(entry[0][0].deep_copy(), self.vocab_size)
        lanes, live = entry
        lane = min(range(len(lanes)), key=live.__getitem__)
        if live[lane] and len(lanes) < self.threads:  # every lane in use: one more
            lanes.append(self._compile(name, grammar))
            live.append(0)
            lane = len(lanes) - 1
        live[lane] += 1
        matcher = GrammarMatcher(lanes[lane].deep_copy(), self.vocab_size, lane, self.executor)
        weakref.finalize(matcher, _leave_lane, live, lane)
        return matcher

    def _compile(self, name: str, grammar: str) -> llguidance.LLMatcher:
        compiled = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise ValueError(f"structured_outputs.{name} cannot be compiled: "
                             f"{compiled.get_error()[:500]}")
        return compiled


def _leave_lane(live: list[int], lane: int) -> None:
    live[lane] -= 1  # a matcher of the lane was dropped


def _grammar(params: StructuredOutputsParams) -> tuple[str, str]:
    """(the field, llguidance's grammar text)."""
    try:
        if params.json is not None:
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return "json", _json_grammar(schema)
        if params.json_object:
            return "json_object", _json_grammar('{"type": "object"}')
        if params.regex is not None:
            return "regex", llguidance.grammar_from("regex", params.regex)
        if params.choice is not None:
            return "choice", llguidance.grammar_from("choice", json.dumps(list(params.choice)))
        return "grammar", llguidance.grammar_from("grammar", params.grammar)
    except Exception as e:  # a parse error of the grammar's text
        name = next(n for n in ("json", "json_object", "regex", "choice", "grammar")
                    if getattr(params, n) not in (None, False))
        raise ValueError(f"structured_outputs.{name} cannot be compiled: {e}"[:600]) from None


def _json_grammar(schema: str) -> str:
    """JSON of the schema without free whitespace between tokens: a model may otherwise emit
    whitespace forever, and the compact form is what a parser reads the same."""
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})
