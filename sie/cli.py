"""The `sie` command: `sie up`, `sie down`, `sie status`, `sie validate`."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from sie.errors import SIEError, SpecError


def _up(args: argparse.Namespace) -> int:
    from sie.cluster import load_cluster
    from sie.processes import EnvoyNotFound, pid_alive
    from sie.standalone import Stack, StartupError, read_state
    from sie.status_table import curl_examples, model_rows, render

    cluster = load_cluster(args.file)
    overrides = {
        k: getattr(args, k)
        for k in ("host", "envoy_port", "envoy_admin_port", "admin_port", "xds_port", "virtual_gpus", "run_dir")
        if getattr(args, k) is not None
    }
    settings = cluster.settings.model_copy(update=overrides)
    run_dir = Path(settings.run_dir).resolve()
    running = read_state(run_dir)
    if running and pid_alive(int(running["pid"])):
        print(f"SIE is already running (pid {running['pid']}); `sie down` stops it.", file=sys.stderr)
        return 1
    stack = Stack(cluster.path.resolve(), settings, run_dir)
    signal.signal(signal.SIGTERM, lambda *_: stack.request_stop())
    signal.signal(signal.SIGINT, lambda *_: stack.request_stop())
    print(f"Starting SIE from {cluster.path} ({len(cluster.services)} models)")
    try:
        stack.start(ready_timeout_s=args.timeout)
        status = stack.status() or {}
        print()
        print(render(model_rows(status)))
        print()
        print(f"Envoy ingress  {stack.ep.envoy_url}     Envoy admin {stack.ep.envoy_admin_url}")
        print(f"SIE admin API  {stack.ep.admin_url}     Logs {run_dir / 'logs'}")
        print("\nTry:")
        for line in curl_examples(status, stack.ep.envoy_url):
            print(f"  {line}")
        print(f"  curl -s {stack.ep.envoy_admin_url}/clusters | grep model.\n")
        print("SIE is up. Ctrl-C or `sie down` stops it.", flush=True)
        stack.supervise()
        print("\nStopping SIE...", flush=True)
        return 0
    except (StartupError, EnvoyNotFound) as exc:
        print(f"sie up failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
        print("SIE stopped.", flush=True)


def _down(args: argparse.Namespace) -> int:
    from sie.standalone import stop_running

    run_dir = Path(args.run_dir or ".sie/run").resolve()
    stop_running(run_dir)
    return 0


def _admin(args: argparse.Namespace) -> tuple[str, str] | None:
    """The control plane to ask and the admin token to ask with: --admin-url and --token-file, or the
    running `sie up` of --run-dir (its state file and <run-dir>/credentials/admin.token)."""
    from sie.auth import ADMIN_TOKEN, CredentialError, read_secret
    from sie.standalone import credentials, read_state

    run_dir = Path(args.run_dir or ".sie/run").resolve()
    admin_url = args.admin_url
    if admin_url is None:
        state = read_state(run_dir)
        if state is None:
            print(
                "SIE is not running here (no state file); pass --admin-url (and --token-file) to ask another "
                "control plane.",
                file=sys.stderr,
            )
            return None
        admin_url = state["admin_url"]
    token_file = Path(args.token_file) if args.token_file else credentials(run_dir).file(ADMIN_TOKEN)
    try:
        return admin_url.rstrip("/"), read_secret(token_file, "admin token")
    except CredentialError as exc:
        print(f"sie: {exc}; pass --token-file with an admin token", file=sys.stderr)
        return None


def _status(args: argparse.Namespace) -> int:
    from sie.standalone import http_json
    from sie.status_table import gpu_rows, instance_rows, model_rows, render

    found = _admin(args)
    if found is None:
        return 1
    admin_url, token = found
    code, body = http_json(admin_url + "/v1/status", timeout=5, token=token)
    if code != 200 or not isinstance(body, dict):
        reason = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
        print(
            f"the control plane at {admin_url} did not answer /v1/status (status {code}) {reason}".rstrip(),
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    print(render(model_rows(body)))
    print()
    print(render(instance_rows(body)))
    gpus = gpu_rows(body)
    if gpus:
        print()
        print(render(gpus))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from sie.cluster import load_cluster

    cluster = load_cluster(args.file)
    for svc in cluster.services:
        print(
            f"ok  {svc.model_id} ({svc.spec.backend.type.value}, {svc.spec.model.priority_level.value}, "
            f"{svc.spec.desired_replicas} instance(s))"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sie", description="SIE: one pool for many models.")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run the whole stack on this machine (xds_server, Envoy, node host)")
    up.add_argument("-f", "--file", default="examples/cluster.yaml", help="cluster file (ModelServices + Cluster)")
    up.add_argument("--host", help="address everything listens on (default 127.0.0.1)")
    up.add_argument("--envoy-port", type=int, help="Envoy ingress port (default 8080)")
    up.add_argument("--envoy-admin-port", type=int, help="Envoy admin port (default 9901)")
    up.add_argument("--admin-port", type=int, help="SIE admin API port (default 8000)")
    up.add_argument("--xds-port", type=int, help="xDS gRPC port (default 18000)")
    up.add_argument("--virtual-gpus", help="simulate GPUs on a machine without one, e.g. 2x80GB")
    up.add_argument("--run-dir", help="where the pid file and logs go (default .sie/run)")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for every model to serve")
    up.set_defaults(func=_up)

    down = sub.add_parser("down", help="stop a running `sie up` and everything it started")
    down.add_argument("--run-dir", help="the run dir `sie up` used (default .sie/run)")
    down.set_defaults(func=_down)

    status = sub.add_parser("status", help="the live table of models and instances")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--admin-url", help="ask this control plane instead of the local one")
    status.add_argument("--token-file", help="an admin (or reader) token; default <run-dir>/credentials/admin.token")
    status.add_argument("--run-dir", help="the run dir `sie up` used (default .sie/run)")
    status.set_defaults(func=_status)

    validate = sub.add_parser("validate", help="check a cluster or ModelService file and exit")
    validate.add_argument("file")
    validate.set_defaults(func=_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func  # set_defaults(func=...) on every subcommand
    try:
        return func(args)
    except SpecError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except SIEError as exc:
        print(f"sie: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
