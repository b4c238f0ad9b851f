"""The sidecar's settings: read once from argv (and the spec file it names) in `main`.

Process contract (node_host launches exactly this):
    python -m sidecar --instance-id ID --spec-file SPEC.json --listen 127.0.0.1:PORT
        --control-listen 127.0.0.1:CPORT --worker-url http://127.0.0.1:WPORT --worker-key-file KEY
        --control-url http://127.0.0.1:8000 --token-file TOKEN --trust-file TRUST.pem --node NODE
        [--gpu-index N] [--address HOST:PORT] [--max-queue N] [--drain-timeout-s S] ...

Two dataclasses, each default stated once, in them: `Settings` is the process's wiring (who it is, where
it listens, what it talks to, its credentials), which its launcher sets; `SidecarTunables` are the
queue bound, timeouts, intervals and windows, which nothing needs to set. Every field's docstring is its
flag's help (`python -m sidecar --help`); the flags are derived from the fields (sie.settings_flags).

Credentials (DESIGN §10): --token-file holds this sidecar's identity (a token the control plane issued
for exactly this instance, model and node; on Kubernetes a projected service-account token), sent with
its telemetry; --trust-file holds the control plane's public key, which the control listener checks its
callers' tokens against; --worker-key-file holds the key its worker answers to.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from sie import strict_json, strict_yaml
from sie.errors import InputError, Problem, SpecError
from sie.settings_flags import add_flags, from_args
from sie.spec import ModelService
from sie.spec_loader import parse_model_service
from sie.telemetry import TELEMETRY_INTERVAL_S

__all__ = ["Settings", "SidecarTunables", "build_parser", "load_spec", "parse_settings"]

QUEUE_PER_SLOT = 4  # --max-queue not given: this many waiting requests per max_concurrent_requests
LOG_LEVELS = tuple(logging.getLevelNamesMapping())  # what logging.basicConfig(level=...) accepts


def _host_port(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ValueError(f"{flag} must be HOST:PORT such as 127.0.0.1:9000, got {text!r}")
    return host.strip("[]"), int(port)


def _host_port_flag(flag: str) -> Callable[[str], str]:
    """A HOST:PORT flag's parser: the text itself, once it is HOST:PORT (the error names the flag)."""

    def parse(text: str) -> str:
        _host_port(text, flag)
        return text

    return parse


def _url(text: str) -> str:
    """http(s)://host[:port][/path]: what the sidecar's clients can call (no query, no fragment)."""
    try:
        parts = urlsplit(text)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
        usable = usable and not parts.query and not parts.fragment
    except ValueError:  # a port that is not a number in range, a broken [IPv6] literal
        usable = False
    if not usable:
        raise ValueError(f"expected an http(s)://host[:port][/path] URL such as http://127.0.0.1:8000, got {text!r}")
    return text.rstrip("/")


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)} (any case), got {text!r}")
    return level


@dataclass(frozen=True)
class SidecarTunables:
    """The queue bound, timeouts, intervals and latency windows. Invalid values raise ValueError."""

    max_queue: int | None = field(default=None, metadata={"metavar": "N"})
    """Requests (count, >= 0) that may wait for a worker slot before more are refused with 429
    queue_full. Default: 4 x the spec's resources.max_concurrent_requests (QUEUE_PER_SLOT), enough to
    absorb a burst without letting the queue time (sla.max_queue_time_ms) run out for most of it. 0: no
    queue, a request either gets a slot or is refused."""

    drain_timeout_s: float = 25.0
    """Seconds (> 0, at most 3,600) the drain at SIGTERM may take before the sidecar stops anyway, and the default
    timeout of POST /-/drain. Default 25: node_host's grace before SIGKILL is 30 s (Kubernetes' default
    terminationGracePeriodSeconds too), which leaves time to report `stopped` and close."""

    probe_interval_s: float = 0.5
    """Seconds (> 0) between the worker's health probes (and load and GPU polls). Default 0.5: a dead
    worker is noticed within about a telemetry interval."""

    probe_timeout_s: float = 1.0
    """Seconds (> 0) a health probe may take before it counts as failed. Default 1. A timeout while the
    worker still answers data-path requests (within probe_interval_s + probe_timeout_s) means busy, not
    dead, and is ignored."""

    telemetry_interval_s: float = TELEMETRY_INTERVAL_S
    """Seconds (> 0) between telemetry records to the control plane; a state change or a sharp rise of
    the recent latency is sent at once. Default sie.telemetry.TELEMETRY_INTERVAL_S, the interval the
    control plane's staleness rules assume."""

    window_s: float = 30.0
    """Seconds (> 0) of the sliding latency window (p50, p99, queue p99, error rate). Default 30: long
    enough for a p99, short enough to follow a change within a minute."""

    window_size: int = 1000
    """Requests (count, >= 1): the latency window keeps at most this many of the most recent. Default
    1000: at a high rate the count bound keeps the summary cheap and recent."""

    recent_s: float = 0.5
    """Seconds (> 0) of the fast signal: the requests finished in the last this many seconds (at least
    the last 8), and those running, counted at their age. Default 0.5, one telemetry interval: a
    slowdown shows in the next record, long before it moves the window's p99."""

    log_level: str = field(default="INFO", metadata={"parse": _log_level, "metavar": "LEVEL"})
    """The logging level: a name logging knows (DEBUG, INFO, WARNING, ERROR, ...), in any case.
    Default INFO: startup, state changes and errors, not every request."""

    def __post_init__(self) -> None:
        positive = ("drain_timeout_s", "probe_interval_s", "probe_timeout_s", "telemetry_interval_s")
        for name in (*positive, "window_s", "recent_s"):
            value = getattr(self, name)
            if not value > 0:  # NaN too
                raise ValueError(f"{name} must be above 0 seconds, got {value}")
        if self.drain_timeout_s > 3600:  # the Kafka connector's drain bound too (sidecar.kafka.settings)
            raise ValueError(f"drain_timeout_s must be at most 3,600 seconds, got {self.drain_timeout_s}")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must not be negative, got {self.max_queue}")
        if self.window_size < 1:
            raise ValueError(f"window_size must be at least 1, got {self.window_size}")
        object.__setattr__(self, "log_level", _log_level(self.log_level))  # frozen: normalised once, here


@dataclass(frozen=True)
class Settings:
    """The process's wiring, set by its launcher (node_host, or the Kubernetes webhook), and its
    tunables. The flags come from the fields; `spec` is read from `spec_file` (parse_settings)."""

    instance_id: str = field(metadata={"metavar": "ID"})
    """This instance's id, unique in the cluster (node_host's, or the pod's name); it names the
    instance in telemetry, logs and its responses. The launcher assigns it."""

    spec_file: Path
    """The ModelService this instance serves, as JSON (or YAML): node_host writes it, the Kubernetes
    webhook mounts it."""

    listen: str = field(metadata={"parse": _host_port_flag("--listen"), "metavar": "HOST:PORT"})
    """HOST:PORT of the data listener Envoy dials (the model's inference paths, nothing else); PORT 0
    picks a free one, and the bound address is printed on stdout. The launcher owns the ports."""

    worker_url: str = field(metadata={"parse": _url, "metavar": "URL"})
    """The worker's http:// base URL (a trailing slash is dropped): the launcher starts the worker (or
    the pod has it)."""

    trust_file: Path
    """The control plane's trust bundle (PEM, sie.auth.tls): its public key(s), which signed the token
    every caller of the control listener must present, and the CA an https control URL's certificate
    must chain to. Required: without it nobody could be let in."""

    node: str = field(metadata={"metavar": "NODE"})
    """The node this instance runs on, reported in telemetry so the control plane can group instances
    by node."""

    spec: ModelService = field(metadata={"cli": False})
    """The ModelService read from spec_file."""

    control_listen: str | None = field(
        default=None, metadata={"parse": _host_port_flag("--control-listen"), "metavar": "HOST:PORT"}
    )
    """HOST:PORT of the control listener (drain, sleep, wake, state, metrics; never on the data port).
    Default: the data listener's host, a free port."""

    worker_key_file: Path | None = None
    """File (0600) with the bearer key of this instance's worker (node hosts always give one). Default
    none: on Kubernetes the worker is the model's own container and shares only the pod's network with
    the sidecar (NetworkPolicies keep others out)."""

    control_url: str | None = field(default=None, metadata={"parse": _url, "metavar": "URL"})
    """The xds_server admin API's base URL, where telemetry goes (https: verified against the trust
    file's CA). Default none: run without a control plane (no telemetry posts)."""

    token_file: Path | None = None
    """File with this sidecar's credential, sent with its telemetry (required with --control-url).
    Default none: no control plane to send it to."""

    worker_metrics_url: str | None = field(default=None, metadata={"parse": _url, "metavar": "URL"})
    """The worker's Prometheus metrics URL, where the engine serves them apart from its API (Triton's
    metrics port). Default: the engine's metrics path (sie.engines) under --worker-url."""

    worker_device: Literal["gpu", "cpu"] | None = None
    """Where the worker's engine runs, which decides how it sleeps (sie.engines: vLLM sleeps on a GPU and
    is unloaded on a CPU). Default: gpu with --gpu-index, else cpu; the node host says cpu for an
    instance on a virtual GPU."""

    gpu_index: int | None = field(default=None, metadata={"metavar": "N"})
    """The GPU (NVML index) this instance's worker uses, read for telemetry. Default none: no GPU, or
    not ours to read."""

    address: str | None = field(default=None, metadata={"parse": _host_port_flag("--address"), "metavar": "HOST:PORT"})
    """HOST:PORT Envoy should dial, as reported in telemetry. Default: the bound listen address; set it
    to the pod IP when listening on 0.0.0.0."""

    wake_url: str | None = field(default=None, metadata={"parse": _url, "metavar": "URL"})
    """The node host's wake endpoint for this instance (POST, with the token of --token-file): while the
    instance sleeps, a request is held and this wakes it (sidecar/waking.py). Default none: a sleeping
    instance refuses requests with a retryable 503, as on Kubernetes, where no node host runs it."""

    tunables: SidecarTunables = field(default_factory=SidecarTunables)
    """The queue bound, timeouts, intervals and windows (their own flags)."""

    def __post_init__(self) -> None:
        _host_port(self.listen, "--listen")
        for flag, value in (("--control-listen", self.control_listen), ("--address", self.address)):
            if value is not None:
                _host_port(value, flag)
        if self.control_url and self.token_file is None:
            raise ValueError(
                "--control-url needs --token-file: the control plane accepts telemetry only with the "
                "sidecar's credential"
            )

    @property
    def listen_host(self) -> str:
        return _host_port(self.listen, "--listen")[0]

    @property
    def listen_port(self) -> int:
        """0: pick a free port; the bound address is printed on stdout."""
        return _host_port(self.listen, "--listen")[1]

    @property
    def control_host(self) -> str:
        if self.control_listen is None:
            return self.listen_host
        return _host_port(self.control_listen, "--control-listen")[0]

    @property
    def control_port(self) -> int:
        if self.control_listen is None:
            return 0
        return _host_port(self.control_listen, "--control-listen")[1]

    @property
    def max_concurrent(self) -> int:
        return self.spec.spec.resources.max_concurrent_requests

    @property
    def max_queue(self) -> int:
        """--max-queue, or QUEUE_PER_SLOT x the spec's max_concurrent_requests when not given."""
        if self.tunables.max_queue is not None:
            return self.tunables.max_queue
        return QUEUE_PER_SLOT * self.max_concurrent

    @property
    def max_queue_time_s(self) -> float:
        return self.spec.spec.sla.max_queue_time_ms / 1000.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sidecar",
        description="SIE sidecar: admission, validation, telemetry and drain for one model instance.",
    )
    add_flags(p, Settings, "", title="wiring (set by the launcher: node_host or the Kubernetes webhook)")
    add_flags(p, SidecarTunables, "", title="tunables")
    return p


def load_spec(path: str) -> ModelService:
    file = Path(path)
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise SpecError(path, [Problem("", f"cannot read the spec file: {exc.strerror}")]) from None
    try:
        if raw.lstrip().startswith(b"{"):
            doc = strict_json.loads(raw, what=path)
        else:
            doc = strict_yaml.load(raw.decode("utf-8", errors="replace"), what=path)  # node_host writes JSON
    except InputError as exc:
        raise SpecError(path, [Problem("", str(exc))]) from None
    return parse_model_service(doc, source=path)


def parse_settings(argv: list[str]) -> Settings:
    """Raises SystemExit (argparse) for bad flags and SpecError for a bad spec file."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.control_url and args.token_file is None:
        parser.error(
            "--control-url needs --token-file: the control plane accepts telemetry only with the sidecar's credential"
        )
    try:  # the dataclasses' own checks name the flags; shown as argparse shows its own errors (usage, exit 2)
        tunables = from_args(SidecarTunables, args, "")
        spec = load_spec(str(args.spec_file))
        return from_args(Settings, args, "", spec=spec, tunables=tunables)
    except SystemExit as exc:
        parser.error(str(exc.code))
