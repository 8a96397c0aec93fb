"""Completions and chat completions: API request -> engine submission -> OpenAI response.

Prompts are tokenized off the event loop, on the front's one tokenizer thread with its own copy of
the tokenizer the engine process sent at start-up (the event loop decodes outputs with another
copy; a Rust tokenizer must not be used by two threads at once), under the rules
``LLM.generate`` applies (``verispec.engine.inputs.PromptEncoder``: the chat template for
messages, vLLM's prompt + max_tokens rule, a text too long by its length alone refused before
tokenizing), so a seeded request gives the tokens ``LLM.generate`` gives and one huge prompt
never stalls ``/health`` or the streams running beside it. Token texts of logprobs are decoded
on the same thread.

The response to a submission (its choices, logprobs and usage, whole or as server-sent events)
is built by ``serve.responses.ApiResponse``.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from verispec.engine import inputs
from verispec.engine.samples import sample_params
from verispec.sampling_params import SamplingParams
from verispec.serve.async_engine import AsyncEngine, EngineError
from verispec.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_best_of,
    check_logprobs,
    check_max_tokens,
    check_n,
    sampling_params,
)
from verispec.serve.responses import ApiResponse, Echo

logger = logging.getLogger("verispec.serve")


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
        response = ApiResponse(self, kind, response_id, prompts, choice_params, num_samples,
                               echo, n, params.logprobs is not None)
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
