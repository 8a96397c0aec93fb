"""Reading and writing EAGLE heads' checkpoints (docs/design.md §5; the heads are
``verispec.models.eagle``).

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

import torch

from verispec.models.config import read_hf_config
from verispec.models.eagle import EagleHead, eagle_config_from_hf
from verispec.models.loader import SKIP, iter_safetensors, tensor_parallel_slice
from verispec.models.parallel import SINGLE, TensorParallel

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
