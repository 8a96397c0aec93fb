"""Parity of the Triton backend with the torch twins: the same token ids for the same inputs and
seeds, bit for bit.

Strategy: build batches that exercise every path (accepted runs, first rejections, bonus tokens,
0-draft requests, greedy and random requests mixed, every verification rule, top-k / top-p /
min-p with per-request "off" values, several chunk sizes so the chunked combine is exercised) and
adversarial inputs (q = p so the residual is empty, disjoint supports, p(d) = 0, tiny
probabilities, ties, -inf logits), run both backends and compare with ``torch.equal``. Without
CUDA the kernels run in Triton's interpreter (tests/conftest.py), so shapes stay small; with
``VERISPEC_TEST_DEVICE=cuda`` the same tests also run at vocabulary 151 936.

Token ids can only differ where two candidates' scores are equal up to float32 rounding (the
twins' reductions sum in another order): events of probability ~1e-7 per draw, which these
seeded inputs do not contain. A bug shows up as many mismatches, not one.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from verispec.ops import options, philox, rejection, sampling, triton_launch, triton_ops  # noqa: E402

K = 4


@pytest.fixture(autouse=True)
def small_blocks(device, monkeypatch):
    """In the interpreter, blocks of 32 tokens, so that the small vocabularies here run the
    two-level race over several blocks (``sampling.race``); on a GPU the default 4096 already
    cuts vocabulary 151 936 into 38 blocks."""
    if device.type == "cpu":
        monkeypatch.setattr(sampling, "SAMPLING_BLOCK", 32)


def _vocab_size(device: torch.device, cpu_vocab_size: int = 37) -> int:
    """151 936 on a GPU; a small V (not a power of two) in the interpreter."""
    return 151936 if device.type == "cuda" else cpu_vocab_size


def make_batch(num_drafts, vocab_size, device, *, seed=0, dtype=torch.float32, scale=2.0,
               temperatures=(0.0, 0.5, 1.0, 1.5), boost=5.0):
    """A verify batch whose drafts are accepted often enough to reach every path.

    Drafts are sampled from q = softmax(target logits + noise) (the proposer's distribution);
    60 % of them get their target logit raised by ``boost`` so long accepted runs occur.
    """
    gen = torch.Generator().manual_seed(seed)
    batch_size = len(num_drafts)
    n = torch.tensor(num_drafts, dtype=torch.int64)
    cu = torch.zeros(batch_size + 1, dtype=torch.int64)
    cu[1:] = n.cumsum(0)
    num_draft_tokens = int(n.sum())
    logits = torch.randn(num_draft_tokens + batch_size, vocab_size, generator=gen) * scale
    req_of_draft = torch.repeat_interleave(torch.arange(batch_size), n)
    verify_rows = torch.arange(num_draft_tokens) + req_of_draft
    q_logits = logits[verify_rows] + torch.randn(num_draft_tokens, vocab_size, generator=gen)
    q = torch.softmax(q_logits, -1)
    drafts = torch.multinomial(q, 1, generator=gen)[:, 0] if num_draft_tokens else \
        torch.zeros(0, dtype=torch.int64)
    lucky = torch.rand(num_draft_tokens, generator=gen) < 0.6
    logits[verify_rows[lucky], drafts[lucky]] += boost
    temps = torch.tensor(temperatures, dtype=torch.float32)
    temperature = temps[torch.arange(batch_size) % len(temperatures)]
    seeds = torch.randint(-(2**62), 2**62, (batch_size,), generator=gen)
    positions = torch.randint(0, 10_000, (batch_size,), generator=gen)
    return dict(
        target_logits=logits.to(dtype).to(device),
        draft_token_ids=drafts.to(device),
        cu_num_draft_tokens=cu.to(device),
        draft_probs=q.to(device),
        temperature=temperature.to(device),
        seeds=seeds.to(device),
        positions=positions.to(device),
    )


def _run_both(batch, *, draft_probs=True, top_k=None, top_p=None, min_p=None, rates=None,
              all_greedy=False, max_num_draft_tokens=K):
    """(torch twin, Triton) outputs of one batch."""
    args = (
        batch["target_logits"], batch["draft_token_ids"], batch["cu_num_draft_tokens"],
        batch["draft_probs"] if draft_probs else None, batch["temperature"], top_k, top_p, min_p,
        batch["seeds"], batch["positions"], max_num_draft_tokens, rates, all_greedy,
    )
    return rejection.rejection_sample(*args), triton_ops.rejection_sample(*args)


def _assert_same(expected, actual):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    mismatched = (expected != actual).any(-1).nonzero().flatten().tolist()
    assert not mismatched, (
        f"requests {mismatched} differ:\n{expected[mismatched]}\n{actual[mismatched]}")


def _coverage(token_ids, num_drafts):
    """(any accepted draft, any first rejection, any all-accepted) over the batch."""
    num_out = (token_ids != -1).sum(1).cpu()
    n = torch.tensor(num_drafts)
    return bool((num_out > 1).any()), bool((num_out <= n).any()), bool((num_out == n + 1).any())


NUM_DRAFTS = [4, 0, 3, 4, 1, 2, 4, 0, 4, 3, 4, 1]


@pytest.mark.parametrize("rule, cpu_vocab_size",
                         [("full", 300), ("one_hot", 37), ("synthetic", 100), ("one_hot", 300),
                          ("full", 37), ("synthetic_full", 100)])
def test_rejection_parity_rules(rule, cpu_vocab_size, device):
    """Every rule; synthetic rates with the one-hot residual and (sampled drafts) the full
    rule's."""
    vocab_size = _vocab_size(device, cpu_vocab_size)
    batch = make_batch(NUM_DRAFTS, vocab_size, device, seed=cpu_vocab_size)
    rates = None
    if rule.startswith("synthetic"):
        rates = torch.tensor([0.9, 0.6, 0.5, 0.3], device=device)
    expected, actual = _run_both(batch, draft_probs=rule.endswith("full"), rates=rates)
    _assert_same(expected, actual)
    assert all(_coverage(expected, NUM_DRAFTS)), "the batch must reach every path"


@pytest.fixture(params=[1, 2], ids=["one-chunk-programs", "two-chunk-programs"])
def group(request, monkeypatch):
    """Both statistics-program widths of the rows kernel: one chunk of a row per program (below
    batch 64) and two (from it on; forced here for any batch, plans made afresh). The
    vocabularies below are no multiple of two chunks, so a last program reads its row's last
    chunk twice."""
    monkeypatch.setattr(triton_ops, "_PLANS", {})
    if request.param == 2:
        monkeypatch.setattr(triton_ops, "_GROUP_BATCH", 1)
        monkeypatch.setattr(triton_ops, "_GROUP_BATCH_SYNTHETIC", 1)
    return request.param


@pytest.mark.parametrize("rule", ["full", "one_hot", "synthetic"])
def test_rejection_parity_groups(rule, group, device):
    """Every rule with one and two chunks per statistics program, greedy and random requests
    mixed, a vocabulary that is no multiple of the chunk."""
    vocab_size = 150 if device.type == "cpu" else 151936 - 7
    # at V ~ 150 000 a boosted draft needs a larger boost to pass often
    batch = make_batch(NUM_DRAFTS, vocab_size, device, seed=51,
                       boost=5.0 if device.type == "cpu" else 14.0)
    rates = torch.tensor([0.9, 0.6, 0.5, 0.3], device=device) if rule == "synthetic" else None
    expected, actual = _run_both(batch, draft_probs=rule == "full", rates=rates)
    _assert_same(expected, actual)
    assert all(_coverage(expected, NUM_DRAFTS)), "the batch must reach every path"


def test_counters_reset_between_launches(device, monkeypatch):
    """No launch zeroes a counter before it runs: each row's deciding program resets its row
    counter, the finishing launch the early words and race counters. Back-to-back launches of
    every rule and of growing shapes (the scratch grows among them) stay exact and leave every
    counter at zero."""
    vocab_size = 150 if device.type == "cpu" else 151936 - 7
    monkeypatch.setattr(triton_ops, "_PLANS", {})
    monkeypatch.setattr(triton_ops, "_SCRATCH", {})
    # scratch smaller than any launch needs, as if earlier launches had been tiny
    probe = torch.empty(1, device=device)
    tiny = tuple(torch.zeros(2, dtype=dtype, device=probe.device)
                 for dtype in (torch.float32, torch.int32, torch.int32))
    triton_ops._SCRATCH[(probe.device, triton_launch._stream(probe))] = tiny
    grown = {tiny[2].data_ptr()}
    for seed, num_drafts in [(71, NUM_DRAFTS[:2]), (72, NUM_DRAFTS), (73, NUM_DRAFTS[:5]),
                             (74, NUM_DRAFTS * 2)]:
        batch = make_batch(num_drafts, vocab_size, device, seed=seed,
                           boost=5.0 if device.type == "cpu" else 14.0)
        for draft_probs in (False, True):
            _assert_same(*_run_both(batch, draft_probs=draft_probs))
        (buffers,) = triton_ops._SCRATCH.values()
        grown.add(buffers[2].data_ptr())
        assert int(buffers[2].abs().sum()) == 0
    assert len(grown) > 1, "the counters should have grown"
    assert int(tiny[2].abs().sum()) == 0


@pytest.mark.parametrize("rule", ["one_hot", "synthetic"])
def test_reads_no_row_after_a_known_rejection(rule, device, monkeypatch):
    """The rows kernel reads no logits of a row that follows its request's first rejection once
    that rejection is known (synthetic rates: of any row but the final one). Under the
    interpreter the programs run one after another in id order, so every rejection is known
    before the next row's programs start, and the rows read are exactly the rows needed: one
    per output token. (On a GPU which rows are skipped depends on timing; the tokens never
    do.)"""
    if device.type != "cpu":
        pytest.skip("program order is deterministic only under the interpreter")
    from verispec.ops import triton_kernels_rows

    monkeypatch.setattr(triton_ops, "_PLANS", {})
    num_chunks = -(-150 // triton_ops.chunk_size(150))
    rows_read = []
    stats = triton_kernels_rows._chunk_stats

    def counting(*args):
        rows_read.append(int(args[4]) // num_chunks)  # the row's first partial / NUM_CHUNKS
        return stats(*args)

    monkeypatch.setattr(triton_kernels_rows, "_chunk_stats", counting)
    batch = make_batch(NUM_DRAFTS, 150, device, seed=51, boost=5.0)
    rates = torch.tensor([0.9, 0.6, 0.5, 0.3]) if rule == "synthetic" else None
    expected, actual = _run_both(batch, draft_probs=False, rates=rates)
    _assert_same(expected, actual)
    num_out = (expected != -1).sum(1)
    assert int(num_out.sum()) < sum(n + 1 for n in NUM_DRAFTS)  # some rows can be skipped
    cu = batch["cu_num_draft_tokens"]
    needed = sorted(int(cu[r]) + r + i for r in range(len(NUM_DRAFTS))
                    for i in range(int(num_out[r])))
    if rule == "synthetic":  # only the final row of each request
        needed = [int(cu[r]) + r + int(num_out[r]) - 1 for r in range(len(NUM_DRAFTS))]
    assert sorted(set(rows_read)) == sorted(needed)
    assert len(rows_read) == num_chunks * len(needed)  # every chunk of them, once


def _forced_batch(device, vocab_size, num_drafts, first_rejections, temperatures):
    """Request r rejects exactly its draft ``first_rejections[r]`` (= n_r: all accepted): the
    drafts before it get a logit 50 above the rest (p(d) = 1 in float32, so u < p(d) always;
    the argmax for greedy requests), the rejected one -inf (p(d) = 0, never the argmax)."""
    batch = make_batch(num_drafts, vocab_size, device, seed=61, temperatures=temperatures)
    logits = batch["target_logits"].cpu()
    drafts = batch["draft_token_ids"].cpu()
    row = 0
    for r, n in enumerate(num_drafts):
        start = sum(num_drafts[:r])
        for i in range(n):
            d = int(drafts[start + i])
            logits[row + i, d] = float("-inf") if i == first_rejections[r] else 50.0
        row += n + 1
    batch["target_logits"] = logits.to(device)
    return batch


def test_rejection_parity_every_first_rejection(group, device):
    """One-hot and full rule, k varying per request (0..4 drafts), the first rejection at every
    position and all drafts accepted, for greedy and random requests; the output length must
    be exactly the forced one."""
    vocab_size = _vocab_size(device, 37)
    num_drafts, first_rejections = [], []
    for n in range(K + 1):
        for j in range(n + 1):
            num_drafts.append(n)
            first_rejections.append(j)
    num_drafts, first_rejections = num_drafts * 2, first_rejections * 2
    # greedy and random requests, each (n, j) once of each kind
    temperatures = [0.0] * (len(num_drafts) // 2) + [1.0] * (len(num_drafts) // 2)
    batch = _forced_batch(device, vocab_size, num_drafts, first_rejections, (0.0,))
    batch["temperature"] = torch.tensor(temperatures, device=device)
    for draft_probs in (False, True):
        expected, actual = _run_both(batch, draft_probs=draft_probs)
        _assert_same(expected, actual)
        assert (expected != -1).sum(1).cpu().tolist() == [j + 1 for j in first_rejections]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rejection_parity_low_precision_logits(dtype, device):
    batch = make_batch(NUM_DRAFTS, _vocab_size(device), device, seed=3, dtype=dtype)
    for draft_probs in (True, False):
        _assert_same(*_run_both(batch, draft_probs=draft_probs))


@pytest.mark.parametrize("block", [16, 64])
def test_rejection_parity_block_sizes(block, device, monkeypatch):
    """Chunks and race blocks of other sizes: many chunks and blocks with a partial last one
    (16), or a row of 150 tokens in three blocks (64)."""
    if device.type != "cpu":
        pytest.skip("the block size is part of the sampling semantics; the GPU keeps 4096")
    monkeypatch.setattr(sampling, "SAMPLING_BLOCK", block)
    batch = make_batch(NUM_DRAFTS[:6], 150, device, seed=block)
    for draft_probs in (True, False):
        _assert_same(*_run_both(batch, draft_probs=draft_probs))


def test_rejection_parity_all_greedy(device):
    batch = make_batch(NUM_DRAFTS, _vocab_size(device), device, seed=11, temperatures=(0.0,))
    for rates in (None, torch.tensor([0.9, 0.6, 0.5, 0.3], device=device)):
        expected, actual = _run_both(batch, draft_probs=False, all_greedy=True, rates=rates)
        _assert_same(expected, actual)


def test_rejection_parity_no_drafts_at_all(device):
    batch = make_batch([0, 0, 0, 0, 0], _vocab_size(device), device, seed=5)
    for draft_probs in (True, False):
        expected, actual = _run_both(batch, draft_probs=draft_probs)
        _assert_same(expected, actual)
        assert expected.shape == (5, K + 1)


def _masks(batch_size, vocab_size, device):
    """Per-request masks with every 'off' value mixed in."""
    top_k = torch.tensor([0, 5, -1, 1, vocab_size, 20, 3, vocab_size + 7], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.99, 0.2, 1.0, 0.75, 0.6])
    min_p = torch.tensor([0.0, 0.05, 0.2, 0.0, 0.5, 0.01, 0.0, 0.1])
    idx = torch.arange(batch_size) % 8
    return top_k[idx].to(device), top_p[idx].to(device), min_p[idx].to(device)


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("which, draft_probs",
                         [("top_k", True), ("top_p", False), ("min_p", True), ("all", False)])
def test_rejection_parity_masks(which, draft_probs, wide, device, monkeypatch):
    """Both mask-search programs: the wide one (these few rows fit one per SM) and, forced,
    the narrow one that larger batches get (on a GPU: another tile, so another sum order)."""
    if not wide and device.type != "cuda":
        pytest.skip("in the interpreter the narrow program is the wide one: the same grid and "
                    "TILE (min(1024 * warps, 128) at V = 100), and warps are not simulated")
    monkeypatch.setattr(triton_ops, "_PLANS", {})
    if not wide:
        monkeypatch.setattr(triton_ops, "_MASK_WIDE_WARPS", triton_ops._MASK_WARPS)
    vocab_size = _vocab_size(device, 100)
    num_drafts = [3, 0, 4, 2, 4, 1, 4, 2]
    batch = make_batch(num_drafts, vocab_size, device, seed=17, scale=3.0)
    top_k, top_p, min_p = _masks(len(num_drafts), vocab_size, device)
    masks = dict(
        top_k=top_k if which in ("top_k", "all") else None,
        top_p=top_p if which in ("top_p", "all") else None,
        min_p=min_p if which in ("min_p", "all") else None,
    )
    _assert_same(*_run_both(batch, draft_probs=draft_probs, **masks))


def test_mask_search_width(monkeypatch):
    """The mask search runs wide programs while the rows fit one per SM, narrow ones beyond."""
    monkeypatch.setattr(triton_ops, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert triton_ops._mask_warps(132, cuda) == triton_ops._MASK_WIDE_WARPS == 32
    assert triton_ops._mask_warps(133, cuda) == triton_ops._MASK_WARPS == 8
    assert triton_ops._mask_warps(10_000, torch.device("cpu")) == triton_ops._MASK_WIDE_WARPS


def _dyadic_batch(device, vocab_size=64):
    """Logits 0 on a power-of-two support and -1e4 (exp = 0) elsewhere: every probability is
    exact, so both backends compute p bit for bit and q = p gives an exactly empty residual."""
    num_drafts = [2, 3, 1, 0]
    batch = make_batch(num_drafts, vocab_size, device, seed=23, temperatures=(1.0, 0.5))
    logits = torch.full_like(batch["target_logits"], -1e4)
    logits[:, : vocab_size // 4] = 0.0  # support of 16 tokens, p = 1/16 each
    batch["target_logits"] = logits
    q = torch.softmax(logits[: int(sum(num_drafts))].float() / 1.0, -1)
    return batch, num_drafts, q


def test_adversarial_q_equals_p_empty_residual(device):
    """q = p exactly: every rejection has an empty residual and falls back to p."""
    batch, _, _ = _dyadic_batch(device)
    cu = batch["cu_num_draft_tokens"].cpu()
    rows = torch.arange(int(cu[-1])) + torch.repeat_interleave(torch.arange(4), cu[1:] - cu[:-1])
    temps = torch.repeat_interleave(batch["temperature"].cpu(), cu[1:] - cu[:-1])
    q = sampling.processed_probs(batch["target_logits"].cpu()[rows], temps)
    batch["draft_probs"] = q.to(device)
    # drafts from the support, so q(d) > 0 and acceptance u q(d) < p(d) = q(d) is random
    batch["draft_token_ids"] = batch["draft_token_ids"] % 16
    expected, actual = _run_both(batch)
    _assert_same(expected, actual)


def test_adversarial_one_hot_empty_residual(group, device):
    """One-hot rule, synthetic rates that reject every draft, drafts whose target probability
    is exactly 1 in float32 (every other token underflows): the residual p without the draft is
    empty and the recovered token falls back to p (here the draft itself)."""
    batch = make_batch(NUM_DRAFTS, _vocab_size(device, 150), device, seed=41)
    logits = batch["target_logits"]
    cu = batch["cu_num_draft_tokens"].cpu()
    n = cu[1:] - cu[:-1]
    rows = (torch.arange(int(cu[-1])) + torch.repeat_interleave(torch.arange(len(n)), n))
    logits[rows.to(logits.device), batch["draft_token_ids"]] = 300.0
    rates = torch.zeros(K, device=device)
    expected, actual = _run_both(batch, draft_probs=False, rates=rates)
    _assert_same(expected, actual)
    random = (batch["temperature"] > 0).cpu() & (n > 0)
    first = batch["draft_token_ids"].cpu()[cu[:-1].clamp_max(int(cu[-1]) - 1)]
    assert torch.equal(expected[random, 0].cpu().long(), first[random])


@pytest.mark.parametrize("share", [0.7, 0.002])
def test_one_hot_residual_when_the_draft_holds_its_chunk_or_not(share, device):
    """One-hot rule, every draft rejected (synthetic rates 0), each draft holding ``share`` of
    its request's p: over half of its chunk's mass (0.7: the residual of that chunk, a
    difference, would cancel if formed as one) or a sliver of it (0.002); the same tokens as
    the twin either way, never the draft (its residual weight is 0)."""
    vocab_size = _vocab_size(device, 150)
    batch = make_batch([1] * 16, vocab_size, device, seed=43, temperatures=(1.0,))
    logits = batch["target_logits"].cpu()
    drafts = batch["draft_token_ids"].cpu()
    rows = torch.arange(16) * 2
    rest = torch.logsumexp(logits[rows].scatter(1, drafts[:, None], float("-inf")), -1)
    logits[rows, drafts] = rest + math.log(share / (1 - share))
    batch["target_logits"] = logits.to(device)
    expected, actual = _run_both(batch, draft_probs=False, rates=torch.zeros(K, device=device))
    _assert_same(expected, actual)
    assert not bool((expected[:, 0].cpu().long() == drafts).any())
    chunk = triton_ops.chunk_size(vocab_size)
    p = torch.softmax(logits[rows], -1)
    in_chunk = (torch.arange(vocab_size)[None, :] // chunk) == (drafts[:, None] // chunk)
    holds = p.gather(1, drafts[:, None])[:, 0] > 0.5 * (p * in_chunk).sum(1)
    assert bool(holds.all()) if share > 0.5 else not bool(holds.any())


def test_adversarial_disjoint_supports_and_zero_target(device):
    """q lives where p is 0 (every draft rejected, residual = p); p(d) = 0 for some drafts;
    -inf logits; ties in the logits (greedy argmax takes the smallest index)."""
    vocab_size = _vocab_size(device)
    batch = make_batch(NUM_DRAFTS, vocab_size, device, seed=29)
    logits = batch["target_logits"]
    half = vocab_size // 2
    logits[:, half:] = float("-inf")  # p = 0 on the upper half
    logits[::3, :4] = 1.5  # ties
    q = torch.zeros_like(batch["draft_probs"])
    q[:, half:] = 1.0 / (vocab_size - half)
    batch["draft_probs"] = q
    batch["draft_token_ids"] = half + batch["draft_token_ids"] % (vocab_size - half)
    for draft_probs in (True, False):
        expected, actual = _run_both(batch, draft_probs=draft_probs)
        _assert_same(expected, actual)
        # greedy requests reject every draft too: argmax is in the lower half
        assert ((expected != -1).sum(1) == 1).all()


def test_adversarial_tiny_probabilities(device):
    """Very peaked targets (most p_v underflow or are denormal) and q concentrated where p is
    small."""
    batch = make_batch(NUM_DRAFTS, _vocab_size(device), device, seed=31, scale=40.0, boost=0.0)
    q_logits = -batch["target_logits"][: batch["draft_probs"].shape[0]].float()
    batch["draft_probs"] = torch.softmax(q_logits, -1)
    for draft_probs in (True, False):
        _assert_same(*_run_both(batch, draft_probs=draft_probs))


def _sampling_inputs(device, num_rows=12, vocab_size=None, seed=41):
    vocab_size = vocab_size or _vocab_size(device)
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, vocab_size, generator=gen) * 3).to(device)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3] * (num_rows // 4)).to(device)
    seeds = torch.randint(0, 2**62, (num_rows,), generator=gen).to(device)
    positions = torch.randint(0, 2**20, (num_rows,), generator=gen).to(device)
    return logits, temperature, seeds, positions


@pytest.mark.parametrize("masked", [False, True])
def test_sample_parity(masked, device):
    logits, temperature, seeds, positions = _sampling_inputs(device, num_rows=8)
    masks = (None, None, None)
    if masked:
        masks = _masks(logits.shape[0], logits.shape[1], device)
    for stream in (philox.SAMPLE_STREAM, philox.DRAFT_STREAM):
        expected = sampling.sample(logits, temperature, *masks, seeds, positions, stream)
        actual = triton_ops.sample(logits, temperature, *masks, seeds, positions, stream)
        assert torch.equal(expected, actual), (expected, actual)
    greedy = torch.zeros_like(temperature)
    expected = sampling.sample(logits, greedy, *masks, seeds, positions, all_greedy=True)
    assert torch.equal(expected, triton_ops.sample(logits, greedy, *masks, seeds, positions,
                                                   all_greedy=True))


@pytest.mark.parametrize("masked", [False, True])
def test_processed_probs_close_and_same_support(masked, device):
    """p itself may differ in the last bits (sums in another order); the kept set may not."""
    logits, temperature, _, _ = _sampling_inputs(
        device, vocab_size=_vocab_size(device, 100) if masked else None)
    masks = _masks(logits.shape[0], logits.shape[1], device) if masked else (None, None, None)
    expected = sampling.processed_probs(logits, temperature, *masks)
    actual = triton_ops.processed_probs(logits, temperature, *masks)
    assert torch.equal(expected > 0, actual > 0)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-7)


def test_sample_draft_parity(device):
    logits, temperature, seeds, positions = _sampling_inputs(device)
    ids, q = sampling.sample_draft(logits, temperature, seeds, positions)
    ids_t, q_t = triton_ops.sample_draft(logits, temperature, seeds, positions)
    assert torch.equal(ids, ids_t)
    torch.testing.assert_close(q_t, q, rtol=1e-5, atol=1e-7)


def test_launch_argument_template():
    """A plan's launch after the first skips Triton's argument binding: it hands the compiled
    kernel the full argument list, constexprs in place, the arguments the plan fixes filled in
    once, and the call's own arguments in the kernel's order in the remaining slots."""
    import inspect

    from verispec.ops.triton_kernels_finish import _finish_kernel

    params = list(inspect.signature(_finish_kernel.fn).parameters.values())
    names = [p.name for p in params]
    assert names == list(_finish_kernel.arg_names)
    constexpr = [n for n in names if n.isupper()]  # the kernels' naming: constexprs in capitals
    assert constexpr == [p.name for p in params if triton_launch._is_constexpr(p)]
    runtime = [n for n in names if n not in constexpr]
    static = {n: f"static {n}" for n in runtime[1::2]}
    launch = triton_launch._Launch(_finish_kernel, (1,), 4, {n: 7 for n in constexpr}, **static)
    template = dict(zip(names, launch.template))
    assert all(template[n] == 7 for n in constexpr)
    assert all(template[n] == static[n] for n in static)
    assert [names[i] for i in launch.slots] == [n for n in runtime if n not in static]
    assert [names[i] for i in launch.runtime] == runtime
    with pytest.raises(AssertionError, match="no arguments"):
        triton_launch._Launch(_finish_kernel, (1,), 4, {n: 7 for n in constexpr}, not_an_argument=1)
    with pytest.raises(KeyError):  # every constexpr must be given
        triton_launch._Launch(_finish_kernel, (1,), 4, {})


def test_backend_registry_and_signatures():
    """The backend carries the twins' signatures, keyword-only arguments included (but the
    compiled CPU kernels a twin takes, ``kernels``, which the torch backend binds)."""
    import inspect

    from verispec.ops.backend import load_backend

    backend = load_backend("triton")
    assert backend.name == "triton"
    for name, twin in [("rejection_sample", rejection.rejection_sample),
                       ("sample", sampling.sample), ("sample_draft", sampling.sample_draft),
                       ("processed_probs", sampling.processed_probs),
                       ("apply_penalties", options.apply_penalties)]:
        ours = inspect.signature(getattr(backend, name)).parameters.values()
        theirs = [p for p in inspect.signature(twin).parameters.values() if p.name != "kernels"]
        assert [(p.name, p.kind, p.default) for p in ours] == [
            (p.name, p.kind, p.default) for p in theirs]


def test_one_plan_per_batch_size(device, monkeypatch):
    """A plan serves every draft count of its batch size (the rows are laid out for k + 1 per
    request): steps whose drafts differ make no new plan (and compile nothing) and stay exact,
    including after a step with more drafts than the one that made the plan."""
    vocab_size = 150 if device.type == "cpu" else 151936 - 7
    monkeypatch.setattr(triton_ops, "_PLANS", {})
    for seed, num_drafts in enumerate([[1, 0, 2, 1], [4, 4, 4, 4], [0, 3, 0, 1], [2, 4, 1, 3]]):
        batch = make_batch(num_drafts, vocab_size, device, seed=80 + seed,
                           boost=5.0 if device.type == "cpu" else 14.0)
        for draft_probs in (False, True):
            _assert_same(*_run_both(batch, draft_probs=draft_probs))
    assert len(triton_ops._PLANS) == 2  # the one-hot and the full rule, batch size 4


def test_row_counts_checked_on_every_call(device):
    """Once a plan exists, a call whose row counts disagree still raises, naming the input."""
    batch = make_batch([2, 1], 37, device, seed=3)
    args = [batch["target_logits"], batch["draft_token_ids"], batch["cu_num_draft_tokens"],
            batch["draft_probs"], batch["temperature"], None, None, None, batch["seeds"],
            batch["positions"], 2]
    triton_ops.rejection_sample(*args)
    with pytest.raises(ValueError, match="target_logits"):
        triton_ops.rejection_sample(args[0][:-1], *args[1:])
    with pytest.raises(ValueError, match="draft_probs"):
        triton_ops.rejection_sample(*args[:3], args[3][:-1], *args[4:])
    with pytest.raises(ValueError, match="max_num_draft_tokens = 1"):
        triton_ops.rejection_sample(*args[:-1], 1)


def test_input_checks(device):
    batch = make_batch([2, 1], 37, device)
    args = dict(batch)
    with pytest.raises(ValueError, match="target_logits"):
        triton_ops.rejection_sample(
            args["target_logits"][:-1], args["draft_token_ids"], args["cu_num_draft_tokens"],
            None, args["temperature"], None, None, None, args["seeds"], args["positions"], 2)
    with pytest.raises(ValueError, match="contiguous"):
        triton_ops.rejection_sample(
            args["target_logits"].t().contiguous().t(), args["draft_token_ids"],
            args["cu_num_draft_tokens"], None, args["temperature"], None, None, None,
            args["seeds"], args["positions"], 2)
    with pytest.raises(ValueError, match="draft_probs"):
        triton_ops.rejection_sample(
            args["target_logits"], args["draft_token_ids"], args["cu_num_draft_tokens"],
            args["draft_probs"].double(), args["temperature"], None, None, None,
            args["seeds"], args["positions"], 2)


@pytest.mark.parametrize("draft_probs", [False, True])
def test_no_draft_here(draft_probs, device):
    """A draft id of -1 ends its request's drafts: the row of the first -1 is sampled as the
    bonus row would be, on both backends, and later drafts are never read."""
    vocab_size = _vocab_size(device, 150)
    num_drafts = [4, 4, 3, 4, 2, 4, 1, 4]
    batch = make_batch(num_drafts, vocab_size, device, seed=81)
    drafts = batch["draft_token_ids"].clone()
    cu = batch["cu_num_draft_tokens"].cpu()
    cut = [1, 0, 2, 3, 1, 4, 0, 2]  # index of the first -1 (= n_r: none)
    for r, first in enumerate(cut):
        drafts[int(cu[r]) + first:int(cu[r + 1])] = -1
    drafts[int(cu[0]) + 2] = 7  # a draft after a -1: ignored
    batch["draft_token_ids"] = drafts
    expected, actual = _run_both(batch, draft_probs=draft_probs)
    _assert_same(expected, actual)
    assert ((expected != -1).sum(1).cpu() <= torch.tensor(cut) + 1).all()
    # the same as the same requests with their drafts cut there
    short = [min(n, c) for n, c in zip(num_drafts, cut)]
    keep = torch.cat([torch.arange(int(cu[r]), int(cu[r]) + n) for r, n in enumerate(short)])
    rows = torch.cat([torch.arange(int(cu[r]) + r, int(cu[r]) + r + n + 1)
                      for r, n in enumerate(short)])
    cut_batch = dict(batch, target_logits=batch["target_logits"][rows.to(device)],
                     draft_token_ids=drafts[keep.to(device)], draft_probs=batch["draft_probs"][
                         keep.to(device)],
                     cu_num_draft_tokens=torch.tensor([0] + short).cumsum(0).to(device))
    _assert_same(expected, _run_both(cut_batch, draft_probs=draft_probs)[0])


@pytest.mark.parametrize("bad", [-2, 37, 1 << 40])
def test_draft_ids_out_of_range_raise(bad, device):
    """A draft id outside [-1, V) is one ValueError naming the field and the value, on both
    backends; ``check_draft_ids=False`` skips the check (the engine's drafts are in range)."""
    batch = make_batch([2, 1], 37, device)
    drafts = batch["draft_token_ids"].clone()
    drafts[1] = bad
    args = (batch["target_logits"], drafts, batch["cu_num_draft_tokens"], None,
            batch["temperature"], None, None, None, batch["seeds"], batch["positions"], 2)
    for op in (rejection.rejection_sample, triton_ops.rejection_sample):
        with pytest.raises(ValueError, match=f"draft_token_ids must lie in \\[0, 37\\).*{bad}"):
            op(*args)
    ok = (batch["target_logits"], batch["draft_token_ids"]) + args[2:]
    assert torch.equal(triton_ops.rejection_sample(*ok, check_draft_ids=False),
                       rejection.rejection_sample(*ok, check_draft_ids=False))


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager(device):
    """Captured once, replayed on new inputs copied into the same buffers: == eager."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA device")
    batch = make_batch(NUM_DRAFTS[:8], 151936, device, seed=43)
    static = {k: v.clone() for k, v in batch.items()}

    def step():
        return triton_ops.rejection_sample(
            static["target_logits"], static["draft_token_ids"], static["cu_num_draft_tokens"],
            static["draft_probs"], static["temperature"], None, None, None, static["seeds"],
            static["positions"], K)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (44, 45):
        fresh = make_batch(NUM_DRAFTS[:8], 151936, device, seed=seed)
        for k, v in fresh.items():
            static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        expected = rejection.rejection_sample(
            fresh["target_logits"], fresh["draft_token_ids"], fresh["cu_num_draft_tokens"],
            fresh["draft_probs"], fresh["temperature"], None, None, None, fresh["seeds"],
            fresh["positions"], K)
        _assert_same(expected, out)


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size", [32, 64])
def test_many_launches(batch_size, device, monkeypatch):
    """Launch after launch on one GPU at the sizes where skipped rows race the rows' decisions
    (which rows are read depends on timing; the tokens must not), with one (B = 32) and two
    (B = 64) chunks per statistics program: 40 launches with fresh seeds, each == the torch
    twin, and every counter back at zero after."""
    if device.type != "cuda":
        pytest.skip("the races between programs need a GPU")
    monkeypatch.setattr(triton_ops, "_PLANS", {})
    monkeypatch.setattr(triton_ops, "_SCRATCH", {})
    batch = make_batch([K] * batch_size, 151936, device, seed=batch_size,
                       temperatures=(1.0, 1.0, 1.0, 0.0), boost=14.0)
    gen = torch.Generator().manual_seed(7)
    for launch in range(40):
        batch["seeds"] = torch.randint(-(2**62), 2**62, (batch_size,), generator=gen).to(device)
        batch["positions"] = torch.randint(0, 10_000, (batch_size,), generator=gen).to(device)
        _assert_same(*_run_both(batch, draft_probs=launch % 2 == 1))
    (buffers,) = triton_ops._SCRATCH.values()
    assert int(buffers[2].abs().sum()) == 0
