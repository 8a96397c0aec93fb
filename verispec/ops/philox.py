"""Counter-based randomness: Philox4x32-10 in torch, word for word Triton's ``tl.rand*``.

Every random draw in verispec is a pure function of ``(seed, position, stream, index)``
(docs/design.md §4). The four are packed into Triton's 64-bit ``offset`` so that a Triton kernel
calling ``tl.rand(seed, offset)`` and the torch code here produce the same 32-bit words:

    offset = ((position * NUM_STREAMS + stream) << 32) | (index >> 2)
    word   = index & 3        of tl.randint4x(seed, offset)
    counter = (offset_lo, offset_hi, 0, 0)          key = (seed_lo, seed_hi)

``index`` is the vocabulary index for per-token noise and 0 for a per-position scalar (an
acceptance ``u``, which is then exactly ``tl.rand(seed, offset)``). One Philox evaluation serves
four consecutive vocabulary indices, so noise over V costs V / 4 evaluations. ``position`` is the
absolute token position that the draw decides.

All arithmetic is on int64 tensors holding uint32 values, so it runs on any device torch runs on;
on the CPU the same rounds run in numpy's uint64 (faster there), and given the compiled CPU
kernels (``kernels``, the backend's choice: ``ops.backend``) the draws' uniforms come from their
rounds, bit for bit the same.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

# Named streams (docs/design.md §4). Keep in sync with verispec/ops/triton_kernels.py.
DRAFT_STREAM = 0  # the proposer's draft sampling
ACCEPT_STREAM = 1  # acceptance uniforms u
RESIDUAL_STREAM = 2  # recovered-token sampling at the first rejection
SAMPLE_STREAM = 3  # normal sampling and bonus tokens
NUM_STREAMS = 4

_MASK32 = 0xFFFFFFFF
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_N_ROUNDS = 10
# tl.rand's scale: the largest float32 with (2**31 - 1) * scale < 1.
_UNIFORM_SCALE = 4.6566127342e-10
# What a uniform of exactly 0 becomes: half of the smallest nonzero value tl.rand can return.
MIN_UNIFORM = 2.3283064e-10


def philox4x32(
    seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 on counter ``(c0, c1, 0, 0)`` with key ``(seed_lo, seed_hi)``.

    Parameters
    ----------
    seed : int64 tensor, broadcastable with ``c0``; the full 64-bit seed (negative seeds use
        their two's-complement bits, as Triton's cast to uint64 does).
    c0, c1 : int64 tensors holding uint32 values.

    Returns
    -------
    Four int64 tensors holding uint32 words, the same as Triton's ``tl.randint4x``.
    """
    if seed.device.type == "cpu":
        # Same rounds in numpy's native uint64: faster than torch's int64 on CPU.
        words = _philox_rounds(
            seed.numpy().astype(np.uint64), c0.numpy().astype(np.uint64),
            c1.numpy().astype(np.uint64), np.uint64,
        )
        return tuple(torch.from_numpy(np.asarray(w, dtype=np.int64)) for w in words)
    return _philox_rounds(seed, c0, c1, int)


def _philox_rounds(seed, c0, c1, as_int):
    """The ten rounds on int64 torch tensors or uint64 numpy arrays holding uint32 values."""
    mask, shift = as_int(_MASK32), as_int(32)
    round_a, round_b = as_int(_ROUND_A), as_int(_ROUND_B)
    key_a, key_b = as_int(_KEY_A), as_int(_KEY_B)
    # Keys keep the seed's shape (one per row, cheap to raise); counters take the full shape.
    k0 = seed & mask
    k1 = (seed >> shift) & mask
    c0 = (c0 & mask) + 0 * k0
    c1 = (c1 & mask) + 0 * c0
    c2 = 0 * c0
    c3 = 0 * c0
    for _ in range(_N_ROUNDS):
        # One 64-bit product gives both halves: uint32 * uint32 < 2**64 (it wraps in torch's
        # int64 but keeps its low 64 bits), so bits 32..63 are the high word, 0..31 the low word.
        prod_b = round_b * c2
        prod_a = round_a * c0
        c0 = ((prod_b >> shift) & mask) ^ c1 ^ k0
        c2 = ((prod_a >> shift) & mask) ^ c3 ^ k1
        c1 = prod_b & mask
        c3 = prod_a & mask
        k0 = (k0 + key_a) & mask
        k1 = (k1 + key_b) & mask
    return c0, c1, c2, c3


def make_offset(position: torch.Tensor, stream: torch.Tensor | int, index: torch.Tensor | int = 0):
    """The 64-bit Triton offset holding draw ``(position, stream, index)``; int64, broadcast.
    The draw is word ``index & 3`` of ``tl.randint4x(seed, offset)``."""
    return ((position * NUM_STREAMS + stream) << 32) | (index >> 2)


def randint4x(seed: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Triton's ``tl.randint4x(seed, offset)`` for int64 offsets: four uint32 words (in int64)."""
    return philox4x32(seed, offset & _MASK32, (offset >> 32) & _MASK32)


def _compiled_uniform(kernels: ModuleType | None, seed: torch.Tensor, offset: torch.Tensor,
                      word: torch.Tensor | int | None = None) -> torch.Tensor | None:
    """The uniforms of ``offset``'s words (``word`` of each, or all four in the vocabulary
    layout) from the compiled rounds of ``kernels`` for CPU tensors, bit for bit what
    ``_nonzero(uint_to_uniform(...))`` of ``randint4x`` gives (one call instead of ~10 torch
    ops a draw); None without them."""
    if kernels is None or seed.device.type != "cpu":
        return None
    if isinstance(word, int):
        word = torch.tensor(word & 3)
    return kernels.philox_uniform(seed, offset & _MASK32, (offset >> 32) & _MASK32, word)


def randint(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Triton's ``tl.randint(seed, offset)``: the first Philox word."""
    return randint4x(seed, offset)[0]


def uint_to_uniform(x: torch.Tensor) -> torch.Tensor:
    """Triton's ``uint_to_uniform_float`` for uint32 words: float32 in [0, 1)."""
    # As int32 a word w >= 2**31 is negative and Triton takes ~w, which as uint32 is w ^ 0xFFFFFFFF
    x = x ^ ((x >> 31) * _MASK32)  # [0, 2**31)
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def rand(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Triton's ``tl.rand(seed, offset)``: float32 in [0, 1), bit for bit (0 is possible)."""
    return uint_to_uniform(randint(seed, offset))


def _nonzero(u: torch.Tensor) -> torch.Tensor:
    # A zero u would let p(d) = 0 tokens pass and make -log(u) infinite in the race.
    return torch.clamp_min(u, MIN_UNIFORM)


def uniform(
    seed: torch.Tensor, position: torch.Tensor, stream: torch.Tensor | int, index: int = 0,
    kernels: ModuleType | None = None,
) -> torch.Tensor:
    """Uniforms in (0, 1) for the scalar draws ``(seed, position, stream, index)`` (broadcast):
    ``tl.rand`` with an exact 0 replaced by ``MIN_UNIFORM``. ``kernels``: the compiled CPU
    kernels (``Backend.cpu``) to draw with, or None (here and in the draws below)."""
    offset = make_offset(position, stream, index)
    compiled = _compiled_uniform(kernels, seed, offset, index)
    if compiled is not None:
        return compiled
    return _nonzero(uint_to_uniform(randint4x(seed, offset)[index & 3]))


def uniform_at(
    seed: torch.Tensor, position: torch.Tensor, stream: torch.Tensor | int, index: torch.Tensor,
    kernels: ModuleType | None = None,
) -> torch.Tensor:
    """``uniform`` with a per-draw ``index`` (int64 tensor, broadcast with ``seed`` and
    ``position``): float32 in (0, 1), entry i the draw ``(seed[i], position[i], stream,
    index[i])``. Index 0 gives exactly ``uniform``'s draw (a token tree's first child draws
    what a chain's draft does; docs/design.md §16)."""
    offset = make_offset(position, stream, index)
    compiled = _compiled_uniform(kernels, seed, offset, index & 3)
    if compiled is not None:
        return compiled
    words = torch.stack(torch.broadcast_tensors(*randint4x(seed, offset)), dim=-1)
    word = torch.broadcast_to(index & 3, words.shape[:-1])
    return _nonzero(uint_to_uniform(words.gather(-1, word[..., None])[..., 0]))


def vocab_uniform(
    seed: torch.Tensor, position: torch.Tensor, stream: torch.Tensor | int, vocab_size: int,
    kernels: ModuleType | None = None,
) -> torch.Tensor:
    """Uniforms in (0, 1) for every vocabulary index of each row.

    Parameters
    ----------
    seed, position : [num_rows] int64
    stream : int, or [num_rows] int64 (one named stream per row)
    vocab_size : V

    Returns
    -------
    [num_rows, V] float32; entry ``[r, v]`` is draw ``(seed[r], position[r], stream, v)``.
    """
    num_counters = (vocab_size + 3) // 4
    counter = torch.arange(num_counters, device=seed.device, dtype=torch.int64)
    if isinstance(stream, torch.Tensor):
        stream = stream[:, None]
    offset = make_offset(position[:, None], stream, 0) | counter[None, :]
    compiled = _compiled_uniform(kernels, seed[:, None], offset)
    if compiled is not None:
        return compiled[:, :vocab_size]
    words = torch.stack(randint4x(seed[:, None], offset), dim=-1)  # [rows, V/4, 4]
    u = uint_to_uniform(words.reshape(seed.shape[0], 4 * num_counters)[:, :vocab_size])
    return _nonzero(u)


def exponential(
    seed: torch.Tensor, position: torch.Tensor, stream: torch.Tensor | int, vocab_size: int,
    kernels: ModuleType | None = None,
) -> torch.Tensor:
    """Exp(1) noise ``E = -log u`` for every vocabulary index of each row: [num_rows, V] float32,
    strictly positive and finite (same arguments as ``vocab_uniform``)."""
    return -torch.log(vocab_uniform(seed, position, stream, vocab_size, kernels))


def exponential_block(
    seed: torch.Tensor, position: torch.Tensor, stream: torch.Tensor | int, start: torch.Tensor,
    n: int, kernels: ModuleType | None = None,
) -> torch.Tensor:
    """Exp(1) noise for the ``n`` consecutive vocabulary indices ``start[r] .. start[r] + n - 1``
    of each row (``start`` [num_rows] int64 and ``n`` multiples of 4): [num_rows, n] float32,
    the draws ``exponential_at`` gives there, from one Philox evaluation per four indices
    instead of one per index."""
    counter = (start[:, None] >> 2) + torch.arange(n // 4, device=seed.device, dtype=torch.int64)
    if isinstance(stream, torch.Tensor):
        stream = stream[:, None]
    offset = make_offset(position[:, None], stream, 0) | counter
    u = _compiled_uniform(kernels, seed[:, None], offset)
    if u is None:
        words = torch.stack(randint4x(seed[:, None], offset), dim=-1)  # [rows, n / 4, 4]
        u = _nonzero(uint_to_uniform(words.reshape(seed.shape[0], n)))
    return -torch.log(u)


def exponential_at(
    seed: torch.Tensor, position: torch.Tensor, stream: torch.Tensor | int, index: torch.Tensor,
    kernels: ModuleType | None = None,
) -> torch.Tensor:
    """Exp(1) noise at chosen indices: ``index`` [num_rows, n] int64; entry ``[r, j]`` is draw
    ``(seed[r], position[r], stream, index[r, j])``, the same value ``exponential`` gives at
    that vocabulary index. Returns [num_rows, n] float32."""
    if isinstance(stream, torch.Tensor):
        stream = stream[:, None]
    offset = make_offset(position[:, None], stream, index)
    u = _compiled_uniform(kernels, seed[:, None], offset, index & 3)
    if u is None:
        words = torch.stack(randint4x(seed[:, None], offset), dim=-1)  # [rows, n, 4]
        u = _nonzero(uint_to_uniform(words.gather(-1, (index & 3)[..., None])[..., 0]))
    return -torch.log(u)
