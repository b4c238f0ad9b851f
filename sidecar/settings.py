"""The sidecar's settings: read once from argv (and the spec file it names) in `main`.

Process contract (node_host launches exactly this):
    python -m sidecar --instance-id ID --spec-file SPEC.json --listen 127.0.0.1:PORT
        --control-listen 127.0.0.1:CPORT --worker-url http://127.0.0.1:WPORT --worker-key-file KEY
        --control-url http://127.0.0.1:8000 --token-file TOKEN --trust-file TRUST.pem --node NODE
        [--gpu-index N] [--address HOST:PORT] [--max-queue N] [--drain-timeout-s S] ...

Credentials (DESIGN §10): --token-file holds this sidecar's identity (a token the control plane issued
for exactly this instance, model and node; on Kubernetes a projected service-account token), sent with
its telemetry; --trust-file holds the control plane's public key, which the control listener checks its
callers' tokens against; --worker-key-file holds the key its worker answers to.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from sie import strict_json, strict_yaml
from sie.errors import InputError, Problem, SpecError
from sie.spec import ModelService
from sie.spec_loader import parse_model_service
from sie.telemetry import TELEMETRY_INTERVAL_S


@dataclass(frozen=True)
class Settings:
    instance_id: str
    spec: ModelService
    listen_host: str
    listen_port: int  # 0: pick a free port; the bound address is printed on stdout
    control_host: str  # the control listener: drain, sleep, wake, state, metrics (never on the data port)
    control_port: int
    worker_url: str  # no trailing slash
    control_url: str | None  # None: run without a control plane (no telemetry posts)
    token_file: Path | None  # this sidecar's credential for telemetry; required with control_url
    trust_file: Path  # the control plane's public key(s): who may call the control listener
    # The bearer key of this instance's worker. None on Kubernetes, where the worker is the model's own
    # container and shares only the pod's network with the sidecar (NetworkPolicies keep others out).
    worker_key_file: Path | None
    node: str
    gpu_index: int | None
    address: str | None  # what Envoy dials; None: the bound listen address
    max_queue: int
    drain_timeout_s: float  # bound on the drain at SIGTERM and the default for /-/drain
    probe_interval_s: float
    probe_timeout_s: float
    telemetry_interval_s: float
    window_s: float
    window_size: int
    recent_s: float
    log_level: str

    @property
    def max_concurrent(self) -> int:
        return self.spec.spec.resources.max_concurrent_requests

    @property
    def max_queue_time_s(self) -> float:
        return self.spec.spec.sla.max_queue_time_ms / 1000.0


def _host_port(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{flag} must be HOST:PORT such as 127.0.0.1:9000, got {text!r}")
    return host.strip("[]"), int(port)


def _address(text: str) -> str:
    _host_port(text, "--address")
    return text


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http:// URL such as http://127.0.0.1:8000, got {text!r}")
    return text.rstrip("/")


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sidecar",
        description="SIE sidecar: admission, validation, telemetry and drain for one model instance.",
    )
    p.add_argument("--instance-id", required=True)
    p.add_argument("--spec-file", required=True, help="ModelService as JSON (or YAML)")
    p.add_argument(
        "--listen",
        required=True,
        type=lambda t: _host_port(t, "--listen"),
        help="HOST:PORT of the data listener Envoy dials (PORT 0 picks a free one)",
    )
    p.add_argument(
        "--control-listen",
        default=None,
        type=lambda t: _host_port(t, "--control-listen"),
        help="HOST:PORT of the control listener (drain, sleep, wake, state, metrics; default: the "
        "data listener's host, a free port)",
    )
    p.add_argument("--worker-url", required=True, type=_url)
    p.add_argument(
        "--worker-key-file",
        default=None,
        type=Path,
        help="file (0600) with the worker's key (node hosts always give one)",
    )
    p.add_argument("--control-url", default=None, type=_url, help="xds_server admin API; omit to run without one")
    p.add_argument(
        "--token-file",
        default=None,
        type=Path,
        help="file with this sidecar's credential, sent with its telemetry (required with --control-url)",
    )
    p.add_argument(
        "--trust-file",
        required=True,
        type=Path,
        help="PEM file with the control plane's public key: callers of the control listener must "
        "present a token it signed",
    )
    p.add_argument("--node", required=True)
    p.add_argument("--gpu-index", type=int, default=None)
    p.add_argument(
        "--address", default=None, type=_address, help="HOST:PORT Envoy should dial (default: the listen address)"
    )
    p.add_argument("--max-queue", type=int, default=None, help="queue bound (default 4 x max_concurrent_requests)")
    p.add_argument("--drain-timeout-s", type=_positive, default=25.0)
    p.add_argument("--probe-interval-s", type=_positive, default=0.5)
    p.add_argument("--probe-timeout-s", type=_positive, default=1.0)
    p.add_argument("--telemetry-interval-s", type=_positive, default=TELEMETRY_INTERVAL_S)
    p.add_argument("--window-s", type=_positive, default=30.0, help="latency window: seconds")
    p.add_argument("--window-size", type=int, default=1000, help="latency window: most recent requests")
    p.add_argument(
        "--recent-s",
        type=_positive,
        default=0.5,
        help="the fast signal: requests finished in the last this many seconds (at least the last 8), "
        "and those running",
    )
    p.add_argument("--log-level", default="INFO")
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
    host, port = args.listen
    control_host, control_port = args.control_listen if args.control_listen is not None else (host, 0)
    if args.control_url and args.token_file is None:
        parser.error(
            "--control-url needs --token-file: the control plane accepts telemetry only with the sidecar's credential"
        )
    spec = load_spec(args.spec_file)
    max_queue = args.max_queue if args.max_queue is not None else 4 * spec.spec.resources.max_concurrent_requests
    if max_queue < 0:
        parser.error(f"--max-queue must not be negative, got {max_queue}")
    if args.window_size < 1:
        parser.error(f"--window-size must be at least 1, got {args.window_size}")
    return Settings(
        instance_id=args.instance_id,
        spec=spec,
        listen_host=host,
        listen_port=port,
        control_host=control_host,
        control_port=control_port,
        worker_url=args.worker_url,
        control_url=args.control_url,
        token_file=args.token_file,
        trust_file=args.trust_file,
        worker_key_file=args.worker_key_file,
        node=args.node,
        gpu_index=args.gpu_index,
        address=args.address,
        max_queue=max_queue,
        drain_timeout_s=args.drain_timeout_s,
        probe_interval_s=args.probe_interval_s,
        probe_timeout_s=args.probe_timeout_s,
        telemetry_interval_s=args.telemetry_interval_s,
        window_s=args.window_s,
        window_size=args.window_size,
        recent_s=args.recent_s,
        log_level=args.log_level.upper(),
    )
