"""Logits processing and sampling, torch twin (the CPU path and the oracle of the Triton kernels).

The processed distribution (docs/design.md §3) of a row with temperature T > 0 is

    z = logits / T
    top-k:  keep z_v >= the k-th largest z                      (ties at the boundary all kept)
    top-p:  p = softmax(z); keep p_v >= tau where tau is the smallest p_v whose strictly larger
            mass sum_{p_u > p_v} p_u is < top_p                 (the shortest prefix of the sorted
                                                                 distribution holding >= top_p)
    min-p:  keep p_v >= min_p * max(p)
    p = softmax over the kept tokens, float32.

Every mask is a threshold on one row, so a kernel can find it by bisection instead of a sort and
land on the same set. Rows with T = 0 are greedy; their p is computed with T = 1 and unused.

Sampling a token proportional to weights w uses the exponential race ``argmax_v w_v / E_v`` with
``E_v = -log u_v`` from the row's Philox stream (docs/design.md §3): no sort, no cumsum, no
``torch.multinomial``, no host sync. Over a vocabulary larger than ``SAMPLING_BLOCK`` the race
runs in two levels (``race``), so that a kernel draws noise for one block of the row, not all V.
"""

from __future__ import annotations

from types import ModuleType

import torch

from verispec.ops import philox

# Tokens per block of the two-level race. A fixed part of the sampling semantics (the kernels
# take it from here), not a tuning knob: another value draws other tokens for the same seeds.
SAMPLING_BLOCK = 4096
# The block-level draws of the two-level race use the row's stream at indices from here on,
# beyond any vocabulary index (Philox counters 2**31 and up), so they are independent of the
# per-token draws.
BLOCK_NOISE_INDEX = 1 << 33


LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_tensor(name: str, t: torch.Tensor, shape: tuple, dtypes: tuple, device,
                 contiguous: bool = False) -> None:
    """``ValueError`` naming ``name`` unless ``t`` is a tensor of ``shape`` (None: any size), a
    dtype in ``dtypes``, on ``device`` (``contiguous``: and contiguous along its last
    dimension, as the kernels read it)."""
    want = "[" + ", ".join("any" if n is None else str(n) for n in shape) + "]"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor {want}, got {type(t).__name__}")
    if t.dim() != len(shape) or any(n is not None and n != m for n, m in zip(shape, t.shape)):
        raise ValueError(f"{name} must be {want}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and t.numel() > 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension")


def check_params(num_rows: int, device, temperature, top_k=None, top_p=None, min_p=None,
                 seeds=None, positions=None, contiguous: bool = False) -> None:
    """Check the per-row (per-request) parameters of the ops: [num_rows] each, on ``device``;
    temperature is required, the others may be None."""
    for name, t, dtypes in (("temperature", temperature, FLOAT_DTYPES),
                            ("top_k", top_k, INT_DTYPES), ("top_p", top_p, FLOAT_DTYPES),
                            ("min_p", min_p, FLOAT_DTYPES), ("seeds", seeds, INT_DTYPES),
                            ("positions", positions, INT_DTYPES)):
        if t is not None or name == "temperature":
            check_tensor(name, t, (num_rows,), dtypes, device, contiguous)


def check_logits(name: str, logits: torch.Tensor, contiguous: bool = False) -> int:
    """``logits`` is [R, V] in a logits dtype; returns R."""
    check_tensor(name, logits, (None, None), LOGITS_DTYPES, getattr(logits, "device", None),
                 contiguous)
    return logits.shape[0]


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R] int64: the first index of each row's maximum (NaN counts as the maximum),
    as ``torch.argmax``. On the CPU through ``torch.max(dim).indices``, which returns the same
    index (documented: the first maximal value) and is several times faster there
    (docs/benchmarks.md)."""
    if x.device.type == "cpu":
        return x.max(dim=-1).indices
    return torch.argmax(x, dim=-1)


def _kth_largest(z: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[R, 1] threshold: the k-th largest value of each row (-inf where top-k is off)."""
    vocab_size = z.shape[-1]
    off = (top_k <= 0) | (top_k >= vocab_size)
    k = torch.where(off, 1, top_k).clamp(1, vocab_size).long()
    # A full sort, not torch.topk: topk needs a static k, which would cost a host sync.
    values = torch.sort(z, dim=-1, descending=True).values
    threshold = values.gather(-1, (k - 1)[:, None])
    return torch.where(off[:, None], float("-inf"), threshold)


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, 1] threshold tau of the top-p mask (0 where top-p is off)."""
    sorted_probs = torch.sort(probs, dim=-1, descending=True).values
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    num_kept = (mass_before < top_p[:, None]).sum(-1).clamp_min(1)
    tau = sorted_probs.gather(-1, (num_kept - 1)[:, None])
    return torch.where((top_p >= 1.0)[:, None], 0.0, tau)


def processed_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The processed target distribution p of each row.

    Parameters
    ----------
    logits : [R, V] float32 / bfloat16 / float16
    temperature : [R] float32; 0 marks a greedy row (processed as T = 1)
    top_k : [R] int, 0 or -1 = off; None = off for every row
    top_p : [R] float32, 1.0 = off; None = off for every row
    min_p : [R] float32, 0.0 = off; None = off for every row

    Returns
    -------
    [R, V] float32 probabilities, each row summing to 1 over its kept tokens.
    """
    check_params(check_logits("logits", logits), logits.device, temperature, top_k, top_p, min_p)
    return _processed_probs(logits, temperature, top_k, top_p, min_p)


def _processed_probs(logits, temperature, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """``processed_probs`` of inputs already checked (the ops' own calls)."""
    temperature = torch.where(temperature > 0, temperature, 1.0).to(torch.float32)
    z = logits.to(torch.float32) / temperature[:, None]
    if top_k is not None:
        z = z.masked_fill(z < _kth_largest(z, top_k), float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if top_p is not None:
        probs = probs.masked_fill(probs < _top_p_threshold(probs, top_p.float()), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if min_p is not None:
        floor = min_p.float()[:, None] * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def race(
    weights: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: torch.Tensor | int,
    kernels: ModuleType | None = None,
) -> torch.Tensor:
    """Sample one index per row with probability proportional to ``weights`` (exponential race).

    Parameters
    ----------
    weights : [R, V] float32, non-negative, at least one positive entry per row
    seeds, positions : [R] int64
    stream : named stream, int or [R] int64
    kernels : the compiled CPU kernels (``Backend.cpu``) or None

    Returns
    -------
    [R] int64 token ids. With V <= ``SAMPLING_BLOCK``: ``argmax_v weights_v / E_v``, ``E_v ~
    Exp(1)`` from draw ``(seed, position, stream, v)``. Larger vocabularies are cut into blocks of
    ``SAMPLING_BLOCK`` tokens and raced in two levels: block c wins with ``argmax_c M_c / E'_c``
    (M_c = the block's total weight, ``E'_c`` from draw ``(seed, position, stream,
    BLOCK_NOISE_INDEX + c)``), then the token with ``argmax_v weights_v / E_v`` over that block's
    tokens (the same per-token draws as the flat race). P(v) = M_c / M * w_v / M_c = w_v / M:
    the same distribution as the flat race, with noise for one block instead of the whole row.
    Ties go to the smallest index at both levels.

    Given the compiled CPU kernels, CPU rows race in one call (``race_rows``) instead of ~25
    torch ops: the same draws, its logarithm and block sums rounded by C instead of torch (a
    token differs from ``torch_race``'s only where two scores agree to the last bit:
    tests/ops/test_cpu_kernels.py).
    """
    if kernels is not None and weights.device.type == "cpu":
        streams = stream if isinstance(stream, torch.Tensor) else torch.full_like(seeds, stream)
        return kernels.race_rows(weights.to(torch.float32), seeds, positions, streams,
                                 SAMPLING_BLOCK, BLOCK_NOISE_INDEX)
    return torch_race(weights, seeds, positions, stream)


def torch_race(
    weights: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: torch.Tensor | int,
) -> torch.Tensor:
    """``race`` in torch ops on any device (the twin of the kernels' races)."""
    num_rows, vocab_size = weights.shape
    block = SAMPLING_BLOCK
    if vocab_size <= block:
        noise = philox.exponential(seeds, positions, stream, vocab_size)
        return first_argmax(weights / noise)
    num_blocks = -(-vocab_size // block)
    padded = torch.nn.functional.pad(weights, (0, num_blocks * block - vocab_size))
    blocks = padded.view(num_rows, num_blocks, block)
    block_ids = torch.arange(num_blocks, device=weights.device, dtype=torch.int64)
    block_noise = philox.exponential_at(seeds, positions, stream,
                                        (BLOCK_NOISE_INDEX + block_ids).expand(num_rows, -1))
    chosen = first_argmax(blocks.sum(-1) / block_noise)  # [R]
    in_block = blocks[torch.arange(num_rows, device=weights.device), chosen]  # [R, block]
    noise = philox.exponential_block(seeds, positions, stream, chosen * block, block)
    return chosen * block + first_argmax(in_block / noise)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: int = philox.SAMPLE_STREAM,
    all_greedy: bool = False,
    kernels: ModuleType | None = None,
) -> torch.Tensor:
    """Sample one token per row from its processed distribution; greedy rows take the argmax.

    Parameters
    ----------
    logits : [R, V] float32 / bfloat16 / float16
    temperature, top_k, top_p, min_p : per row, as in ``processed_probs``
    seeds : [R] int64, the request seeds
    positions : [R] int64, the position the sampled token will occupy
    stream : the named Philox stream (``SAMPLE_STREAM`` for normal and bonus sampling)
    all_greedy : the caller's host-side knowledge that every row is greedy (skips the noise)
    kernels : the compiled CPU kernels (``Backend.cpu``) for the race, or None

    Returns
    -------
    [R] int64 token ids. Ties in the argmax go to the smallest index.
    """
    check_params(check_logits("logits", logits), logits.device, temperature, top_k, top_p, min_p,
                 seeds, positions)
    greedy_ids = first_argmax(logits)
    if all_greedy:
        return greedy_ids
    if logits.device.type == "cpu" and not bool((temperature > 0).all()):
        # A mixed batch on the CPU processes and races its sampled rows only (there is no
        # device to keep in step): a row's draw depends on its own seed and position alone, so
        # the tokens are the same.
        rows = (temperature > 0).nonzero().squeeze(1)
        ids = greedy_ids.clone()
        if rows.numel():
            pick = [None if x is None else x[rows] for x in (top_k, top_p, min_p)]
            probs = _processed_probs(logits[rows], temperature[rows], *pick)
            ids[rows] = race(probs, seeds[rows], positions[rows],
                             stream[rows] if isinstance(stream, torch.Tensor) else stream, kernels)
        return ids
    probs = _processed_probs(logits, temperature, top_k, top_p, min_p)
    random_ids = race(probs, seeds, positions, stream, kernels)
    return torch.where(temperature == 0, greedy_ids, random_ids)


def draft_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The proposer's distribution q: softmax(logits / T) in float32 (temperature only,
    docs/design.md §3). logits [R, V]; temperature [R] (0 treated as 1). Returns [R, V] float32."""
    return _processed_probs(logits, temperature)


def sample_draft(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    kernels: ModuleType | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft sampler: sample draft tokens from q on the draft stream.

    Parameters
    ----------
    logits : [R, V] the proposer's logits
    temperature : [R] float32 (0 = greedy drafting: argmax)
    seeds : [R] int64
    positions : [R] int64, the position each draft token will occupy
    kernels : the compiled CPU kernels (``Backend.cpu``) for the race, or None

    Returns
    -------
    (draft_token_ids [R] int64, draft_probs [R, V] float32 = q)
    """
    check_params(check_logits("logits", logits), logits.device, temperature, seeds=seeds,
                 positions=positions)
    q = draft_probs(logits, temperature)
    ids = torch.where(
        temperature == 0,
        first_argmax(logits),
        race(q, seeds, positions, philox.DRAFT_STREAM, kernels),
    )
    return ids, q
