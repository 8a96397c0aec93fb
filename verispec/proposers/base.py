"""The proposer interface and registry (docs/design.md §1, §5).

A proposer guesses up to k draft tokens per running request; the target verifies them all in one
forward. The engine drives every proposer through the same four calls:

    step:    proposal = proposer.propose(requests)        # drafts for every running request
             token_ids = runner.verify(requests, proposal) # target forward + rejection sampler
             ...                                           # engine commits the output tokens
             proposer.on_commit(slots, num_committed_tokens)
    finish:  proposer.free(slot)                           # the request left its slot

Proposers register by name (``@register_proposer("ngram")``) and the engine builds the one that
``SpeculativeConfig.method`` names, with ``build_proposer(config, context)``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

from verispec.config import SpeculativeConfig
from verispec.models.parallel import SINGLE, TensorParallel
from verispec.ops.quant import QuantizedWeight
from verispec.runtime.kv_cache import BlockTables
from verispec.runtime.model_runner import ModelRunner


@runtime_checkable
class ProposalRequest(Protocol):
    """What a proposer reads of one running request (the engine's request object satisfies it).

    Attributes
    ----------
    slot : int
        The request's row in every per-slot buffer (KV caches, the proposer's own state),
        in ``[0, max_num_seqs)``.
    token_ids : [num_tokens] int, numpy array (preferred, read without a copy) or sequence
        The committed tokens so far: prompt, then output. ``num_tokens`` is the committed length,
        so the first draft token occupies absolute position ``num_tokens``.
    max_num_draft_tokens : int
        n_r may not exceed it: k cut so that the drafts fit in ``max_model_len`` and leave room
        for the recovered or bonus token within the request's remaining ``max_tokens``
        (typically ``min(k, max_model_len - num_tokens - 1, max_tokens - num_output_tokens - 1)``
        clamped at 0). 0 means "propose nothing for this request this step".
    temperature : float
        The request's sampling temperature (0 = greedy). Probabilistic drafting samples from
        ``q = softmax(draft_logits / temperature)``; a greedy request drafts the argmax.
    seed : int
        The request's int64 seed; draft sampling draws ``(seed, position, DRAFT_STREAM)``.
    grammar : optional
        Its structured output's matcher (``verispec.sample.grammar.GrammarMatcher``) at the
        committed output, or None; a request without the attribute has no grammar
        (``draft_grammar``). Proposers draft only what it allows (docs/design.md §15).
    """

    slot: int
    token_ids: Any
    max_num_draft_tokens: int
    temperature: float
    seed: int


class DraftProposal(NamedTuple):
    """One step's drafts in the flattened layout of docs/design.md §2 (unpacks as a 3-tuple).

    Attributes
    ----------
    draft_token_ids : [num_draft_tokens] int64, on the proposer's ``device``
        All requests' drafts concatenated in the order of the ``requests`` argument.
    cu_num_draft_tokens : [B + 1] int64, always on the host (CPU), leading 0
        Request r owns ``draft_token_ids[cu[r]:cu[r + 1]]``; n_r = 0 is legal. Every n_r is
        known on the host before the verify forward, so the engine lays out the verify batch
        from it without a device sync (and copies it to the device for the rejection sampler).
    draft_probs : [num_draft_tokens, V] float32, on the proposer's ``device``, or None
        The proposer's distribution q = softmax(draft_logits / T) for each draft (the full
        rule); None for greedy drafts and n-gram (the one-hot rule).
    """

    draft_token_ids: torch.Tensor  # [num_draft_tokens] int64
    cu_num_draft_tokens: torch.Tensor  # [B + 1] int64, CPU
    draft_probs: torch.Tensor | None  # [num_draft_tokens, V] float32

    @property
    def num_draft_tokens_cpu(self) -> np.ndarray:
        """[B] int64 host array: n_r of each request."""
        return np.diff(self.cu_num_draft_tokens.numpy())


@dataclass(frozen=True)
class ProposerContext:
    """What the engine knows at start-up that a proposer may need (n-gram needs none of it).

    ``target_model`` is the target's ``ModelRunner`` in a running engine (EAGLE reads its hidden
    states, early exit drafts with its first layers, final norm and LM head and may share its
    cache; a draft model follows its layout and graphs); tests may give the model itself.
    ``tokenizer`` is the target's (None for a model without one): a draft model's must match.
    """

    max_num_seqs: int = 1
    max_model_len: int = 2048
    vocab_size: int | None = None
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    target_model: Any = None
    tokenizer: Any = None
    # The target's KV block tables: a proposer's own KV cache shares them (its block i belongs
    # to the request that holds the target's block i), so the engine's reservation covers it.
    block_tables: BlockTables | None = None
    # The target's place in a tensor-parallel group: a draft model or head is split the same
    # way (docs/design.md §14).
    tp: TensorParallel = SINGLE
    load_format: str = "auto"  # the target's: a draft model's weights are read (or made) alike


class Proposer(abc.ABC):
    """Base of every proposer: one batched ``propose`` per step, plus cache hooks.

    Contract of ``propose`` (all proposers)
    ----------------------------------------
    - Called once per step; ``on_commit`` for the same requests follows before the next call.
    - Request r gets ``0 <= n_r <= requests[r].max_num_draft_tokens`` drafts; draft i of r
      occupies absolute position ``len(requests[r].token_ids) + i``.
    - Nothing in ``propose`` may read device values back to the host (no ``.item()``,
      ``.tolist()``, ``.cpu()``): n_r is decided on the host, drafts stay on the device.
    - ``uses_draft_probs`` is fixed at construction: True iff ``propose`` returns draft_probs
      (the engine picks the full or the one-hot rule once, not per step).

    Model-based proposers (what ``draft_model`` and ``early_exit`` implement)
    ------------------------------------------------------------------------
    - State per slot in persistent tensors indexed by ``request.slot`` (KV cache rows, the
      number of tokens the proposer's cache holds, ``num_cached_tokens[slot]``), allocated
      once for ``context.max_num_seqs`` slots and ``context.max_model_len`` positions.
    - ``propose`` first feeds the committed tokens its cache lacks,
      ``token_ids[num_cached_tokens[slot]:]`` (the whole prompt on a request's first step, then
      usually just the last committed token; ``d_k`` and the bonus token after a step that
      accepted all k drafts), then runs ``n_r = max_num_draft_tokens`` autoregressive steps
      (n_r is known on the host before any device work). Drafting feeds d_1 .. d_{n_r - 1};
      d_{n_r} is produced but not consumed, so after ``propose`` the cache holds
      ``num_tokens + n_r - 1`` tokens. A request with n_r = 0 may be skipped entirely; its next
      ``propose`` catches up.
    - Greedy drafting (``draft_sample_method="greedy"``): ``argmax`` of the draft logits, no
      logits kept, ``draft_probs=None``.
    - Probabilistic drafting (``"probabilistic"``): draw each draft with
      ``verispec.ops.sample_draft(logits, temperature, seeds, positions)`` where ``positions``
      is the absolute position the draft token occupies (``num_tokens + i``); it samples on the
      draft stream and returns q = softmax(logits / T). Keep the temperature-scaled logits (or
      q) in a float32 ``[max_num_seqs, k, V]`` buffer owned by the proposer, allocated once
      (a CUDA-graph replay only writes buffers that existed at capture), and return q in the
      flattened ``[num_draft_tokens, V]`` layout. float32 because the ratio p/q is sensitive.
    - ``on_commit`` rolls the cache back to the committed tokens it has consumed:
      ``num_cached_tokens[slot] = min(num_cached_tokens[slot], num_committed_tokens - 1)``.
      Positions below ``num_committed_tokens - 1`` hold the accepted drafts, identical to the
      committed tokens; the last committed token (recovered or bonus) was never fed.
    - ``free(slot)`` sets ``num_cached_tokens[slot] = 0``; the slot's next request starts empty.
    - ``draft_model`` builds its own model and KV cache from ``config.model`` and checks that its
      vocabulary equals ``context.vocab_size``. ``early_exit`` drafts with
      ``context.target_model``'s first ``config.num_draft_layers`` layers, final norm and LM head;
      its cache for those layers follows the same ``num_cached_tokens`` rule (it may share the
      target's rows for those layers: the verify forward rewrites the drafted positions with
      the same tokens, and everything past the committed length is dead).
    """

    name: str = ""  # set by @register_proposer
    uses_draft_probs: bool = False
    # What the engine's step uses besides propose / on_commit / free (declared, never probed):
    # the runner a model-based proposer drives (its KV cache shares the target's block tables;
    # the engine sets its ``max_forward_tokens`` and logs its graphs), and the name of its
    # captured draft step in that runner's graphs (its cost is measured at start-up).
    runner: ModelRunner | None = None
    graph_name: str | None = None
    # Whether the proposer's KV at position p depends on the token at p + 1 (an EAGLE head
    # pairs the target's hidden state at p with it): a prefix-cache hit then keeps only blocks
    # completed before the same next token (runtime.prefix_cache).
    shifted_inputs: bool = False
    # Whether drafting follows a request's grammar (structured output): the n-gram and
    # model-based proposers draft only tokens it allows. Exactness never depends on it; a
    # benchmark turns it off to measure the acceptance it gains.
    grammar_aware: bool = True
    # Whether ``runner`` is a causal LM of the proposer's own (a draft model): the engine
    # compiles its prefill steps' kernels at start-up (``ModelRunner.warm_up_kernels``).
    own_causal_lm: bool = False

    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None) -> None:
        self.config = config
        self.context = context if context is not None else ProposerContext()
        self.num_speculative_tokens = config.num_speculative_tokens  # k
        self.device = self.context.device

    @abc.abstractmethod
    def propose(self, requests: Sequence[ProposalRequest]) -> DraftProposal:
        """Draft tokens for every running request of the step.

        Parameters
        ----------
        requests : B running requests (``ProposalRequest``), in the order of the verify batch.

        Returns
        -------
        DraftProposal
            ``(draft_token_ids [num_draft_tokens] int64, cu_num_draft_tokens [B + 1] int64 CPU,
            draft_probs [num_draft_tokens, V] float32 | None)``.
        """

    def draft_grammar(self, request: ProposalRequest):
        """The request's grammar matcher, synced to its committed output, when drafting follows
        it; else None. ``grammar`` is optional in ``ProposalRequest`` (the requests of tests and
        benchmarks need not have one), hence the default."""
        return getattr(request, "grammar", None) if self.grammar_aware else None

    def on_commit(  # noqa: B027 - optional hook, no-op by default
        self, slots: Sequence[int], num_committed_tokens: Sequence[int]
    ) -> None:
        """After verification: request in ``slots[r]`` now has ``num_committed_tokens[r]``
        committed tokens (prompt + output). Roll back any state past them. Host ints; the
        engine has them on the host already (it checks stop conditions token by token)."""

    def free(self, slot: int) -> None:  # noqa: B027 - optional hook, no-op by default
        """The request in ``slot`` finished, was aborted or preempted; forget its state."""

    def capture(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Capture the proposer's CUDA graphs (after the target's; no-op without graphs)."""

    @property
    def draft_cost(self) -> float:
        """One draft token's cost in target decode steps, for the planner's choice of how many
        to draft where step costs are not measured (CPU). Default 0 (a lookup); proposers with
        a model of their own return the ratio of the weights a forward of each reads
        (``matmul_weight_bytes``): a decode step reads every weight once."""
        return 0.0

    def draft_ahead(self, requests: Sequence[ProposalRequest],
                    output_token_ids: torch.Tensor) -> bool:
        """Optionally queue the next step's drafts on the device now, from this step's output
        tokens (``[B, k + 1]`` on the device, -1 padded, not yet read by the host), so the
        device drafts while the host commits. ``propose`` uses them only if the next step is
        these requests continuing with exactly those tokens; otherwise it drafts as usual.
        Returns whether drafts were queued (default: never)."""
        return False


def matmul_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a one-token forward of ``model`` reads (a decode step is bound by
    them): its 2-D parameters but the embedding tables (a lookup), plus an LM head tied to one
    of them; GGUF weights kept quantised (``ops.quant``) count their packed bytes, so a
    float32 EAGLE head over a 4-bit target costs what it reads."""
    total, seen = 0, set()
    for name, p in model.named_parameters():
        if p.dim() == 2 and "embed" not in name:
            total += p.numel() * p.element_size()
            seen.add(p.data_ptr())
    for name, m in model.named_modules():
        if isinstance(m, QuantizedWeight) and "embed" not in name:
            total += _packed_bytes(m)
    head = getattr(model, "lm_head_weight", None)
    if isinstance(head, torch.Tensor) and head.data_ptr() not in seen:
        total += head.numel() * head.element_size()
    elif isinstance(head, QuantizedWeight) and head is getattr(model, "embed_weight", None):
        total += _packed_bytes(head)
    return total


def _packed_bytes(weight: QuantizedWeight) -> int:
    return sum(b.numel() * b.element_size() for b in weight.buffers())


ProposerT = TypeVar("ProposerT", bound=Proposer)

_PROPOSERS: dict[str, type[Proposer]] = {}


def register_proposer(name: str) -> Callable[[type[ProposerT]], type[ProposerT]]:
    """Class decorator: make a ``Proposer`` subclass available as ``SpeculativeConfig.method``."""

    def decorator(cls: type[ProposerT]) -> type[ProposerT]:
        if not (isinstance(cls, type) and issubclass(cls, Proposer)):
            raise TypeError(f"@register_proposer({name!r}) needs a Proposer subclass, got {cls!r}")
        existing = _PROPOSERS.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"proposer {name!r} is already registered to {existing.__qualname__}"
            )
        cls.name = name
        _PROPOSERS[name] = cls
        return cls

    return decorator


def available_proposers() -> list[str]:
    """Registered proposer names, sorted (the CLI's ``--speculative-method`` choices)."""
    return sorted(_PROPOSERS)


def get_proposer_cls(name: str) -> type[Proposer]:
    """The class registered as ``name``; an unknown name is a ValueError listing the known."""
    try:
        return _PROPOSERS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"speculative method must be one of {available_proposers()}, got {name!r}"
        ) from None


def build_proposer(config: SpeculativeConfig, context: ProposerContext | None = None) -> Proposer:
    """The proposer that ``config.method`` names, built for ``context``."""
    return get_proposer_cls(config.method)(config, context)
