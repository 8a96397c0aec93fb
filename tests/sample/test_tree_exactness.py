"""Statistical proof that token-tree verification preserves the processed target distribution.

Strategy: each case fixes a tree shape, a target row per slot (the root and every node) and the
proposer's logits at every slot with children. 200 000 independently seeded requests draft
their trees through the real tree draft sampler (``sample_children``: i.i.d., without
replacement, or greedy top-m) and are verified by ``tree_rejection_sample``. Exactness, slot by
slot: among the requests whose accepted path reaches slot s (the root always), the token emitted
right after it (the next accepted child, or the recovered / bonus token) must follow p_s, the
processed distribution of s's row; chi-square against an independent float64 reference (p-value
>= 1e-6; slots reached fewer than 200 times are not tested, and every case must test a slot of
depth >= 3). Trees are adversarial: siblings with overlapping mass, duplicate children (i.i.d.
from a peaked q), a sibling that is the target's argmax behind one that is not, siblings the
target masks out (p = 0), widths 1 to 4, depth 4. Greedy targets must emit exactly the argmax
path. Two wrong verifiers (no residual update after a rejected sibling; distinct children
verified as if i.i.d.) must fail the same test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from tests.sample.stats import P_VALUE_THRESHOLD, chi_square_p_value, record, reference_probs
from verispec.ops import tree_rejection
from verispec.ops.tree import sample_children
from verispec.ops.tree_rejection import tree_rejection_sample

NUM_REQUESTS = 200_000
CHUNK = 25_000
MIN_SAMPLES = 200
NEG_INF = float("-inf")

# widths 3, 2, 1, 4, 1 over depth 4 (slots: root 0, node i = slot i + 1)
SHAPE_WIDE = [-1, -1, -1, 0, 0, 1, 3, 3, 3, 3, 6]
# width 2 at every level, depth 4
SHAPE_BINARY = [-1, -1, 0, 0, 2, 2, 4, 4]
# the same, the subtree under the second child (where greedy drafts led by a masked token pass)
SHAPE_SECOND = [-1, -1, 1, 1, 3, 3, 5, 5]


@dataclass
class TreeCase:
    name: str
    parents: list[int]
    target_logits: np.ndarray  # [n + 1, V]: the row of each slot
    draft_logits: np.ndarray  # [n + 1, V]: the proposer's logits at each slot
    rule: str = "iid"  # "iid", "wor" (without replacement) or "onehot" (greedy top-m drafts)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    draft_temperature: float | None = None  # default: the request's temperature
    children: dict = field(init=False)

    def __post_init__(self):
        self.children = {}
        for i, parent in enumerate(self.parents):
            self.children.setdefault(parent + 1, []).append(i)

    @property
    def depths(self) -> list[int]:
        depth = [0]
        for parent in self.parents:
            depth.append(depth[parent + 1] + 1)
        return depth


def _case(name, parents, seed, vocab=29, scale=1.5, noise=0.6, **kw) -> TreeCase:
    """Target rows at random; the proposer resembles the target (deep slots get reached)."""
    rng = np.random.default_rng(seed)
    n = len(parents)
    target = rng.normal(size=(n + 1, vocab)) * scale
    draft = target + rng.normal(size=(n + 1, vocab)) * noise
    return TreeCase(name, parents, target, draft, **kw)


def _peaked_draft(case: TreeCase, seed: int, boost: float = 3.0) -> TreeCase:
    """q concentrated on a few tokens the target also likes: siblings overlap, duplicates."""
    rng = np.random.default_rng(seed)
    top = np.argsort(-case.target_logits, axis=1)[:, :3]
    draft = rng.normal(size=case.draft_logits.shape) * 0.3
    np.put_along_axis(draft, top, boost + rng.normal(size=top.shape), axis=1)
    case.draft_logits = draft
    return case


def _argmax_second(case: TreeCase) -> TreeCase:
    """Greedy drafts whose first child is the target's second choice and whose second child
    is the target's argmax."""
    order = np.argsort(-case.target_logits, axis=1)
    draft = np.zeros_like(case.draft_logits)
    rows = np.arange(draft.shape[0])
    draft[rows, order[:, 1]] = 5.0
    draft[rows, order[:, 0]] = 4.0
    draft[rows, order[:, 2]] = 3.0
    draft[rows, order[:, 3]] = 2.0
    case.draft_logits = draft
    return case


def _masked_siblings(case: TreeCase, count: int = 2) -> TreeCase:
    """q puts most mass on ``count`` tokens just outside the target's top 4 (used with
    top_k=4): many siblings have p = 0 (greedy drafts: the first ``count`` of every node)."""
    order = np.argsort(-case.target_logits, axis=1)
    draft = case.target_logits.copy()
    np.put_along_axis(draft, order[:, 4:4 + count],
                      case.target_logits.max(1, keepdims=True) + 1.5, axis=1)
    case.draft_logits = draft
    return case


CASES = [
    _case("iid_wide_T1", SHAPE_WIDE, 1),
    _case("iid_binary_T0.7_top_p", SHAPE_BINARY, 2, temperature=0.7, top_p=0.9),
    _peaked_draft(_case("iid_duplicates_peaked_q", SHAPE_WIDE, 3), 30),
    _masked_siblings(_case("iid_zero_p_siblings_top_k", SHAPE_WIDE, 4, top_k=4)),
    _case("wor_wide_T1", SHAPE_WIDE, 5, rule="wor"),
    _peaked_draft(_case("wor_overlap_peaked_q", SHAPE_BINARY, 6, rule="wor"), 60),
    _masked_siblings(_case("wor_zero_p_siblings_top_k", SHAPE_WIDE, 7, rule="wor", top_k=4)),
    _case("wor_T1.3_min_p", SHAPE_WIDE, 8, rule="wor", temperature=1.3, min_p=0.05),
    _case("onehot_wide_T1", SHAPE_WIDE, 9, rule="onehot"),
    _argmax_second(_case("onehot_argmax_second_sibling", SHAPE_WIDE, 10, rule="onehot")),
    _masked_siblings(_case("onehot_zero_p_siblings", SHAPE_SECOND, 11, rule="onehot",
                           top_k=4), count=1),
]


def run_case(case: TreeCase, num_requests=NUM_REQUESTS, without_replacement=None,
             device="cpu"):
    """Returns per-slot token counts [n + 1, V]: row s counts the tokens emitted right after
    slot s by the requests whose path reached it. Drafting and verification run on ``device``
    (``VERISPEC_TEST_DEVICE``: the GPU runs the same ops on CUDA tensors)."""
    n, vocab = len(case.parents), case.target_logits.shape[1]
    depths = case.depths
    max_depth = max(depths)
    max_width = max(len(c) for c in case.children.values())
    if without_replacement is None:
        without_replacement = case.rule == "wor"
    counts = np.zeros((n + 1, vocab), dtype=np.int64)
    target = torch.tensor(case.target_logits, dtype=torch.float32, device=device)
    draft = torch.tensor(case.draft_logits, dtype=torch.float32, device=device)
    draft_temperature = (0.0 if case.rule == "onehot" else case.temperature
                         if case.draft_temperature is None else case.draft_temperature)
    for start in range(0, num_requests, CHUNK):
        batch = min(CHUNK, num_requests - start)
        seeds = torch.arange(start, start + batch, dtype=torch.int64, device=device) * 7919 + 1
        positions = torch.full((batch,), 40, dtype=torch.int64, device=device)
        tokens = torch.zeros(batch, n, dtype=torch.int64, device=device)
        q_nodes = torch.zeros(batch, n, vocab, device=device)
        for slot, kids in case.children.items():
            ids, q = sample_children(
                draft[slot].expand(batch, -1),
                torch.full((batch,), draft_temperature, device=device), seeds,
                positions + depths[slot], len(kids), case.rule == "wor")
            assert bool((ids >= 0).all())
            tokens[:, kids] = ids
            q_nodes[:, kids] = q[:, None, :]
        opt = {"top_k": (case.top_k, 0, torch.int32), "top_p": (case.top_p, 1.0, torch.float32),
               "min_p": (case.min_p, 0.0, torch.float32)}
        out, nodes = tree_rejection_sample(
            target.repeat(batch, 1), tokens.reshape(-1),
            torch.tensor(case.parents, device=device).repeat(batch),
            torch.arange(batch + 1, device=device) * n,
            None if case.rule == "onehot" else q_nodes.reshape(-1, vocab),
            torch.full((batch,), case.temperature, device=device),
            *(None if value == off else torch.full((batch,), value, dtype=dtype, device=device)
              for value, off, dtype in opt.values()),
            seeds, positions, n, max_depth, max_width,
            without_replacement=without_replacement, check=start == 0)
        out, nodes = out.cpu().numpy(), nodes.cpu().numpy()
        counts[0] += np.bincount(out[:, 0], minlength=vocab)
        for i in range(n):
            depth = depths[i + 1]
            reached = nodes[:, depth - 1] == i
            counts[i + 1] += np.bincount(out[reached, depth], minlength=vocab)
    return counts


def p_values(case: TreeCase, counts: np.ndarray) -> dict[int, float]:
    """Chi-square p-value of every slot reached at least ``MIN_SAMPLES`` times."""
    result = {}
    for slot in range(counts.shape[0]):
        if counts[slot].sum() >= MIN_SAMPLES:
            p = reference_probs(case.target_logits[slot], case.temperature, case.top_k,
                                case.top_p, case.min_p)
            result[slot] = chi_square_p_value(counts[slot], p)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tree_emits_processed_target_at_every_slot(case, device):
    counts = run_case(case, device=device)
    assert counts[0].sum() == NUM_REQUESTS
    values = p_values(case, counts)
    record(f"tree {case.name}", NUM_REQUESTS, list(values.values()))
    assert max(case.depths[s] for s in values) >= 3, f"{case.name}: no deep slot was tested"
    for slot, value in values.items():
        assert value >= P_VALUE_THRESHOLD, (
            f"{case.name}: slot {slot} (depth {case.depths[slot]}, {counts[slot].sum()} "
            f"samples) p-value {value:.3g}")


@pytest.mark.parametrize("rule", ["iid", "wor", "onehot"])
def test_greedy_target_walks_the_argmax_path(rule, device):
    """Temperature 0 with drafts sampled at T = 1 (greedy top-m for "onehot"): every emitted
    token is its slot's argmax, and the walk descends wherever a child equals the argmax."""
    case = _case(f"greedy_{rule}", SHAPE_WIDE, 21, rule=rule, temperature=0.0,
                 draft_temperature=1.0, noise=0.3)
    counts = run_case(case, num_requests=5_000, device=device)
    best = case.target_logits.argmax(1)
    for slot in np.flatnonzero(counts.sum(1)):
        assert counts[slot].sum() == counts[slot, best[slot]], f"slot {slot}: not the argmax"
    assert counts[[s for s in range(counts.shape[0]) if case.depths[s] >= 2]].sum() > 0
    record(f"tree greedy_{rule}", 5_000, [1.0])


def test_greedy_target_tries_every_sibling():
    """Greedy drafts whose first child is the target's second choice: the walk must take the
    second child (the argmax) at the root, then stop at node 5 (its only child is not the
    argmax)."""
    case = _argmax_second(_case("greedy_second", SHAPE_WIDE, 22, rule="onehot",
                                temperature=0.0))
    counts = run_case(case, num_requests=100)
    reached = (counts.sum(1) > 0).tolist()
    assert reached == [s in (0, 2) for s in range(len(SHAPE_WIDE) + 1)]
    assert counts[0, case.target_logits[0].argmax()] == 100


def _must_fail(case: TreeCase, label: str, **kw) -> None:
    values = p_values(case, run_case(case, **kw))
    record(f"tree {case.name}, {label} (must fail)", NUM_REQUESTS, list(values.values()))
    assert min(values.values()) < P_VALUE_THRESHOLD, f"{label} went unnoticed: {values}"


@pytest.mark.slow
def test_verifier_without_residual_update_fails(monkeypatch):
    """The test of the test: trying every sibling against the unchanged p (no residual after a
    rejected sibling) over-emits tokens that several siblings propose."""
    case = _peaked_draft(_case("no_residual_update", SHAPE_WIDE, 41), 410)
    monkeypatch.setattr(tree_rejection, "full_residual", lambda p, q: p)
    _must_fail(case, "no residual update")


@pytest.mark.slow
def test_distinct_children_verified_as_iid_fails():
    """Children drawn without replacement but verified with the i.i.d. rule (q not updated)
    must fail: the second child's q is not q."""
    case = _peaked_draft(_case("wor_as_iid", SHAPE_BINARY, 42, rule="wor"), 420)
    _must_fail(case, "distinct children as i.i.d.", without_replacement=False)
