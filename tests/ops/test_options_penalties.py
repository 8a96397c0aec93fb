"""``apply_penalties``, the penalties a captured step applies (docs/design.md §15).

Strategy: exact equality. The op must give, bit for bit, what ``apply_options`` gives the same
rows (the eager pass, which sees the drafts before each row through index tensors), and its
Triton twin (in the interpreter on the CPU) what the torch twin gives. Inputs are adversarial:
-inf logits (masked tokens), zeros, drafts that repeat a token, tokens counted in the output
and in the prompt, neutral and opposite-sign penalties, requests without penalties (slot -1),
steps of one row per request (decode) and of S rows (verify).
"""

from __future__ import annotations

import pytest
import torch

from verispec.ops.options import OptionTensors, apply_options, apply_penalties

V = 45
NUM_SLOTS = 6
PARAMS = [(1.3, 0.5, 0.3), (0.7, -0.4, 0.0), (1.0, 0.0, 0.0), (1.0, 0.9, -0.6), (2.0, 0.0, 1.0)]


def make_step(B, S, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B * S, V, generator=g) * 3
    logits[torch.rand(B * S, V, generator=g) < 0.1] = float("-inf")
    logits[:, 7] = 0.0
    ids = torch.randint(0, V, (B, S), generator=g)
    if S > 2:
        ids[0, 2] = ids[0, 1]  # a draft repeated
    slots = torch.randperm(NUM_SLOTS, generator=g)[:B]
    slots[B // 2] = -1  # no penalty
    params = torch.tensor([PARAMS[b % len(PARAMS)] for b in range(B)], dtype=torch.float32)
    counts = torch.randint(0, 3, (NUM_SLOTS, V), generator=g, dtype=torch.int32)
    counts[:, 7] = 2
    prompt = torch.rand(NUM_SLOTS, V, generator=g) < 0.3
    return logits, ids, slots, params, counts, prompt


def eager(logits, ids, slots, params, counts, prompt):
    """The same penalties through ``apply_options``: token_source = the drafts, one -1."""
    B, S = ids.shape
    drafts = ids[:, 1:].reshape(-1)
    source = torch.cat([drafts, torch.tensor([-1])])
    on = [b for b in range(B) if slots[b] >= 0]
    rows = torch.tensor([b * S + i for b in on for i in range(S)])
    pair_rows, pair_source = [], []
    for m, b in enumerate(on):
        for i in range(S):
            for j in range(i):  # row i counts drafts 1..i
                pair_rows.append(m * S + i)
                pair_source.append(b * (S - 1) + j)
    per_row = params[on].repeat_interleave(S, 0)
    fields = dict.fromkeys(OptionTensors.__dataclass_fields__)
    fields.update(token_source=source, penalty_rows=rows,
                  penalty_slots=slots[on].repeat_interleave(S),
                  repetition=per_row[:, 0].contiguous(), frequency=per_row[:, 1].contiguous(),
                  presence=per_row[:, 2].contiguous(), output_counts=counts, prompt_mask=prompt)
    if pair_rows:
        fields.update(draft_count_rows=torch.tensor(pair_rows),
                      draft_count_source=torch.tensor(pair_source))
    return apply_options(logits, OptionTensors(**fields))


@pytest.mark.parametrize("S", [1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_equals_the_eager_options(S, seed):
    step = make_step(5, S, seed)
    got = step[0].clone()
    apply_penalties(got, *step[1:])
    want = eager(*step)
    assert torch.equal(got, want)
    untouched = [b * S + i for b in range(5) if step[2][b] < 0 for i in range(S)]
    assert torch.equal(got[untouched], step[0][untouched])


@pytest.mark.parametrize("S", [1, 4])
def test_triton_twin_same_bits(S, device):
    pytest.importorskip("triton")
    from verispec.ops import triton_options

    step = make_step(5, S, 3)
    step = tuple(t.to(device) for t in step)
    want = step[0].clone()
    apply_penalties(want, *step[1:])
    got = step[0].clone()
    triton_options.apply_penalties(got, *step[1:])
    assert torch.equal(got, want)
