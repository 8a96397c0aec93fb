"""``verispec train-draft`` on a tiny random target.

Strategy: a 6-layer random Llama (float32) and token-id prompts. A few optimizer steps must
lower the loss; the written directory must load as an EAGLE-3 head whose weights are the
trained ones and whose greedy speculation emits the plain greedy tokens; a run interrupted
after its first checkpoint and started again must end with the very weights of an uninterrupted
run (resumable, deterministic). The training forward (TTT) must compute, at every unrolled step,
the logits the inference proposer computes through its KV cache for the same context and drafts
(training teaches exactly what inference runs).
"""

from __future__ import annotations

import importlib
import json
import random
import re
import shutil

import pytest
import torch

from tests.proposers.test_draft_model import save_llama
from tests.proposers.test_eagle_loader import eagle_checkpoint, eagle_proposer, write_checkpoint
from verispec.cli import main
from verispec.engine.llm import LLM
from verispec.models import load_model
from verispec.models.eagle_checkpoint import eagle_state_dict, load_eagle_head
from verispec.runtime.model_runner import ModelRunner
from verispec.sampling_params import SamplingParams
from verispec.train import TrainDraftConfig, train_draft
from verispec.train import eagle3 as recipe

VOCAB = 64
trainer = importlib.import_module("verispec.train.train_draft")  # the module, not the function
train_data = importlib.import_module("verispec.train.data")
eagle3 = importlib.import_module("verispec.train.eagle3")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    return save_llama(tmp_path_factory.mktemp("train_target"), num_layers=6)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with open(path, "w") as f:
        for _ in range(12):
            ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 8))]
            f.write(json.dumps({"prompt_token_ids": ids}) + "\n")
    return str(path)


def _config(out, target_dir, prompts_file, **kw) -> TrainDraftConfig:
    return TrainDraftConfig(**{**dict(
        output_dir=str(out), model=target_dir, prompts=prompts_file, max_new_tokens=20,
        temperature=0.0, draft_vocab_size=48, ttt_steps=2, epochs=4, batch_size=4, lr=3e-3,
        warmup_steps=2, save_every=4, dtype="float32", max_num_seqs=4), **kw})


def test_train_draft_learns_and_round_trips(tmp_path, target_dir, prompts_file):
    out = tmp_path / "head"
    summary = train_draft(_config(out, target_dir, prompts_file), log=lambda _: None)
    assert summary["steps"] == 12 and summary["sequences"] == 12
    assert summary["target_weights"] == "float32"
    state = torch.load(out / "trainer_state.pt", weights_only=False)
    target = load_model(target_dir)
    # the loss over all the data, before training (the initial head) and after
    samples = [trainer.Sample(*s)
               for s in torch.load(out / "data.pt", weights_only=False)["samples"]]
    draft_ids = state["draft_ids"]
    *batch, starts = train_data.collate(samples, 512,
                                        target.model.lm_head_weight.float()[draft_ids])
    fresh = trainer.EagleHead(trainer._head_config(target.config, 48),
                              target.model.embed_weight.float())
    recipe.init_head(fresh, target.model.lm_head_weight, draft_ids, target.model.norm.weight)
    trained = load_eagle_head(str(out), "eagle3", target.model, dtype=torch.float32)
    with torch.no_grad():
        before, _, acc_before = recipe.ttt_loss(fresh, *batch, 2, starts)
        after, _, acc_after = recipe.ttt_loss(trained, *batch, 2, starts)
    assert after < before - 0.2 and acc_after[0] > acc_before[0] + 0.1, (before, after, acc_before,
                                                                      acc_after)
    head = load_eagle_head(str(out), "eagle3", target.model)
    assert head.eagle.draft_vocab_size == 48 and head.eagle.aux_layer_ids == (3, 4, 5)
    saved = eagle_state_dict(head)
    # fc trained on standardised aux states is saved for the raw ones: W = W' / s
    torch.testing.assert_close(saved["fc.weight"] * train_data.feature_rms(samples),
                               state["params"][0])
    torch.testing.assert_close(saved["lm_head.weight"], state["params"][9])
    # the trained head drafts in the engine; greedy output is the plain greedy output
    prompts = [[5, 9, 14, 3], [40, 41, 7, 7, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(target_dir, dtype="float32").generate(prompts, params)
    llm = LLM(target_dir, dtype="float32", speculative_config={
        "method": "eagle3", "model": str(out), "num_speculative_tokens": 3})
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.spec.stats.num_drafts > 0


def test_head_starts_from_the_target_layer(target_dir):
    """A fresh head's layer starts as the target's layer that reads the last aux state: its
    attention over the hidden half of the input, its MLP and norms; a target whose layer does
    not fit (another shape, no attention) leaves the random start."""
    target = load_model(target_dir).model
    head = trainer.EagleHead(trainer._head_config(target.config, 48), target.embed_weight.float())
    weights = eagle3.copyable_layer(target, 3, head)
    layer = target.layers[3]
    assert all(torch.equal(a, b) for a, b in zip(weights, (
        layer.attn.qkv_weight, layer.attn.o_weight, layer.mlp.gate_up_weight,
        layer.mlp.down_weight, layer.input_norm.weight, layer.post_attn_norm.weight)))
    draft_ids = torch.arange(48)
    recipe.init_head(head, target.lm_head_weight, draft_ids, target.norm.weight, 0, weights)
    H = head.eagle.hidden_size
    torch.testing.assert_close(head.attn.qkv_weight[:, H:], layer.attn.qkv_weight.float())
    for mine, theirs in ((head.attn.o_weight, layer.attn.o_weight),
                         (head.mlp.gate_up_weight, layer.mlp.gate_up_weight),
                         (head.mlp.down_weight, layer.mlp.down_weight),
                         (head.hidden_norm.weight, layer.input_norm.weight),
                         (head.post_attn_norm.weight, layer.post_attn_norm.weight)):
        torch.testing.assert_close(mine, theirs.float())
    random_half = head.attn.qkv_weight[:, :H]
    assert 0 < random_half.abs().mean() < 1  # the embedding half: small and random
    assert eagle3.copyable_layer(target, 99, head) is None
    assert eagle3.copyable_layer(torch.nn.Module(), 3, head) is None
    other = trainer.EagleHead(trainer._head_config(target.config, 48),
                              target.embed_weight.float())
    other.mlp.down_weight = torch.nn.Parameter(torch.zeros(H, 7))  # another MLP width
    assert eagle3.copyable_layer(target, 3, other) is None


def test_prompt_counts(tmp_path, prompts_file, monkeypatch):
    """By default every prompt of a user's file is answered, and the first 5500 of the 6400
    built-in ones (what fits the 30-minute CPU run); --num-prompts takes the first N."""
    seen = []

    def generate(llm, prompts, *args, **kwargs):
        seen.append(len(prompts))
        raise KeyboardInterrupt  # (nothing is generated here)

    monkeypatch.setattr(trainer, "generate_samples", generate)
    for prompts, num_prompts in ((None, None), (prompts_file, None), (None, 7),
                                 (prompts_file, 5)):
        config = TrainDraftConfig(str(tmp_path / "out"), prompts=prompts, num_prompts=num_prompts)
        with pytest.raises(KeyboardInterrupt):
            trainer._load_or_generate(config, None, (1, 2, 3))
    assert seen == [trainer.BUILTIN_PROMPTS, 12, 7, 5] and trainer.BUILTIN_PROMPTS == 5500


def test_feature_rms_is_over_response_tokens():
    aux = torch.ones(6, 4)
    aux[:2] = 100.0  # the prompt (massive activations there do not set the scale)
    aux[2:, 1] = 3.0
    sample = trainer.Sample(torch.arange(6).numpy(), aux, torch.zeros(6, 2), response_start=2)
    torch.testing.assert_close(train_data.feature_rms([sample]),
                               torch.tensor([1.0, 3.0, 1.0, 1.0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_train_draft_on_cuda(tmp_path, prompts_file):
    """``--device cuda``: the target generates on the GPU engine and the head trains there; the
    loss falls, the data is kept on the CPU, and the head loads and drafts on the GPU with
    greedy output == plain greedy."""
    target_dir = save_llama(tmp_path / "target", num_layers=6, hidden_size=64)  # head_dim 16
    out = tmp_path / "head"
    summary = train_draft(_config(out, target_dir, prompts_file, device="cuda", epochs=6),
                          log=lambda _: None)
    history = torch.load(out / "trainer_state.pt", weights_only=False,
                         map_location="cpu")["history"]
    assert history[-1]["loss"][0] < history[0]["loss"][0] - 0.2, history
    assert summary["steps"] == 18
    data = torch.load(out / "data.pt", weights_only=False)["samples"]
    assert all(s[1].device.type == "cpu" and s[2].device.type == "cpu" for s in data)
    prompts = [[5, 9, 14, 3], [40, 41, 7, 7, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(target_dir, dtype="float32", device="cuda").generate(prompts, params)
    llm = LLM(target_dir, dtype="float32", device="cuda", speculative_config={
        "method": "eagle3", "model": str(out), "num_speculative_tokens": 3})
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.spec.stats.num_drafts > 0


def test_resume_gives_the_uninterrupted_result(tmp_path, target_dir, prompts_file,
                                               monkeypatch):
    whole = tmp_path / "whole"
    train_draft(_config(whole, target_dir, prompts_file, epochs=2), log=lambda _: None)
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copy(whole / "data.pt", cut / "data.pt")  # the same generated data, not generated again
    calls = {"n": 0}
    real = recipe.ttt_loss

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:  # after the checkpoint of step 4
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "ttt_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_draft(_config(cut, target_dir, prompts_file, epochs=2), log=lambda _: None)
    assert torch.load(cut / "trainer_state.pt", weights_only=False)["step"] == 4
    monkeypatch.setattr(trainer, "ttt_loss", real)
    lines = []
    train_draft(_config(cut, target_dir, prompts_file, epochs=2), log=lines.append)
    assert any("resuming at step 4" in line for line in lines)
    a = torch.load(whole / "trainer_state.pt", weights_only=False)
    b = torch.load(cut / "trainer_state.pt", weights_only=False)
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
    # other settings in the same directory are refused
    with pytest.raises(ValueError, match="other settings"):
        train_draft(_config(cut, target_dir, prompts_file, epochs=2, lr=1e-3),
                    log=lambda _: None)
    # data recorded at other layers (or before the layers were recorded) is refused, not
    # trained on as if it were this run's
    data = torch.load(cut / "data.pt", weights_only=False)
    for stale in ({**data, "aux_layers": [2, 3, 3]}, data["samples"]):
        other = tmp_path / "other"
        other.mkdir(exist_ok=True)
        torch.save(stale, other / "data.pt")
        with pytest.raises(ValueError, match=r"layers .* this run reads layers \(3, 4, 5\)"):
            train_draft(_config(other, target_dir, prompts_file, epochs=2), log=lambda _: None)


def test_aux_layers_of_trained_heads():
    """The middle layer, one halfway to the last, the last; three distinct layers of any
    target of at least 3 (for 3 or 4 layers, the last three)."""
    assert trainer.aux_layer_ids(30) == (15, 22, 29)
    assert trainer.aux_layer_ids(32) == (16, 23, 31)
    assert trainer.aux_layer_ids(6) == (3, 4, 5)
    assert trainer.aux_layer_ids(4) == (1, 2, 3)
    assert trainer.aux_layer_ids(3) == (0, 1, 2)
    for n in range(3, 100):
        ids = trainer.aux_layer_ids(n)
        assert len(set(ids)) == 3 and 0 <= min(ids) and max(ids) == n - 1
        assert list(ids) == sorted(ids)


def test_states_recorded_while_generating(target_dir, prompts_file, monkeypatch, capsys):
    """The hidden states kept from the generation steps are those of a forward over the same
    tokens afterwards (the path a runner with graphs captured without them takes); a sequence
    keeps the tokens that were fed, all but the last response token. A refused prompt is
    named in a warning, once, and the others are generated."""
    from verispec.train import data

    llm = LLM(target_dir, dtype="float32", max_num_seqs=4)
    prompts = data.load_prompt_file(prompts_file)[:6]
    layers = (2, 3, 3)
    bad = [[3, VOCAB + 5]]  # a token id outside the vocabulary
    kept = data.generate_samples(llm, prompts[:3] + bad + prompts[3:], layers, 12, 0.0, 0,
                                 batch_size=4)
    err = capsys.readouterr().err
    assert err.count("1 of 7 prompts were refused") == 1 and str(VOCAB + 5) in err
    monkeypatch.setattr(data, "_generate_recording", lambda *args: None)
    after = data.generate_samples(llm, prompts[:3] + bad + prompts[3:], layers, 12, 0.0, 0,
                                  batch_size=4)
    assert capsys.readouterr().err.count("1 of 7 prompts were refused") == 1
    assert len(kept) == len(after) == 6
    for a, b, prompt in zip(kept, after, prompts):
        assert a.response_start == b.response_start == len(prompt)
        assert len(prompt) < len(b.token_ids) <= len(prompt) + 12  # (EOS may end it early)
        assert len(a.token_ids) == len(b.token_ids) - 1
        assert (a.token_ids == b.token_ids[:-1]).all()
        n = len(a.token_ids)
        torch.testing.assert_close(a.aux, b.aux[:n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.final, b.final[:n], atol=1e-4, rtol=1e-4)


def test_response_temperatures_taken_in_turn(target_dir, prompts_file, monkeypatch):
    """Several temperatures answer the prompts in turn (prompt i at temperature[i % n], each
    with its own seed), across generation batches; the greedy ones are the plain greedy
    responses."""
    from verispec.train import data

    llm = LLM(target_dir, dtype="float32", max_num_seqs=4)
    prompts = data.load_prompt_file(prompts_file)[:6]
    seen = []
    add_request = llm.add_request
    monkeypatch.setattr(llm, "add_request", lambda prompt, params: (
        seen.append((params.temperature, params.seed)), add_request(prompt, params))[1])
    samples = data.generate_samples(llm, prompts, (2, 3, 3), 12, (0.0, 1.0), 7, batch_size=4)
    assert seen == [(0.0, 7), (1.0, 8), (0.0, 9), (1.0, 10), (0.0, 11), (1.0, 12)]
    monkeypatch.undo()
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for i, (sample, plain) in enumerate(zip(samples, greedy)):
        response = list(sample.token_ids[sample.response_start:])
        if i % 2 == 0:  # the sample keeps all but the last response token
            assert response == plain.token_ids[:len(response)]
    assert any(list(s.token_ids[s.response_start:]) != g.token_ids[:len(s.token_ids)
               - s.response_start] for s, g in zip(samples[1::2], greedy[1::2]))


def test_training_forward_equals_inference(tmp_path):
    """TTT step j's logits at position t = the proposer's logits for draft j + 1 after the
    context 0..t + 1 with drafts x_{t+2} .. x_{t+1+j} fed back (float32)."""
    target_dir = save_llama(tmp_path / "t", num_layers=6)
    target = load_model(target_dir)
    config, state = eagle_checkpoint("eagle3", target.config, seed=2, draft_vocab_size=40)
    head_dir = write_checkpoint(tmp_path / "h", config, state)
    head = load_eagle_head(head_dir, "eagle3", target.model)
    tokens = [4, 19, 33, 7, 51, 26, 12, 9, 40, 2]
    S, steps = len(tokens), 3
    runner = ModelRunner(target.model, 1, 32)
    runner.capture_layers = head.eagle.aux_layer_ids
    runner.forward([0], [tokens], logits="none")
    aux = runner.captured_hidden.rows  # [S, 3H]
    # labels are irrelevant here: logits are compared, so any target_logits work
    with torch.no_grad():
        logits_by_step = _ttt_logits(head, torch.tensor([tokens]), aux[None], steps)
    for t in (2, 5):
        for j in range(steps):
            if t + 1 + j >= S:
                continue
            proposer = eagle_proposer(head_dir, "eagle3", ModelRunner(target.model, 1, 32), 3)
            # context: tokens 0 .. t + 1 (pairs 0 .. t), drafts: tokens t + 2 .. t + 1 + j
            n = t + 2
            logits, out = proposer._head_forward([0], [tokens[1:n]], aux[: n - 1], True)
            for i in range(j):
                logits, out = proposer._head_forward([0], [[tokens[n + i]]], out, False)
            torch.testing.assert_close(logits[0], logits_by_step[j][t], atol=1e-4,
                                       rtol=1e-4)
    # with a response start, steps >= 1 skip the leading positions no step trains; the trained
    # rows (labels from position 6 on: t >= 5 - j) keep their logits
    with torch.no_grad():
        trained = _ttt_logits(head, torch.tensor([tokens]), aux[None], steps, 6)
    for j in range(steps):
        torch.testing.assert_close(trained[j], logits_by_step[j][5 - j:], atol=1e-5, rtol=1e-5)


def _ttt_logits(head, tokens, aux, steps, response_start=None):
    """The head's logits at every TTT step, read through ``ttt_loss``'s own computation: step
    j's [S - 1 - j, V_draft] rows of the positions t whose label t + 1 + j exists (from
    position ``response_start`` on, if given)."""
    captured = []
    real = recipe.soft_cross_entropy

    def spy(logits, target):
        captured.append(logits.detach().clone())
        return real(logits, target)

    recipe.soft_cross_entropy = spy
    try:
        V = head.eagle.draft_vocab_size
        recipe.ttt_loss(head, tokens, aux, torch.zeros(1, tokens.shape[1], V),
                        torch.tensor([tokens.shape[1]]), steps,
                        None if response_start is None else torch.tensor([response_start]))
    finally:
        recipe.soft_cross_entropy = real
    return captured


def test_cli_refuses_bad_flags(tmp_path, capsys):
    assert main(["train-draft", "--output-dir", str(tmp_path / "x"), "--ttt-steps", "0"]) == 2
    assert "ttt_steps must be an integer >= 1, got 0" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    from verispec.train.data import load_prompt_file

    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected"):
        load_prompt_file(str(bad))


def test_aux_layers_flag(tmp_path, target_dir, prompts_file, capsys):
    """--aux-layers picks the three layers a head reads: refused unless three distinct layers
    of the target; a head trained on them names them in its config and reads them."""
    assert main(["train-draft", "--output-dir", str(tmp_path / "x"),
                 "--aux-layers", "1", "1", "2"]) == 2
    assert "aux_layers must be three distinct layer indices >= 0, got [1, 1, 2]" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match=r"aux_layers=\(1, 2, 6\) must be layers of the "
                                         r"target, 0..5 \(num_hidden_layers=6\)"):
        train_draft(_config(tmp_path / "y", target_dir, prompts_file, aux_layers=(1, 2, 6)),
                    log=lambda _: None)
    out = tmp_path / "z"
    train_draft(_config(out, target_dir, prompts_file, aux_layers=(0, 2, 5), epochs=1),
                log=lambda _: None)
    head = load_eagle_head(str(out), "eagle3", load_model(target_dir).model)
    assert head.eagle.aux_layer_ids == (0, 2, 5)
    assert torch.load(out / "data.pt", weights_only=False)["aux_layers"] == [0, 2, 5]


def test_builtin_prompts_hold_out_the_free_bench_prompts():
    """The built-in set is large and diverse, and ``bench --prompts free`` measures prompts the
    head never trained on: none of them, nor any of their subjects, is in the set."""
    from verispec.bench.prompts import FREE_PROMPTS
    from verispec.train.prompts import SUBJECTS, builtin_prompts

    prompts = builtin_prompts(0)
    assert len(prompts) >= 4000 and len(set(prompts)) == len(prompts)
    assert builtin_prompts(0) == prompts and builtin_prompts(1) != prompts
    assert not set(prompts) & set(FREE_PROMPTS)
    held_out_subjects = ("lighthouse", "sky", "language", "autumn", "blacksmith", "virus",
                         "bacteri", "board game", "cat", "dog", "dream", "paint")
    for prompt in FREE_PROMPTS:  # the list names a subject of every held-out prompt
        assert any(re.search(rf"\b{word}", prompt.lower()) for word in held_out_subjects), prompt
    for subject in SUBJECTS:
        for word in held_out_subjects:
            assert not re.search(rf"\b{word}", subject.lower()), (subject, word)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_cross_entropy_matches_the_plain_formula(dtype):
    """The chunked loss (rows over several chunks, one partial) equals -sum p log q with its
    autograd gradient, and counts the rows whose argmaxes agree."""
    g = torch.Generator().manual_seed(4)
    rows = 2 * recipe.LOSS_CHUNK + 5
    logits = (3 * torch.randn(rows, 50, generator=g)).to(dtype).requires_grad_(True)
    target = (3 * torch.randn(rows, 50, generator=g)).to(dtype)
    target[:7] = logits.detach()[:7]  # these rows agree
    loss, agree = recipe.soft_cross_entropy(logits, target)
    (2 * loss).backward()
    mine = logits.grad.clone()
    logits.grad = None
    reference = -(torch.softmax(target.float(), -1)
                  * torch.log_softmax(logits.float(), -1)).sum()
    (2 * reference).backward()
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-5, atol=1e-4)
    rtol = 1e-5 if dtype == torch.float32 else 1e-2  # (the gradient is rounded to dtype)
    torch.testing.assert_close(mine.float(), logits.grad.float(), rtol=rtol, atol=1e-6)
    assert mine.dtype == dtype
    expected = int((logits.float().max(-1).indices == target.float().max(-1).indices).sum())
    assert int(agree) == expected >= 7
