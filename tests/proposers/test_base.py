"""Proposer interface and registry.

Strategy: the registry's contract (names, errors, decorator checks, construction from a
``SpeculativeConfig``), then a toy model-based proposer written only from the ``Proposer``
docstring (a bigram "model" with a per-slot token cache standing in for a KV cache) driven
through simulated steps: after every ``on_commit`` its cache must hold exactly a prefix of the
committed tokens, and the next ``propose`` must feed exactly the missing ones (the prompt, the
last output token, or ``d_k`` plus the bonus token after a fully accepted step). Probabilistic
drafting goes through ``verispec.ops.sample_draft`` and returns q rows that are distributions.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from verispec import ops
from verispec.config import SpeculativeConfig
from verispec.proposers import (
    DraftProposal,
    NgramProposer,
    ProposalRequest,
    Proposer,
    ProposerContext,
    available_proposers,
    base,
    build_proposer,
    get_proposer_cls,
    register_proposer,
)


@dataclass
class Request:
    token_ids: list[int]
    max_num_draft_tokens: int
    slot: int = 0
    temperature: float = 0.0
    seed: int = 0


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made in a test do not leak into the others."""
    monkeypatch.setattr(base, "_PROPOSERS", dict(base._PROPOSERS))


def test_ngram_is_registered():
    assert "ngram" in available_proposers()
    assert get_proposer_cls("ngram") is NgramProposer
    assert NgramProposer.name == "ngram"
    assert isinstance(build_proposer(SpeculativeConfig(method="ngram")), NgramProposer)


def test_unknown_name_lists_registered():
    with pytest.raises(ValueError, match=r"must be one of \[.*'ngram'.*\], got 'eagle9'"):
        get_proposer_cls("eagle9")
    with pytest.raises(ValueError, match="got 'nope'"):
        build_proposer(SpeculativeConfig(method="nope"))
    with pytest.raises(ValueError, match="got None"):
        get_proposer_cls(None)


def test_register_checks(scratch_registry):
    @register_proposer("toy")
    class Toy(Proposer):
        def propose(self, requests):
            raise NotImplementedError

    assert get_proposer_cls("toy") is Toy and Toy.name == "toy"
    assert available_proposers() == sorted(available_proposers())
    assert register_proposer("toy")(Toy) is Toy  # re-registering the same class is harmless
    with pytest.raises(ValueError, match="already registered"):

        @register_proposer("toy")
        class Other(Proposer):
            def propose(self, requests):
                raise NotImplementedError

    with pytest.raises(TypeError, match="needs a Proposer subclass"):
        register_proposer("bad")(object)
    assert "toy" not in base._PROPOSERS or "bad" not in base._PROPOSERS


def test_proposer_is_abstract():
    with pytest.raises(TypeError):
        Proposer(SpeculativeConfig())  # type: ignore[abstract]


def test_draft_proposal_is_a_3_tuple():
    proposal = DraftProposal(torch.tensor([4, 5, 6]), torch.tensor([0, 2, 2, 3]), None)
    draft_token_ids, cu_num_draft_tokens, draft_probs = proposal
    assert draft_token_ids.tolist() == [4, 5, 6] and draft_probs is None
    assert proposal.num_draft_tokens_cpu.tolist() == [2, 0, 1]


def test_request_protocol():
    assert isinstance(Request([1], 1), ProposalRequest)


class BigramDraftProposer(Proposer):
    """A model-based proposer built from the base docstring: logits = table[last token]."""

    def __init__(self, config: SpeculativeConfig, context: ProposerContext, table: torch.Tensor):
        super().__init__(config, context)
        self.table = table  # [V, V] float32
        self.uses_draft_probs = config.draft_sample_method == "probabilistic"
        k = config.num_speculative_tokens
        n, max_len, vocab = context.max_num_seqs, context.max_model_len, table.shape[0]
        self.cache = torch.full((n, max_len), -1, dtype=torch.int64)  # fed token at each position
        self.num_cached_tokens = np.zeros(n, dtype=np.int64)
        self.logits_buffer = torch.zeros(n, k, vocab, dtype=torch.float32)  # [max_num_seqs, k, V]
        self.num_fed_last_step: dict[int, int] = {}

    def _feed(self, slot: int, token_ids: Sequence[int]) -> None:
        start = int(self.num_cached_tokens[slot])
        self.cache[slot, start : start + len(token_ids)] = torch.tensor(token_ids)
        self.num_cached_tokens[slot] = start + len(token_ids)

    def propose(self, requests):
        drafts, probs, cu = [], [], [0]
        for request in requests:
            slot, num_tokens = request.slot, len(request.token_ids)
            missing = request.token_ids[int(self.num_cached_tokens[slot]) :]
            self.num_fed_last_step[slot] = len(missing)
            self._feed(slot, missing)
            last = request.token_ids[-1]
            n = request.max_num_draft_tokens
            for i in range(n):
                logits = self.table[last][None]  # [1, V]
                self.logits_buffer[slot, i] = logits[0]
                temperature = torch.tensor([request.temperature if self.uses_draft_probs else 0.0])
                draft, q = ops.sample_draft(
                    logits, temperature, torch.tensor([request.seed]),
                    torch.tensor([num_tokens + i]),
                )
                drafts.append(int(draft))
                probs.append(q[0])
                if i < n - 1:  # d_n is produced, not consumed
                    self._feed(slot, [int(draft)])
                last = int(draft)
            cu.append(cu[-1] + n)
        draft_probs = None
        if self.uses_draft_probs:
            draft_probs = torch.stack(probs) if probs else torch.zeros(0, self.table.shape[0])
        return DraftProposal(torch.tensor(drafts, dtype=torch.int64),
                             torch.tensor(cu, dtype=torch.int64), draft_probs)

    def on_commit(self, slots, num_committed_tokens):
        for slot, num in zip(slots, num_committed_tokens):
            self.num_cached_tokens[slot] = min(self.num_cached_tokens[slot], num - 1)

    def free(self, slot):
        self.num_cached_tokens[slot] = 0


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_model_proposer_contract_over_steps(draft_sample_method):
    rng = random.Random(3)
    vocab, k = 11, 3
    config = SpeculativeConfig(method="toy", num_speculative_tokens=k,
                               draft_sample_method=draft_sample_method)
    context = ProposerContext(max_num_seqs=4, max_model_len=256, vocab_size=vocab)
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
    proposer = BigramDraftProposer(config, context, table)
    requests = [Request([rng.randrange(vocab) for _ in range(rng.randint(1, 6))], k, slot=s,
                        temperature=0.8, seed=100 + s) for s in range(4)]
    prompt_lens = [len(r.token_ids) for r in requests]
    saw_all_accepted = False
    for step in range(40):
        for request in requests:
            request.max_num_draft_tokens = rng.randint(0, k)
        before = [len(r.token_ids) for r in requests]
        proposal = proposer.propose(requests)
        cu = proposal.cu_num_draft_tokens.tolist()
        if proposal.draft_probs is not None:
            assert proposal.draft_probs.shape == (cu[-1], vocab)
            assert proposal.draft_probs.dtype == torch.float32
            torch.testing.assert_close(proposal.draft_probs.sum(-1), torch.ones(cu[-1]))
        for r, request in enumerate(requests):
            n = cu[r + 1] - cu[r]
            num_fed = proposer.num_fed_last_step[request.slot]
            if step == 0:
                assert num_fed == prompt_lens[r]  # the whole prompt first
            # After drafting: the committed tokens plus d_1 .. d_{n-1}.
            assert proposer.num_cached_tokens[request.slot] == before[r] + max(n - 1, 0)
            # Verification (simulated): accept a leading run, then a recovered or bonus token.
            accepted = rng.randint(0, n)
            saw_all_accepted |= accepted == n > 0
            drafts = proposal.draft_token_ids[cu[r] : cu[r] + accepted].tolist()
            request.token_ids += drafts + [rng.randrange(vocab)]
        proposer.on_commit([r.slot for r in requests], [len(r.token_ids) for r in requests])
        for request in requests:
            num_cached = int(proposer.num_cached_tokens[request.slot])
            assert num_cached <= len(request.token_ids) - 1
            assert proposer.cache[request.slot, :num_cached].tolist() == (
                request.token_ids[:num_cached]
            )
    assert saw_all_accepted
    proposer.free(2)
    assert proposer.num_cached_tokens[2] == 0


def test_model_proposer_feeds_dk_and_bonus_after_full_acceptance():
    vocab, k = 7, 3
    config = SpeculativeConfig(method="toy", num_speculative_tokens=k)
    proposer = BigramDraftProposer(config, ProposerContext(max_num_seqs=1, max_model_len=64),
                                   torch.randn(vocab, vocab))
    request = Request([1, 2, 3], k)
    drafts = proposer.propose([request]).draft_token_ids.tolist()
    request.token_ids += drafts + [5]  # all k accepted, then the bonus token
    proposer.on_commit([0], [len(request.token_ids)])
    assert proposer.num_cached_tokens[0] == 3 + k - 1  # d_k never fed
    proposer.propose([request])
    assert proposer.num_fed_last_step[0] == 2  # d_k and the bonus token
