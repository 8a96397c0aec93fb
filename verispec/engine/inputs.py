"""Turning what the user passes to ``generate`` into token ids, and output tokens into text.

A prompt is a string (tokenized as is, no chat template), a list of token ids, or a list of chat
messages (``{"role": ..., "content": ...}`` dicts; the model's chat template is applied with the
generation prompt). ``generate`` takes one prompt or a list of them: a list of ints is one
token-id prompt and a list of dicts one conversation; any other list is a batch.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from verispec.sampling_params import SamplingParams


def _is_number(value: Any) -> bool:
    """A token id candidate: a Python or numpy number (bools are not)."""
    return isinstance(value, numbers.Number) and not isinstance(value, (bool, np.bool_))


def is_single_prompt(prompts: Any) -> bool:
    """One prompt (a string, a list of numbers, a 1-D numpy array, a list of chat messages) or
    a batch. A list of numbers is one prompt even where some are not valid token ids (numpy
    integers, floats): it then fails as one prompt, not as a batch of per-token errors."""
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    if isinstance(prompts, (list, tuple)) and prompts:
        return all(_is_number(p) for p in prompts) or all(isinstance(p, dict) for p in prompts)
    return False


def apply_chat_template(tokenizer, messages: Sequence[dict]) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompt is a list of chat messages but the model has no chat template")
    for m in messages:
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(
                f"chat messages need string 'role' and 'content' fields, got {m!r}"
            )
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=True)


def encode_prompt(prompt: Any, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """(prompt text or None, prompt token ids); ValueError naming the cause when invalid."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("prompt is a string but the model has no tokenizer; pass token ids")
        ids = tokenizer.encode(prompt)
        text = prompt
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        text = apply_chat_template(tokenizer, prompt)
        # The template writes the special tokens itself (BOS included where the model uses one).
        ids = tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(prompt, (list, tuple, np.ndarray)):
        if len(prompt) == 0:
            raise ValueError("prompt is empty")
        # numpy integers are token ids too; floats, bools and out-of-range values are not
        bad = [t for t in prompt if not isinstance(t, numbers.Integral)
               or isinstance(t, (bool, np.bool_)) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids must be integers in [0, {vocab_size}), got "
                f"{[t.item() if isinstance(t, np.generic) else t for t in bad[:5]]!r}"
            )
        ids, text = [int(t) for t in prompt], None
    else:
        raise ValueError(
            "prompt must be a string, a list of token ids or a list of chat messages, "
            f"got {type(prompt).__name__}: {prompt!r:.80}"
        )
    if not ids:
        raise ValueError(f"prompt {prompt!r:.80} has no tokens")
    return text, ids


def as_sampling_params(params: Any) -> SamplingParams:
    """A SamplingParams, or a dict of its fields (whose ValueError names the bad field)."""
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        try:
            return SamplingParams(**params)
        except TypeError as e:
            raise ValueError(f"sampling_params: {e}") from None
    raise ValueError(f"sampling_params must be SamplingParams or a dict, got {params!r}")


def decode_output(tokenizer, token_ids: Sequence[int]) -> str:
    if tokenizer is None:
        return ""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def find_stop_string(text: str, stop: Sequence[str]) -> int | None:
    """Index in ``text`` where the earliest stop string starts, or None."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


def streamable_text(text: str, stop: Sequence[str]) -> str:
    """The prefix of ``text`` that is safe to show now: no trailing partial UTF-8 character
    (decoded as U+FFFD) and no trailing piece that could be the start of a stop string."""
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return text[: len(text) - hold]
