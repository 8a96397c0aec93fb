"""A GGUF model's tokenizer without importing transformers: the ``tokenizers`` library for
encode / decode and ``jinja2`` for the chat template, the two libraries transformers' own fast
tokenizer runs on.

Why: importing transformers is ~0.75 s of a warm start of ``verispec generate`` on the bundled
model (~3.7 s in all on a 2-core VM, docs/benchmarks.md), for a tokenizer whose work is done by
``tokenizers`` anyway.

Exactness: it is used only where it was checked against transformers. When a GGUF's cached
directory is written or first loaded with transformers (``models.loader``), ``verify`` compares
the two on probe texts, token ids and chat conversations (encode with and without special
tokens, decode with and without skipping them, the chat template with a generation prompt,
the vocabulary and the EOS id) and records the verdict in ``fast_tokenizer.json``; ``load``
returns a ``FastTokenizer`` only for a directory whose verdict is a pass. Anything it does not
do itself (another call shape of ``apply_chat_template``, any other attribute, llguidance's
view: ``hf_tokenizer``) loads the transformers tokenizer on first use and goes to it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

logger = logging.getLogger("verispec")

VERDICT_FILE = "fast_tokenizer.json"
# the named special tokens a chat template sees (transformers' special_tokens_map)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
VERSION = 1

# probes for ``verify``: texts (ASCII, code, numbers, whitespace runs, accents, CJK, emoji, the
# chat markup itself) and conversations
PROBE_TEXTS = (
    "", "Hello", " Hello  world\n\n\tdone ", "What is the capital of France?",
    "def add(a, b):\n    return a + b  # sum\n", "1234567890 3.14159 -42 1e-9",
    "Ça déjà vu, naïve façade — «quotes» and ‘single’", "日本語のテキストと中文",
    "emoji 🙂👍🏽 end",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "   leading and trailing   ", "a" * 300,
)
PROBE_CHATS = (
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "  2 + 2?\n"}],
    [{"role": "user", "content": "日本語 🙂"}],
)


def _compile_template(source: str):
    """The chat template compiled as transformers compiles it: a sandboxed jinja2 environment
    with trim_blocks and lstrip_blocks, loop controls, a ``tojson`` that keeps non-ASCII text,
    ``raise_exception`` and ``strftime_now``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken-like dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class FastTokenizer:
    """encode / decode / chat template of a checked directory (module docstring); everything
    else through the transformers tokenizer, loaded on first use by ``load_full``."""

    def __init__(self, model_dir: str, load_full: Callable[[str], Any]) -> None:
        import tokenizers

        self.name_or_path = model_dir
        self._load_full = load_full
        self._full = None
        self.backend_tokenizer = tokenizers.Tokenizer.from_file(
            os.path.join(model_dir, "tokenizer.json"))
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            config = json.load(f)
        self.chat_template = config.get("chat_template")
        template_path = os.path.join(model_dir, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(template_path):
            with open(template_path) as f:
                self.chat_template = f.read()
        self._template = None
        self.special_tokens_map = {
            name: text for name in SPECIAL_TOKENS
            if (text := _token_text(config.get(name))) is not None}
        self.eos_token = self.special_tokens_map.get("eos_token")
        self.bos_token = self.special_tokens_map.get("bos_token")
        self.eos_token_id = (None if self.eos_token is None
                             else self.backend_tokenizer.token_to_id(self.eos_token))
        self.bos_token_id = (None if self.bos_token is None
                             else self.backend_tokenizer.token_to_id(self.bos_token))

    def __getstate__(self) -> dict:
        """Pickled (the server sends the engine's tokenizer to its API process) without the
        compiled template, which is compiled again on first use."""
        return {**self.__dict__, "_template": None}

    @property
    def hf_tokenizer(self):
        """The transformers tokenizer of the same directory (loaded once, on first use)."""
        if self._full is None:
            self._full = self._load_full(self.name_or_path)
        return self._full

    def __getattr__(self, name: str):  # only for names this class does not define
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf_tokenizer, name)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(token_ids),
                                             skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, conversation, tokenize: bool = True,
                            add_generation_prompt: bool = False, **kwargs):
        """The chat rendered as text, for messages of string ``role`` and ``content`` only and
        no other option; any other call goes to the transformers tokenizer."""
        plain = (not tokenize and not kwargs and self.chat_template is not None
                 and isinstance(conversation, (list, tuple))
                 and all(isinstance(m, dict) and set(m) == {"role", "content"}
                         and isinstance(m["role"], str) and isinstance(m["content"], str)
                         for m in conversation))
        if not plain:
            return self.hf_tokenizer.apply_chat_template(
                conversation, tokenize=tokenize, add_generation_prompt=add_generation_prompt,
                **kwargs)
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=[dict(m) for m in conversation], tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **self.special_tokens_map)


def verify(model_dir: str, hf_tokenizer) -> bool:
    """Compare a ``FastTokenizer`` of ``model_dir`` with its transformers tokenizer on the
    probes (module docstring) and record the verdict in ``model_dir``; True when they agree."""
    try:
        fast = FastTokenizer(model_dir, lambda _: hf_tokenizer)
        same = (fast.get_vocab() == hf_tokenizer.get_vocab()
                and fast.eos_token_id == hf_tokenizer.eos_token_id
                and fast.special_tokens_map == hf_tokenizer.special_tokens_map)
        for text in PROBE_TEXTS:
            for special in (True, False):
                ids = fast.encode(text, add_special_tokens=special)
                same = same and ids == hf_tokenizer.encode(text, add_special_tokens=special)
                for skip in (True, False):
                    same = same and (fast.decode(ids, skip_special_tokens=skip)
                                     == hf_tokenizer.decode(ids, skip_special_tokens=skip))
        vocab = len(fast)
        spread = [[(i * 7919 + j * 104729) % vocab for j in range(24)] for i in range(8)]
        for ids in spread:
            for skip in (True, False):
                same = same and (fast.decode(ids, skip_special_tokens=skip)
                                 == hf_tokenizer.decode(ids, skip_special_tokens=skip))
        if fast.chat_template is not None:
            for chat in PROBE_CHATS:
                for prompt in (True, False):
                    same = same and (
                        fast.apply_chat_template(chat, tokenize=False,
                                                 add_generation_prompt=prompt)
                        == hf_tokenizer.apply_chat_template(chat, tokenize=False,
                                                            add_generation_prompt=prompt))
    except Exception as exc:  # any failure to build or to render: not this fast path
        logger.info("tokenizer of %s: no fast path (%s)", model_dir, exc)
        same = False
    try:
        with open(os.path.join(model_dir, VERDICT_FILE), "w") as f:
            json.dump({"version": VERSION, "agrees": bool(same)}, f)
    except OSError:  # a read-only cache: checked again next time
        pass
    return bool(same)


def load(model_dir: str, load_full: Callable[[str], Any]) -> FastTokenizer | None:
    """A ``FastTokenizer`` of ``model_dir`` if ``verify`` passed there, else None."""
    try:
        with open(os.path.join(model_dir, VERDICT_FILE)) as f:
            verdict = json.load(f)
    except (OSError, ValueError):
        return None
    if verdict.get("version") != VERSION or verdict.get("agrees") is not True:
        return None
    return FastTokenizer(model_dir, load_full)
