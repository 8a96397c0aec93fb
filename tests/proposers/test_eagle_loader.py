"""EAGLE head checkpoints: the layouts people have, loaded and checked against a plain reference.

Strategy: checkpoints are synthesized with random weights in each layout (EAGLE-3 as published
for Llama-3.x: ``pytorch_model.bin`` with ``midlayer.*``; as SpecForge writes it: safetensors
with ``midlayer.*``, its own ``embed_tokens`` and ``d2t`` / ``t2d``; ``layers.0.*`` under a
``model.`` prefix; EAGLE-1: ``layers.0.*`` with an fc bias, no norms of its own). The loaded
head runs through the proposer's own forward over its KV cache (a prefix, then single tokens)
and must give what ``reference_head`` computes: the architecture written out in plain torch
from the HF-named tensors, the whole sequence at once with a causal mask. Heads that do not fit
the target, missing or surplus weights and inconsistent vocabulary maps are one ValueError
naming the sizes or the key.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from tests.proposers.test_draft_model import save_llama
from verispec.config import SpeculativeConfig
from verispec.models import load_model
from verispec.models.eagle_checkpoint import (
    eagle_state_dict,
    load_eagle_head,
    save_eagle_head,
)
from verispec.proposers import ProposerContext, build_proposer
from verispec.runtime.model_runner import ModelRunner

VOCAB = 64
HIDDEN = 32
TARGET_LAYERS = 6
MAX_MODEL_LEN = 64


def eagle_checkpoint(method: str, target_config, *, draft_vocab_size: int | None = None,
                     seed: int = 0, fc_bias: bool = False, own_embedding: bool = False,
                     scale: float = 0.3, aux_layer_ids=None) -> tuple[dict, dict]:
    """(config.json dict, state dict with HF ``layers.0.*`` names) of a random head."""
    g = torch.Generator().manual_seed(seed)
    H, V = target_config.hidden_size, target_config.vocab_size
    heads, kv_heads, head_dim, inter = 4, 2, H // 4, 2 * H

    def rand(*shape):
        return torch.randn(*shape, generator=g) * scale

    attn_in = 2 * H if method == "eagle3" else H
    state = {
        "layers.0.self_attn.q_proj.weight": rand(heads * head_dim, attn_in),
        "layers.0.self_attn.k_proj.weight": rand(kv_heads * head_dim, attn_in),
        "layers.0.self_attn.v_proj.weight": rand(kv_heads * head_dim, attn_in),
        "layers.0.self_attn.o_proj.weight": rand(H, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": rand(inter, H),
        "layers.0.mlp.up_proj.weight": rand(inter, H),
        "layers.0.mlp.down_proj.weight": rand(H, inter),
        "layers.0.post_attention_layernorm.weight": 1 + rand(H),
    }
    config = {"architectures": ["LlamaForCausalLMEagle3" if method == "eagle3" else
                                "EagleLlamaForCausalLM"],
              "hidden_size": H, "intermediate_size": inter, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": V, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 256, "num_hidden_layers": 1}
    if method == "eagle3":
        num_aux = 3 if aux_layer_ids is None else len(aux_layer_ids)
        Vd = draft_vocab_size or V
        ids = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
        state.update({
            "fc.weight": rand(H, num_aux * H),
            "layers.0.input_layernorm.weight": 1 + rand(H),
            "layers.0.hidden_norm.weight": 1 + rand(H),
            "norm.weight": 1 + rand(H),
            "lm_head.weight": rand(Vd, H) * 3,
            "d2t": ids - torch.arange(Vd),
        })
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
        config["draft_vocab_size"] = Vd
        if aux_layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    else:
        state["fc.weight"] = rand(H, 2 * H)
        if fc_bias:
            state["fc.bias"] = rand(H)
    if own_embedding:
        state["embed_tokens.weight"] = rand(V, H) * 3
    return config, state


LAYOUTS = {
    # name: (method, file, key rewrite)
    "eagle3_published_bin": ("eagle3", "pytorch_model.bin",
                             lambda k: k.replace("layers.0.", "midlayer.")),
    "eagle3_specforge": ("eagle3", "model.safetensors",
                         lambda k: k.replace("layers.0.", "midlayer.")),
    "eagle3_layers0_model_prefix": ("eagle3", "model.safetensors", lambda k: "model." + k),
    "eagle1_published_bin": ("eagle", "pytorch_model.bin", lambda k: k),
}


def write_checkpoint(path, config: dict, state: dict, file: str = "model.safetensors",
                     rename=lambda k: k) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    renamed = {rename(k): v.contiguous() for k, v in state.items()}
    if file.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(renamed, os.path.join(path, file))
    else:
        torch.save(renamed, os.path.join(path, file))
    return str(path)


# ----------------------------------------------------------------------------- reference


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, theta=10000.0):  # x [S, heads, d], HF's rotate-half convention
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions[:, None].double() * inv[None]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None].float()
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None].float()
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def reference_head(method: str, config: dict, state: dict, embed: torch.Tensor,
                   target_lm_head: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over a whole sequence from scratch: token ``tokens[s]`` with ``hidden[s]`` (the
    target's) at ``positions[s]``, causal. Returns (logits over the target vocabulary [S, V]
    with -inf outside the draft vocabulary, output hidden [S, H])."""
    s = {k: v.float() for k, v in state.items()}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    emb = F.embedding(tokens, s.get("embed_tokens.weight", embed))
    if method == "eagle3":
        h = hidden @ s["fc.weight"].T
        x = torch.cat([_rms(emb, s["layers.0.input_layernorm.weight"]),
                       _rms(h, s["layers.0.hidden_norm.weight"])], -1)
        residual = h
    else:
        x = torch.cat([emb, hidden], -1) @ s["fc.weight"].T + s.get("fc.bias", 0)
        residual = x
    S = tokens.shape[0]
    q = (x @ s["layers.0.self_attn.q_proj.weight"].T).view(S, heads, -1)
    k = (x @ s["layers.0.self_attn.k_proj.weight"].T).view(S, kv_heads, -1)
    v = (x @ s["layers.0.self_attn.v_proj.weight"].T).view(S, kv_heads, -1)
    q, k = _rope(q, positions), _rope(k, positions)
    rep = heads // kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("shd,thd->hst", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hst,thd->shd", scores.softmax(-1), v).reshape(S, -1)
    residual = residual + attn @ s["layers.0.self_attn.o_proj.weight"].T
    y = _rms(residual, s["layers.0.post_attention_layernorm.weight"])
    gate, up = y @ s["layers.0.mlp.gate_proj.weight"].T, y @ s["layers.0.mlp.up_proj.weight"].T
    mlp = (F.silu(gate) * up) @ s["layers.0.mlp.down_proj.weight"].T
    out = residual + mlp
    if method == "eagle":
        return out @ target_lm_head.T, out
    draft_logits = _rms(out, s["norm.weight"]) @ s["lm_head.weight"].T
    logits = torch.full((S, embed.shape[0]), float("-inf"))
    logits[:, torch.arange(draft_logits.shape[1]) + s["d2t"].long()] = draft_logits
    return logits, out


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    return save_llama(tmp_path_factory.mktemp("eagle_target"), num_layers=TARGET_LAYERS)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir)


def eagle_proposer(head_dir: str, method: str, target_runner: ModelRunner, k: int = 3,
                   draft_sample_method: str = "greedy", max_num_seqs: int = 4):
    config = SpeculativeConfig(method=method, model=head_dir, num_speculative_tokens=k,
                               draft_sample_method=draft_sample_method)
    return build_proposer(config, ProposerContext(
        max_num_seqs=max_num_seqs, max_model_len=target_runner.max_model_len,
        vocab_size=target_runner.config.vocab_size, target_model=target_runner))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_loads_and_matches_reference(layout, target, tmp_path):
    method, file, rename = LAYOUTS[layout]
    own_embedding = layout == "eagle3_specforge"
    config, state = eagle_checkpoint(method, target.config, seed=3,
                                     draft_vocab_size=40 if method == "eagle3" else None,
                                     fc_bias=method == "eagle", own_embedding=own_embedding)
    if layout == "eagle3_published_bin":
        del state["t2d"]  # optional: d2t alone defines the map
    head_dir = write_checkpoint(tmp_path / layout, config, state, file, rename)
    runner = ModelRunner(target.model, 4, MAX_MODEL_LEN)
    proposer = eagle_proposer(head_dir, method, runner)
    head = proposer.head
    assert head.is_eagle3 == (method == "eagle3")
    assert (head.embed_weight is target.model.embed_weight) != own_embedding

    S = 9
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (S,), generator=g)
    in_features = head.eagle.fc_in_features if method == "eagle3" else HIDDEN
    hidden = torch.randn(S, in_features, generator=g)
    positions = torch.arange(S)
    want_logits, want_out = reference_head(method, config, state, target.model.embed_weight,
                                           target.model.lm_head_weight, tokens, hidden,
                                           positions)
    # the proposer's forward over its cache: a prefix of 6, then one position at a time
    slot, done = 2, 0
    for n in (6, 1, 1, 1):
        logits, out = proposer._head_forward([slot], [tokens[done:done + n].tolist()],
                                             hidden[done:done + n], True)
        done += n
        full = logits
        if proposer.draft_to_target is not None:
            full = torch.full((1, VOCAB), float("-inf")).index_copy_(
                1, proposer.draft_to_target, logits)
        torch.testing.assert_close(full[0], want_logits[done - 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[0], want_out[done - 1], atol=1e-4, rtol=1e-4)
    assert proposer.num_cached_tokens[slot] == S
    # the captured target layers: the configured or default aux layers, or the final norm
    expected_layers = (2, TARGET_LAYERS // 2, TARGET_LAYERS - 3) if method == "eagle3" else (
        TARGET_LAYERS,)
    assert runner.capture_layers == expected_layers


def test_round_trip_through_save(target, tmp_path):
    """What save_eagle_head writes (the train-draft output) loads back to the same head, in the
    vLLM / SGLang layout: midlayer.* keys, d2t, t2d, draft_vocab_size, aux layers."""
    config, state = eagle_checkpoint("eagle3", target.config, seed=5, draft_vocab_size=24,
                                     aux_layer_ids=[1, 2, 4])
    src = write_checkpoint(tmp_path / "src", config, state)
    head = load_eagle_head(src, "eagle3", target.model)
    save_eagle_head(head, str(tmp_path / "out"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("t2d").dtype == torch.bool and f.get_tensor("t2d").sum() == 24
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight",
            "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"} <= keys
    saved = json.load(open(tmp_path / "out" / "config.json"))
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"]
    assert saved["draft_vocab_size"] == 24 and saved["target_hidden_size"] == HIDDEN
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    again = load_eagle_head(str(tmp_path / "out"), "eagle3", target.model)
    before, after = eagle_state_dict(head), eagle_state_dict(again)
    assert before.keys() == after.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name], msg=name)


def _expect_error(tmp_path, target, match, *, method="eagle3", edit_config=None,
                  edit_state=None, **kwargs):
    config, state = eagle_checkpoint(method, target.config, **kwargs)
    if edit_config:
        edit_config(config)
    if edit_state:
        edit_state(state)
    path = write_checkpoint(tmp_path / "bad", config, state)
    with pytest.raises(ValueError, match=match):
        load_eagle_head(path, method, target.model)


def test_head_that_does_not_fit_is_refused(target, tmp_path):
    # vocabulary: both sizes named
    _expect_error(tmp_path, target, r"vocab_size=100.*vocab_size=64",
                  edit_config=lambda c: c.update(vocab_size=100))
    # hidden states of another size (EAGLE-3 target_hidden_size, EAGLE-1 hidden_size)
    _expect_error(tmp_path, target, r"size 48 \(target_hidden_size\).*hidden_size=32",
                  edit_config=lambda c: c.update(target_hidden_size=48))
    _expect_error(tmp_path, target, r"size 48.*hidden_size=32", method="eagle",
                  edit_config=lambda c: c.update(hidden_size=48, intermediate_size=96))
    # aux layers outside the target
    _expect_error(tmp_path, target, r"\[0, 6\).*\[1, 2, 9\]", aux_layer_ids=[1, 2, 9])


def test_bad_checkpoints_name_the_key(target, tmp_path):
    _expect_error(tmp_path, target, r"missing weights for \['norm.weight'\]",
                  edit_state=lambda s: s.pop("norm.weight"))
    _expect_error(tmp_path, target, r"'layers.0.mlp.up_proj.weight' has shape \(64, 31\)",
                  edit_state=lambda s: s.update({"layers.0.mlp.up_proj.weight":
                                                 torch.zeros(64, 31)}))
    _expect_error(tmp_path, target, r"'layers.0.extra.weight' has no place",
                  edit_state=lambda s: s.update({"layers.0.extra.weight": torch.zeros(3)}))
    _expect_error(tmp_path, target, r"d2t maps two draft ids to one target id",
                  draft_vocab_size=8, edit_state=lambda s: s.update(d2t=-torch.arange(8)))
    _expect_error(tmp_path, target, r"t2d does not mark", draft_vocab_size=8,
                  edit_state=lambda s: s.update(t2d=torch.ones(VOCAB, dtype=torch.bool)))
    _expect_error(tmp_path, target, r"not an EAGLE-3 head.*method 'eagle'",
                  edit_state=lambda s: s.pop("layers.0.hidden_norm.weight"))
    path = write_checkpoint(tmp_path / "e3", *eagle_checkpoint("eagle3", target.config))
    with pytest.raises(ValueError, match=r"EAGLE-3 head \(load it with method 'eagle3'\)"):
        load_eagle_head(path, "eagle", target.model)
    with pytest.raises(ValueError, match=r"not a local directory"):
        load_eagle_head(str(tmp_path / "nowhere"), "eagle3", target.model)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"no \*.safetensors or pytorch_model.bin"):
        load_eagle_head(path, "eagle3", target.model)


def test_speculative_config_keys():
    SpeculativeConfig(method="eagle3", model="/heads/x", draft_sample_method="probabilistic")
    with pytest.raises(ValueError, match=r"'eagle' does not use prompt_lookup_min=2"):
        SpeculativeConfig(method="eagle", model="/heads/x", prompt_lookup_min=2)
    with pytest.raises(ValueError, match=r"needs the head"):
        build_proposer(SpeculativeConfig(method="eagle3"), ProposerContext())
