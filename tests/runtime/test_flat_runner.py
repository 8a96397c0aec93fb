"""The GPU step's layout and its CUDA-graph runner, checked on the CPU with the torch twins.

Strategy: the flat-layout runner (``flat_layout=True``, what CUDA runs) must give the logits of
the padded-batch runner for prefills, decode and verify steps of requests at different lengths;
its fixed-shape path (what a graph replays; on CPU the same step runs eagerly on the static
buffers) must give the same logits as its eager path, including for a batch padded up to its
bucket and requests that feed fewer tokens than the step's width. The graph runner's bucket
choice and padding rows are checked directly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.utils import HF_CONFIGS, save_tiny_model
from verispec.models import load_model
from verispec.runtime.cuda_graphs import CUDAGraphRunner, StepInput, batch_buckets, bucket_for
from verispec.runtime.model_runner import ModelRunner

PROMPTS = [[5, 17, 33, 2, 90, 11, 64], [7, 3], [100, 101, 102, 103, 104, 105, 106, 9, 1]]


@pytest.fixture(scope="module", params=HF_CONFIGS)
def loaded(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(path, request.param)
    return load_model(str(path), "float32")


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    err = (a - b).abs().max().item()
    assert err <= 1e-4 * b.abs().max().item(), err


def _runners(model, **kwargs):
    reference = ModelRunner(model, 4, 64)
    flat = ModelRunner(model, 4, 64, flat_layout=True, max_step_tokens=4, **kwargs)
    return reference, flat


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_flat_layout_matches_padded_batch(loaded, enforce_eager):
    reference, flat = _runners(loaded.model, enforce_eager=enforce_eager)
    if not enforce_eager:
        flat.capture([1, 4])
    slots = [2, 0, 1]
    for runner in (reference, flat):  # prefill of three prompts of different lengths
        runner.logits = runner.forward(slots, PROMPTS, logits="all")
    _close(flat.logits, reference.logits)
    # decode, then a verify step of 1 + 3, 1 + 0 and 1 + 2 tokens (padded to 4 in the graph)
    steps = [([[4], [9], [12]], "last"), ([[4, 8, 15], [16], [23, 42]], "all"),
             ([[1], [2], [3]], "last")]
    for tokens, mode in steps:
        out = [r.forward(slots, tokens, logits=mode) for r in (reference, flat)]
        _close(out[1], out[0])
        assert flat.kv_cache.lengths_np.tolist() == reference.kv_cache.lengths_np.tolist()


def test_verify_takes_device_drafts(loaded):
    reference, flat = _runners(loaded.model)
    flat.capture([1, 4])
    slots = [0, 3]
    for runner in (reference, flat):
        runner.forward(slots, PROMPTS[:2], logits="none")
    drafts = torch.tensor([8, 15, 42, 7])  # 3 drafts for slot 0, 1 for slot 3
    ref = reference.forward(slots, [[4, 8, 15, 42], [9, 7]], logits="all")
    _close(flat.verify(slots, [4, 9], drafts, np.array([3, 1])), ref)


def test_bucket_padding_rows_use_the_scratch_slot(loaded):
    _, flat = _runners(loaded.model)
    flat.capture([1])
    flat.forward([1], [PROMPTS[1]], logits="none")
    before = flat.kv_cache.k.clone()
    flat.forward([1], [[5]])  # batch 1 in bucket 1: no padding
    flat.forward([1, 0], [[6], [7]])  # batch 2: bucket 2
    flat.forward([1, 0, 2], [[8], [9], [10]])  # batch 3: bucket 4, one padding row
    changed = (flat.kv_cache.k != before).flatten(2).any(-1)  # [layers, blocks]
    tables = flat.kv_cache.block_tables
    owned = sorted(b for slot in (0, 1, 2) for b in tables.blocks(slot))
    assert tables.blocks(3) == [] and flat.kv_cache.scratch_slot == 4
    # only blocks of slots 0..2 changed, and perhaps the scratch block 0: the padding row wrote
    # there (token 0, whose embedding HF zeroes as the padding id, so its k may stay 0)
    written = set(changed.any(0).nonzero().view(-1).tolist()) - {0}
    assert written and written <= set(owned)
    assert (tables.table_np[4] == 0).all()


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64)[-3:] == [48, 56, 64]
    assert bucket_for(3, batch_buckets(8)) == 4 and bucket_for(9, batch_buckets(8)) is None


def test_graph_runner_pads_rows_and_reuses_static_buffers():
    runner = CUDAGraphRunner(torch.device("cpu"), 8)
    seen = []

    def step(inputs):
        seen.append(inputs["x"])
        return inputs["x"] * 2

    runner.add("double", {"x": StepInput(2, torch.int64, pad=-1)}, step)
    out, bucket = runner.run("double", {"x": np.array([[1, 2], [3, 4], [5, 6]])})
    assert bucket == 4
    assert out.tolist() == [[2, 4], [6, 8], [10, 12], [-2, -2]]
    runner.run("double", {"x": np.array([[7, 8], [9, 10], [0, 0]])})
    assert seen[-1] is seen[-2]  # the same static buffer of bucket 4, written in place
    assert runner.fits("double", 8) and not runner.fits("double", 9)
    with pytest.raises(ValueError, match="already captured"):
        runner.add("double", {"x": StepInput(2, torch.int64)}, step)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_fixed_batch_index_tensors_are_contiguous(loaded, batch_size):
    """Regression: for one request, slot_ids expanded to S tokens was a stride-0 view that the
    kernels read as contiguous, past its end (an illegal address on the GPU)."""
    _, flat = _runners(loaded.model)
    batch = flat.fixed_batch(torch.arange(batch_size), torch.zeros(batch_size, dtype=torch.long),
                             2)
    for name in ("positions", "slot_mapping", "slot_ids", "context_lens", "query_start"):
        t = getattr(batch, name)
        assert t.dim() == 1 and t.stride(0) == 1, name
    # no blocks reserved: every position maps into the scratch block 0
    assert batch.slot_mapping.tolist() == [p for _ in range(batch_size) for p in range(2)]


@pytest.mark.parametrize("flat", [False, True])
def test_long_forwards_in_pieces_equal_one_forward(loaded, flat):
    """A prefill of more tokens than ``max_forward_tokens`` runs as several forwards (a
    request's tokens split across them in order): the logits and the cache are bit for bit
    those of one forward, and the hidden states an EAGLE head reads are joined in order. (The
    flat layout on CPU runs the torch twins, whose matmul rows depend on the row count: there
    the pieces agree to rounding; on the GPU, bit for bit, tests/engine/test_gpu_engine.py.)"""
    prompts = [list(range(3, 40)), [7, 3, 9], list(range(50, 71))]
    outs = []
    for limit in (None, 8, 13):
        runner = ModelRunner(loaded.model, 4, 64, flat_layout=flat, enforce_eager=True)
        runner.capture_layers = (0, runner.config.num_hidden_layers)
        runner.max_forward_tokens = limit
        last = runner.forward([2, 0, 1], prompts)
        hidden = runner.captured_hidden
        follow = runner.forward([2, 0, 1], [[5], [6], [7]])
        tables = runner.kv_cache.block_tables
        k = [runner.kv_cache.k[:, tables.blocks(s)].flatten(1, 2)[:, :runner.kv_cache.length(s)]
             for s in (2, 0, 1)]
        outs.append((last, follow, hidden.rows, hidden.counts.tolist(), k))
    same = torch.equal if not flat else (
        lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5))
    for other in outs[1:]:
        assert same(other[0], outs[0][0]) and same(other[1], outs[0][1])
        assert same(other[2], outs[0][2]) and other[3] == outs[0][3]
        assert all(same(a, b) for a, b in zip(other[4], outs[0][4]))


def test_ragged_arange_is_each_count_s_range_concatenated():
    from verispec.runtime.flat_layout import ragged_arange

    rng = np.random.default_rng(0)
    for _ in range(50):
        counts = rng.integers(0, 5, size=rng.integers(0, 8))
        want = np.concatenate([np.arange(n) for n in counts] + [np.zeros(0, np.int64)])
        got = ragged_arange(counts)
        assert got.dtype == np.int64 and np.array_equal(got, want), counts


def test_scratch_forward_writes_no_real_slot(loaded):
    """The start-up steps on the scratch slot (the memory plan's profile, ``warm_up_kernels``)
    return a hidden row per fed token and leave every real slot's cache rows as they were."""
    _, flat = _runners(loaded.model)
    flat.forward([0, 1], [[5, 6, 7], [8, 9]])
    k_before = [k.clone() for k in flat.kv_cache.k_layers]
    counts = np.array([32, 1, 1], dtype=np.int64)
    with torch.inference_mode():
        hidden = flat._scratch_forward(counts)
    assert hidden.shape == (34, loaded.config.hidden_size)
    tables = flat.kv_cache.block_tables
    real = np.concatenate([tables.table_np[s, :tables.num_blocks_np[s]] for s in (0, 1)])
    for before, after in zip(k_before, flat.kv_cache.k_layers):
        assert torch.equal(before[real], after[real])
