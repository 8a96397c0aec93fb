"""Decoder layers of a GGUF-quantised Llama-family model on the CPU in one compiled call per
forward (``ops/quant_decoder.c``): the padded CPU forward of ``models.llama`` without its ~25
torch ops and ~7 kernel calls per layer from Python.

``QuantDecoder`` holds the layers' packed weights as the C structures; ``run`` takes one
forward's metadata and runs a span of layers over the residual stream in place. The model asks
for it once (``LlamaForCausalLM.set_cpu_matmuls``). It calls the kernels the per-op path calls
(norm, quantised matmul, attention, silu * up) and computes RoPE and the residual adds as torch
does (RoPE's sum is torch's addcmul, one FMA), so the two paths give the same bits
(tests/models/test_gguf_quant.py compares every forward of a speculative run).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from verispec.ops.quant import QuantizedWeight

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
MAX_HEAD_DIM = 512  # the C file's RoPE buffer


class _QWeight(ctypes.Structure):
    _fields_ = [("qs", _ptr), ("scales", _ptr), ("bias", _ptr), ("n_padded", _i64), ("k", _i64),
                ("group", _i64), ("bits", _i64), ("half", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _QWeight), ("o", _QWeight), ("gate_up", _QWeight), ("down", _QWeight),
                ("input_norm", _ptr), ("post_norm", _ptr)]


class _Step(ctypes.Structure):
    _fields_ = [("batch", _i64), ("seq", _i64), ("hidden", _i64), ("num_heads", _i64),
                ("num_kv_heads", _i64), ("head_dim", _i64), ("intermediate", _i64),
                ("cos", _ptr), ("sin", _ptr), ("slot_mapping", _ptr), ("valid_index", _ptr),
                ("num_valid", _i64), ("block_tables", _ptr), ("bt_stride", _i64),
                ("block_size", _i64), ("kv_len", _i64), ("mask", _ptr), ("causal", _i64),
                ("num_threads", _i64), ("scale", _f32), ("eps", _f32)]


def bind(library: ctypes.CDLL) -> None:
    """Declare the C functions' signatures on the loaded kernels (``ops.cpu_kernels``)."""
    library.decoder_layers.restype = ctypes.c_int
    library.decoder_layers.argtypes = [ctypes.POINTER(_Layer), _i64, _ptr, _ptr,
                                       ctypes.POINTER(_Step), _ptr, _ptr, _ptr]
    library.decoder_scratch_floats.restype = _i64
    library.decoder_scratch_floats.argtypes = [ctypes.POINTER(_Layer)] + [_i64] * 5


@dataclass
class DecoderWeights:
    """One layer's weights: the four projections quantised, the two norms float32 [hidden]."""

    qkv: QuantizedWeight  # [(heads + 2 kv heads) head_dim, hidden]
    o: QuantizedWeight  # [hidden, heads head_dim]
    gate_up: QuantizedWeight  # [2 intermediate, hidden]
    down: QuantizedWeight  # [hidden, intermediate]
    input_norm: torch.Tensor  # [hidden] float32
    post_norm: torch.Tensor  # [hidden] float32
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


class QuantDecoder:
    """The layers of one model as ``quant_decoder.c`` takes them. Build with ``QuantDecoder.of``
    (None where a layer does not fit the compiled path)."""

    def __init__(self, kernels: ModuleType, layers: list[DecoderWeights], hidden: int,
                 num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                 eps: float, scale: float) -> None:
        self.library = kernels.library()
        bind(self.library)
        self.shape = (hidden, num_heads, num_kv_heads, head_dim, intermediate)
        self.eps, self.scale = eps, scale
        self._keep: list[torch.Tensor] = []  # padded biases the structures point into
        self.layers = (_Layer * len(layers))(*(self._layer(w) for w in layers))

    @classmethod
    def of(cls, kernels: ModuleType | None, layers: list[DecoderWeights], hidden: int,
           num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float,
           scale: float) -> QuantDecoder | None:
        """The compiled decoder for these layers, or None: no kernels here, a projection not
        quantised (or on the torch twin), a float32 norm missing, an odd or too wide head."""
        if kernels is None or not kernels.quant_available() or not layers:
            return None
        if head_dim % 2 or head_dim > MAX_HEAD_DIM:
            return None
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        shapes = {"qkv": (q_size + 2 * kv_size, hidden), "o": (hidden, q_size),
                  "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}
        for w in layers:
            for name, shape in shapes.items():
                weight = getattr(w, name)
                if (not isinstance(weight, QuantizedWeight) or weight.quant_kernels is None
                        or tuple(weight.shape) != shape):
                    return None
            if any(n.dtype != torch.float32 or n.shape != (hidden,)
                   for n in (w.input_norm, w.post_norm)):
                return None
        return cls(kernels, layers, hidden, num_heads, num_kv_heads, head_dim, intermediate,
                   eps, scale)

    def _weight(self, w: QuantizedWeight, bias: torch.Tensor | None) -> _QWeight:
        if bias is not None:
            bias = F.pad(bias.float(), (0, w.out_padded - w.shape[0])).contiguous()
            self._keep.append(bias)
        qs, scales = w._buffers["qs"], w._buffers["scales"]
        return _QWeight(qs.data_ptr(), scales.data_ptr(),
                        None if bias is None else bias.data_ptr(), w.out_padded, w.shape[1],
                        w.group, w.bits, int(scales.dtype == torch.float16))

    def _layer(self, w: DecoderWeights) -> _Layer:
        return _Layer(self._weight(w.qkv, w.qkv_bias), self._weight(w.o, w.o_bias),
                      self._weight(w.gate_up, w.gate_up_bias),
                      self._weight(w.down, w.down_bias),
                      w.input_norm.data_ptr(), w.post_norm.data_ptr())

    @staticmethod
    def accepts(x: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]
                ) -> bool:
        """The forward's stream and caches fit: float32, contiguous, on the CPU."""
        return (x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
                and all(c.dtype == torch.float32 and c.is_contiguous()
                        for c in (*k_caches, *v_caches)))

    def step(self, x: torch.Tensor, meta, block_size: int) -> tuple[_Step, list[torch.Tensor]]:
        """One forward's ``models.layout.AttentionMetadata`` as the C structure (and the
        tensors it points into, to keep alive for the forward). x: [B, S, hidden]; the caches'
        ``block_size``."""
        hidden, num_heads, num_kv_heads, head_dim, intermediate = self.shape
        B, S, _ = x.shape
        cos = meta.cos.float().reshape(B * S, head_dim).contiguous()
        sin = meta.sin.float().reshape(B * S, head_dim).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        valid = None if meta.valid_index is None else meta.valid_index.to(torch.int64).contiguous()
        tables = meta.block_tables
        if tables.dtype != torch.int32 or tables.stride(-1) != 1:
            tables = tables.to(torch.int32).contiguous()
        mask = None if meta.attn_mask is None else meta.attn_mask.contiguous()
        keep = [t for t in (cos, sin, slots, valid, tables, mask) if t is not None]
        step = _Step(B, S, hidden, num_heads, num_kv_heads, head_dim, intermediate,
                     cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                     None if valid is None else valid.data_ptr(), slots.numel(),
                     tables.data_ptr(), tables.stride(0), block_size, meta.kv_len,
                     None if mask is None else mask.data_ptr(), int(meta.is_causal),
                     torch.get_num_threads(), self.scale, self.eps)
        return step, keep

    def run(self, x: torch.Tensor, step: _Step, k_caches: list[torch.Tensor],
            v_caches: list[torch.Tensor], start: int, stop: int,
            captures: dict[int, torch.Tensor] | None = None) -> None:
        """Layers [start, stop) over x [B, S, hidden] (float32, contiguous) in place; their
        caches ``k_caches[start:stop]`` ... are written as the per-op path writes them.
        ``captures``: layer i -> a tensor like x that receives the stream entering layer i
        (start <= i < stop), in the same call."""
        count = stop - start
        if count <= 0:
            return
        taken = None
        if captures:
            for i, t in captures.items():
                if not (start <= i < stop and t.shape == x.shape and t.dtype == x.dtype
                        and t.is_contiguous()):
                    raise ValueError(f"capture of layer {i}: a contiguous tensor like x for a "
                                     f"layer in [{start}, {stop})")
            taken = (_ptr * count)(*(captures[start + j].data_ptr() if start + j in captures
                                     else None for j in range(count)))
        hidden, num_heads, _, head_dim, intermediate = self.shape
        layers = ctypes.cast(ctypes.addressof(self.layers) + start * ctypes.sizeof(_Layer),
                             ctypes.POINTER(_Layer))
        tokens = step.batch * step.seq
        scratch = torch.empty(self.library.decoder_scratch_floats(
            layers, count, tokens, hidden, num_heads * head_dim, intermediate))
        ks = (_ptr * count)(*(c.data_ptr() for c in k_caches[start:stop]))
        vs = (_ptr * count)(*(c.data_ptr() for c in v_caches[start:stop]))
        status = self.library.decoder_layers(layers, count, ks, vs, ctypes.byref(step),
                                             x.data_ptr(), scratch.data_ptr(), taken)
        if status != 0:
            raise MemoryError(f"decoder_layers: no scratch memory for {step.kv_len} cache rows")
