"""The compiled CPU kernels (``verispec.ops.cpu_kernels``): the bfloat16 linear layer
(float32 accumulation, one rounding to bfloat16) for every shape a model or a verify step gives
it, and attention over the KV cache against SDPA."""

from __future__ import annotations

import shutil

import pytest
import torch

from verispec.ops import cpu_build, cpu_kernels

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(),
                                  reason="the bfloat16 CPU kernel is not for this machine")
# every bfloat16 kernel this CPU runs (AVX2; AVX-512 BF16 and AMX where the CPU has them)
ISAS = cpu_kernels.bf16_isas() or ("avx2",)


def test_built_wherever_it_is_wanted():
    """On an AVX2 CPU without torch's fast bfloat16 path, with a C compiler, the kernel builds
    (so CI on such a machine runs the tests below instead of skipping them)."""
    if cpu_build._wanted() and (shutil.which("cc") or shutil.which("gcc")):
        assert cpu_kernels.available()


def test_switched_off_by_environment(monkeypatch):
    from verispec.ops.backend import get_backend

    monkeypatch.setenv("VERISPEC_CPU_KERNELS", "0")
    assert get_backend("cpu").cpu is None


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
@pytest.mark.parametrize("in_features, out_features", [(32, 5), (48, 33), (31, 7), (576, 40),
                                                        (1536, 9), (18, 1), (64, 48)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_rounds_the_float32_sum_once(isa, rows, in_features, out_features,
                                                 with_bias):
    """Against the exact product: within half a bfloat16 ulp plus float32 summation error; and
    within one bfloat16 ulp of torch's bfloat16 matmul (which differs only in summation order).
    Odd and non-multiple-of-16 input sizes take the scalar or masked tails; 5, 9 and 17 rows a
    partial group or tile; (64, 48) is a shape AMX takes (the others fall back from it)."""
    gen = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    ours = cpu_kernels.bf16_linear(x, weight, bias, isa)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, out_features)
    exact = torch.nn.functional.linear(x.double(), weight.double(),
                                       None if bias is None else bias.double())
    torch.testing.assert_close(ours.double(), exact, rtol=2**-8, atol=1e-5 * in_features**0.5)
    torch_bf16 = torch.nn.functional.linear(x, weight, bias).double()
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    assert ((ours.double() - torch_bf16).abs() <= ulp + 1e-6).all()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8])
@pytest.mark.parametrize("in_features, out_features", [(32, 5), (31, 7), (576, 40), (17, 1)])
def test_f32_linear_matches_f_linear(rows, in_features, out_features):
    """The float32 kernel: F.linear up to summation order (input sizes off multiples of 16 take
    the scalar tail; 5 rows a partial group), with and without bias."""
    gen = torch.Generator().manual_seed(rows + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(2, rows, in_features, generator=gen)
    for bias in (None, torch.randn(out_features, generator=gen)):
        ours = cpu_kernels.f32_linear(x, weight, bias)
        assert ours.shape == (2, rows, out_features) and ours.dtype == torch.float32
        torch.testing.assert_close(ours, torch.nn.functional.linear(x, weight, bias),
                                   rtol=1e-5, atol=1e-6 * in_features)  # float32 summation


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_bf16_linear_any_leading_shape_and_strides(isa):
    """[B, S, in] inputs, a transposed (non-contiguous) one, and an empty one."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(32, 64, generator=gen).bfloat16()
    x = torch.randn(2, 3, 64, generator=gen).bfloat16()
    ref = cpu_kernels.bf16_linear(x.reshape(6, 64), weight, None, isa).reshape(2, 3, 32)
    assert torch.equal(cpu_kernels.bf16_linear(x, weight, None, isa), ref)
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert not xt.is_contiguous()
    assert torch.equal(cpu_kernels.bf16_linear(xt, weight, None, isa), ref)
    empty = cpu_kernels.bf16_linear(x[:, :0], weight, None, isa)
    assert empty.shape == (2, 0, 32)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("in_features, out_features", [(576, 64), (1536, 48), (40, 24)])
def test_bf16_linear_rows_do_not_depend_on_the_batch(isa, in_features, out_features):
    """Batch invariance (docs/design.md §12): every row has the same bits computed alone, in any
    group of rows and at any place in a group or AMX tile (1 .. 40 rows)."""
    gen = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(40, in_features, generator=gen).bfloat16()
    alone = torch.cat([cpu_kernels.bf16_linear(x[i:i + 1], weight, bias, isa) for i in range(40)])
    for rows in (2, 3, 4, 5, 16, 17, 40):
        for start in (0, 40 - rows):
            got = cpu_kernels.bf16_linear(x[start:start + rows], weight, bias, isa)
            assert torch.equal(got, alone[start:start + rows]), (rows, start)


def test_bf16_linear_names_a_kernel_this_cpu_lacks():
    if not cpu_kernels.available() or "amx" in cpu_kernels.bf16_isas():
        pytest.skip("needs the kernels on a CPU without AMX")
    with pytest.raises(ValueError, match="isa='amx' does not run here"):
        cpu_kernels.bf16_linear(torch.zeros(1, 32).bfloat16(), torch.zeros(16, 32).bfloat16(),
                                None, "amx")


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("in_features, out_features", [(16, 3), (32, 16)])
def test_bf16_linear_special_values(isa, in_features, out_features):
    """NaN and infinities propagate as in float32 arithmetic; overflow rounds to infinity."""
    weight = torch.ones(out_features, in_features).bfloat16()
    x = torch.zeros(4, in_features).bfloat16()
    x[0, 3] = float("nan")
    x[1, 0] = float("inf")
    x[2, :] = 3e38  # the float32 sum overflows
    out = cpu_kernels.bf16_linear(x, weight, None, isa).float()
    assert out[0].isnan().all() and (out[1] == float("inf")).all()
    assert (out[2] == float("inf")).all() and (out[3] == 0).all()


def _sdpa_reference(q, k_cache, v_cache, slots, kv_len, mask, causal, scale):
    """float64 SDPA over gathered cache rows, zeros for a token that sees no row."""
    batch, seq, heads, _ = q.shape
    keys = k_cache[slots, :kv_len].double().transpose(1, 2)  # [B, hkv, kv_len, d]
    values = v_cache[slots, :kv_len].double().transpose(1, 2)
    group = heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = scale * q.double().transpose(1, 2) @ keys.transpose(-1, -2)  # [B, h, S, kv_len]
    if causal:
        rows = torch.arange(kv_len)[None, :] <= (kv_len - seq + torch.arange(seq))[:, None]
        mask = rows[None, None].expand(batch, 1, seq, kv_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return (probs @ values).transpose(1, 2)  # [B, S, h, d]


def _paged_cache(logical: torch.Tensor, block_size: int, shuffle: bool, seed: int = 0):
    """``logical`` [num_slots, max_len, ...] as a pool [num_blocks, block_size, ...] (block 0
    unused, as the scratch block) and its block tables [num_slots, max_blocks] int32."""
    num_slots, max_len = logical.shape[:2]
    max_blocks = -(-max_len // block_size)
    ids = torch.arange(1, 1 + num_slots * max_blocks)
    if shuffle:
        ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))]
    table = ids.view(num_slots, max_blocks).to(torch.int32)
    pool = logical.new_zeros((1 + num_slots * max_blocks, block_size) + tuple(logical.shape[2:]))
    padded = logical.new_zeros((num_slots, max_blocks * block_size) + tuple(logical.shape[2:]))
    padded[:, :max_len] = logical
    pool[table.long()] = padded.view(num_slots, max_blocks, block_size, *logical.shape[2:])
    return pool, table


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq, heads, kv_heads, head_dim", [(1, 4, 2, 16), (3, 6, 2, 24),
                                                            (5, 3, 3, 64), (2, 8, 1, 40)])
@pytest.mark.parametrize("visibility", ["all", "mask", "causal"])
def test_cache_attention_matches_sdpa(dtype, seq, heads, kv_heads, head_dim, visibility):
    """Grouped-query attention of S new tokens over a paged float32 cache read through shuffled
    block tables, q a strided view (as the model's rotated q and k share one tensor): equal to
    SDPA in float64 up to float32 arithmetic (bfloat16: one rounding of the output), and
    bit-identical to the same cache with each slot's blocks in order (a contiguous cache) and,
    causal, to each token attending alone (a decode step). A masked row that sees no key (a
    padding query) gets zeros."""
    gen = torch.Generator().manual_seed(seq * 100 + heads * 10 + head_dim)
    num_slots, max_len, kv_len, batch = 5, 40, 29, 3
    k_logical = torch.randn(num_slots, max_len, kv_heads, head_dim, generator=gen)
    v_logical = torch.randn(num_slots, max_len, kv_heads, head_dim, generator=gen)
    slots = torch.tensor([4, 0, 2])
    qk = torch.randn(batch, seq, heads + kv_heads, head_dim, generator=gen).to(dtype)
    q = qk[:, :, :heads]
    mask = None
    if visibility == "mask":
        mask = torch.rand(batch, 1, seq, kv_len, generator=gen) < 0.7
        mask[1, 0, 0] = False  # sees nothing
    scale = head_dim**-0.5
    outs = []
    for block_size, shuffle in ((4, True), (16, True), (4, False)):
        k_cache, table = _paged_cache(k_logical, block_size, shuffle)
        v_cache, _ = _paged_cache(v_logical, block_size, shuffle)
        outs.append(cpu_kernels.cache_attention(q, k_cache, v_cache, table[slots].contiguous(),
                                                kv_len, mask, visibility == "causal", scale))
    ours = outs[0]
    assert ours.dtype == dtype and ours.shape == (batch, seq, heads, head_dim)
    assert all(torch.equal(ours, other) for other in outs[1:])
    ref = _sdpa_reference(q, k_logical, v_logical, slots, kv_len, mask,
                          visibility == "causal", scale)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-8, atol=1e-3)
    torch.testing.assert_close(ours.double(), ref, **tol)
    if visibility == "mask":
        assert (ours[1, 0] == 0).all()
    if visibility == "causal":  # each token alone (a decode step) gives its row's bits
        k_cache, table = _paged_cache(k_logical, 4, True)
        v_cache, _ = _paged_cache(v_logical, 4, True)
        for s in range(seq):
            alone = cpu_kernels.cache_attention(q[:, s:s + 1], k_cache, v_cache,
                                                table[slots].contiguous(),
                                                kv_len - seq + s + 1, None, False, scale)
            assert torch.equal(alone[:, 0], ours[:, s])


@needs_kernel
def test_model_attention_through_the_kernel_matches_sdpa(tmp_path, monkeypatch):
    """The model's steps of few tokens (short prefills, a padded batch, verify-shaped appends,
    decode) attend through the kernel, and give the logits of its SDPA path."""
    from tests.models.utils import save_tiny_model
    from verispec.models import layers, load_model
    from verispec.runtime.model_runner import ModelRunner

    loaded = load_model(save_tiny_model(tmp_path, "LlamaForCausalLM"), "float32")
    calls = []
    kernel = cpu_kernels.cache_attention
    monkeypatch.setattr(cpu_kernels, "cache_attention",
                        lambda *args: calls.append(args[0].shape) or kernel(*args))

    def steps(batch_invariant=True):
        runner = ModelRunner(loaded.model, 3, 64, batch_invariant=batch_invariant)
        out = [runner.forward([2, 0], [[5, 17, 33, 2], [7, 3]], logits="all"),
               runner.forward([2, 0], [[8, 9, 10], [11]], logits="all"),
               runner.forward([0], [[12]]), runner.forward([0, 2], [[13], [14]])]
        return torch.cat(out)

    with_kernel = steps()
    assert len(calls) == 4 * loaded.model.config.num_hidden_layers
    monkeypatch.setattr(layers, "CPU_KERNEL_MAX_QUERIES", 0)  # batch-variant path: SDPA
    torch.testing.assert_close(with_kernel, steps(batch_invariant=False), rtol=1e-5, atol=1e-5)
    assert len(calls) == 4 * loaded.model.config.num_hidden_layers  # SDPA the second time


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, size", [(1, 576), (4, 576), (3, 13), (600, 576)])
def test_rms_norm_matches_hf_and_does_not_depend_on_the_batch(dtype, rows, size):
    """HF Llama's RMS norm (float32 statistics; bfloat16 rounded before and after the weight)
    within float32 summation order; each row the same bits alone as in the batch (600 rows take
    the parallel region)."""
    gen = torch.Generator().manual_seed(rows + size)
    x = (3 * torch.randn(rows, size, generator=gen)).to(dtype)
    weight = torch.randn(size, generator=gen).to(dtype)
    ours = cpu_kernels.rms_norm(x, weight, 1e-5)
    xf = x.float()
    hf = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(ours, hf, rtol=2**-6 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-5)
    for i in (0, rows - 1):
        assert torch.equal(cpu_kernels.rms_norm(x[i:i + 1], weight, 1e-5)[0], ours[i])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 300])
def test_silu_mul_matches_torch_and_does_not_depend_on_the_batch(rows):
    """silu(gate) * up of a fused [gate | up] row, strided rows included (a padded matmul
    output), within an ulp or two of torch's (exp differs in the last bit); each row the same
    bits alone as in the batch (300 rows take the parallel region); adversarial values
    (large, tiny, infinite, NaN) as torch gives them."""
    n = 1024
    gen = torch.Generator().manual_seed(rows)
    wide = 6 * torch.randn(rows, 2 * n + 64, generator=gen)
    wide[0, :6] = torch.tensor([100.0, -100.0, 1e-30, float("inf"), float("-inf"), float("nan")])
    gate_up = wide[:, : 2 * n]  # rows strided by 2 n + 64
    ours = cpu_kernels.silu_mul(gate_up, n)
    want = torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    torch.testing.assert_close(ours, want, rtol=3e-7, atol=1e-30, equal_nan=True)
    for i in (0, rows - 1):
        torch.testing.assert_close(cpu_kernels.silu_mul(gate_up[i:i + 1], n)[0], ours[i],
                                   rtol=0, atol=0, equal_nan=True)
    assert ours.shape == (rows, n)


@needs_kernel
@pytest.mark.parametrize("mapped", [False, True])
def test_token_bitmask_matches_the_torch_masks(mapped):
    """A grammar's masks through the kernel == the torch twin, bit for bit: rows of the logits
    picked out of order (one left alone), rows strided (a wider buffer), a vocabulary that ends
    inside a word, words all allowed, all refused and mixed, special values in allowed and
    refused places (NaN and -0.0 kept where allowed); with a column map (an EAGLE-3 head's
    vocabulary in the target's ids) too."""
    from verispec.ops import options

    vocab, num_words = 1000, -(-1000 // 32)
    gen = torch.Generator().manual_seed(4)
    bits = torch.randint(0, 2, (3, num_words * 32), generator=gen, dtype=torch.int64)
    bits[0, :64] = 1  # two whole words allowed
    bits[1, 32:96] = 0  # two whole words refused
    weights = 1 << torch.arange(32, dtype=torch.int64)
    bitmask = (bits.view(3, num_words, 32) * weights).sum(-1)
    bitmask = torch.where(bitmask >= 1 << 31, bitmask - (1 << 32), bitmask).to(torch.int32)
    token_ids = torch.randperm(vocab, generator=gen)[:300] if mapped else None
    columns = vocab if token_ids is None else token_ids.numel()
    wide = torch.randn(5, columns + 7, generator=gen)
    wide[:, :4] = torch.tensor([float("nan"), -0.0, float("inf"), float("-inf")])
    logits = wide[:, :columns]  # rows strided by columns + 7
    rows = torch.tensor([3, 0, 4])
    want = logits.clone()
    options.apply_token_bitmask(want, rows, bitmask, token_ids)
    ours = logits.clone()
    options.apply_token_bitmask(ours, rows, bitmask, token_ids, kernels=cpu_kernels)
    strided = wide.clone()[:, :columns]
    cpu_kernels.token_bitmask(strided, rows, bitmask, token_ids)
    for got in (ours, strided):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(ours[[1, 2]].view(torch.int32), logits[[1, 2]].view(torch.int32))


@needs_kernel
def test_avx2_kernels_alone_where_the_avx512_file_does_not_build(tmp_path, monkeypatch):
    """A compiler that cannot build the AVX-512 BF16 / AMX file still gives the AVX2 kernels
    (and remembers the failed build instead of retrying it at every start)."""
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(cpu_build, "_X512_SOURCE", broken)
    monkeypatch.setattr(cpu_build, "_cache_dir", lambda: tmp_path / "kernels")
    for cached in (cpu_build.load, cpu_kernels.bf16_isas):
        cached.cache_clear()
    try:
        assert cpu_kernels.available() and cpu_kernels.bf16_isas() == ("avx2",)
        x, w = torch.randn(3, 64).bfloat16(), torch.randn(16, 64).bfloat16()
        torch.testing.assert_close(cpu_kernels.bf16_linear(x, w, None).float(),
                                   (x.float() @ w.float().T), rtol=2**-7, atol=1e-3)
        assert len(list((tmp_path / "kernels").glob("*.failed"))) == 1
    finally:
        monkeypatch.undo()
        for cached in (cpu_build.load, cpu_kernels.bf16_isas):
            cached.cache_clear()


@needs_kernel
def test_philox_uniforms_are_the_torch_uniforms():
    """The compiled uniforms (every draw of ``verispec.ops.philox`` on this CPU) are the bits of
    the torch path (``_nonzero(uint_to_uniform(words))``), over 400 000 random offsets and
    seeds of every sign, for each function that draws: per-token noise, a block of it, noise at
    chosen indices, and the scalar acceptance uniforms."""
    from verispec.ops import philox

    g = torch.Generator().manual_seed(1)
    seeds = torch.tensor([0, 1, -7, 2**63 - 1, -(2**63), 0x1234_5678_9ABC_DEF0, 99, 5])
    positions = torch.randint(0, 2**40, (8,), generator=g)
    index = torch.randint(0, 2**31, (8, 600), generator=g)
    starts = torch.randint(0, 2**20, (8,), generator=g) * 4
    stream = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0])

    def draws(kernels):
        return (philox.vocab_uniform(seeds, positions, stream, 50001, kernels),
                philox.exponential_block(seeds, positions, 2, starts, 4096, kernels),
                philox.exponential_at(seeds, positions, stream, index, kernels),
                philox.uniform(seeds, positions, 1, kernels=kernels),
                philox.uniform(seeds, positions, 3, 6, kernels))

    compiled = draws(cpu_kernels)
    for mine, theirs in zip(compiled, draws(None)):
        assert mine.dtype == theirs.dtype == torch.float32 and mine.shape == theirs.shape
        assert torch.equal(mine, theirs)


@needs_kernel
def test_compiled_race_draws_the_torch_race_tokens():
    """The compiled exponential race (``sampling.race`` on this CPU) picks the tokens of the
    torch race (``sampling.torch_race``, the kernels' twin) over vocabularies below, at and
    above one block, a partial last block, rows of zeros but one, sparse and peaked weights,
    NaN weights (the first NaN wins, as torch.max), strided rows, seeds of every sign, far
    positions and a stream per row: 5 000 draws, the same tokens."""
    from verispec.ops import sampling

    g = torch.Generator().manual_seed(7)
    block = sampling.SAMPLING_BLOCK
    checked = 0
    for vocab_size in (1, 5, 4095, block, block + 1, 2 * block, 12001, 12 * block):
        for trial in range(10):
            rows = 100 if vocab_size < block else 40
            logits = torch.randn(rows, vocab_size + 3, generator=g) * (0.3 + 2 * (trial % 4))
            weights = torch.softmax(logits, -1)[:, :vocab_size]  # strided rows
            if trial % 5 == 1:
                weights = weights.masked_fill(torch.rand(weights.shape, generator=g) < 0.9, 0)
            if trial % 5 == 2:
                weights = torch.zeros_like(weights)
                weights[:, -1] = 1.0
            if trial % 5 == 3:
                weights = weights.clone()
                weights[0, vocab_size // 2] = float("nan")
            seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g)
            positions = torch.randint(0, 2**40, (rows,), generator=g)
            stream = torch.randint(0, 4, (rows,), generator=g) if trial % 2 else 3
            mine = sampling.race(weights, seeds, positions, stream, cpu_kernels)
            theirs = sampling.torch_race(weights, seeds, positions, stream)
            assert mine.dtype == torch.int64 and torch.equal(mine, theirs), (vocab_size, trial)
            checked += rows
    assert checked == 5000


def _rejection_case(g: torch.Generator, vocab_size: int, batch_size: int, k: int, case: int):
    """Random inputs of ``rejection_sample``: drafts drawn from q (so that many pass), some
    requests greedy, some without drafts or cut short by -1, q for the full rule or None."""
    from verispec.ops import sampling

    num_drafts = torch.randint(0, k + 1, (batch_size,), generator=g)
    cu = torch.zeros(batch_size + 1, dtype=torch.int64)
    cu[1:] = num_drafts.cumsum(0)
    n = int(cu[-1])
    logits = torch.randn(n + batch_size, vocab_size, generator=g) * (1 + case % 3)
    draft_logits = torch.randn(n, vocab_size, generator=g) * 0.5
    # the draft model sees the target's logits, roughly: drafts pass often
    target_rows = torch.arange(n) + torch.repeat_interleave(torch.arange(batch_size), num_drafts)
    draft_logits += logits[target_rows]
    q = torch.softmax(draft_logits, -1)
    seeds = torch.randint(-(2**62), 2**62, (batch_size,), generator=g)
    positions = torch.randint(0, 2**20, (batch_size,), generator=g)
    draft_ids = sampling.torch_race(q, torch.randint(0, 99, (n,), generator=g), torch.arange(n),
                                    0) if n else torch.zeros(0, dtype=torch.int64)
    if case % 4 == 1 and n:
        draft_ids[torch.rand(n, generator=g) < 0.2] = -1
    temperature = torch.rand(batch_size, generator=g) + 0.2
    temperature[torch.rand(batch_size, generator=g) < 0.3] = 0.0
    top_k = torch.randint(0, 50, (batch_size,), generator=g) if case % 5 == 2 else None
    top_p = torch.rand(batch_size, generator=g) if case % 5 == 3 else None
    if case % 6 == 4:
        logits = logits.to(torch.bfloat16)
    return (logits, draft_ids, cu, None if case % 3 == 0 else q, temperature, top_k, top_p,
            None, seeds, positions, k)


@needs_kernel
def test_compiled_rejection_gives_the_torch_tokens():
    """``rejection_sample`` on this CPU (p from torch, the rest one compiled call) gives the
    tokens of the torch twin, over 600 random batches: vocabularies under and over one race
    block, the full and the one-hot rule, greedy and sampled requests together, all-greedy
    calls, requests without drafts, drafts cut short by -1, top-k and top-p, bfloat16 logits."""
    from verispec.ops import rejection

    g = torch.Generator().manual_seed(3)
    cases = []
    for case in range(600):
        vocab_size = (37, 4096, 9000)[case % 3]
        args = list(_rejection_case(g, vocab_size, 1 + case % 6, 1 + case % 4, case))
        all_greedy = case % 10 == 9
        if all_greedy:
            args[4] = torch.zeros_like(args[4])
        cases.append((args, all_greedy))
    compiled = [rejection.rejection_sample(*args, all_greedy=all_greedy, kernels=cpu_kernels)
                for args, all_greedy in cases]
    accepted = 0
    for (args, all_greedy), mine in zip(cases, compiled):
        theirs = rejection.rejection_sample(*args, all_greedy=all_greedy)
        assert mine.dtype == theirs.dtype == torch.int32 and torch.equal(mine, theirs)
        accepted += int(((mine != -1).sum(1) - 1).sum())
    assert accepted > 300  # drafts pass, so the acceptance path is exercised


@needs_kernel
def test_compiled_rejection_names_a_draft_id_out_of_range():
    """With the engine's ``check_draft_ids=False`` an id outside [-1, V) still gets the
    check's error, not a read outside the rows."""
    from verispec.ops import rejection

    t = torch.tensor
    with pytest.raises(ValueError, match="draft_token_ids must lie in"):
        rejection.rejection_sample(torch.randn(3, 50), t([3, 50]), t([0, 2]), None, t([0.5]),
                                   None, None, None, t([1]), t([9]), 2, check_draft_ids=False,
                                   kernels=cpu_kernels)
