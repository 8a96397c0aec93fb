"""Turning what the user passes to ``generate`` into token ids, and output tokens into text.

A prompt is a string (tokenized as is, no chat template), a list of token ids, a list of chat
messages (``{"role": ..., "content": ...}`` dicts; the model's chat template is applied with the
generation prompt), or vLLM's prompt dicts ``{"prompt": text}`` and ``{"prompt_token_ids":
ids}``. ``generate`` takes one prompt or a list of them: a list of ints (or a 1-D numpy array or
torch tensor of them) is one token-id prompt, a list of chat messages one conversation; any
other list (vLLM's prompt dicts among them) is a batch.

``PromptEncoder`` holds the rules a request meets before it is queued, the same for ``LLM`` and
the server: text is valid Unicode, chat roles are ones the chat template knows, token ids are in
the vocabulary, and (vLLM's rule) the prompt plus ``max_tokens`` fits ``max_model_len``. A prompt
whose text alone proves it too long is refused before it is tokenized.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from verispec.sample.options import check_token_ids
from verispec.sampling_params import SamplingParams


def _is_number(value: Any) -> bool:
    """A token id candidate: a Python or numpy number (bools are not)."""
    return isinstance(value, numbers.Number) and not isinstance(value, (bool, np.bool_))


# vLLM's prompt dicts: TextPrompt {"prompt": text}, TokensPrompt {"prompt_token_ids": ids}
PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


def is_prompt_dict(value: Any) -> bool:
    """Whether ``value`` is one of vLLM's prompt dicts (not a chat message)."""
    return isinstance(value, dict) and any(k in value for k in PROMPT_DICT_KEYS)


def is_single_prompt(prompts: Any) -> bool:
    """One prompt (a string, a list of numbers, a 1-D numpy array, a list of chat messages, a
    prompt dict) or a batch. A list of numbers is one prompt even where some are not valid
    token ids (numpy integers, floats): it then fails as one prompt, not as a batch of
    per-token errors."""
    if isinstance(prompts, str) or is_prompt_dict(prompts):
        return True
    if isinstance(prompts, (np.ndarray, torch.Tensor)):
        return prompts.ndim == 1
    if isinstance(prompts, (list, tuple)) and prompts:
        return all(_is_number(p) for p in prompts) or all(
            isinstance(p, dict) and not is_prompt_dict(p) for p in prompts)
    return False


def unwrap_prompt(prompt: Any) -> Any:
    """A prompt dict's text or token ids (any other prompt as it is); ValueError naming the key
    for a key verispec does not read (multimodal data, ...) or for both keys at once."""
    if not is_prompt_dict(prompt):
        return prompt
    unknown = sorted(str(k) for k in prompt if k not in PROMPT_DICT_KEYS)
    if unknown:
        raise ValueError(f"prompt dict key {unknown[0]!r} is not supported: a prompt dict takes "
                         "'prompt' (text) or 'prompt_token_ids'")
    if len(prompt) != 1:
        raise ValueError("a prompt dict takes one of 'prompt' (text) and 'prompt_token_ids', "
                         "got both")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"prompt['prompt'] must be a string, got "
                             f"{type(prompt['prompt']).__name__}")
        return prompt["prompt"]
    ids = prompt["prompt_token_ids"]
    if isinstance(ids, str) or not isinstance(ids, (list, tuple, np.ndarray, torch.Tensor)):
        raise ValueError(f"prompt['prompt_token_ids'] must be a list of token ids, got "
                         f"{type(ids).__name__}")
    if len(ids) and not all(_is_number(t) for t in (ids.tolist() if hasattr(ids, "tolist")
                                                    else ids)):
        raise ValueError("prompt['prompt_token_ids'] must be a list of token ids")
    return ids


def prompt_text(prompt: Any) -> str | None:
    """The text of a prompt given as text (a string or ``{"prompt": text}``), else None."""
    if is_prompt_dict(prompt):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def check_unicode(text: str, name: str) -> None:
    """ValueError naming ``name`` when ``text`` cannot be UTF-8 (a lone surrogate such as the
    JSON escape ``"\\ud800"`` decodes to): no tokenizer can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode: {text[e.start:e.end]!r} at character "
                         f"{e.start} is a lone surrogate") from None


# The roles every chat template is written for; a template may name more (``tool``, ...).
BASE_CHAT_ROLES = ("system", "user", "assistant")
_TEMPLATE_ROLE = re.compile(r"""role['"]?\]?\s*(?:==|!=)\s*['"]([A-Za-z_][\w-]*)['"]""")


def chat_roles(tokenizer) -> tuple[str, ...]:
    """The roles a message may have: the base three and those the chat template compares
    ``role`` with."""
    template = getattr(tokenizer, "chat_template", None)
    named = _TEMPLATE_ROLE.findall(template) if isinstance(template, str) else []
    return tuple(dict.fromkeys([*BASE_CHAT_ROLES, *named]))


def apply_chat_template(tokenizer, messages: Sequence[dict]) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompt is a list of chat messages but the model has no chat template")
    roles = chat_roles(tokenizer)
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(
                f"chat messages need string 'role' and 'content' fields, got {m!r}"
            )
        if m["role"] not in roles:
            raise ValueError(f"messages[{i}].role={m['role']!r} is not a role the chat template "
                             f"knows ({', '.join(roles)})")
        check_unicode(m["role"], f"messages[{i}].role")
        check_unicode(m["content"], f"messages[{i}].content")
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=True)


def encode_prompt(prompt: Any, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """(prompt text or None, prompt token ids); ValueError naming the cause when invalid."""
    if isinstance(prompt, torch.Tensor):
        if prompt.ndim != 1:
            raise ValueError(f"a tensor prompt must be 1-D token ids, got shape "
                             f"{tuple(prompt.shape)}")
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        check_unicode(prompt, "prompt")
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


def longest_token_chars(tokenizer) -> int | None:
    """The most characters one token covers, or None where the tokenizer's normalizer could
    shrink the text (then the text proves nothing about its token count). A token covers at
    most this many characters of the input, so a text of n characters has at least
    ``ceil(n / longest)`` tokens: byte-level BPE spells every byte as one vocabulary character,
    SentencePiece every input character as one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    return max(len(token) for token in tokenizer.get_vocab())


class PromptEncoder:
    """Prompts to token ids and the checks of a request against one model's limits; the same
    rules for ``LLM`` and the server. Every ValueError names the field and the value."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.longest_token_chars = None if tokenizer is None else longest_token_chars(tokenizer)

    def _check_text_length(self, text: str, name: str) -> None:
        """Refuse a text whose length alone proves it more than ``max_model_len - 1`` tokens,
        before tokenizing it (a 10 MB text takes seconds to tokenize)."""
        longest = self.longest_token_chars
        limit = self.max_model_len - 1
        if longest is not None and len(text) > longest * limit:
            raise ValueError(
                f"{name} has {len(text)} characters, so at least {-(-len(text) // longest)} "
                f"tokens (a token covers at most {longest} characters), but max_model_len="
                f"{self.max_model_len} leaves room for at most {limit} prompt tokens")

    def encode(self, prompt: Any) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids), at most ``max_model_len - 1`` of them."""
        tokenizer = self.tokenizer
        if isinstance(prompt, str) and tokenizer is not None:
            check_unicode(prompt, "prompt")
            self._check_text_length(prompt, "prompt")
        if (isinstance(prompt, (list, tuple)) and prompt and tokenizer is not None
                and all(isinstance(m, dict) for m in prompt)):
            text = apply_chat_template(tokenizer, prompt)
            self._check_text_length(text, "prompt (chat template applied)")
            # The template writes the special tokens itself (BOS included where the model uses
            # one), as in encode_prompt.
            ids = tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                raise ValueError(f"prompt {prompt!r:.80} has no tokens")
        else:
            text, ids = encode_prompt(prompt, tokenizer, self.vocab_size)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, but max_model_len={self.max_model_len} leaves no "
                f"room to generate (at most {self.max_model_len - 1} prompt tokens)")
        return text, ids

    def check_params(self, params: SamplingParams, num_prompt_tokens: int,
                     max_tokens_name: str = "max_tokens") -> None:
        """Token ids of ``params`` in the vocabulary, and vLLM's rule: prompt + max_tokens <=
        max_model_len."""
        vocab_size = self.vocab_size
        outside = [t for t in params.stop_token_ids if t >= vocab_size]
        if outside:
            raise ValueError(f"stop_token_ids {outside[:5]!r} are outside the model's vocabulary "
                             f"[0, {vocab_size})")
        check_token_ids(params, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"{name}={value} exceeds the model's vocabulary size "
                                 f"{vocab_size}")
        if num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"{max_tokens_name}={params.max_tokens} and the prompt's {num_prompt_tokens} "
                f"tokens exceed max_model_len={self.max_model_len}: ask for at most "
                f"{self.max_model_len - num_prompt_tokens} tokens")


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
