"""Draft-model proposer (docs/design.md §5): a second, smaller Llama-family model drafts k tokens.

``DraftModelProposer`` adds loading the draft model and checking its vocabulary against the
target's (``check_vocab_sizes``) to ``ModelProposer`` (``verispec.proposers.model_proposer``),
which drafts: the catch-up feed, the n_r batched autoregressive steps, the per-slot draft
buffers and the rollback at commit; its CUDA graphs and drafting ahead are
``verispec.proposers.model_graph``, its token trees ``verispec.proposers.draft_tree``.
"""

from __future__ import annotations

from verispec.config import SpeculativeConfig
from verispec.models.loader import load_model
from verispec.proposers.base import ProposerContext, register_proposer
from verispec.proposers.model_proposer import ModelProposer
from verispec.runtime.model_runner import ModelRunner


def check_vocab_sizes(
    draft_vocab_size: int,
    target_vocab_size: int | None,
    model_path: str,
    draft_tokenizer=None,
    target_tokenizer=None,
) -> None:
    """ValueError naming both sizes and the draft model when the vocabularies differ (the
    model's embedding rows, and the tokenizers' sizes when both are known)."""
    if target_vocab_size is not None and draft_vocab_size != target_vocab_size:
        raise ValueError(
            f"draft model {model_path!r} has vocab_size={draft_vocab_size}, but the target has "
            f"vocab_size={target_vocab_size}: a draft model must share the target's vocabulary"
        )
    if draft_tokenizer is not None and target_tokenizer is not None:
        num_draft, num_target = len(draft_tokenizer), len(target_tokenizer)
        if num_draft != num_target:
            raise ValueError(
                f"draft model {model_path!r} has a tokenizer of {num_draft} tokens, but the "
                f"target's tokenizer has {num_target}: a draft model must share the target's "
                "vocabulary"
            )
        draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
        if draft_vocab != target_vocab:
            differ = sorted(t for t in draft_vocab.keys() ^ target_vocab.keys())[:3] or sorted(
                t for t in draft_vocab if draft_vocab[t] != target_vocab[t])[:3]
            raise ValueError(
                f"draft model {model_path!r} has a tokenizer of the target's size whose tokens "
                f"differ (e.g. {differ!r}): a draft model must share the target's vocabulary")


@register_proposer("draft_model")
class DraftModelProposer(ModelProposer):
    """A second model, loaded from ``config.model`` (a local HF directory or a ``.gguf`` file)
    with ``context.dtype`` on ``context.device``, with its own KV cache of
    ``context.max_num_seqs`` slots x ``context.max_model_len`` positions over the same slot
    numbers as the target.

    Its vocabulary must equal ``context.vocab_size`` (or, when that is None, the vocabulary of
    ``context.target_model``'s config); when both tokenizers are known (the
    draft directory's, and ``context.tokenizer`` or ``context.target_model.tokenizer``) their
    sizes must agree as well.
    """

    captures_positions = True
    own_causal_lm = True

    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None) -> None:
        super().__init__(config, context)

        if config.model is None:
            raise ValueError(
                "speculative method 'draft_model' needs the draft model: set "
                "SpeculativeConfig.model to a local HF directory or .gguf file"
            )
        ctx = self.context
        self.loaded = load_model(config.model, ctx.dtype, ctx.device, tp=ctx.tp,
                                 load_format=ctx.load_format)
        target_tokenizer = ctx.tokenizer
        if target_tokenizer is None:  # a LoadedModel given as the target
            target_tokenizer = getattr(ctx.target_model, "tokenizer", None)
        target_vocab_size = ctx.vocab_size
        if target_vocab_size is None:  # the target's config (a runner, a model or a LoadedModel)
            target_vocab_size = getattr(getattr(ctx.target_model, "config", None), "vocab_size",
                                        None)
        check_vocab_sizes(
            self.loaded.config.vocab_size, target_vocab_size, str(config.model),
            self.loaded.tokenizer, target_tokenizer,
        )
        target_graphs = getattr(ctx.target_model, "graphs", None)
        self.runner = ModelRunner(
            self.loaded.model, ctx.max_num_seqs, ctx.max_model_len, ctx.device,
            max_step_tokens=max(config.num_speculative_tokens,
                                len(config.tree_parents or ())) + 1,
            enforce_eager=ctx.device.type == "cuda" and target_graphs is None,
            # drafts decide which tokens a sampled request emits: batch invariant like the target
            batch_invariant=getattr(ctx.target_model, "batch_invariant", True),
            block_tables=ctx.block_tables)
        if target_graphs is not None and self.runner.graphs is not None:
            self.runner.graphs.pool = target_graphs.pool  # one memory pool for every capture
        self._init_buffers(ctx.max_num_seqs, self.loaded.config.vocab_size)
