"""How an EAGLE-3 head's held-out acceptance grows with its training data: ``train-draft`` over
prompt counts and epochs, each head scored offline on the ``free`` bench prompts.

The offline score runs the head's own training-time-test drafts (``verispec.train.eagle3``)
over the target's greedy responses to the held-out prompts: at every response position, the
chain of k = 3 greedy drafts is accepted up to its first miss. ``accept len`` averages that over
every position; ``walk len`` starts a chain only where the last one ended, as generation does
(positions right after a miss are harder, so it is lower); ``alpha T=0.7`` is the first draft's
expected acceptance at temperature 0.7, E sum_x min(p(x), q(x)) (a sampled draft), and
E p(argmax q) for a greedy draft.

    python benchmarks/bench_train_draft.py --device cuda --num-prompts 2048 4288 --epochs 3 8
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
import torch.nn.functional as F

from verispec.engine.bench_prompts import FREE_PROMPTS
from verispec.engine.llm import LLM
from verispec.models.eagle import default_aux_layer_ids, load_eagle_head
from verispec.train import eagle3
from verispec.train.data import generate_samples

trainer = importlib.import_module("verispec.train.train_draft")


@torch.no_grad()
def score(head_dir: str, llm, samples, k: int = 3, temperature: float = 0.7) -> dict:
    """Offline acceptance of a head on recorded greedy responses (see the module docstring)."""
    target = llm.loaded.model
    head = load_eagle_head(head_dir, "eagle3", target, torch.float32, llm.device)
    d2t = head.draft_to_target()
    lm_head = target.lm_head_weight.float()
    accepted, chains, walk, walks = 0, 0, 0, 0
    per_position = np.zeros(k)
    alpha, alpha_greedy, alpha_n = 0.0, 0.0, 0
    for s in samples:
        tokens = torch.from_numpy(s.token_ids)[None].to(llm.device)
        S = tokens.shape[1]
        logits: list[torch.Tensor] = []  # step j: [S - 1 - j, V_draft]: row t drafts t + 2 + j
        real = F.log_softmax

        def spy(x, dim=-1, _kept=logits, _real=real, **kw):
            _kept.append(x)
            return _real(x, dim=dim, **kw)

        F.log_softmax = spy
        try:
            eagle3.ttt_loss(head, tokens, s.aux.float()[None].to(llm.device),
                            torch.zeros(1, S, head.eagle.draft_vocab_size, device=llm.device),
                            torch.tensor([S], device=llm.device), k)
        finally:
            F.log_softmax = real
        drafts = [(x.argmax(-1) if d2t is None else d2t[x.argmax(-1)]).cpu().numpy()
                  for x in logits]
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
        lo, hi = s.response_start - 1, S - 2
        if hi > lo:
            p = torch.softmax(s.final[lo + 1:hi + 1].float().to(llm.device) @ lm_head.T
                              / temperature, -1)
            q = torch.zeros_like(p)
            q[:, d2t if d2t is not None else slice(None)] = torch.softmax(
                logits[0][lo:hi] / temperature, -1)
            alpha += float(torch.minimum(p, q).sum())
            alpha_greedy += float(p.gather(1, q.argmax(-1, keepdim=True)).sum())
            alpha_n += hi - lo
    return {"accept_len": 1 + accepted / chains, "walk_len": 1 + walk / max(1, walks),
            "per_position": (per_position / chains).tolist(), "alpha_t07": alpha / alpha_n,
            "alpha_t07_greedy_draft": alpha_greedy / alpha_n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="target (default: the bundled model)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[2048, 4288])
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[128])
    parser.add_argument("--epochs", type=int, nargs="+", default=[3, 8])
    parser.add_argument("--workdir", default="/tmp/bench_train_draft")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    model_dir = trainer.resolve_model_path(args.model)
    # the engine train-draft would make for the longest responses asked for
    longest = trainer.TrainDraftConfig(output_dir=args.workdir,
                                       max_new_tokens=max(max(args.max_new_tokens), 128))
    llm = LLM(model_dir, dtype="bfloat16", device=args.device, max_num_seqs=longest.max_num_seqs,
              max_model_len=trainer._data_model_len(longest, model_dir), batch_invariant=False)
    held_out = generate_samples(llm, list(FREE_PROMPTS), default_aux_layer_ids(
        llm.model_config.num_hidden_layers), 128, 0.0, 0, 64)
    rows = []
    print(f"{'prompts':>7} {'tokens':>6} {'epochs':>6} {'gen s':>6} {'train s':>7} "
          f"{'accept len':>10} {'walk len':>8} {'per position':>20} {'alpha T=0.7':>11} "
          f"{'greedy draft':>12}")
    for num_prompts, max_new_tokens in itertools.product(args.num_prompts,
                                                         args.max_new_tokens):
        data_dir = os.path.join(args.workdir, f"data_{num_prompts}_{max_new_tokens}")
        for epochs in args.epochs:
            out = os.path.join(args.workdir, f"head_{num_prompts}_{max_new_tokens}_{epochs}")
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
                max_new_tokens=max_new_tokens, device=args.device), log=lambda line: None,
                llm=llm)
            seconds = time.perf_counter() - start
            if not os.path.exists(data):
                os.makedirs(data_dir, exist_ok=True)
                os.replace(os.path.join(out, trainer.DATA_FILE), data)
                os.symlink(data, os.path.join(out, trainer.DATA_FILE))
            result = score(out, llm, held_out)
            gen = summary["generate_seconds"]
            rows.append(dict(num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                             epochs=epochs, generate_s=round(gen, 1),
                             train_s=round(seconds - gen, 1), tokens=summary["tokens"],
                             **{k: (np.round(v, 4).tolist() if isinstance(v, list)
                                    else round(v, 4)) for k, v in result.items()}))
            r = rows[-1]
            print(f"{num_prompts:>7} {max_new_tokens:>6} {epochs:>6} {r['generate_s']:>6.0f} "
                  f"{r['train_s']:>7.0f} {r['accept_len']:>10.3f} {r['walk_len']:>8.3f} "
                  f"{str([round(x, 2) for x in r['per_position']]):>20} {r['alpha_t07']:>11.3f} "
                  f"{r['alpha_t07_greedy_draft']:>12.3f}", flush=True)
    print(json.dumps(dict(benchmark="train_draft", device=str(llm.device),
                          target=model_dir, results=rows)))


if __name__ == "__main__":
    main()
