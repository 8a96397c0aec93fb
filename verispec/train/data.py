"""Training data for ``verispec train-draft``: the target's own generations and hidden states.

A head learns to predict what the target says, so the responses come from the target itself:
the engine generates a response to every prompt (a built-in set, or a JSONL file of
``{"prompt": "..."}``, ``{"messages": [{"role": ..., "content": ...}, ...]}`` or
``{"prompt_token_ids": [...]}`` lines), then one target forward over prompt + response records,
per token, the residual streams entering the head's aux layers and the final-norm hidden state
(the target's next-token distribution, the training label, is that state through the target's
LM head).

The built-in set (``verispec.train.prompts``) is generated from request templates and subjects;
it holds out the prompts of ``verispec bench --prompts free``.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from verispec.bench.report import progress
from verispec.sampling_params import SamplingParams
from verispec.train.prompts import builtin_prompts

logger = logging.getLogger("verispec")

__all__ = ["Sample", "builtin_prompts", "generate_samples", "load_prompt_file",
           "select_draft_vocab"]


def load_prompt_file(path: str) -> list:
    """Prompts of a JSONL file: ``{"prompt": str}`` (sent as one user message when the model
    has a chat template), ``{"messages": [...]}`` chat messages or ``{"prompt_token_ids":
    [...]}``; ValueError naming the file and line otherwise."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"prompts file {str(path)!r} does not exist")
    prompts: list = []
    with file.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            record = record if isinstance(record, dict) else {}
            text, messages = record.get("prompt"), record.get("messages")
            ids = record.get("prompt_token_ids")
            if isinstance(text, str) and text.strip() and messages is None:
                prompts.append(text)
            elif (isinstance(ids, list) and ids and text is None and messages is None
                  and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                          for t in ids)):
                prompts.append(list(ids))
            elif (isinstance(messages, list) and messages and text is None
                  and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                          and isinstance(m.get("content"), str) for m in messages)):
                prompts.append(messages)
            else:
                raise ValueError(
                    f'{path}:{number}: expected {{"prompt": "..."}}, {{"messages": [{{"role": '
                    f'..., "content": ...}}, ...]}} or {{"prompt_token_ids": [...]}}, got '
                    f"{line.strip()[:80]!r}")
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


@dataclass
class Sample:
    """One sequence of the target's: tokens and the hidden states the head trains on."""

    token_ids: np.ndarray  # [S] int64: prompt, then the target's response
    aux: torch.Tensor  # [S, len(aux_layers) * H] the residual streams entering the aux layers
    final: torch.Tensor  # [S, H] final-norm hidden state (its LM head gives the target's p)
    response_start: int = 0  # index of the first response token (the loss is trained from it)


def generate_samples(llm, prompts: list, aux_layers: tuple[int, ...], max_new_tokens: int,
                     temperature: float | tuple[float, ...], seed: int,
                     batch_size: int) -> list[Sample]:
    """Generate a response to every prompt with ``llm`` (an ``LLM``) and record the hidden
    states of prompt + response. ``temperature``: one, or several taken in turn over the
    prompts (prompt i is answered at ``temperature[i % len(temperature)]``).

    The states are kept as the engine computes them (``capture_layers`` on every step), so
    no second pass is needed: a sequence keeps the tokens that were fed, the prompt and all but
    the last response token. Where a step runs a graph captured without those states (the
    CUDA engine), one target forward per ``llm.max_num_seqs`` sequences records them after
    generation instead."""
    temperatures = (temperature,) if isinstance(temperature, (int, float)) else temperature
    chat = getattr(llm.tokenizer, "chat_template", None)
    requests = [[{"role": "user", "content": p}] if isinstance(p, str) and chat else p
                for p in prompts]
    samples: list[Sample] = []
    runner = llm.runner
    layers = tuple(aux_layers) + (llm.model_config.num_hidden_layers,)
    bar = progress(total=len(requests), desc="generating", unit="prompt")
    runner.capture_layers = layers
    record_after = False
    errors: list[str] = []  # why each refused prompt was refused
    try:
        for start in range(0, len(requests), batch_size):
            chunk = requests[start:start + batch_size]
            params = [SamplingParams(temperature=temperatures[(start + i) % len(temperatures)],
                                     max_tokens=max_new_tokens, seed=seed + start + i)
                      for i in range(len(chunk))]
            recorded = None if record_after else _generate_recording(llm, chunk, params, errors)
            if recorded is None:  # a step did not capture: record with one forward afterwards
                record_after = True
                recorded = _record(llm, _generate(llm, chunk, params, errors))
            samples += [_sample(llm, ids, rows, response_start)
                        for ids, rows, response_start in recorded]
            bar.update(len(chunk))
    finally:
        runner.capture_layers = ()
        runner.captured_hidden = None
        bar.close()
    if errors:
        logger.warning("train-draft: %d of %d prompts were refused and are not in the data; "
                       "the first: %s", len(errors), len(requests), errors[0])
    return samples


def _sample(llm, token_ids: list[int], rows: torch.Tensor, response_start: int) -> Sample:
    H = llm.model_config.hidden_size
    rows = rows.cpu()  # kept on the CPU (a GPU run trains in batches moved to the GPU)
    return Sample(np.asarray(token_ids, dtype=np.int64), rows[:, :-H].clone(),
                  rows[:, -H:].clone(), response_start)


def _generate(llm, requests: list, params: list, errors: list[str]
              ) -> list[tuple[list[int], int]]:
    """(prompt + response token ids, response start) of each request that did not fail."""
    outputs = llm.generate(requests, params)
    errors += [o.error for o in outputs if o.error is not None]
    return [((o.prompt_token_ids + o.token_ids)[: llm.max_model_len], len(o.prompt_token_ids))
            for o in outputs if o.error is None]


def _generate_recording(llm, requests: list, params: list, errors: list[str]):
    """Generate while keeping each step's captured states; None as soon as a step captured
    none (the caller then records afterwards). Returns (fed token ids, their states, response
    start) per request that did not fail."""
    runner = llm.runner
    pieces: dict[int, list[torch.Tensor]] = {}
    started = []
    num_errors = len(errors)
    for request, p in zip(requests, params):
        try:
            started.append(llm.add_request(request, p))
        except ValueError as e:
            errors.append(str(e))
            continue
        pieces[started[-1].request_id] = []
    try:
        while llm.has_unfinished_requests:
            # the step's requests: those running, and those it admits (a slot is set then)
            candidates = list(llm.scheduler.running) + list(llm.scheduler.waiting)
            runner.captured_hidden = None
            llm.step()
            captured = runner.captured_hidden
            if captured is None:
                _abort_unfinished(llm, started)
                del errors[num_errors:]  # the caller generates these requests again
                return None
            by_slot = {r.slot: r for r in candidates if r.slot >= 0}
            for b, slot in enumerate(captured.slots):
                first = int(captured.row_start[b])
                pieces[by_slot[slot].request_id].append(
                    captured.rows[first:first + int(captured.counts[b])].clone())
    except BaseException:
        _abort_unfinished(llm, started)
        raise
    recorded = []
    for r in started:
        output = llm.get_output(r)
        if output.error is not None or not pieces[r.request_id]:
            continue
        rows = torch.cat(pieces[r.request_id])
        ids = (output.prompt_token_ids + output.token_ids)[: rows.shape[0]]
        recorded.append((ids, rows[: len(ids)], len(output.prompt_token_ids)))
    return recorded


def _abort_unfinished(llm, requests: list) -> None:
    for r in requests:
        if not r.finished:
            llm.abort_request(r)


def _record(llm, sequences: list[tuple[list[int], int]]):
    """One target forward per ``llm.max_num_seqs`` sequences: (token ids, states, response
    start) of each."""
    runner = llm.runner
    recorded = []
    for s0 in range(0, len(sequences), llm.max_num_seqs):
        group = sequences[s0:s0 + llm.max_num_seqs]
        slots = list(range(len(group)))
        runner.forward(slots, [ids for ids, _ in group], logits="none")
        rows = runner.captured_hidden.rows
        for slot in slots:
            runner.kv_cache.free(slot)
        offset = 0
        for ids, response_start in group:
            recorded.append((ids, rows[offset:offset + len(ids)], response_start))
            offset += len(ids)
    return recorded


def select_draft_vocab(samples: list[Sample], vocab_size: int, draft_vocab_size: int,
                       always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``draft_vocab_size`` most frequent tokens of the samples (``always`` first, then by
    count, ties by id), sorted: [draft_vocab_size] int64 target ids (EAGLE-3's d2t is
    ``ids - arange``)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in samples:
        counts += np.bincount(s.token_ids, minlength=vocab_size)
    counts[list(always)] = counts.max() + 1
    order = np.lexsort((np.arange(vocab_size), -counts))[:draft_vocab_size]
    return torch.from_numpy(np.sort(order))


def batches(samples: list[Sample], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of similar lengths (sorted within a shuffled pool, then shuffled)."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    pool = 16 * batch_size
    batches = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start:start + pool], key=lambda i: len(samples[i].token_ids))
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(samples: list[Sample], max_len: int, draft_head: torch.Tensor,
             aux_scale: torch.Tensor | None = None):
    """Padded [B, S] tokens, [B, S, D] aux (divided by ``aux_scale`` [D] if given), [B, S,
    V_draft] target logits, [B] lengths and [B] response starts (``ttt_loss``'s arguments)."""
    lengths = torch.tensor([min(len(s.token_ids), max_len) for s in samples])
    S = int(lengths.max())
    B = len(samples)
    tokens = torch.zeros(B, S, dtype=torch.int64)
    aux = torch.zeros(B, S, samples[0].aux.shape[1], dtype=samples[0].aux.dtype)
    final = torch.zeros(B, S, samples[0].final.shape[1], dtype=samples[0].final.dtype)
    for b, (s, n) in enumerate(zip(samples, lengths.tolist())):
        tokens[b, :n] = torch.from_numpy(s.token_ids[:n])
        aux[b, :n] = s.aux[:n]
        final[b, :n] = s.final[:n]
    starts = torch.tensor([s.response_start for s in samples])
    # built on the CPU, where the data is kept, then moved to the head's device
    device = draft_head.device
    tokens, aux, final, lengths, starts = (t.to(device) for t in (tokens, aux, final, lengths,
                                                                   starts))
    aux = aux.float() if aux_scale is None else aux.float() / aux_scale
    # the labels' logits in draft_head's dtype (bfloat16 with amp, a fast matmul on CPUs with
    # AMX; the target's own bfloat16 LM head rounds its logits alike)
    return tokens, aux, final.to(draft_head.dtype) @ draft_head.T, lengths, starts


def feature_rms(samples: list[Sample]) -> torch.Tensor:
    """[D] root mean square of each aux feature over the response tokens of up to 512 of the
    samples (spread over the set), at least 1e-6."""
    picked = samples[:: max(1, len(samples) // 512)]
    rows = torch.cat([s.aux[s.response_start:] if s.response_start < len(s.token_ids) else s.aux
                      for s in picked]).float()
    return rows.pow(2).mean(0).sqrt().clamp_min(1e-6)
