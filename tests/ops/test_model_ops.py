"""The model ops of the GPU step: each Triton kernel against its torch twin on the same inputs
(Triton's interpreter on CPU, the GPU with ``VERISPEC_TEST_DEVICE=cuda``), and the property the
GPU engine relies on: a row's result does not depend on the other rows of the call (batch
invariance, docs/design.md §12), checked bit for bit.

Strategy: small random shapes that exercise every branch (residual or not, qk-norm, sliding
window, several queries per request with different context lengths, split and unsplit matmuls);
tolerances are those of one bfloat16 rounding where the kernel and the twin sum in different
orders.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verispec.ops import model_ops
from verispec.ops.backend import get_backend

triton_model = pytest.importorskip("verispec.ops.triton_model")
triton_attention = pytest.importorskip("verispec.ops.triton_attention")


def _dot_dtype(device, dtype: torch.dtype) -> None:
    """Triton's interpreter computes a bfloat16 ``tl.dot`` wrongly: such cases run on a GPU."""
    if dtype == torch.bfloat16 and torch.device(device).type != "cuda":
        pytest.skip("bfloat16 tl.dot runs on a GPU only (the interpreter does not emulate it)")


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-2) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    err = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_twin(device, with_residual, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(device, dtype)
    res = torch.randn(5, 96, generator=g).to(device, dtype) if with_residual else None
    res_twin = None if res is None else res.clone()
    out = triton_model.rms_norm(x, w, 1e-5, res)
    ref = model_ops.rms_norm(x, w, 1e-5, res_twin)
    _close(out, ref)
    if with_residual:
        # x + r rounded once (the interpreter's float32 -> bfloat16 cast may truncate)
        torch.testing.assert_close(res, res_twin, rtol=8e-3, atol=0)


def test_silu_mul_matches_twin(device):
    gu = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(device)
    _close(triton_model.silu_mul(gu), model_ops.silu_mul(gu), 1e-5)


def _paged(logical: torch.Tensor, table: torch.Tensor, block_size: int,
           num_blocks: int) -> torch.Tensor:
    """The pool [num_blocks, block_size, ...] holding ``logical`` [slots, max_len, ...] (slot s
    position t at block ``table[s, t // block_size]``); the scratch block 0 stays zero."""
    pool = logical.new_zeros((num_blocks, block_size) + tuple(logical.shape[2:]))
    slots, max_len = logical.shape[:2]
    for s in range(slots):
        for t in range(max_len):
            pool[table[s, t // block_size], t % block_size] = logical[s, t]
    return pool


def _logical(pool: torch.Tensor, table: torch.Tensor, num_slots: int, max_len: int):
    """The inverse of ``_paged``: [num_slots, max_len, ...]."""
    return torch.stack([pool[table[s].long()].flatten(0, 1)[:max_len] for s in range(num_slots)])


def _attention_inputs(device, dtype, counts, contexts, hq=4, hkv=2, d=16, max_len=40, seed=3,
                      block_size=4, in_order=False):
    """A flat step: request b feeds counts[b] new tokens (qkv rows) ending at position
    contexts[b] - 1 of slot B - b; the paged caches hold random keys and values before them.
    Blocks are handed out shuffled (``in_order``: slot s holds consecutive blocks), over a pool
    with the scratch block 0 and a scratch slot row of zeros."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(counts), sum(counts)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).to(device, dtype)
    angles = torch.arange(max_len)[:, None] * (0.3 ** torch.arange(d // 2))[None]
    emb = torch.cat((angles, angles), -1)
    sin = emb.sin()
    sin[:, : d // 2].neg_()  # the signed table of models.rope
    cos, sin = emb.cos().to(device, dtype), sin.to(device, dtype)
    max_blocks = -(-max_len // block_size)
    num_blocks = 1 + (B + 1) * max_blocks
    order = torch.arange(1, num_blocks)
    if not in_order:
        order = order[torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(7))]
    table = torch.zeros(B + 2, max_blocks, dtype=torch.int32)  # row B + 1: the scratch slot
    table[: B + 1] = order.view(B + 1, max_blocks).to(torch.int32)
    k_logical = torch.randn(B + 1, max_len, hkv, d, generator=g)
    v_logical = torch.randn(B + 1, max_len, hkv, d, generator=g)
    k_cache = _paged(k_logical, table, block_size, num_blocks).to(device, dtype)
    v_cache = _paged(v_logical, table, block_size, num_blocks).to(device, dtype)
    slot_ids = torch.arange(B, 0, -1)  # not the identity
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(counts, contexts)])
    slots = torch.repeat_interleave(slot_ids, torch.tensor(counts))
    slot_mapping = table[slots, positions // block_size].long() * block_size + (
        positions % block_size)
    qs = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)))
    return dict(qkv=qkv, positions=positions.to(device), cos=cos, sin=sin, k_cache=k_cache,
                v_cache=v_cache, slot_mapping=slot_mapping.to(device),
                block_tables=table.to(device), slot_ids=slot_ids.to(device),
                context_lens=torch.tensor(contexts).to(device), query_start=qs.to(device),
                max_queries=max(counts), num_heads=hq, num_kv_heads=hkv, scale=0.25)


def _rope_attention(fn, inputs, **kwargs):
    """fn on copies of the caches: (output, k cache, v cache)."""
    x = dict(inputs, k_cache=inputs["k_cache"].clone(), v_cache=inputs["v_cache"].clone())
    return fn(**x, **kwargs), x["k_cache"], x["v_cache"]


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_cache_attention_matches_twin(device, dtype, window, qk_norm):
    """RoPE (after the Qwen3 head norm), the cache write and attention against the twin
    (rope_cache_write then cache_attention), for a step of at most 16 new tokens per request
    (written inside the attention launch) and one of 20 (a launch of its own first)."""
    _dot_dtype(device, dtype)
    d = 16
    g = torch.Generator().manual_seed(8)
    norms = dict(q_norm=(1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype),
                 k_norm=(1 - 0.1 * torch.randn(d, generator=g)).to(device, dtype),
                 eps=1e-6) if qk_norm else {}
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for counts, contexts in (([1, 4, 3, 9], [1, 11, 37, 20]), ([2, 20], [9, 30])):
        inputs = _attention_inputs(device, dtype, counts, contexts, d=d)
        out = _rope_attention(triton_model.rope_cache_attention, inputs, window=window, **norms)
        ref = _rope_attention(model_ops.rope_cache_attention, inputs, window=window, **norms)
        for a, b in zip(out, ref):
            _close(a, b, tol)


def test_cache_write_is_the_same_in_and_before_the_attention_launch(device, monkeypatch):
    """A step's K/V written inside the attention launch (steps of <= 16 tokens) and in a launch
    of its own (longer steps) are the same bits, and so are the outputs."""
    inputs = _attention_inputs(device, torch.float32, [1, 4, 3, 9], [1, 11, 37, 20])
    inside = _rope_attention(triton_model.rope_cache_attention, inputs)
    monkeypatch.setattr(triton_attention, "FUSED_WRITE_MAX_QUERIES", 0)
    before = _rope_attention(triton_model.rope_cache_attention, inputs)
    for a, b in zip(inside, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("op", ["triton", "twin"])
def test_paged_attention_equals_contiguous_bitwise(device, op, window):
    """Attention through shuffled block tables gives the bits of the same caches laid out in
    order (blocks of a slot consecutive, i.e. a contiguous cache): the kernel and the twin reduce
    over positions in a fixed order whatever block holds them. Decode, verify-shaped and
    prefill-shaped requests, block sizes 1, 4 and 16, caches compared position by position."""
    fn = triton_model.rope_cache_attention if op == "triton" else model_ops.rope_cache_attention
    counts, contexts = [1, 4, 3, 20], [1, 11, 37, 30]
    for block_size in (1, 4, 16):
        results = []
        for in_order in (True, False):
            inputs = _attention_inputs(device, torch.float32, counts, contexts, max_len=48,
                                       block_size=block_size, in_order=in_order)
            out, k, v = _rope_attention(fn, inputs, window=window)
            table = inputs["block_tables"].cpu()
            results.append((out, _logical(k.cpu(), table, 5, 48), _logical(v.cpu(), table, 5, 48)))
        for a, b in zip(*results):
            assert torch.equal(a.cpu(), b.cpu()), block_size


def test_query_alone_equals_query_in_verify(device):
    """Four tokens decoded one at a time (each writes its K/V, then attends) and the same four
    as one verify step give bit-identical outputs and caches: later keys are masked, and blocks
    past a query leave it unchanged."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    inputs = _attention_inputs(device, dtype, [4], [70], max_len=80)
    many, k_many, v_many = _rope_attention(triton_model.rope_cache_attention, inputs)
    k_cache, v_cache = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    for i in range(4):
        alone = triton_model.rope_cache_attention(**dict(
            inputs, qkv=inputs["qkv"][i:i + 1], positions=inputs["positions"][i:i + 1],
            slot_mapping=inputs["slot_mapping"][i:i + 1], k_cache=k_cache, v_cache=v_cache,
            context_lens=torch.tensor([67 + i], device=device),
            query_start=torch.tensor([0, 1], device=device), max_queries=1))
        assert torch.equal(alone[0], many[i])
    assert torch.equal(k_cache, k_many) and torch.equal(v_cache, v_many)


@pytest.mark.parametrize("block_q", [None, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_a_mixed_step_equal_them_alone(device, dtype, block_q):
    """A prefill or mixed step (a chunk of 20 queries beside one-token decodes: the launch with
    the flat grid of real tiles and the prefill's query tile) gives each row the bits of the
    same query alone in a decode step, and writes the same caches."""
    _dot_dtype(device, dtype)
    if block_q is not None and torch.device(device).type != "cuda":
        pytest.skip("query tiles other than the defaults: a question for the GPU's instructions")
    counts, contexts = [1, 20, 1, 1], [9, 45, 30, 1]
    inputs = _attention_inputs(device, dtype, counts, contexts, max_len=64)
    tile = {} if block_q is None else {"block_q": block_q}
    mixed, k_mixed, v_mixed = _rope_attention(triton_model.rope_cache_attention, inputs, **tile)
    k_cache, v_cache = _each_query_alone(inputs, counts, contexts, mixed, **tile)
    assert torch.equal(k_cache, k_mixed) and torch.equal(v_cache, v_mixed)


def _each_query_alone(inputs, counts, contexts, together, **kwargs):
    """Each query of ``inputs`` decoded alone, in order (each writing its K/V first), on copies
    of the caches, against its row of ``together``, bit for bit; returns those caches."""
    device = inputs["qkv"].device
    k_cache, v_cache = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    start = 0
    for b, (n, ctx) in enumerate(zip(counts, contexts)):
        for i in range(n):
            row = start + i
            alone = triton_model.rope_cache_attention(**dict(
                inputs, qkv=inputs["qkv"][row:row + 1],
                positions=inputs["positions"][row:row + 1],
                slot_mapping=inputs["slot_mapping"][row:row + 1], k_cache=k_cache,
                v_cache=v_cache, slot_ids=inputs["slot_ids"][b:b + 1],
                context_lens=torch.tensor([ctx - n + i + 1], device=device),
                query_start=torch.tensor([0, 1], device=device), max_queries=1), **kwargs)
            assert torch.equal(alone[0], together[row]), (b, i)
        start += n
    return k_cache, v_cache


# (SMALL_PARTITION_KEYS, SMALL_PARTITIONS, PARTITION_KEYS, MAX_PARTITIONS) shrunk: 64-key
# partitions, at most 2 a query (128 and 192 past positions 128 and 256) or 8 (128 past 512);
# 64 keys below position 128, then 128 and 256 (past 256)
SMALL_PARTITIONS = [(64, 0, 64, 2), (64, 0, 64, 8), (64, 2, 128, 2)]


@pytest.mark.parametrize("window", [None, 90])
@pytest.mark.parametrize("partitions", SMALL_PARTITIONS)
def test_partitions_and_split_kv_keep_the_bits(device, monkeypatch, window, partitions):
    """The reduction's partitions (``SMALL_PARTITIONS``; tiles whose queries straddle a size
    change have both): a decode or verify launch split over 1, 2, 3 or 5 programs a tile
    (split-KV, the last program to finish folding) gives the bits of one program a tile, and a
    prefill launch (the flat grid, folding as it goes) gives each row the bits of that query
    decoded alone, split."""
    for name, value in zip(("SMALL_PARTITION_KEYS", "SMALL_PARTITIONS", "PARTITION_KEYS",
                            "MAX_PARTITIONS"), partitions):
        monkeypatch.setattr(triton_attention, name, value)
    counts, contexts = [1, 4, 3, 4, 2, 3], [1, 70, 131, 258, 300, 514]  # 254 .. 257: two sizes
    inputs = _attention_inputs(device, torch.float32, counts, contexts, max_len=528,
                               block_size=16)
    split = [_rope_attention(triton_model.rope_cache_attention, inputs, window=window,
                             split_programs=n) for n in (1, 2, 3, 5)]
    for out, k, v in split[1:]:
        assert torch.equal(out, split[0][0])
        assert torch.equal(k, split[0][1]) and torch.equal(v, split[0][2])
    counts, contexts = [20, 1], [270, 131]
    inputs = _attention_inputs(device, torch.float32, counts, contexts, max_len=320,
                               block_size=16)
    prefill, _, _ = _rope_attention(triton_model.rope_cache_attention, inputs, window=window)
    _each_query_alone(inputs, counts, contexts, prefill, window=window, split_programs=2)


def test_layers_of_a_step_share_what_the_layout_gives(device):
    """The layers of a mixed step pass the step's ``derived`` dict (``FlatBatch.derived``): the
    first layer computes the flat grid's tile starts into it, the next ones reuse them (under
    inference mode, as the engine runs), with the bits of a launch that computes its own."""
    counts, contexts = [1, 20, 1], [9, 45, 30]
    derived = {}
    with torch.inference_mode():
        results = []
        for shared in (None, derived, derived):
            inputs = _attention_inputs(device, torch.float32, counts, contexts, max_len=64)
            results.append(_rope_attention(triton_model.rope_cache_attention, inputs,
                                           derived=shared))
    assert [key[0] for key in derived] == ["tile_starts"]
    for out, k, v in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(k, results[0][1])
        assert torch.equal(v, results[0][2])


def test_split_kv_layers_share_the_step_tickets(device):
    """A split-KV launch counts its programs' arrivals per tile in the step's ``derived``
    tickets; the last program of a tile puts its count back to 0, so the next layer's launch
    (same tickets) folds again: the same bits as launches with fresh tickets, and the tickets
    are all 0 after every launch."""
    counts, contexts = [1, 4, 2], [200, 70, 131]
    derived = {}
    with torch.inference_mode():
        results = []
        for shared in (None, derived, derived, derived):
            inputs = _attention_inputs(device, torch.float32, counts, contexts, max_len=256,
                                       block_size=16)
            results.append(_rope_attention(triton_model.rope_cache_attention, inputs,
                                           derived=shared, split_programs=3))
            tickets = [v for k, v in derived.items() if k[0] == "tickets"]
            assert shared is None or (len(tickets) == 1 and not tickets[0].any())
    for out, k, v in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(k, results[0][1])
        assert torch.equal(v, results[0][2])


@pytest.mark.parametrize("shape", [(40, 64), (48, 1024)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_twin(device, shape, bias, dtype):
    _dot_dtype(device, dtype)
    N, K = shape
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    _close(triton_model.linear(x, w, b), model_ops.linear(x, w, b),
           1e-3 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_silu_mul_matches_twin_and_the_unfused_kernels(device, bias, dtype):
    """The fused gate|up projection + SwiGLU equals the twin, and on a GPU it is bit-identical
    to the unfused kernels (linear, then silu_mul): the same sums, rounded the same way."""
    _dot_dtype(device, dtype)
    g = torch.Generator().manual_seed(6)
    inter, K = 80, 256  # 80 outputs: a partial last tile
    x = torch.randn(5, K, generator=g).to(device, dtype)
    w = (torch.randn(2 * inter, K, generator=g) / K**0.5).to(device, dtype)
    b = torch.randn(2 * inter, generator=g).to(device, dtype) if bias else None
    fused = triton_model.linear_silu_mul(x, w, b)
    assert fused.shape == (5, inter)
    _close(fused, model_ops.linear_silu_mul(x, w, b), 1e-3 if dtype == torch.float32 else 1e-2)
    unfused = triton_model.silu_mul(triton_model.linear(x, w, b))
    if torch.device(device).type == "cuda":
        assert torch.equal(fused, unfused)
    else:  # the interpreter's dot of another tile shape may round differently
        _close(fused, unfused, 1e-5)
    for row in (0, 4):  # batch invariant like linear
        assert torch.equal(triton_model.linear_silu_mul(x[row:row + 1], w, b)[0], fused[row])
    if torch.device(device).type == "cuda":  # 20 rows: the general tile, not the few rows';
        for copies in (4, 40):  # 200: the tile of many rows (LINEAR_MANY_ROWS_GATED)
            assert torch.equal(triton_model.linear_silu_mul(torch.cat([x] * copies), w, b)[:5],
                               fused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_matches_torch_with_ties_and_nan(device, dtype):
    """The first maximum of each row, as torch.argmax: ties across and within chunks of 8192
    and lanes, a partial last chunk, a maximum in the last column, a NaN (the maximum), an all
    -inf row."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 9000, generator=g)
    x[0, [5000, 123, 8999]] = 50.0  # three ties in different blocks and lanes: 123 wins
    x[1, [4096 + 7, 7]] = 50.0  # the same lane of two blocks: 7 wins
    x[2, 8999] = 50.0
    x[3, [10, 20]] = float("nan")
    x[4] = float("-inf")
    x[5, [8192 + 3, 8191]] = 50.0  # either side of the chunk boundary: 8191 wins
    x = x.to(device, dtype)
    assert triton_model.argmax(x).tolist() == model_ops.argmax(x).tolist()
    assert triton_model.argmax(x).tolist() == [123, 7, 8999, 10, 0, 8191]


def test_linear_rows_do_not_depend_on_the_batch(device):
    """Row 0 of a one-row product equals row 0 of a 70-row product (another tile, its loads
    by the tensor-memory accelerator or by the threads), bit for bit."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(5)
    x = torch.randn(70, 1024, generator=g).to(device, dtype)
    w = (torch.randn(48, 1024, generator=g) / 32).to(device, dtype)
    tiles = triton_model.LINEAR_TILES[x.element_size()]
    few_rows = triton_model.LINEAR_FEW_ROWS.get(x.element_size())
    full = triton_model.linear(x, w, config=tiles[0])  # the largest tile
    # every tile also with its loads by the tensor-memory accelerator (Hopper; the interpreter)
    tma = tuple(dataclasses.replace(t, tma=not t.tma) for t in tiles)
    many_rows = tuple(t for (size, _), t in triton_model.LINEAR_MANY_ROWS.items()
                      if size == x.element_size())
    for row in (0, 65):
        for tile in tiles[1:] + tma + many_rows + ((few_rows[2],) if few_rows else ()):
            alone = triton_model.linear(x[row:row + 1], w, config=tile)
            assert torch.equal(alone[0], full[row]), tile
    assert torch.equal(triton_model.linear(x, w)[65], full[65])  # the tile linear_config picks


def test_linear_float32_out_is_the_rounded_product(device):
    """``out_dtype=float32`` (the LM head's logits) stores the product rounded to x's dtype, then
    widened: the same values as ``linear(x, w).float()``, bit for bit, in one kernel."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 256, generator=g).to(device, dtype)
    w = (torch.randn(40, 256, generator=g) / 16).to(device, dtype)
    out = triton_model.linear(x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, triton_model.linear(x, w).float())
    twin = model_ops.linear(x, w, out_dtype=torch.float32)
    assert twin.dtype == torch.float32 and torch.equal(twin, model_ops.linear(x, w).float())


def test_linear_tiles_follow_the_shape():
    """Llama-3.1-8B shapes: the tiles the H100 measurements picked; bulk-copy loads (bfloat16)
    from 56 rows where the last row tile is 7/8 full, from 128 always (H200); float32 keeps one
    block_k (only the tensor cores add a step's 16-feature slices in order, which makes
    bfloat16's 64 and 128 the same sum)."""
    cfg = triton_model.linear_config
    bf16 = torch.bfloat16
    assert (cfg(1, 6144, bf16).block_m, cfg(1, 6144, bf16).block_n) == (16, 32)  # qkv
    assert (cfg(64, 6144, bf16).block_m, cfg(64, 6144, bf16).block_n) == (64, 64)
    assert cfg(1, 4096, bf16).block_n == 32 and cfg(64, 4096, bf16).block_n == 32  # o, down
    assert cfg(1, 28672, bf16).block_n == 128 and cfg(1, 28672, bf16).block_m == 64
    # the fused gate|up projection at up to 16 rows: tiles of 64 gate and 64 up outputs
    assert cfg(16, 28672, bf16, gated=True) == triton_model.LinearConfig(16, 128, 4, 4)
    assert cfg(17, 28672, bf16, gated=True) == cfg(17, 28672, bf16)
    # ... and above 128 rows: gate and up tiles of 128 x 128 (bulk copies from 128 rows)
    many_gated = cfg(129, 28672, bf16, gated=True)
    assert (many_gated.block_m, many_gated.block_n, many_gated.block_k) == (128, 256, 64)
    assert many_gated.tma and cfg(128, 28672, bf16, gated=True) == cfg(128, 28672, bf16)
    assert cfg(256, 28672, bf16).block_m == 256 and cfg(128, 28672, bf16).block_m == 128
    assert cfg(256, 6144, bf16).block_m == 128 and cfg(256, 4096, bf16).block_m == 64
    assert (cfg(256, 6144, bf16).block_k, cfg(256, 6144, bf16).num_stages) == (64, 5)
    assert cfg(128, 6144, bf16).block_k == 128  # deeper pipelines above 128 rows only
    assert not cfg(55, 28672, bf16).tma and cfg(56, 28672, bf16).tma
    assert not cfg(96, 28672, bf16).tma and cfg(128, 28672, bf16).tma  # last tile 3/4 full
    assert not cfg(256, 4096, torch.float32).tma
    assert len({t.block_k for t in triton_model.LINEAR_TILES[4]}) == 1
    assert {t.block_k for t in triton_model.LINEAR_TILES[2]} <= {64, 128}


def test_model_ops_choice():
    assert get_backend("cpu").model_ops() is model_ops.TORCH_MODEL_OPS


def test_strided_index_tensors_are_refused(device):
    """An expanded (stride-0) index tensor would be read past its end: refused up front."""
    inputs = _attention_inputs(device, torch.float32, [1, 1], [3, 4])
    strided = torch.ones(1, dtype=torch.long, device=device).expand(2)
    with pytest.raises(ValueError, match="slot_ids must be a contiguous 1-D tensor"):
        triton_model.rope_cache_attention(**dict(inputs, slot_ids=strided))
