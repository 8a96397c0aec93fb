"""Proposers: the base class, the registry and the registered proposers (docs/design.md §5).

Importing this package registers every built-in proposer, so ``available_proposers()`` lists
them all.
"""

from verispec.proposers.base import (
    DraftProposal,
    ProposalRequest,
    Proposer,
    ProposerContext,
    available_proposers,
    build_proposer,
    get_proposer_cls,
    register_proposer,
)
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.eagle import Eagle3Proposer, EagleProposer
from verispec.proposers.early_exit import EarlyExitProposer
from verispec.proposers.ngram import NgramProposer, ngram_lookup

__all__ = [
    "DraftModelProposer",
    "DraftProposal",
    "Eagle3Proposer",
    "EagleProposer",
    "EarlyExitProposer",
    "NgramProposer",
    "ProposalRequest",
    "Proposer",
    "ProposerContext",
    "available_proposers",
    "build_proposer",
    "get_proposer_cls",
    "ngram_lookup",
    "register_proposer",
]
