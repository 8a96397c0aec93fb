"""Building one OpenAI response from the outputs of its engine requests, whole or streamed.

Streaming sends server-sent events as OpenAI's API: one ``data: {chunk}`` per engine step that
moved a request (several tokens when speculation accepted drafts; several steps at once when
the reader fell behind), the last chunk of a choice with its ``finish_reason``, a usage chunk
when ``stream_options.include_usage``, then ``data: [DONE]``. Logprobs cover every generated
token but one that ended the request (an EOS or stop token, which is not text either). The
usage reports ``prompt_tokens_details.cached_tokens``: prompt tokens the engine's prefix cache
served. With ``best_of``, the n samples of highest cumulative logprob of each prompt become its
choices. The endpoints that validate a request and submit it are ``serve.serving``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fastapi.responses import JSONResponse, Response

from verispec.engine.samples import best_of, cumulative_logprob
from verispec.sampling_params import SamplingParams
from verispec.serve.async_engine import EngineError, Submission
from verispec.serve.detokenizer import Output, RequestState
from verispec.serve.protocol import MIN_LOGPROB, ApiError

logger = logging.getLogger("verispec.serve")


class Serving(Protocol):
    """What a response reads of the endpoints that made it (``serve.serving.OpenAIServing``)."""

    model_name: str

    def token_text(self, token_id: int) -> str: ...

    async def in_tokenizer_thread(self, fn: Callable, *args): ...


@dataclass(frozen=True)
class Echo:
    """``echo``: each prompt's text, shown before its choices' text; ``only``: max_tokens 0
    (the prompt alone, no generated token)."""

    texts: list[str]
    only: bool


@dataclass
class _Choice:
    """What one choice of a response has sent so far."""

    text: str = ""
    num_logprobs: int = 0
    text_offset: int = 0
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    echoed: bool = False  # its prompt (echo) was sent


class ApiResponse:
    """One API response being built from the outputs of its submission."""

    def __init__(self, serving: Serving, kind: str, response_id: str,
                 prompts: Sequence[list[int]], params: Sequence[SamplingParams], n: int,
                 echo: Echo | None, num_returned: int | None = None,
                 wants_logprobs: bool = True) -> None:
        self.serving = serving
        self.chat = kind == "chat.completion"
        self.kind = kind
        self.id = response_id
        self.created = int(time.time())
        self.params = params  # one per choice
        self.prompts = prompts
        self.n = n  # samples per prompt
        self.num_returned = n if num_returned is None else num_returned  # choices per prompt
        self.wants_logprobs = wants_logprobs
        self.echo = echo
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        self.choices = [_Choice() for _ in params]
        if echo is not None:  # the completion's text offsets follow the prompt's text
            for index, choice in enumerate(self.choices):
                choice.text_offset = len(echo.texts[index // n])

    async def _echoed(self, index: int, submission: Submission, delta: str,
                      logprobs: list | None, finish_reason: str | None):
        """With ``echo``: the prompt's text (and logprobs) before the choice's first delta;
        with max_tokens 0 nothing of the generated token. Returns (delta, logprobs,
        finish_reason)."""
        choice, echo = self.choices[index], self.echo
        if echo.only:
            delta, logprobs = "", None if logprobs is None else []
            choice.num_tokens = 0
            finish_reason = finish_reason and "length"
        if choice.echoed:
            return delta, logprobs, finish_reason
        choice.echoed = True
        prefix = echo.texts[index // self.n]
        if logprobs is None:
            return prefix + delta, None, finish_reason
        # the prompt logprobs came with the first sample of the prompt
        first = submission.states[index - index % self.n]
        items = await self.serving.in_tokenizer_thread(
            self._prompt_logprobs, self.prompts[index // self.n], first.prompt_logprobs)
        return prefix + delta, items + logprobs, finish_reason

    def _prompt_logprobs(self, prompt: list[int], entries: list | None) -> list:
        """Completions-format logprob items of the prompt's tokens (the first has none)."""
        text = self.serving.token_text
        items, offset = [], 0
        for t, token_id in enumerate(prompt):
            entry = None if entries is None or t >= len(entries) else entries[t]
            items.append((text(token_id), None if entry is None else _clamp(entry[token_id]),
                          None if entry is None else {text(k): _clamp(v)
                                                      for k, v in entry.items()}, offset))
            offset += len(text(token_id))
        return items

    def _advance(self, index: int, state: RequestState,
                 output: Output) -> tuple[str, list | None]:
        """The choice's new text and new logprobs (None unless asked for) since last time."""
        choice, params = self.choices[index], self.params[index]
        text = output.text
        # Text only grows (held-back pieces of UTF-8 or of a stop string are not shown early);
        # should a re-decode ever change shown text, the response keeps the text it sent.
        delta = text[len(choice.text):] if text.startswith(choice.text) else ""
        choice.text = text
        choice.num_tokens = output.num_tokens
        choice.num_cached_tokens = state.num_cached_tokens
        choice.finish_reason = output.finish_reason
        if params.logprobs is None:
            return delta, None
        end = output.num_text_tokens  # committed tokens: the state's lists never change there
        new = [(state.token_ids[i], state.logprobs[i]) for i in range(choice.num_logprobs, end)]
        choice.num_logprobs = end
        return delta, self._logprobs(choice, new, params.logprobs)

    async def _advance_off_loop(self, index: int, state: RequestState, output: Output):
        """``_advance``, on the tokenizer thread when token texts must be decoded."""
        if self.params[index].logprobs is None:
            return self._advance(index, state, output)
        return await self.serving.in_tokenizer_thread(self._advance, index, state, output)

    def _logprobs(self, choice: _Choice, new: list[tuple[int, dict]], num_top: int) -> list:
        text = self.serving.token_text
        items = []
        for token_id, entry in new:
            top = list(entry.items())[:num_top]
            if self.chat:
                items.append(dict(_chat_logprob(text(token_id), entry[token_id]),
                                  top_logprobs=[_chat_logprob(text(t), v) for t, v in top]))
            else:
                items.append((text(token_id), _clamp(entry[token_id]),
                              {text(t): _clamp(v) for t, v in entry.items()}, choice.text_offset))
                choice.text_offset += len(text(token_id))
        return items

    def _choice_json(self, index: int, delta: str, logprobs: list | None,
                     finish_reason: str | None, streaming: bool) -> dict:
        if logprobs is not None and self.chat:
            logprobs = {"content": logprobs}
        elif logprobs is not None:
            tokens, values, top, offsets = (list(x) for x in zip(*logprobs)) if logprobs else (
                [], [], [], [])
            logprobs = {"tokens": tokens, "token_logprobs": values, "top_logprobs": top,
                        "text_offset": offsets}
        if not self.chat:
            return {"index": index, "text": delta, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        message = {"content": delta} if streaming else {"role": "assistant", "content": delta}
        return {"index": index, ("delta" if streaming else "message"): message,
                "logprobs": logprobs, "finish_reason": finish_reason}

    def _usage(self) -> dict:
        completion = sum(c.num_tokens for c in self.choices)
        cached = sum(c.num_cached_tokens for c in self.choices)
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.num_prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _envelope(self, choices: list[dict], streaming: bool) -> dict:
        kind = self.kind + (".chunk" if streaming and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.serving.model_name, "choices": choices}

    async def collect(self, submission: Submission) -> Response:
        """The whole response (non-streaming)."""
        logprobs: list[list | None] = [None] * len(self.choices)
        try:
            async for batch in submission.outputs():
                for index, state, output in batch:
                    _, new = await self._advance_off_loop(index, state, output)
                    if new is not None:
                        logprobs[index] = (logprobs[index] or []) + new
        except EngineError as e:
            raise ApiError(500, str(e)) from None
        finally:
            submission.abort()
        choices = []
        for i, c in enumerate(self.choices):
            text, new, finish_reason = c.text, logprobs[i], c.finish_reason
            if self.echo is not None:
                if new is None and self.params[i].logprobs is not None:
                    new = []
                text, new, finish_reason = await self._echoed(i, submission, text, new,
                                                              finish_reason)
            choices.append(self._choice_json(i, text, new, finish_reason, False))
        if self.num_returned < self.n:
            choices = self._best_of(choices, submission)
        return JSONResponse(dict(self._envelope(choices, False), usage=self._usage()))

    def _best_of(self, choices: list[dict], submission: Submission) -> list[dict]:
        """Each prompt's ``num_returned`` samples of highest cumulative logprob, best first,
        renumbered (``best_of``); their logprobs only if the request asked for them."""
        kept = []
        for p in range(len(self.prompts)):
            group = range(p * self.n, (p + 1) * self.n)
            cumulative = [cumulative_logprob(submission.states[i].token_ids,
                                             submission.states[i].logprobs) for i in group]
            for rank, j in enumerate(best_of(cumulative, self.num_returned)):
                choice = dict(choices[group[j]], index=p * self.num_returned + rank)
                if not self.wants_logprobs:
                    choice["logprobs"] = None
                kept.append(choice)
        return kept

    async def stream(self, submission: Submission, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events; a client that disconnects cancels this, which aborts."""
        usage = {"usage": None} if include_usage else {}
        # Every chunk is this envelope around one choice: its JSON is written once, and each
        # chunk serialises only its choice (the server writes one chunk per request per step).
        head, tail = _sse(dict(self._envelope([_HOLE], True), **usage)).split(_HOLE_JSON)
        try:
            if self.chat:  # the first chunk of each choice carries the role
                for index in range(len(self.choices)):
                    choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}
                    yield head + json.dumps(choice, ensure_ascii=False) + tail
            async for batch in submission.outputs():
                for index, state, output in batch:
                    delta, logprobs = await self._advance_off_loop(index, state, output)
                    finish_reason = output.finish_reason
                    if self.echo is not None:
                        delta, logprobs, finish_reason = await self._echoed(
                            index, submission, delta, logprobs, finish_reason)
                    if delta or logprobs or finish_reason:
                        choice = self._choice_json(index, delta, logprobs, finish_reason,
                                                   True)
                        yield head + json.dumps(choice, ensure_ascii=False) + tail
            if include_usage:
                yield _sse(dict(self._envelope([], True), usage=self._usage()))
        except EngineError as e:
            yield _sse(ApiError(500, str(e)).body())
        except asyncio.CancelledError:  # the client disconnected: nobody to answer
            logger.info("%s: the client disconnected; its requests were aborted", self.id)
            raise
        finally:
            submission.abort()
        yield "data: [DONE]\n\n"


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _chat_logprob(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _clamp(logprob), "bytes": list(token.encode("utf-8"))}


_HOLE = "\x00choice\x00"  # a placeholder no JSON of a choice contains
_HOLE_JSON = json.dumps(_HOLE, ensure_ascii=False)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
