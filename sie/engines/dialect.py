"""What SIE needs to know to talk to one engine, as a value: the `Dialect`.

SIE runs engines as they are (vLLM, SGLang, Triton) beside its own (torch, sklearn, sim). They differ in
where they say they are alive, where their load figures are and under which names, whether and how they
give their accelerator memory back, and which of the public inference paths they serve. Everything of
that kind is a field or a function of one frozen `Dialect` per engine, so the sidecar and the node host
ask the dialect (`sie.engines.dialect_for(backend)`) and never test `backend == ...` themselves.

Pure: values and functions of values. The I/O (HTTP calls, processes) is the sidecar's and the node
host's; how an engine is launched is the node host's (node_host/backends/<engine>_server/).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from sie.errors import error_bytes
from sie.spec import ModelService
from sie.worker_loads import EngineLoad


class MemoryRelease(str, Enum):
    """How an instance of the engine gives its accelerator memory back when it sleeps."""

    # The engine frees its memory and keeps running (SGLang's memory saver, vLLM's sleep mode on a GPU,
    # SIE's engines' offload, Triton's repository unload): a wake is a call, not a load.
    CALL = "call"
    # The engine cannot (vLLM's CPU build refuses sleep mode): the sleep drains the instance and the node
    # host stops its worker; a wake starts it again and holds the first request meanwhile.
    UNLOAD = "unload"


@dataclass(frozen=True)
class Call:
    """One HTTP call to the worker: POST `path` with the JSON `body` (None: no body)."""

    path: str
    body: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Sleep:
    """How the engine sleeps on one kind of device: by calls (release, resume) or by unloading, and why."""

    release: MemoryRelease
    why: str  # said in `sie status` beside the mode: why this engine sleeps this way here
    release_call: Call | None = None  # MemoryRelease.CALL only
    resume_call: Call | None = None


class InferCodec(Protocol):
    """Translates SIE's `/infer` JSON to the engine's own request and its answer back (Triton: the KServe
    v2 protocol), by the model's input and output schemas. Bound to one model (`Dialect.codec(service)`)."""

    def request(self, doc: Mapping[str, Any]) -> bytes:
        """SIE's /infer body (already validated against the input schema: one row, or {"instances": [...]})
        as the engine's request body. Raises sie.errors.InputError naming the field it cannot encode."""
        ...

    def response(self, status: int, body: bytes) -> tuple[int, bytes]:
        """The engine's answer as SIE's: (status, body), a success as SIE's /infer JSON (one row, or
        {"predictions": [...]}, as the request was), an error in SIE's one error shape."""
        ...


@dataclass(frozen=True)
class Dialect:
    """One engine's wire: see the module docstring. Every path is relative to the worker's base URL."""

    name: str  # "sie", "sglang", "vllm", "triton"
    health_path: str  # GET; 200 means it serves
    # GET the engine's own load document (SGLang's /v1/loads shape, sie.worker_loads.parse_loads); None:
    # the engine has none, and its metrics are read instead.
    loads_path: str | None
    metrics_path: str  # GET, Prometheus text
    parse_metrics: Callable[[str], EngineLoad]  # the engine's own gauge names into SIE's load figures
    # Which public inference paths (sie.spec.INFERENCE_PATHS) the engine serves itself; the sidecar
    # answers the others with 404 naming these, and never forwards them.
    serves: frozenset[str]
    sleep_on_gpu: Sleep
    sleep_on_cpu: Sleep
    # Where a public path goes at the worker, when not the same path ("{model}" is the model id: Triton's
    # /infer -> /v2/models/{model}/infer).
    targets: Mapping[str, str] = field(default_factory=dict)
    # The engine serves its metrics on a port of their own (Triton): the node host gives it one more port.
    metrics_apart: bool = False
    # The header that carries the worker key: "Authorization" as a bearer token, or another header whose
    # whole value is the key (Triton's restricted APIs compare a header's value).
    key_header: str = "Authorization"
    # For engines whose error answers are not in SIE's one error shape: (status, body) -> SIE's body.
    error_shape: Callable[[int, bytes], bytes] | None = None
    # For engines that do not take SIE's /infer JSON: the translation, bound to one model; None: forwarded as is.
    codec: Callable[[ModelService], InferCodec] | None = None

    def sleep(self, on_gpu: bool) -> Sleep:
        """How an instance sleeps where it runs: on a GPU (the ledger placed it on one) or not."""
        return self.sleep_on_gpu if on_gpu else self.sleep_on_cpu

    def key_headers(self, key: str | None) -> dict[str, str]:
        """The headers of a call to the worker that carry its key (none without one)."""
        if not key:
            return {}
        if self.key_header.lower() == "authorization":
            return {"Authorization": f"Bearer {key}"}
        return {self.key_header: key}

    def target(self, path: str, model_id: str) -> str:
        return self.targets.get(path, path).replace("{model}", model_id)


_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_KIND = re.compile(r"^[a-z][a-z0-9_]*$")
MAX_ENGINE_MESSAGE = 2000


def openai_error(status: int, body: bytes) -> bytes:
    """An OpenAI-style engine error (vLLM: {"error": {"message", "type": "BadRequestError", "param",
    "code"}}, or its older flat {"object": "error", ...}) in SIE's one error shape: the same message,
    its type in snake_case ("bad_request_error"), param and code kept beside them. Anything else the
    engine answered becomes an `engine_error` carrying its text (cut), so a client meets one shape
    whichever engine served it."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict) and isinstance(doc, dict) and doc.get("object") == "error":
        err = doc
    if not isinstance(err, dict) or not isinstance(err.get("message"), str) or not err["message"]:
        text = body.decode("utf-8", "replace").strip()[:MAX_ENGINE_MESSAGE] or f"HTTP {status} with no body"
        return error_bytes("engine_error", f"the engine answered HTTP {status}: {text}")
    kind = err.get("type")
    kind = _CAMEL.sub("_", kind).lower().replace("-", "_").replace(" ", "_") if isinstance(kind, str) else ""
    if not _KIND.match(kind):
        kind = "engine_error"
    context = {k: err[k] for k in ("param", "code") if err.get(k) is not None}
    return error_bytes(kind, err["message"][:MAX_ENGINE_MESSAGE], **context)
