"""A request's output in the API process: the engine's tokens -> committed tokens, text, finish.

The engine process sends each request's new tokens every step (``channel.RequestDelta``);
``RequestState`` keeps them and gives the text ``LLM.generate`` gives for the same tokens
(``engine.inputs.decode_output``: special tokens skipped; an EOS or stop token that ended the
request is not text; while unfinished, a trailing partial UTF-8 character or the start of a stop
string is held back, ``inputs.streamable_text``).

Stop strings are checked here, not in the engine, exactly as ``LLM`` checks them: token by
token, after each token the text of the output so far is searched, unless that token ended the
request in the engine (an EOS or stop token id, which ``LLM`` tests first). At the first hit the
request finishes with ``"stop"``: its tokens end at that token (the engine, which ran on, is told
to abort it; the tokens it made after are dropped) and its text ends just before the stop
string. A ``"length"`` finish on the token that completes a stop string is a ``"stop"``, as in
``LLM``. Without stop strings the engine's tokens are committed as they arrive.

Decoding the whole output every step costs O(n) per request per step (a 128-stream server with
1 000-token outputs would spend more time decoding than the engine spends stepping). For a
tokenizer whose decoding concatenates, ``Detokenizer`` decodes only the tokens after a checkpoint:
a byte-level decoder (GPT-2 / Llama-3 / SmolLM style) turns tokens into bytes and the bytes into
UTF-8 text, so text(a + b) = text(a) + text(b) whenever text(a) does not end in U+FFFD (the UTF-8
decoder is then between two characters, and special tokens are dropped one by one); the
checkpoint moves to such points. Other decoders (SentencePiece's, which strips the first
token's leading space, or any with clean-up of spaces) decode the whole output.
"""

from __future__ import annotations

from typing import NamedTuple

from verispec.engine.inputs import decode_output, find_stop_string, streamable_text
from verispec.sampling_params import SamplingParams


def decodes_incrementally(tokenizer) -> bool:
    """Whether ``tokenizer``'s decoding concatenates at character boundaries (module
    docstring): a byte-level decoder and no clean-up of spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return False
    return getattr(tokenizer, "clean_up_tokenization_spaces", True) is False


class Detokenizer:
    """``decode_output(tokenizer, token_ids[:n])`` of one growing token list, for growing n.

    ``incremental`` (``decodes_incrementally``) keeps the text up to a checkpoint; a call for
    fewer tokens than the checkpoint, or without it, decodes all ``n`` tokens.
    """

    def __init__(self, tokenizer, incremental: bool) -> None:
        self.tokenizer = tokenizer
        self.incremental = incremental
        # Incremental: the Rust decoder itself, which is all ``tokenizer.decode`` runs when it
        # cleans up no spaces (it skips the Python layers, ~10 us a call).
        self._decode = tokenizer.backend_tokenizer.decode if incremental else None
        self._num_checkpoint = 0  # tokens whose text is _checkpoint_text, exactly
        self._checkpoint_text = ""

    def text(self, token_ids: list[int], n: int) -> str:
        if self.tokenizer is None:
            return ""
        if not self.incremental or n < self._num_checkpoint:
            return decode_output(self.tokenizer, token_ids[:n])
        tail = self._decode(token_ids[self._num_checkpoint : n], skip_special_tokens=True)
        text = self._checkpoint_text + tail
        if tail and not tail.endswith("\ufffd"):  # between two characters: a checkpoint
            self._num_checkpoint = n
            self._checkpoint_text = text
        return text


class Output(NamedTuple):
    """A request's output at one moment (the lists it indexes only grow, so it stays valid)."""

    text: str
    num_tokens: int  # committed output tokens
    num_text_tokens: int  # of which are text: all but an EOS / stop token that ended it
    finish_reason: str | None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestState:
    """One request of the API process: what the engine sent, what is committed, its text.

    ``receive`` takes the engine's deltas (on arrival); ``commit_stop_strings`` commits what
    arrived when the request has stop strings; ``output`` gives the text. ``token_ids[:
    num_tokens]`` and ``logprobs[: num_tokens]`` are committed and never change.
    """

    def __init__(self, request_id: int, params: SamplingParams, num_prompt_tokens: int,
                 tokenizer, incremental: bool, stream: bool) -> None:
        self.request_id = request_id
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.stream = stream
        self.detokenizer = Detokenizer(tokenizer, incremental)
        self.token_ids: list[int] = []  # every token received; the first num_tokens committed
        self.logprobs: list[dict[int, float]] | None = (
            None if params.logprobs is None else [])
        self.num_tokens = 0
        # prompt logprobs (None first, then one dict per prompt token), with the first delta
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.engine_finish_reason: str | None = None
        self.finish_reason: str | None = None
        self.stop_text_len: int | None = None  # text cut before a stop string
        self.num_cached_tokens = 0
        self.last_token_time = 0.0  # when the engine's latest tokens arrived
        self.num_reported = 0  # tokens of the latest output()
        self.reported_finished = False
        self.finish_observed = False  # its finish is in the metrics

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wakes_each_step(self) -> bool:
        """Whether its reader must look at every step (streamed text, stop strings), or only
        at the end."""
        return self.stream or bool(self.params.stop)

    def receive(self, token_ids: list[int], logprobs: list | None, finish_reason: str | None,
                num_cached_tokens: int) -> int:
        """One step's delta from the engine; returns the tokens committed now (without stop
        strings all of them; with, none until ``commit_stop_strings``)."""
        if self.finished:  # stopped here by a stop string; the engine ran on
            return 0
        self.token_ids += token_ids
        if self.logprobs is not None and logprobs:
            self.logprobs += logprobs
        self.engine_finish_reason = finish_reason
        self.num_cached_tokens = num_cached_tokens
        if self.params.stop:
            return 0
        return self._commit(len(self.token_ids), finish_reason)

    def commit_stop_strings(self) -> int:
        """Commit the received tokens, checking stop strings token by token (module
        docstring); returns the tokens committed."""
        start, end = self.num_tokens, len(self.token_ids)
        if self.finished or not self.params.stop:
            return 0
        finish = self.engine_finish_reason
        for n in range(start + 1, end + 1):
            if n == end and finish == "stop":  # an EOS / stop token: the engine's stop
                break
            text = self.detokenizer.text(self.token_ids, n)
            index = find_stop_string(text, self.params.stop)
            if index is not None:
                end, finish, self.stop_text_len = n, "stop", index
                break
        return self._commit(end, finish)

    def _commit(self, end: int, finish_reason: str | None) -> int:
        num_new = end - self.num_tokens
        self.num_tokens = end
        self.finish_reason = finish_reason
        return num_new

    def end(self, reason: str) -> None:
        """End it unfinished (``"abort"``: the client left; ``"error"``): nothing more is
        committed."""
        if not self.finished:
            self.finish_reason = reason

    @property
    def changed(self) -> bool:
        """Whether ``output`` would show anything new."""
        return self.num_tokens != self.num_reported or self.finished != self.reported_finished

    def output(self) -> Output:
        """The committed output as ``LLM.generate`` shows it (module docstring)."""
        n = self.num_tokens
        num_text = n - 1 if (n and self.finish_reason == "stop"
                             and self.stop_text_len is None) else n
        text = self.detokenizer.text(self.token_ids, num_text)
        if self.stop_text_len is not None:
            text = text[: self.stop_text_len]
        elif not self.finished:
            text = streamable_text(text, self.params.stop)
        self.num_reported, self.reported_finished = n, self.finished
        return Output(text, n, num_text, self.finish_reason)
