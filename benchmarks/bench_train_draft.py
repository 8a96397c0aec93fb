"""How an EAGLE-3 head's held-out acceptance grows with its training data: ``train-draft`` over
prompt counts, response lengths, response temperatures, epochs and seeds, for one choice of aux
layers, each head scored offline on the ``free`` bench prompts (or 40 held-out prompts, or 40
built-in prompts of the training kind it did not train on, or 40 it trained on: one row each).

The offline score runs the head's own training-time-test drafts (``verispec.train.eagle3``)
over the target's responses to the held-out prompts. On greedy responses: at every response
position, the chain of k = 3 greedy drafts is accepted up to its first miss; ``accept len``
averages that over every position, ``walk len`` starts a chain only where the last one ended,
as generation does (positions right after a miss are harder, so it is lower). On responses
sampled at temperature 0.7 (what ``bench --temperature 0.7`` drafts on): ``T=0.7 len`` is the
expected accept length 1 + a0 + a0 a1 + a0 a1 a2 of sampled drafts under the full rule, a_j =
sum_x min(p(x), q(x)) at draft j, and ``a0`` its first draft's acceptance for a sampled draft
and for a greedy one (E p(argmax q), the one-hot rule).

    python benchmarks/bench_train_draft.py --device cuda --num-prompts 4288 6400 --epochs 3 \
        --temperatures 0 0,0.7
    python benchmarks/bench_train_draft.py --device cuda --num-prompts 4500 --seeds 0 1 \
        --held-out all --aux-layers 2 15 27      # vLLM's default layers, against train-draft's
    python benchmarks/bench_train_draft.py --device cuda --num-prompts 4500 --seeds 0 1 \
        --held-out all builtin trained           # free-form prompts against the training kind
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import time

import numpy as np
import torch

from verispec.bench.prompts import FREE_PROMPTS
from verispec.engine.llm import LLM
from verispec.models.eagle_checkpoint import load_eagle_head
from verispec.train import eagle3
from verispec.train.data import generate_samples
from verispec.train.prompts import builtin_prompts

trainer = importlib.import_module("verispec.train.train_draft")

# 30 more held-out requests (``--held-out all``: 40 with the ``free`` ones, for differences
# the 10 alone cannot resolve); none is a built-in training prompt (checked at start).
MORE_HELD_OUT = (
    "How do airplanes stay in the air?",
    "Write a recipe for a simple vegetable soup.",
    "What are the benefits of regular exercise?",
    "Tell me about the history of the bicycle.",
    "Write a short story about a girl who finds a secret door in her school.",
    "Explain how a refrigerator works.",
    "Give me some tips for writing a good essay.",
    "What is the difference between weather and climate?",
    "Write a song about the sea.",
    "Describe your ideal weekend.",
    "Why is sleep important for children?",
    "Explain what a black hole is.",
    "Write a thank-you note to a neighbour who helped you move.",
    "What makes a good leader?",
    "How do plants know which way is up?",
    "Write a story about an old man and his dog walking in the snow.",
    "What should I pack for a week-long hiking trip?",
    "Describe the life cycle of a butterfly.",
    "What are some fun things to do on a rainy day?",
    "Explain how money works to a child.",
    "Write a short mystery story set on a train.",
    "Why do leaves change colour in the fall?",
    "What is the best way to prepare for an exam?",
    "Write a poem about a city at dawn.",
    "How does the internet send messages across the world?",
    "What are the main causes of pollution?",
    "Tell a bedtime story about a little star.",
    "Explain the rules of basketball.",
    "What would happen if the moon disappeared?",
    "Write a letter to your future self.",
)


def ttt_logits(head, sample, k: int, device) -> list[torch.Tensor]:
    """The head's draft logits over a recorded sequence: step j's [S - 1 - j, V_draft], row t
    drafting token t + 2 + j (read through ``ttt_loss``'s own computation)."""
    tokens = torch.from_numpy(sample.token_ids)[None].to(device)
    S = tokens.shape[1]
    logits: list[torch.Tensor] = []
    real = eagle3.soft_cross_entropy

    def spy(x, target):
        logits.append(x)
        return real(x, target)

    eagle3.soft_cross_entropy = spy
    try:
        eagle3.ttt_loss(head, tokens, sample.aux.float()[None].to(device),
                        torch.zeros(1, S, head.eagle.draft_vocab_size, device=device),
                        torch.tensor([S], device=device), k)
    finally:
        eagle3.soft_cross_entropy = real
    return logits


@torch.no_grad()
def score(head_dir: str, llm, greedy_samples, sampled_samples, k: int = 3,
          temperature: float = 0.7, scales: tuple[float, ...] = (1.0,)) -> dict:
    """Offline acceptance of a head on recorded responses (see the module docstring)."""
    target = llm.loaded.model
    head = load_eagle_head(head_dir, "eagle3", target, torch.float32, llm.device)
    d2t = head.draft_to_target()
    lm_head = target.lm_head_weight.float()
    accepted, chains, walk, walks = 0, 0, 0, 0
    per_position = np.zeros(k)
    for s in greedy_samples:
        S = len(s.token_ids)
        drafts = [(x.argmax(-1) if d2t is None else d2t[x.argmax(-1)]).cpu().numpy()
                  for x in ttt_logits(head, s, k, llm.device)]
        ids = s.token_ids
        chain = {}
        for t in range(s.response_start - 1, S - 2 - k):
            n = 0
            while n < k and drafts[n][t] == ids[t + 2 + n]:
                per_position[n] += 1
                n += 1
            chain[t] = n
        accepted += sum(chain.values())
        chains += len(chain)
        t = s.response_start - 1
        while t in chain:
            walk += chain[t]
            walks += 1
            t += chain[t] + 1
    # the sampled drafts' q at temperature * scale for each scale (1: the request's own)
    length = np.zeros(len(scales))
    alpha, alpha_greedy, n = 0.0, 0.0, 0
    for s in sampled_samples:
        lo, hi = s.response_start - 1, len(s.token_ids) - 2 - k  # chains of k drafts
        if hi <= lo:
            continue
        logits = ttt_logits(head, s, k, llm.device)
        final = s.final.float().to(llm.device)
        for i, scale in enumerate(scales):
            chain, alive = torch.ones(hi - lo, device=llm.device), 1.0
            for j in range(k):
                p = torch.softmax(final[lo + 1 + j:hi + 1 + j] @ lm_head.T / temperature, -1)
                q = torch.zeros_like(p)
                q[:, d2t if d2t is not None else slice(None)] = torch.softmax(
                    logits[j][lo:hi] / (temperature * scale), -1)
                a = torch.minimum(p, q).sum(-1)
                if j == 0 and i == 0:
                    alpha += float(a.sum())
                    alpha_greedy += float(p.gather(1, q.argmax(-1, keepdim=True)).sum())
                alive = alive * a
                chain += alive
            length[i] += float(chain.sum())
        n += hi - lo
    extra = {} if len(scales) == 1 else {"t07_len_by_draft_temperature_scale": dict(
        zip(map(str, scales), (length / n).round(4).tolist()))}
    return {"accept_len": 1 + accepted / chains, "walk_len": 1 + walk / max(1, walks),
            "per_position": (per_position / chains).tolist(), "t07_len": length[0] / n,
            "alpha_t07": alpha / n, "alpha_t07_greedy_draft": alpha_greedy / n, **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="target (default: the bundled model)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[4288, 6400])
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[96])
    parser.add_argument("--epochs", type=int, nargs="+", default=[3])
    parser.add_argument("--temperatures", nargs="+", default=["0,0.7"],
                        help="response temperatures, comma-separated per run (train-draft's "
                             "--temperature)")
    parser.add_argument("--aux-layers", type=int, nargs=3, default=None, metavar="LAYER",
                        help="the target layers the heads read (default: train-draft's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="train-draft seeds (initial weights and data order) per run")
    parser.add_argument("--held-out", choices=["free", "all", "builtin", "trained"], nargs="+",
                        default=["free"],
                        help="prompt sets each head is scored on: the 10 free bench prompts, 40 "
                             "(30 more), the last 40 built-in prompts (of the training prompts' "
                             "kind, none trained on), or the first 40 (trained on)")
    parser.add_argument("--draft-temperature-scales", type=float, nargs="+", default=[1.0],
                        help="also score sampled drafts whose q is at 0.7 x each scale (the "
                             "first is the reported T=0.7 len; more add a column)")
    parser.add_argument("--workdir", default="/tmp/bench_train_draft")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    model_dir = trainer.resolve_model_path(args.model)
    # the engine train-draft would make for the longest responses asked for
    longest = trainer.TrainDraftConfig(output_dir=args.workdir,
                                       max_new_tokens=max(max(args.max_new_tokens), 128))
    llm = LLM(model_dir, dtype="bfloat16", device=args.device, max_num_seqs=longest.max_num_seqs,
              max_model_len=trainer._data_model_len(longest, model_dir), batch_invariant=False)
    aux_layers = tuple(args.aux_layers or trainer.aux_layer_ids(
        llm.model_config.num_hidden_layers))
    # train-draft's prompts are the built-in set shuffled with its seed; each tag's data is
    # generated once, by the first seed's run, and reused by the others
    builtin = builtin_prompts(args.seeds[0])
    held_out_sets = {}
    for name in args.held_out:
        if name == "builtin":
            prompts = builtin[-40:]
            if max(args.num_prompts) > len(builtin) - 40:
                raise SystemExit(f"--held-out builtin: --num-prompts must be <= "
                                 f"{len(builtin) - 40} (the last 40 are held out)")
        elif name == "trained":
            prompts = builtin[:40]
        else:
            prompts = list(FREE_PROMPTS) + (list(MORE_HELD_OUT) if name == "all" else [])
            assert not set(prompts) & set(builtin), "a held-out prompt is a training prompt"
        held_out_sets[name] = (len(prompts),
                               generate_samples(llm, prompts, aux_layers, 128, 0.0, 0, 64),
                               generate_samples(llm, prompts, aux_layers, 128, 0.7, 0, 64))
    rows = []
    print(f"aux layers {aux_layers}, held out: "
          + ", ".join(f"{k} ({v[0]} prompts)" for k, v in held_out_sets.items()))
    print(f"{'held out':>8} {'prompts':>7} {'tokens':>6} {'temps':>7} {'epochs':>6} {'seed':>4} "
          f"{'gen s':>6} {'train s':>7} {'accept len':>10} {'walk len':>8} {'per position':>20} "
          f"{'T=0.7 len':>9} {'a0 sampled':>10} {'a0 greedy':>9}")
    for num_prompts, max_new_tokens, temps in itertools.product(
            args.num_prompts, args.max_new_tokens, args.temperatures):
        temperature = tuple(float(t) for t in temps.split(","))
        tag = f"{num_prompts}_{max_new_tokens}_{temps}_{'_'.join(map(str, aux_layers))}"
        data_dir = os.path.join(args.workdir, f"data_{tag}")
        for epochs, seed in itertools.product(args.epochs, args.seeds):
            out = os.path.join(args.workdir, f"head_{tag}_{epochs}_{seed}")
            os.makedirs(out, exist_ok=True)
            for name in (trainer.STATE_FILE, "model.safetensors"):
                if os.path.exists(os.path.join(out, name)):
                    os.remove(os.path.join(out, name))
            data = os.path.join(data_dir, trainer.DATA_FILE)
            if os.path.exists(data) and not os.path.exists(os.path.join(out, trainer.DATA_FILE)):
                os.symlink(data, os.path.join(out, trainer.DATA_FILE))
            start = time.perf_counter()
            summary = trainer.train_draft(trainer.TrainDraftConfig(
                output_dir=out, model=model_dir, num_prompts=num_prompts, epochs=epochs,
                max_new_tokens=max_new_tokens, temperature=temperature, device=args.device,
                seed=seed, aux_layers=aux_layers),
                log=lambda line: None,
                llm=llm)
            seconds = time.perf_counter() - start
            if not os.path.exists(data):
                os.makedirs(data_dir, exist_ok=True)
                os.replace(os.path.join(out, trainer.DATA_FILE), data)
                os.symlink(data, os.path.join(out, trainer.DATA_FILE))
            gen = summary["generate_seconds"]
            for name, (num_held_out, held_out, held_out_sampled) in held_out_sets.items():
                result = score(out, llm, held_out, held_out_sampled,
                               scales=tuple(args.draft_temperature_scales))
                rows.append(dict(num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                                 temperatures=list(temperature), epochs=epochs, seed=seed,
                                 aux_layers=list(aux_layers), held_out=name,
                                 held_out_prompts=num_held_out, generate_s=round(gen, 1),
                                 train_s=round(seconds - gen, 1), tokens=summary["tokens"],
                                 **{k: (np.round(v, 4).tolist() if isinstance(v, list)
                                        else v if isinstance(v, dict) else round(v, 4))
                                    for k, v in result.items()}))
                r = rows[-1]
                print(f"{name:>8} {num_prompts:>7} {max_new_tokens:>6} {temps:>7} {epochs:>6} "
                      f"{seed:>4} {r['generate_s']:>6.0f} {r['train_s']:>7.0f} "
                      f"{r['accept_len']:>10.3f} {r['walk_len']:>8.3f} "
                      f"{str([round(x, 2) for x in r['per_position']]):>20} "
                      f"{r['t07_len']:>9.3f} {r['alpha_t07']:>10.3f} "
                      f"{r['alpha_t07_greedy_draft']:>9.3f}"
                      + (f"  by scale {r['t07_len_by_draft_temperature_scale']}"
                         if len(args.draft_temperature_scales) > 1 else ""), flush=True)
    print(json.dumps(dict(benchmark="train_draft", device=str(llm.device),
                          target=model_dir, results=rows)))


if __name__ == "__main__":
    main()
