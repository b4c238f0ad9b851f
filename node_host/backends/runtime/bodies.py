"""Request and response bodies of the worker protocol: SGLang's /generate and OpenAI's completions.

Pure functions: JSON in, `GenerateRequest` out; `Completion`/`Delta` in, JSON out. Parsing raises
`BadRequest` naming the field and what is expected, so a client can fix its call, and nothing else for
any JSON value (tests/unit/node_host/test_worker_bodies_property.py holds it to that). `limit` is the
model's limits.max_new_tokens: it binds every spelling (max_tokens, max_completion_tokens and
sampling_params.max_new_tokens). Sampling parameters
SGLang knows but these engines do not use (frequency_penalty, regex, ...) are accepted and ignored, as
the sidecar forwards bodies written for real SGLang.

Sampling ranges are SGLang's and vLLM's: temperature >= 0 (bounded here at TEMPERATURE_MAX; below 1e-5
the engine samples greedily, as vLLM does), top_p in (0, 1] (0 keeps no token at all: both refuse it).
The sidecar holds bodies to the same ranges (sidecar/validation.py `sampling_problem`); the worker
checks again because it must not rely on being called only through its sidecar.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from node_host.backends.protocol import (
    DEFAULT_MAX_NEW_TOKENS,
    BadRequest,
    Completion,
    Delta,
    GenerateRequest,
    SamplingParams,
)


def new_rid() -> str:
    return uuid.uuid4().hex


def _number(
    body: Mapping[str, Any],
    key: str,
    default: float,
    low: float,
    high: float,
    where: str,
    *,
    open_low: bool = False,
    hint: str = "",
) -> float:
    """body[key] as a float in [low, high] ((low, high] with open_low); NaN and infinities fail both."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{where}{key}: expected a number, got {type(value).__name__}")
    if not ((low < value) if open_low else (low <= value)) or not value <= high:
        interval = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise BadRequest(f"{where}{key}: {value} is outside {interval}{hint}")
    return float(value)


# Past this, a higher temperature changes nothing a client could want (the distribution is already flat);
# a bound keeps the input bounded (DESIGN §10). The sidecar's sampling_problem uses the same.
TEMPERATURE_MAX = 100.0


MAX_TOKEN_ID = 2**31 - 1
MAX_MESSAGES = 10_000


def _max_tokens(value: Any, where: str, limit: int | None) -> int:
    if value is None:
        return DEFAULT_MAX_NEW_TOKENS if limit is None else min(DEFAULT_MAX_NEW_TOKENS, limit)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"{where}: expected a non-negative integer, got {str(value)[:40]}")
    if limit is not None and value > limit:
        raise BadRequest(f"{where}: {value} is more than this model allows ({limit}, limits.max_new_tokens)")
    return value


def _stop(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > 16 or not all(isinstance(s, str) and s for s in value):
        raise BadRequest(f"{where}: expected a non-empty string or a list of at most 16 of them")
    return tuple(value)


def _sampling(body: Mapping[str, Any], max_tokens_key: str, where: str, limit: int | None) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=_max_tokens(body.get(max_tokens_key), f"{where}{max_tokens_key}", limit),
        temperature=_number(body, "temperature", 1.0, 0.0, TEMPERATURE_MAX, where),
        top_p=_number(
            body, "top_p", 1.0, 0.0, 1.0, where, open_low=True, hint="; for greedy decoding send temperature 0"
        ),
        stop=_stop(body.get("stop"), f"{where}stop"),
        ignore_eos=bool(body.get("ignore_eos", False)),
    )


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value)
    )


def parse_generate(body: Any, arrival: float, limit: int | None = None) -> tuple[GenerateRequest, bool]:
    """SGLang /generate -> (request, stream). One prompt per call (SGLang's batched lists are refused)."""
    body = _object(body)
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params: expected an object")
    sampling = _sampling(params, "max_new_tokens", "sampling_params.", limit)
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequest("give exactly one of 'text' (a string) and 'input_ids' (a list of token ids)")
    if text is not None and not isinstance(text, str):
        raise BadRequest("text: expected one string (batched lists are not supported; send one request each)")
    if input_ids is not None and not _token_ids(input_ids):
        raise BadRequest("input_ids: expected a non-empty list of non-negative token ids")
    rid = body.get("rid") or new_rid()
    if not isinstance(rid, str) or len(rid) > 256:
        raise BadRequest("rid: expected a string of at most 256 characters")
    request = GenerateRequest(
        rid=rid,
        params=sampling,
        text=text,
        input_ids=tuple(input_ids) if input_ids is not None else None,
        arrival=arrival,
    )
    return request, bool(body.get("stream", False))


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts; only text parts mean anything to a text model
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}[{i}]: only text parts ({{'type': 'text', 'text': ...}}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        return ""
    raise BadRequest(f"{where}: expected a string or a list of text parts")


def parse_chat(body: Any, arrival: float, limit: int | None = None) -> tuple[GenerateRequest, bool, bool]:
    """OpenAI /v1/chat/completions -> (request, stream, include_usage_chunk)."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise BadRequest(
            f"messages: expected a non-empty list (at most {MAX_MESSAGES}) of {{'role': ..., 'content': ...}}"
        )
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or len(message["role"]) > 64:
            raise BadRequest(f"messages[{i}]: expected an object with a string 'role'")
        parsed.append({"role": message["role"], "content": _content(message.get("content"), f"messages[{i}].content")})
    _single_choice(body)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if key == "max_completion_tokens" and body.get("max_tokens") is not None:
        _max_tokens(body.get("max_tokens"), "max_tokens", limit)  # both given: both are held to the limit
    request = GenerateRequest(
        rid=new_rid(), params=_sampling(body, key, "", limit), messages=tuple(parsed), arrival=arrival
    )
    return request, bool(body.get("stream", False)), _include_usage(body)


def parse_completion(body: Any, arrival: float, limit: int | None = None) -> tuple[GenerateRequest, bool, bool]:
    """OpenAI /v1/completions -> (request, stream, include_usage_chunk)."""
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    _single_choice(body)
    sampling = _sampling(body, "max_tokens", "", limit)
    if isinstance(prompt, str):
        request = GenerateRequest(rid=new_rid(), params=sampling, text=prompt, arrival=arrival)
    elif _token_ids(prompt):
        request = GenerateRequest(rid=new_rid(), params=sampling, input_ids=tuple(prompt), arrival=arrival)
    else:
        raise BadRequest("prompt: expected one string or one list of token ids (one prompt per request)")
    return request, bool(body.get("stream", False)), _include_usage(body)


def _single_choice(body: Mapping[str, Any]) -> None:
    n = body.get("n", 1)
    if n is not None and (n != 1 or isinstance(n, bool)):
        raise BadRequest("n: only n=1 is supported; send several requests instead")


def _include_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


# ---- responses -------------------------------------------------------------------------------------


def _finish_reason(reason: str | None, matched: str | int | None, completion_tokens: int) -> dict[str, Any] | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": "stop", "matched": matched}


def generate_body(
    rid: str,
    text: str,
    prompt_tokens: int,
    completion_tokens: int,
    finish: str | None,
    matched: str | int | None,
    e2e_latency: float,
) -> dict[str, Any]:
    """SGLang's /generate answer; also each streamed chunk (where `text` is the text so far)."""
    return {
        "text": text,
        "meta_info": {
            "id": rid,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "e2e_latency": e2e_latency,
            "finish_reason": _finish_reason(finish, matched, completion_tokens),
        },
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_body(rid: str, model: str, done: Completion, created: int | None = None) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": done.text},
                "finish_reason": done.finish_reason,
            }
        ],
        "usage": usage(done.prompt_tokens, done.completion_tokens),
    }


def chat_chunk(rid: str, model: str, created: int, delta: Delta | None, first: bool) -> dict[str, Any]:
    """One streamed chat chunk. `delta` None with first=True is the opening role chunk."""
    content: dict[str, Any] = {}
    if first:
        content["role"] = "assistant"
    if delta is not None and delta.text:
        content["content"] = delta.text
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": content, "finish_reason": delta.finish_reason if delta else None}],
    }


def completion_body(rid: str, model: str, done: Completion, created: int | None = None) -> dict[str, Any]:
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.finish_reason}],
        "usage": usage(done.prompt_tokens, done.completion_tokens),
    }


def completion_chunk(rid: str, model: str, created: int, delta: Delta) -> dict[str, Any]:
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}],
    }


def usage_chunk(rid: str, model: str, created: int, obj: str, last: Delta) -> dict[str, Any]:
    """OpenAI's `stream_options.include_usage` chunk: no choices, the usage of the whole stream."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(last.prompt_tokens, last.completion_tokens),
    }
