"""The OpenAI API surface of the server: request bodies, their sampling parameters, errors.

Request bodies are pydantic models that forbid unknown fields: nothing a client sends is silently
ignored. The sampling options are OpenAI's (``presence_penalty``, ``frequency_penalty``,
``logit_bias`` with token ids as string keys) and vLLM's extras (``repetition_penalty``,
``min_tokens``, ``bad_words``, ``allowed_token_ids``). ``n`` samples per prompt come back as
``choices`` with ``index`` = prompt index x n + sample (vLLM's order); ``echo`` puts the prompt
before the completion (with ``logprobs``, the prompt tokens' logprobs too; with ``max_tokens``
0 the prompt alone: what lm-evaluation-harness sends for loglikelihood tasks). ``best_of``
(completions) generates that many samples per prompt and returns the ``n`` with the highest
cumulative logprob, best first (not with ``stream``, as OpenAI's). ``suffix`` is accepted at its
neutral value only (empty); ``user`` (an end-user id) is accepted and has no effect on
generation, as in OpenAI's API. Scalars are strict: ``"0.5"`` is not a temperature.

Every error is OpenAI's body ``{"error": {"message", "type", "param", "code"}}``; the message
names the field and the value.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from verispec.engine.inputs import check_unicode
from verispec.sampling_params import MAX_N, SamplingParams, StructuredOutputsParams

# Most top logprobs per token a request may ask for (vLLM's default max_logprobs; OpenAI's chat
# top_logprobs limit).
MAX_LOGPROBS = 20
# JSON has no -inf: a token the masks removed reports this, as vLLM does.
MIN_LOGPROB = -9999.0

ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
               413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        """The JSON response (ASCII-escaped: a message may quote text that is not valid
        Unicode)."""
        return Response(json.dumps(self.body()), status_code=self.status,
                        media_type="application/json")


def show(value: Any, limit: int = 100) -> str:
    """A value as an error message quotes it (repr, cut to ``limit`` characters)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: StrictStr
    content: StrictStr | list[TextPart]

    def as_dict(self) -> dict:
        content = self.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content}


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema`` (JSON matching ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _GenerationRequest(_Body):
    """The fields both endpoints share."""

    model: StrictStr | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = None
    user: StrictStr | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None  # token id (a string, as JSON keys) -> bias
    repetition_penalty: StrictFloat | None = None
    min_tokens: StrictInt | None = None
    bad_words: list[StrictStr] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    n: StrictInt | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's StructuredOutputsParams fields

    @property
    def grammar_param(self) -> str:
        """The field that set the request's structured output (what its errors name)."""
        return "response_format" if self.response_format is not None else "structured_outputs"

    def structured(self) -> StructuredOutputsParams | None:
        """The request's structured output; ApiError naming the field when it is malformed."""
        fmt, fields = self.response_format, self.structured_outputs
        if fmt is not None and fields is not None:
            raise ApiError(400, "response_format and structured_outputs both constrain the "
                           "output; give one", "response_format")
        if fmt is not None:
            if fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ApiError(400, "response_format.json_schema.schema is required with type "
                               "'json_schema'", "response_format")
            return StructuredOutputsParams(json=fmt.json_schema.schema_)
        if fields is None:
            return None
        try:
            return StructuredOutputsParams(**fields)
        except (TypeError, ValueError) as e:
            raise ApiError(400, f"structured_outputs: {e}".replace(
                "structured_outputs: structured_outputs", "structured_outputs"),
                "structured_outputs") from None

    def check_text(self) -> None:
        """ApiError naming the field when a string the client sent is not valid Unicode (JSON
        lets a lone surrogate through as ``"\\ud800"``)."""
        for name in self.model_fields_set:
            _check_strings(getattr(self, name), name, name)

    def check_neutral_fields(self) -> None:
        """ApiError for a field verispec does not implement set to anything but its neutral
        value."""
        for name, neutral in NEUTRAL_VALUES.items():
            value = getattr(self, name, None)
            if value is not None and value != neutral:
                raise ApiError(400, f"{name}={show(value)} is not supported by verispec (only "
                               f"{show(neutral)}, which is the default)", name)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true, got "
                           f"stream_options={show(self.stream_options.model_dump())}",
                           "stream_options")


def _check_strings(value: Any, path: str, field: str) -> None:
    if isinstance(value, str):
        try:
            check_unicode(value, path)
        except ValueError as e:
            raise ApiError(400, str(e), field) from None
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_strings(item, f"{path}[{i}]", field)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, f"{path} key {key!r}", field)
            _check_strings(item, f"{path}[{key!r}]", field)
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            _check_strings(getattr(value, name), f"{path}.{name}", field)


class CompletionRequest(_GenerationRequest):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def prompts(self) -> list[str | list[int]]:
        """One prompt per choice: a string or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None


NEUTRAL_VALUES = {"suffix": ""}

# Union-typed fields: what a validation error says they must be.
FIELD_EXPECTS = {
    "prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a non-empty list of {'role': str, 'content': str | [{'type': 'text', "
                "'text': str}]} messages",
}


def validation_error(errors: list[dict], body: Any) -> ApiError:
    """The first of pydantic's errors (FastAPI's RequestValidationError) as one 400 naming the
    field and the value."""
    error = errors[0]
    loc = [part for part in error.get("loc", ()) if part != "body"]
    kind = error.get("type", "")
    if kind == "json_invalid":
        reason = (error.get("ctx") or {}).get("error") or error.get("msg")
        return ApiError(400, f"the request body is not valid JSON: {reason}")
    if not loc or not isinstance(loc[0], str):
        return ApiError(400, f"the request body must be a JSON object, got {show(body)}")
    field = loc[0]
    value = body.get(field) if isinstance(body, dict) else error.get("input")
    if kind == "extra_forbidden":
        return ApiError(400, f"{field} is not a field verispec supports (got {show(value)})",
                        field)
    if kind == "missing" and len(loc) == 1:
        return ApiError(400, f"{field} is required", field)
    if field in FIELD_EXPECTS:
        return ApiError(400, f"{field} must be {FIELD_EXPECTS[field]}, got {show(value)}", field)
    path = field + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    return ApiError(400, f"{path}: {error.get('msg')}, got {show(error.get('input'))}", field)


def check_logprobs(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(400, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", name)


def check_max_tokens(name: str, value: int | None, zero_with_echo: bool = False) -> None:
    if value is not None and value < (0 if zero_with_echo else 1):
        raise ApiError(400, f"{name} must be an integer >= 1 (0 only with echo=true), got "
                       f"{value}", name)


def check_n(value: int | None) -> int:
    """The number of samples per prompt (``n``), checked."""
    n = 1 if value is None else value
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be an integer in [1, {MAX_N}], got {n}", "n")
    return n


def check_best_of(value: int | None, n: int, stream: bool) -> int:
    """The number of samples generated per prompt (``best_of``, default ``n``), checked."""
    if value is None:
        return n
    if not n <= value <= MAX_N:
        raise ApiError(400, f"best_of must be an integer in [n, {MAX_N}] (n={n}), got {value}",
                       "best_of")
    if stream and value > n:
        raise ApiError(400, f"best_of={value} > n={n} cannot be streamed (the best samples are "
                       "known only at the end); use stream=false", "best_of")
    return value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as strings) with int keys; a 400 naming the field for
    a key that is not a token id."""
    if not bias:
        return None
    result = {}
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise ApiError(400, f"logit_bias keys must be token ids (non-negative integers as "
                           f"strings), got {show(key)}", "logit_bias")
        result[int(key)] = value
    return result


def sampling_params(request: _GenerationRequest, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams (OpenAI defaults: temperature 1, top_p 1); a ValueError of
    SamplingParams becomes a 400 naming the field (its messages start with the field's name)."""
    fields = dict(
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=0 if request.top_k is None else request.top_k,
        min_p=0.0 if request.min_p is None else request.min_p,
        seed=request.seed,
        max_tokens=max_tokens,
        stop=[request.stop] if isinstance(request.stop, str) else (request.stop or []),
        stop_token_ids=request.stop_token_ids or [],
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None
        else request.repetition_penalty,
        logit_bias=_logit_bias(request.logit_bias),
        min_tokens=request.min_tokens or 0,
        bad_words=request.bad_words or None,
        allowed_token_ids=request.allowed_token_ids,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=request.structured(),
    )
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        message = str(e)
        param = next((name for name in fields if message.startswith(name + " ")), None)
        raise ApiError(400, message, param) from None
