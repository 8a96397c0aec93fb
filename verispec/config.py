"""Frozen configuration dataclasses that validate themselves (docs/design.md §3, §5).

``SpeculativeConfig`` uses vLLM's ``speculative_config`` key names so a vLLM dict carries over
unchanged through ``SpeculativeConfig.from_dict``.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from verispec.ops.tree import (
    MAX_DYNAMIC_CANDIDATES,
    DynamicTree,
    StaticTree,
    parents_from_paths,
)

REJECTION_SAMPLE_METHODS = ("standard", "synthetic")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
DEFAULT_PROMPT_LOOKUP = 5
# Tolerance for rounding in user-given rates, e.g. a rate of 1.0000000001 from arithmetic.
_RATE_EPS = 1e-9


def acceptance_length_to_rates(length: float, k: int) -> list[float]:
    """Minimum-variance unconditional rates for a mean acceptance length.

    ``L = 1 + sum(a_i)`` counts the bonus or recovered token, so ``L`` must lie in ``[1, k + 1]``.
    The schedule accepts whole positions with certainty and leaves one fractional position:
    ``[1.0] * floor(L - 1) + [L - 1 - floor(L - 1)] + [0.0] * rest``, cut to ``k``.

    >>> acceptance_length_to_rates(2.6, 3)
    [1.0, 0.6, 0.0]
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
    if not isinstance(length, (int, float)) or isinstance(length, bool) or math.isnan(length):
        raise ValueError(f"synthetic_acceptance_length must be a number, got {length!r}")
    if not 1.0 <= length <= k + 1:
        raise ValueError(
            f"synthetic_acceptance_length must be in [1, {k + 1}] for num_speculative_tokens={k}, "
            f"got {length!r}"
        )
    extra = float(length) - 1.0
    whole = math.floor(extra)
    rates = [1.0] * whole + [round(extra - whole, 12)]
    rates = (rates + [0.0] * k)[:k]
    return rates


def unconditional_to_conditional_rates(rates: Sequence[float]) -> list[float]:
    """Conditional per-position rates ``c_i = a_i / a_{i-1}`` (``c_1 = a_1``; 0 after a zero).

    >>> unconditional_to_conditional_rates([1.0, 0.6, 0.0, 0.0])
    [1.0, 0.6, 0.0, 0.0]
    """
    conditional = []
    prev = 1.0
    for a in rates:
        conditional.append(0.0 if prev == 0.0 else min(1.0, a / prev))
        prev = a
    return conditional


def _check_rates(rates: Any, k: int) -> list[float]:
    if not isinstance(rates, (list, tuple)):
        raise ValueError(f"synthetic_acceptance_rates must be a list of {k} numbers, got {rates!r}")
    if len(rates) != k:
        raise ValueError(
            f"synthetic_acceptance_rates must have num_speculative_tokens={k} entries, "
            f"got {len(rates)}: {list(rates)!r}"
        )
    for a in rates:
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ValueError(f"synthetic_acceptance_rates must lie in [0, 1], got {list(rates)!r}")
    for prev, cur in zip(rates, rates[1:]):
        if cur > prev + _RATE_EPS:
            raise ValueError(
                "synthetic_acceptance_rates are unconditional (P(first i drafts accepted)) and "
                f"must be non-increasing, got {list(rates)!r}"
            )
    return [float(a) for a in rates]


# The most draft tokens per step (k); EAGLE-style and draft-model proposers use up to ~10.
MAX_SPECULATIVE_TOKENS = 32
# Method-specific keys (with their defaults) and the methods that use them.
METHOD_KEYS_DEFAULTS = {"model": None, "prompt_lookup_min": None, "prompt_lookup_max": None,
                        "num_draft_layers": None, "draft_sample_method": "greedy",
                        "speculative_token_tree": None, "speculative_eagle_topk": None,
                        "speculative_num_draft_tokens": None}
# EAGLE-2's dynamic tree (SGLang's key names and meanings)
DYNAMIC_TREE_KEYS = {"speculative_eagle_topk", "speculative_num_draft_tokens"}
METHOD_KEYS = {
    "ngram": {"prompt_lookup_min", "prompt_lookup_max"},
    "draft_model": {"model", "draft_sample_method", "speculative_token_tree"},
    "early_exit": {"num_draft_layers", "draft_sample_method"},
    # model: the EAGLE head's directory
    "eagle": {"model", "draft_sample_method", "speculative_token_tree"} | DYNAMIC_TREE_KEYS,
    "eagle3": {"model", "draft_sample_method", "speculative_token_tree"} | DYNAMIC_TREE_KEYS,
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings, named as vLLM's ``speculative_config``.

    ``method``: proposer name (``"ngram"``, ``"draft_model"``, ``"early_exit"``, ``"eagle"``,
    ``"eagle3"``; validated against the proposer registry by the engine). ``model``: the draft
    model for ``"draft_model"``, the head's directory for ``"eagle"`` / ``"eagle3"``.
    ``rejection_sample_method``: ``"standard"`` (exact) or ``"synthetic"`` (benchmarking,
    docs/design.md §3 rule 4), which takes exactly one of ``synthetic_acceptance_rates``
    (unconditional, length k) or ``synthetic_acceptance_length``.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    rejection_sample_method: str = "standard"
    draft_sample_method: str = "greedy"
    synthetic_acceptance_rates: Sequence[float] | None = None
    synthetic_acceptance_length: float | None = None
    num_draft_layers: int | None = None  # early_exit: how many target layers draft
    # A static token tree (docs/design.md §16), vLLM's format: a list of paths of child indices
    # from the root, or its string form; its depth must be num_speculative_tokens.
    speculative_token_tree: str | Sequence[Sequence[int]] | None = None
    # EAGLE-2's dynamic tree (docs/design.md §16), SGLang's keys: num_speculative_tokens levels,
    # speculative_eagle_topk children per expanded node and speculative_eagle_topk nodes
    # expanded per level, pruned to speculative_num_draft_tokens tokens verified per request
    # (the last committed token included, as in SGLang: the tree keeps that many - 1 drafts).
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    # Derived in __post_init__: the unconditional rates a_1..a_k for synthetic mode.
    unconditional_rates: tuple[float, ...] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] "
                f"(each slot keeps k draft rows, k x vocab_size floats when probabilistic), "
                f"got {k!r}")
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"method must be a proposer name, got {self.method!r}")
        if self.rejection_sample_method not in REJECTION_SAMPLE_METHODS:
            raise ValueError(
                f"rejection_sample_method must be one of {REJECTION_SAMPLE_METHODS}, "
                f"got {self.rejection_sample_method!r}"
            )
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(
                f"draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, "
                f"got {self.draft_sample_method!r}"
            )
        if self.num_draft_layers is not None and (
            isinstance(self.num_draft_layers, bool)
            or not isinstance(self.num_draft_layers, int)
            or self.num_draft_layers < 1
        ):
            raise ValueError(
                f"num_draft_layers must be an integer >= 1, got {self.num_draft_layers!r}"
            )
        self._check_method_keys()  # before the prompt lookup's derived defaults are filled in
        self._check_prompt_lookup()
        self._check_synthetic()
        self._check_token_tree()
        self._check_dynamic_tree()

    def _check_method_keys(self) -> None:
        """A key the method does not use is an error, not silently ignored (methods registered
        elsewhere are not checked)."""
        given = [name for name in METHOD_KEYS_DEFAULTS
                 if getattr(self, name) != METHOD_KEYS_DEFAULTS[name]]
        used = METHOD_KEYS.get(self.method)
        unused = [name for name in given if used is not None and name not in used]
        if unused:
            raise ValueError(
                f"speculative method {self.method!r} does not use "
                + ", ".join(f"{name}={getattr(self, name)!r}" for name in unused)
                + f"; it takes {sorted(used) or 'none of the method-specific keys'}")

    def _check_prompt_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        used = METHOD_KEYS.get(self.method, {"prompt_lookup_min"})
        if lo is None and hi is None and "prompt_lookup_min" not in used:
            return  # left unset where unused, so the config rebuilds from its own fields
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        if lo > hi:
            raise ValueError(
                f"prompt_lookup_min must be <= prompt_lookup_max, got prompt_lookup_min={lo} "
                f"and prompt_lookup_max={hi}"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _check_synthetic(self) -> None:
        rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        k = self.num_speculative_tokens
        if self.rejection_sample_method != "synthetic":
            if rates is not None or length is not None:
                given = "synthetic_acceptance_rates" if rates is not None else (
                    "synthetic_acceptance_length"
                )
                raise ValueError(
                    f"{given} is only used with rejection_sample_method='synthetic', "
                    f"got rejection_sample_method={self.rejection_sample_method!r}"
                )
            return
        if (rates is None) == (length is None):
            raise ValueError(
                "rejection_sample_method='synthetic' needs exactly one of "
                "synthetic_acceptance_rates and synthetic_acceptance_length, got "
                f"synthetic_acceptance_rates={rates!r} and synthetic_acceptance_length={length!r}"
            )
        if rates is not None:
            unconditional = _check_rates(rates, k)
            object.__setattr__(self, "synthetic_acceptance_rates", tuple(unconditional))
        else:
            unconditional = acceptance_length_to_rates(length, k)
        object.__setattr__(self, "unconditional_rates", tuple(unconditional))

    def _check_token_tree(self) -> None:
        tree = self.speculative_token_tree
        if tree is None:
            return
        if isinstance(tree, str):
            try:
                tree = ast.literal_eval(tree)
            except (ValueError, SyntaxError) as error:
                raise ValueError(f"speculative_token_tree must be a list of tuples of child "
                                 f"indices, got {self.speculative_token_tree!r}") from error
        try:
            paths = tuple(tuple(int(i) for i in path) for path in tree)
        except (TypeError, ValueError) as error:
            raise ValueError(f"speculative_token_tree must be a list of tuples of child "
                             f"indices, got {self.speculative_token_tree!r}") from error
        if not paths:
            raise ValueError("speculative_token_tree must hold at least one path, got []")
        parents_from_paths(paths)  # ValueError naming the bad path
        depth = max(len(path) for path in paths)
        if depth != self.num_speculative_tokens:
            raise ValueError(
                f"speculative_token_tree has depth {depth}; num_speculative_tokens must equal "
                f"it, got num_speculative_tokens={self.num_speculative_tokens}")
        if self.is_synthetic:
            raise ValueError("speculative_token_tree: token trees are verified by the standard "
                             "rule, not rejection_sample_method='synthetic'")
        object.__setattr__(self, "speculative_token_tree", paths)

    def _check_dynamic_tree(self) -> None:
        topk, total = self.speculative_eagle_topk, self.speculative_num_draft_tokens
        if topk is None and total is None:
            return
        if topk is None or total is None:
            raise ValueError(
                "an EAGLE dynamic tree needs both speculative_eagle_topk and "
                f"speculative_num_draft_tokens, got speculative_eagle_topk={topk!r} and "
                f"speculative_num_draft_tokens={total!r}")
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"speculative_eagle_topk must be an integer >= 1, got {topk!r}")
        k = self.num_speculative_tokens
        most = 1 + DynamicTree.num_candidates(k, topk)
        if isinstance(total, bool) or not isinstance(total, int) or not 2 <= total <= most:
            raise ValueError(
                f"speculative_num_draft_tokens (tokens verified per request, the last committed "
                f"one included) must be an integer in [2, {most}] for num_speculative_tokens="
                f"{k} and speculative_eagle_topk={topk}, got {total!r}")
        if most - 1 > MAX_DYNAMIC_CANDIDATES:
            raise ValueError(
                f"speculative_eagle_topk={topk} over num_speculative_tokens={k} levels drafts "
                f"{most - 1} candidates, more than {MAX_DYNAMIC_CANDIDATES}")
        if self.speculative_token_tree is not None:
            raise ValueError("speculative_token_tree (a static tree) and speculative_eagle_topk "
                             "/ speculative_num_draft_tokens (a dynamic tree) exclude each other")
        if self.is_synthetic:
            raise ValueError("speculative_eagle_topk: token trees are verified by the standard "
                             "rule, not rejection_sample_method='synthetic'")

    @property
    def is_tree(self) -> bool:
        """Token trees (a static or a dynamic one) instead of a chain of k drafts."""
        return self.speculative_token_tree is not None or self.speculative_eagle_topk is not None

    @property
    def tree_key(self) -> str:
        """The key that asked for token trees (error messages name it)."""
        return ("speculative_eagle_topk" if self.speculative_eagle_topk is not None
                else "speculative_token_tree")

    @property
    def max_tree_tokens(self) -> int:
        """The most draft tokens one request verifies in a step: k for a chain, else a tree's
        nodes."""
        if self.speculative_token_tree is not None:
            return len(self.speculative_token_tree)
        if self.speculative_eagle_topk is not None:
            return self.speculative_num_draft_tokens - 1
        return self.num_speculative_tokens

    def tree_shape(self):
        """The engine's tree: ``ops.tree.StaticTree``, ``ops.tree.DynamicTree`` or None (a
        chain)."""
        if self.speculative_token_tree is not None:
            return StaticTree(self.tree_parents)
        if self.speculative_eagle_topk is not None:
            return DynamicTree(self.num_speculative_tokens, self.speculative_eagle_topk,
                               self.speculative_num_draft_tokens - 1)
        return None

    @property
    def tree_parents(self) -> list[int] | None:
        """Each tree node's parent (local index, -1 = the root) in the order of
        ``speculative_token_tree``; None for a chain."""
        if self.speculative_token_tree is None:
            return None
        return parents_from_paths(self.speculative_token_tree)

    @property
    def conditional_rates(self) -> list[float] | None:
        """Per-position conditional rates ``c_i`` for synthetic mode, else None."""
        if self.unconditional_rates is None:
            return None
        return unconditional_to_conditional_rates(self.unconditional_rates)

    @property
    def mean_acceptance_length(self) -> float | None:
        """Configured ``L = 1 + sum(a_i)`` in synthetic mode, else None."""
        if self.unconditional_rates is None:
            return None
        return 1.0 + sum(self.unconditional_rates)

    @property
    def is_synthetic(self) -> bool:
        return self.rejection_sample_method == "synthetic"

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        """Build from a vLLM ``speculative_config`` dict; an unknown key is an error naming it."""
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {config!r}")
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {unknown}; known keys: {sorted(known)}"
            )
        return cls(**config)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
