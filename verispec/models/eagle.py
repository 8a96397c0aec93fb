"""EAGLE draft heads (docs/design.md §5): one decoder layer fed the target's own hidden states.

Two architectures, named as vLLM's ``speculative_config`` methods:

- ``eagle`` (EAGLE-1): ``x = fc([embed(t); h])`` (2H -> H) with h the target's final-norm hidden
  state, one Llama decoder layer without an input norm, and the *target's* LM head applied to the
  layer's output (no final norm). The output is also the next draft step's h.
- ``eagle3`` (EAGLE-3): ``h = fc([a_1; a_2; a_3])`` (3H -> H) over the residual streams entering
  three target layers (``aux_layer_ids``; HF's ``hidden_states[i]``), then one decoder layer whose
  attention input is ``[input_norm(embed(t)); hidden_norm(h)]`` (2H) with h as the residual; its
  output before the final norm is the next draft step's h (no fc then), after ``norm`` it goes to
  the head's own LM head over ``draft_vocab_size`` tokens. Draft id i is target id
  ``i + d2t[i]``; ``t2d`` marks the target ids that have a draft id.

Position p of the head pairs the hidden state of target position p with the token at p + 1, and
its output predicts the token at p + 2 (so the head's cache, like a draft model's, is indexed by
the target's positions).

Checkpoints (``load_eagle_head``): a directory with ``config.json`` and ``*.safetensors`` or
``pytorch_model.bin``, in the layouts published for Llama-3.x and written by SpecForge (and by
``verispec train-draft``, ``save_eagle_head``): keys ``fc.*``, ``midlayer.*`` or ``layers.0.*``
(HF decoder-layer names), ``norm.*``, ``lm_head.*``, ``d2t``, ``t2d``, optionally
``embed_tokens.weight`` (otherwise the target's embedding is used) and a ``model.`` prefix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from verispec.models.config import ModelConfig, read_hf_config
from verispec.models.llama import (
    MLP,
    Attention,
    AttentionMetadata,
    FlatBatch,
    RMSNorm,
    _param,
    set_cpu_matmuls,
)
from verispec.models.loader import SKIP, iter_safetensors, tensor_parallel_slice
from verispec.models.parallel import SINGLE, TensorParallel
from verispec.ops import quant
from verispec.ops.cpu_linear import linear
from verispec.ops.model_ops import ModelOps

EAGLE_METHODS = ("eagle", "eagle3")
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
EAGLE1_ARCHITECTURE = "EagleLlamaForCausalLM"

# HF decoder-layer module name -> ours (inside ``EagleHead``); q/k/v and gate/up fill fused
# matrices as in the Llama loader.
_LAYER_KEYS = {
    "self_attn.q_proj": ("attn.qkv", 0),
    "self_attn.k_proj": ("attn.qkv", 1),
    "self_attn.v_proj": ("attn.qkv", 2),
    "self_attn.o_proj": ("attn.o", None),
    "mlp.gate_proj": ("mlp.gate_up", 0),
    "mlp.up_proj": ("mlp.gate_up", 1),
    "mlp.down_proj": ("mlp.down", None),
    "input_layernorm": ("input_norm", None),
    "hidden_norm": ("hidden_norm", None),
    "post_attention_layernorm": ("post_attn_norm", None),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's and SpecForge's default EAGLE-3 layers: an early, a middle and a late one."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class EagleConfig:
    """What a head's ``config.json`` says, checked against its target."""

    method: str  # "eagle" | "eagle3"
    layer: ModelConfig  # the decoder layer's shape (num_hidden_layers = 1)
    vocab_size: int  # the target vocabulary the head's ids refer to
    draft_vocab_size: int  # eagle3: rows of its LM head; eagle: = vocab_size
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # eagle3: target layers read; eagle: (num_target_layers,)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def fc_in_features(self) -> int:
        if self.method == "eagle3":
            return len(self.aux_layer_ids) * self.target_hidden_size
        return 2 * self.hidden_size

    def to_hf_dict(self) -> dict:
        """``config.json`` as vLLM and SGLang read an EAGLE-3 (or EAGLE-1) head."""
        c = self.layer
        hf = {
            "architectures": [EAGLE3_ARCHITECTURE if self.method == "eagle3"
                              else EAGLE1_ARCHITECTURE],
            "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "rope_scaling": dict(c.rope_scaling) or None,
            "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": self.vocab_size, "tie_word_embeddings": False,
            "attention_bias": c.qkv_bias, "torch_dtype": "float32",
        }
        if self.method == "eagle3":
            hf["draft_vocab_size"] = self.draft_vocab_size
            hf["target_hidden_size"] = self.target_hidden_size
            hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        return hf


def eagle_config_from_hf(hf: dict, method: str, target: ModelConfig, path: str) -> EagleConfig:
    """Parse a head's ``config.json`` and check that it fits ``target``: the same vocabulary,
    hidden states of the target's size, aux layers inside the target; a ValueError naming both
    sizes (or the value) otherwise."""
    if method not in EAGLE_METHODS:
        raise ValueError(f"EAGLE method must be one of {EAGLE_METHODS}, got {method!r}")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool) or hf[key] < 1:
            raise ValueError(f"EAGLE head {path!r}: config.json needs {key} (an integer >= 1), "
                             f"got {hf.get(key)!r}")
    layer = ModelConfig.from_hf_dict({**hf, "num_hidden_layers": 1}, "EagleHead")
    vocab_size = hf["vocab_size"]
    if vocab_size != target.vocab_size:
        raise ValueError(
            f"EAGLE head {path!r} has vocab_size={vocab_size}, but the target has "
            f"vocab_size={target.vocab_size}: a head must share the target's vocabulary")
    target_hidden_size = hf.get("target_hidden_size") or layer.hidden_size
    if target_hidden_size != target.hidden_size:
        raise ValueError(
            f"EAGLE head {path!r} reads hidden states of size {target_hidden_size} "
            f"(target_hidden_size), but the target has hidden_size={target.hidden_size}")
    draft_vocab_size = vocab_size
    L = target.num_hidden_layers
    if method == "eagle3":
        draft_vocab_size = hf.get("draft_vocab_size") or vocab_size
        if not isinstance(draft_vocab_size, int) or not 1 <= draft_vocab_size <= vocab_size:
            raise ValueError(f"EAGLE head {path!r}: draft_vocab_size must be an integer in "
                             f"[1, vocab_size={vocab_size}], got {draft_vocab_size!r}")
        eagle_config = hf.get("eagle_config") or {}
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(default_aux_layer_ids(L) if ids is None else ids)
        if len(aux) == 0 or not all(isinstance(i, int) and 0 <= i < L for i in aux):
            raise ValueError(
                f"EAGLE head {path!r}: eagle_aux_hidden_state_layer_ids must be layers of the "
                f"target, in [0, {L}) (it has num_hidden_layers={L}), got {list(aux)!r}")
    else:
        aux = (L,)  # the target's final-norm output
    return EagleConfig(method, layer, vocab_size, draft_vocab_size, target_hidden_size, aux)


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head; the parameters follow ``EagleConfig``.

    ``embed_weight`` is the target's embedding unless the checkpoint has its own; the EAGLE-1
    LM head is the target's. ``config`` is the decoder layer's ``ModelConfig`` (what a
    ``ModelRunner`` needs for the head's KV cache and RoPE tables).
    """

    def __init__(self, eagle: EagleConfig, embed_weight: torch.Tensor,
                 target_lm_head: torch.Tensor | None = None, fc_bias: bool = False,
                 dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE,
                 embed_is_target: bool = False) -> None:
        super().__init__()
        self.eagle = eagle
        # Under tensor parallelism the decoder layer is split as the target's (``config`` is
        # the rank's slice); fc, the norms and an LM head of its own are whole on every rank;
        # the target's embedding and LM head are the rank's vocabulary slices.
        self.tp = tp
        self.config = c = tp.shard_config(eagle.layer)
        H = eagle.hidden_size
        self.embed_weight = embed_weight  # [vocab_size, H], a tensor, possibly the target's
        self.embed_sharded = tp.enabled and embed_is_target
        self.fc_weight = _param(H, eagle.fc_in_features, dtype=dtype)
        self.fc_bias = _param(H, dtype=dtype) if fc_bias else None
        self.attn = Attention(c, dtype, tp)
        self.post_attn_norm = RMSNorm(H, c.rms_norm_eps, dtype)
        self.mlp = MLP(c, dtype, tp)
        self.is_eagle3 = eagle.method == "eagle3"
        # the target's LM head (EAGLE-1; an EAGLE-3 head over the whole vocabulary without one
        # of its own), or the head's own over its draft vocabulary
        self.shares_lm_head = target_lm_head is not None
        self.lm_head_sharded = tp.enabled and self.shares_lm_head
        if self.is_eagle3:
            # the attention reads [embedding; hidden]: 2H input features
            self.attn.qkv_weight = _param(c.q_size + 2 * c.kv_size, 2 * H, dtype=dtype)
            self.input_norm = RMSNorm(H, c.rms_norm_eps, dtype)
            self.hidden_norm = RMSNorm(H, c.rms_norm_eps, dtype)
            self.norm = RMSNorm(H, c.rms_norm_eps, dtype)
            self.lm_head_weight = (target_lm_head if self.shares_lm_head
                                   else _param(eagle.draft_vocab_size, H, dtype=dtype))
            # draft id i -> target id i + d2t[i]
            self.register_buffer("d2t", torch.zeros(eagle.draft_vocab_size, dtype=torch.int64))
        else:
            if target_lm_head is None:
                raise ValueError("an EAGLE-1 head drafts through the target's LM head: give it")
            self.lm_head_weight = target_lm_head  # [vocab_size, H], the target's
        self.matmul_splits, self.upcast_rows, self.batch_invariant = 1, 0, False
        self.kernels: ModuleType | None = None

    def draft_to_target(self) -> torch.Tensor | None:
        """[draft_vocab_size] int64 target id of each draft id; None when they coincide (an
        EAGLE-1 head, or an EAGLE-3 head over the whole vocabulary with d2t = 0)."""
        if not self.is_eagle3 or (self.eagle.draft_vocab_size == self.eagle.vocab_size
                                  and not self.d2t.any()):
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        return linear(x, weight, bias, self.matmul_splits, self.upcast_rows, self.batch_invariant,
                      self.kernels)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S] int64: the token at p + 1 of each head position p
        hidden: torch.Tensor,  # [B, S, D]: target hidden states (D = fc input) or the head's own
        from_target: bool,  # hidden is the target's (fc applies) or the head's previous output
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],  # [1] x [num_blocks, block_size, hkv, head_dim]
        v_caches: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden for the LM head [B, S, H], hidden for the next draft step [B, S, H])."""
        emb = self.embed(input_ids).to(self.fc_weight.dtype)
        hidden = hidden.to(self.fc_weight.dtype)
        if self.is_eagle3:
            if from_target:
                hidden = self._linear(hidden, self.fc_weight, self.fc_bias)
            x = torch.cat([self.input_norm(emb), self.hidden_norm(hidden)], dim=-1)
            residual = hidden + self.attn(x, meta, k_caches[0], v_caches[0])
        else:
            x = self._linear(torch.cat([emb, hidden], dim=-1), self.fc_weight, self.fc_bias)
            residual = x + self.attn(x, meta, k_caches[0], v_caches[0])
        out = residual + self.mlp(self.post_attn_norm(residual))
        return (self.norm(out) if self.is_eagle3 else out), out

    def forward_flat(
        self,
        input_ids: torch.Tensor,  # [T] int64
        hidden: torch.Tensor,  # [T, D]: target hidden states or the head's own (as forward)
        from_target: bool,
        batch: FlatBatch,
        k_caches: list[torch.Tensor],  # [1] x [num_blocks, block_size, hkv, head_dim]
        v_caches: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` on the flat layout of a GPU step (``LlamaForCausalLM.forward_flat``: one
        kernel per small op, capturable), the residual adds fused into the norms. Returns
        ([T, H] for the LM head, [T, H] for the next draft step); ``hidden`` is left as it
        was."""
        ops = batch.ops
        emb = self.embed(input_ids).to(self.fc_weight.dtype)
        hidden = hidden.to(self.fc_weight.dtype)
        if self.is_eagle3:
            residual = (ops.linear(hidden, self.fc_weight, self.fc_bias) if from_target
                        else hidden.clone())  # the norms below add into it in place
            x = torch.cat([ops.rms_norm(emb, self.input_norm.weight, self.input_norm.eps),
                           ops.rms_norm(residual, self.hidden_norm.weight,
                                        self.hidden_norm.eps)], dim=-1)
        else:
            x = ops.linear(torch.cat([emb, hidden], dim=-1), self.fc_weight, self.fc_bias)
            residual = x  # read by the attention before the norm below adds into it
        attn = self.attn.forward_flat(x, batch, k_caches[0], v_caches[0])
        h = ops.rms_norm(attn, self.post_attn_norm.weight, self.post_attn_norm.eps, residual)
        mlp = self.mlp.forward_flat(h, ops)
        if self.is_eagle3:  # residual += mlp: the output, and its final norm for the LM head
            return ops.rms_norm(mlp, self.norm.weight, self.norm.eps, residual), residual
        out = residual + mlp
        return out, out

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[...] int64 -> [..., H] (the target's embedding: vocabulary-parallel under TP)."""
        if self.embed_sharded:
            return self.tp.embedding(input_ids, self.embed_weight, self.eagle.vocab_size)
        return quant.embedding(input_ids, self.embed_weight)  # the target's may be quantised

    def compute_logits(self, hidden: torch.Tensor, ops: ModelOps | None = None) -> torch.Tensor:
        """[..., H] -> [..., draft_vocab_size] float32 (EAGLE-1: the target's vocabulary);
        through ``ops.linear`` on the GPU path; the target's LM head's slices gathered under
        tensor parallelism."""
        if ops is not None:
            logits = ops.linear(hidden, self.lm_head_weight, out_dtype=torch.float32)
        else:
            logits = self._linear(hidden, self.lm_head_weight).float()
        if self.lm_head_sharded:
            return self.tp.gather_vocab(logits, self.eagle.vocab_size)
        return logits

    def set_cpu_matmuls(self, splits: int, upcast_rows: int = 0, batch_invariant: bool = False,
                        kernels: ModuleType | None = None) -> None:
        """``models.llama.set_cpu_matmuls`` of every module."""
        set_cpu_matmuls(self, splits, upcast_rows, batch_invariant, kernels)


# ----------------------------------------------------------------------------- checkpoints


def _checkpoint_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a head directory's ``*.safetensors`` or ``pytorch_model.bin``."""
    if any(f.endswith(".safetensors") for f in os.listdir(path)):
        yield from iter_safetensors(path)
        return
    bin_path = os.path.join(path, "pytorch_model.bin")
    if not os.path.isfile(bin_path):
        raise ValueError(f"EAGLE head {path!r} has no *.safetensors or pytorch_model.bin weights")
    try:
        state = torch.load(bin_path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(f"{bin_path} is not a readable torch checkpoint ({e})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{bin_path} must hold a dict of tensors, got {type(state).__name__}")
    yield from state.items()


def canonical_key(name: str) -> str:
    """A checkpoint key in one spelling: no ``model.`` prefix, ``midlayer.`` -> ``layers.0.``."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer."):]
    return name


def _place(head: EagleHead, name: str) -> tuple[torch.Tensor, int] | None:
    """The tensor that canonical key ``name`` fills and the first row it fills (fused q|k|v and
    gate|up matrices take several keys); None: no such weight in this head."""
    c = head.config
    simple = {"fc.weight": head.fc_weight, "fc.bias": head.fc_bias}
    if head.is_eagle3:
        simple.update({"norm.weight": head.norm.weight, "lm_head.weight": head.lm_head_weight,
                       "d2t": head.d2t})
    if name in simple:
        return None if simple[name] is None else (simple[name], 0)
    if not name.startswith("layers.0."):
        return None
    module, _, kind = name[len("layers.0."):].rpartition(".")
    if module not in _LAYER_KEYS or kind not in ("weight", "bias"):
        return None
    ours, part = _LAYER_KEYS[module]
    if ours in ("input_norm", "hidden_norm"):
        owner = getattr(head, ours, None) if head.is_eagle3 else None
        return None if owner is None or kind != "weight" else (owner.weight, 0)
    if ours == "post_attn_norm":
        return None if kind != "weight" else (head.post_attn_norm.weight, 0)
    parent, attr = ours.split(".")
    dest = getattr(getattr(head, parent), f"{attr}_{kind}")
    if dest is None:
        return None
    if part is None:
        return dest, 0
    if ours == "attn.qkv":
        return dest, (0, c.q_size, c.q_size + c.kv_size)[part]
    return dest, part * c.intermediate_size


def _part_rows(head: EagleHead, name: str, dest: torch.Tensor, start: int) -> torch.Tensor:
    """The rows of ``dest`` that key ``name`` fills from row ``start``."""
    c = head.config
    module = name[len("layers.0."):].rpartition(".")[0] if name.startswith("layers.0.") else ""
    ours, part = _LAYER_KEYS.get(module, (None, None))
    if part is None:
        return dest
    if ours == "attn.qkv":
        size = c.q_size if part == 0 else c.kv_size
    else:
        size = c.intermediate_size
    return dest[start:start + size]


def load_eagle_head(path: str, method: str, target_model, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None,
                    tp: TensorParallel = SINGLE) -> EagleHead:
    """Load an EAGLE-1 (``method="eagle"``) or EAGLE-3 (``"eagle3"``) head for ``target_model``
    (a ``LlamaForCausalLM``). ValueError naming the file and what is wrong: a missing or
    unexpected weight, a shape that differs, a head that does not fit the target."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise ValueError(f"EAGLE head {path!r} is not a local directory (config.json + weights)")
    path = os.fspath(path)
    target = getattr(target_model, "full_config", target_model.config)
    eagle = eagle_config_from_hf(read_hf_config(path), method, target, path)
    dtype = target_model.embed_weight.dtype if dtype is None else dtype
    device = target_model.embed_weight.device if device is None else torch.device(device)
    tensors = {canonical_key(n): t for n, t in _checkpoint_tensors(path)
               if not n.endswith(_IGNORED_SUFFIXES)}
    if method == "eagle3" and "layers.0.hidden_norm.weight" not in tensors:
        raise ValueError(f"EAGLE head {path!r} has no hidden_norm weight: it is not an EAGLE-3 "
                         "head (an EAGLE-1 head loads with method 'eagle')")
    if method == "eagle" and "layers.0.hidden_norm.weight" in tensors:
        raise ValueError(f"EAGLE head {path!r} has a hidden_norm weight: it is an EAGLE-3 head "
                         "(load it with method 'eagle3')")
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is not None and tuple(embed.shape) != (eagle.vocab_size, eagle.hidden_size):
        raise ValueError(f"EAGLE head {path!r}: embed_tokens.weight has shape "
                         f"{tuple(embed.shape)}, expected {(eagle.vocab_size, eagle.hidden_size)}")
    if embed is None and eagle.hidden_size != target.hidden_size:
        raise ValueError(
            f"EAGLE head {path!r} has hidden_size={eagle.hidden_size} and no embedding of its "
            f"own, but the target's embedding has hidden_size={target.hidden_size}")
    if method == "eagle" and eagle.hidden_size != target.hidden_size:
        raise ValueError(
            f"EAGLE head {path!r} has hidden_size={eagle.hidden_size}, but the target's LM head "
            f"it drafts through has hidden_size={target.hidden_size}")
    t2d = tensors.pop("t2d", None)
    # An EAGLE-3 head over the whole vocabulary with no LM head of its own uses the target's
    # (as EAGLE-1 heads do): the same tensor, split like the target's under TP.
    share_lm_head = method == "eagle" or (
        "lm_head.weight" not in tensors and eagle.draft_vocab_size == eagle.vocab_size)
    with torch.device(device):
        head = EagleHead(
            eagle,
            target_model.embed_weight if embed is None else embed.to(device, dtype),
            target_model.lm_head_weight if share_lm_head else None,
            fc_bias="fc.bias" in tensors, dtype=dtype, tp=tp, embed_is_target=embed is None)
    if method == "eagle3" and "d2t" not in tensors and eagle.draft_vocab_size == eagle.vocab_size:
        tensors["d2t"] = torch.zeros(eagle.vocab_size, dtype=torch.int64)
    filled: set[tuple[int, int]] = set()  # (id of a tensor, first row filled)
    with torch.no_grad():
        for name, tensor in tensors.items():
            place = _place(head, name)
            if place is None:
                raise ValueError(f"EAGLE head {path!r}: checkpoint tensor {name!r} has no place "
                                 f"in an {method} head")
            dest, start = place
            view = _part_rows(head, name, dest, start)
            if name.startswith("layers.0."):  # the rank's slice of the decoder layer
                index = tensor_parallel_slice(eagle.layer, tp, "model." + name)
                if index is SKIP:  # a row-parallel bias that rank 0 adds
                    view.zero_()
                    filled.add((id(dest), start))
                    continue
                if index is not None:
                    tensor = tensor[index]
            if tuple(view.shape) != tuple(tensor.shape):
                raise ValueError(f"EAGLE head {path!r}: checkpoint tensor {name!r} has shape "
                                 f"{tuple(tensor.shape)}, expected {tuple(view.shape)}")
            view.copy_(tensor)
            filled.add((id(dest), start))
    _check_filled(head, filled, path, method)
    _check_vocab_maps(head, t2d, path)
    head.eval()
    return head


def _required(head: EagleHead) -> list[tuple[str, torch.Tensor, list[int]]]:
    """(name, tensor, row starts of its fused parts) of every weight a checkpoint must fill."""
    c = head.config
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    required = [("fc.weight", head.fc_weight, []),
                ("layers.0.self_attn.{q,k,v}_proj.weight", head.attn.qkv_weight, [0, q, q + kv]),
                ("layers.0.self_attn.o_proj.weight", head.attn.o_weight, []),
                ("layers.0.mlp.{gate,up}_proj.weight", head.mlp.gate_up_weight, [0, inter]),
                ("layers.0.mlp.down_proj.weight", head.mlp.down_weight, []),
                ("layers.0.post_attention_layernorm.weight", head.post_attn_norm.weight, [])]
    if head.is_eagle3:
        required += [("layers.0.input_layernorm.weight", head.input_norm.weight, []),
                     ("layers.0.hidden_norm.weight", head.hidden_norm.weight, []),
                     ("norm.weight", head.norm.weight, []),
                     ("d2t", head.d2t, [])]
        if not head.shares_lm_head:
            required.append(("lm_head.weight", head.lm_head_weight, []))
    for bias_owner, name in ((head.attn, "qkv_bias"), (head.attn, "o_bias"),
                             (head.mlp, "gate_up_bias"), (head.mlp, "down_bias")):
        bias = getattr(bias_owner, name)
        if bias is not None:
            parts = {"qkv_bias": [0, q, q + kv], "gate_up_bias": [0, inter]}.get(name, [])
            required.append((f"layers.0 {name}", bias, parts))
    return required


def _check_filled(head: EagleHead, filled: set, path: str, method: str) -> None:
    missing = []
    for name, tensor, parts in _required(head):
        if not all((id(tensor), s) in filled for s in parts or [0]):
            missing.append(name)
    if missing:
        raise ValueError(f"EAGLE head {path!r} is missing weights for {missing} (an {method} "
                         "head)")


def _check_vocab_maps(head: EagleHead, t2d: torch.Tensor | None, path: str) -> None:
    """d2t must map draft ids to distinct target ids in the vocabulary; t2d, when given, must
    mark exactly those."""
    if not head.is_eagle3:
        return
    V = head.eagle.vocab_size
    target_ids = torch.arange(head.d2t.shape[0], device=head.d2t.device) + head.d2t
    if target_ids.numel() and (target_ids.min() < 0 or target_ids.max() >= V):
        raise ValueError(f"EAGLE head {path!r}: d2t maps draft ids outside the target vocabulary "
                         f"[0, {V})")
    if torch.unique(target_ids).numel() != target_ids.numel():
        raise ValueError(f"EAGLE head {path!r}: d2t maps two draft ids to one target id")
    if t2d is not None:
        if tuple(t2d.shape) != (V,):
            raise ValueError(f"EAGLE head {path!r}: t2d has shape {tuple(t2d.shape)}, expected "
                             f"({V},)")
        mask = torch.zeros(V, dtype=torch.bool)
        mask[target_ids.cpu()] = True
        if not torch.equal(t2d.to(torch.bool).cpu(), mask):
            raise ValueError(f"EAGLE head {path!r}: t2d does not mark the target ids d2t maps to")


def eagle_state_dict(head: EagleHead, include_embedding: bool = True) -> dict[str, torch.Tensor]:
    """The head's weights under the keys vLLM and SGLang load (``midlayer.*`` for EAGLE-3,
    ``layers.0.*`` for EAGLE-1), contiguous float32 copies on the CPU."""
    c = head.config
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    layer = "midlayer." if head.is_eagle3 else "layers.0."
    qkv, gate_up = head.attn.qkv_weight, head.mlp.gate_up_weight
    state = {
        "fc.weight": head.fc_weight,
        layer + "self_attn.q_proj.weight": qkv[:q],
        layer + "self_attn.k_proj.weight": qkv[q:q + kv],
        layer + "self_attn.v_proj.weight": qkv[q + kv:],
        layer + "self_attn.o_proj.weight": head.attn.o_weight,
        layer + "mlp.gate_proj.weight": gate_up[:inter],
        layer + "mlp.up_proj.weight": gate_up[inter:],
        layer + "mlp.down_proj.weight": head.mlp.down_weight,
        layer + "post_attention_layernorm.weight": head.post_attn_norm.weight,
    }
    if head.fc_bias is not None:
        state["fc.bias"] = head.fc_bias
    if head.is_eagle3:
        state.update({
            layer + "input_layernorm.weight": head.input_norm.weight,
            layer + "hidden_norm.weight": head.hidden_norm.weight,
            "norm.weight": head.norm.weight,
            "lm_head.weight": head.lm_head_weight,
        })
    if include_embedding:
        state["embed_tokens.weight"] = head.embed_weight
    out = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    if head.is_eagle3:
        out["d2t"] = head.d2t.detach().cpu().contiguous()
        mask = torch.zeros(head.eagle.vocab_size, dtype=torch.bool)
        mask[(torch.arange(head.d2t.shape[0]) + out["d2t"])] = True
        out["t2d"] = mask
    return out


def save_eagle_head(head: EagleHead, path: str, include_embedding: bool = True) -> None:
    """Write ``config.json`` and ``model.safetensors`` (the layout ``load_eagle_head``, vLLM and
    SGLang load)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(head.eagle.to_hf_dict(), f, indent=2)
    save_file(eagle_state_dict(head, include_embedding), os.path.join(path, "model.safetensors"))
