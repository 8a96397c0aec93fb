"""Completions and chat completions: API request -> engine submission -> OpenAI response.

Prompts are tokenized off the event loop, on the front's one tokenizer thread with its own copy of
the tokenizer the engine process sent at start-up (the event loop decodes outputs with another
copy; a Rust tokenizer must not be used by two threads at once), under the rules
``LLM.generate`` applies (``verispec.engine.inputs.PromptEncoder``: the chat template for
messages, vLLM's prompt + max_tokens rule, a text too long by its length alone refused before
tokenizing), so a seeded request gives the tokens ``LLM.generate`` gives and one huge prompt
never stalls ``/health`` or the streams running beside it. Token texts of logprobs are decoded
on the same thread.

Streaming sends server-sent events as OpenAI's API: one ``data: {chunk}`` per engine step that
moved a request (several tokens when speculation accepted drafts; several steps at once when
the reader fell behind), the last chunk of a choice with its ``finish_reason``, a usage chunk
when ``stream_options.include_usage``, then ``data: [DONE]``. Logprobs cover every generated
token but one that ended the request (an EOS or stop token, which is not text either). The
usage reports ``prompt_tokens_details.cached_tokens``: prompt tokens the engine's prefix cache
served.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from verispec.engine import inputs
from verispec.engine.samples import best_of, cumulative_logprob, sample_params
from verispec.sampling_params import SamplingParams
from verispec.serve.async_engine import AsyncEngine, EngineError, Submission
from verispec.serve.detokenizer import Output, RequestState
from verispec.serve.protocol import (
    MIN_LOGPROB,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_best_of,
    check_logprobs,
    check_max_tokens,
    check_n,
    sampling_params,
)

logger = logging.getLogger("verispec.serve")


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


class OpenAIServing:
    """The two generation endpoints of one served model."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        info = engine.info
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = copy.deepcopy(info.tokenizer)
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self.encoder = inputs.PromptEncoder(self.tokenizer, self.vocab_size, self.max_model_len)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)
        # The one thread that uses self.tokenizer.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="verispec-tokenizer")

    async def in_tokenizer_thread(self, fn: Callable, *args):
        """``fn(*args)`` on the tokenizer thread: tokenizing never blocks the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn,
                                                                *args)

    def shutdown(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- requests

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"The model {name!r} does not exist: this server serves "
                           f"{self.model_name!r}", "model", "model_not_found")

    def _encode_all(self, prompts: list, param: str) -> list[list[int]]:
        """Token ids of each prompt (text, ids or chat messages), on the tokenizer thread;
        ApiError naming ``param`` (and the prompt's index when there are several)."""
        encoded = []
        for i, prompt in enumerate(prompts):
            try:
                encoded.append(self.encoder.encode(prompt)[1])
            except ValueError as e:
                message = str(e)
                if message.startswith("prompt "):  # the API's name for it -> the field's
                    message = param + message.removeprefix("prompt")
                if not message.startswith(param):
                    message = f"{param}: {message}"
                if len(prompts) > 1:
                    message = f"{param}[{i}]: {message}"
                raise ApiError(400, message, param) from None
        return encoded

    async def encode(self, prompts: list, param: str) -> list[list[int]]:
        return await self.in_tokenizer_thread(self._encode_all, prompts, param)

    def check_params(self, ids: list[int], params: SamplingParams, max_tokens_name: str) -> None:
        """The rules of ``LLM.generate`` (vocabulary, prompt + max_tokens <= max_model_len)."""
        try:
            self.encoder.check_params(params, len(ids), max_tokens_name)
        except ValueError as e:
            message = str(e)
            param = next((name for name in ("stop_token_ids", "logprobs", "logit_bias",
                                            "allowed_token_ids", max_tokens_name)
                          if message.startswith(name)), None)
            raise ApiError(400, message, param) from None

    async def completion(self, body: CompletionRequest, raw: Request) -> Response:
        body.check_text()
        self.check_model(body.model)
        body.check_neutral_fields()
        check_logprobs("logprobs", body.logprobs)
        echo = bool(body.echo)
        check_max_tokens("max_tokens", body.max_tokens, zero_with_echo=echo)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
        # echo with max_tokens 0: the prompt alone (one token is generated and not shown)
        params = sampling_params(body, max(max_tokens, 1), body.logprobs,
                                 body.logprobs if echo else None)
        n = check_n(body.n)
        num_samples = check_best_of(body.best_of, n, body.stream)
        texts = body.prompts()
        prompts = await self.encode(texts, "prompt")
        for ids in prompts:
            self.check_params(ids, params, "max_tokens")
        echo_texts = None
        if echo:
            echo_texts = [t if isinstance(t, str) else await self.in_tokenizer_thread(
                inputs.decode_output, self.tokenizer, t) for t in texts]
        return await self._respond(raw, "text_completion", prompts, params, n, body.stream,
                                   body.stream_options, "prompt",
                                   Echo(echo_texts, max_tokens == 0) if echo else None,
                                   body.grammar_param, num_samples)

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        body.check_text()
        self.check_model(body.model)
        body.check_neutral_fields()
        for name in ("max_tokens", "max_completion_tokens"):
            check_max_tokens(name, getattr(body, name))
        if body.max_tokens is not None and body.max_completion_tokens is not None and (
                body.max_tokens != body.max_completion_tokens):
            raise ApiError(400, f"max_tokens={body.max_tokens} and max_completion_tokens="
                           f"{body.max_completion_tokens} disagree; give one", "max_tokens")
        check_logprobs("top_logprobs", body.top_logprobs)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, f"top_logprobs={body.top_logprobs} needs logprobs=true",
                           "top_logprobs")
        max_tokens = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        [ids] = await self.encode([[m.as_dict() for m in body.messages]], "messages")
        if max_tokens is None:  # as vLLM: whatever max_model_len leaves
            max_tokens = self.max_model_len - len(ids)
        params = sampling_params(body, max_tokens, num_top)
        n = check_n(body.n)
        self.check_params(ids, params, param)
        return await self._respond(raw, "chat.completion", [ids], params, n, body.stream,
                                   body.stream_options, "messages",
                                   grammar_param=body.grammar_param)

    async def _respond(self, raw: Request, kind: str, prompts: list[list[int]],
                       params: SamplingParams, n: int, stream: bool, stream_options,
                       prompt_param: str, echo: Echo | None = None,
                       grammar_param: str = "structured_outputs",
                       num_samples: int | None = None) -> Response:
        # one engine request per sample: prompt i's samples are i m .. i m + m - 1 (m = best_of,
        # else n); with best_of > n the n best of each prompt's become its choices at the end
        num_samples = num_samples or n
        samples = sample_params(dataclasses.replace(
            params, n=n, best_of=None if num_samples == n else num_samples))
        choice_prompts = [p for p in prompts for _ in range(num_samples)]
        choice_params = samples * len(prompts)
        try:
            submission = await self.engine.submit(choice_prompts, choice_params, stream)
        except ValueError as e:  # refused by the engine (the checks above catch most first)
            message = str(e)
            if message.startswith("structured_outputs"):  # a grammar that does not compile
                if grammar_param == "response_format":
                    message = message.replace("structured_outputs.json",
                                              "response_format.json_schema.schema", 1)
                raise ApiError(400, message, grammar_param) from None
            raise ApiError(400, message, prompt_param) from None
        except EngineError as e:
            raise ApiError(503, str(e)) from None
        response_id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex
        response = _Response(self, kind, response_id, prompts, choice_params, num_samples, echo,
                             n, params.logprobs is not None)
        if stream:
            include_usage = stream_options is not None and stream_options.include_usage
            return StreamingResponse(response.stream(submission, include_usage),
                                     media_type="text/event-stream")
        return await cancel_on_disconnect(response.collect(submission), raw, response_id)

    # ----------------------------------------------------------------- tokens as text

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:  # a model without a tokenizer: vLLM's spelling of an id
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


async def cancel_on_disconnect(work, raw: Request, response_id: str) -> Response:
    """Run ``work`` (a coroutine returning a Response) unless the client disconnects first; then
    cancel it (its requests are aborted), log it (INFO) and answer nobody."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        # Wait for both to end: a cancelled task has no result until it has run its cleanup.
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        logger.info("%s: the client disconnected; its requests were aborted", response_id)
        return Response(status_code=499)
    return task.result()


class _Response:
    """One API response being built from the outputs of its submission."""

    def __init__(self, serving: OpenAIServing, kind: str, response_id: str,
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
