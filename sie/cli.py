"""The `sie` command: `sie up`, `sie down`, `sie status`, `sie validate`, `sie apply`, `sie rollout`."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sie.errors import SIEError, SpecError
from sie.status_table import printable

if TYPE_CHECKING:
    import ssl

    from sie.spec import ModelService


def _run_dir(value: str | None, default: str = ".sie/run") -> Path:
    """The run directory a command was given, absolute but with its last component unresolved: a symbolic
    link there is refused (sie.auth.store.private_dir), not silently followed to wherever it points."""
    return Path(os.path.abspath(value or default))


def _node_name(text: str) -> str:
    """argparse's check of a node's name (--node, `sie token node NAME`): it becomes a file name and a token."""
    from sie.cluster import node_name

    try:
        return node_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ttl(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 366 * 86_400:
        raise argparse.ArgumentTypeError(f"expected seconds in 0..31,622,400 (0: never expires), got {text!r}")
    return value


def _up(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from sie.cluster import ClusterSettings, load_cluster
    from sie.errors import Problem, StartupError
    from sie.processes import EnvoyNotFound
    from sie.spec_loader import problems_from_validation
    from sie.standalone import Stack, envoy_admin_socket
    from sie.status_table import curl_examples, model_rows, render

    cluster = load_cluster(args.file)
    _print_warnings(cluster.warnings)
    overrides = {
        k: getattr(args, k)
        for k in (
            "host",
            "envoy_port",
            "envoy_admin_port",
            "admin_port",
            "xds_port",
            "picker_port",
            "virtual_gpus",
            "run_dir",
        )
        if getattr(args, k) is not None
    }
    try:  # a flag is held to the same ranges as the file's setting it overrides
        settings = ClusterSettings.model_validate({**cluster.settings.model_dump(), **overrides})
    except ValidationError as exc:
        problems = [
            Problem("--" + p.path.replace("_", "-"), p.reason) if p.path in overrides else p
            for p in problems_from_validation(exc)
        ]
        raise SpecError(f"the settings of {cluster.path} with the command line's flags", problems) from None
    run_dir = _run_dir(settings.run_dir)
    stack = Stack(cluster.path.resolve(), settings, run_dir, control_plane_only=args.control_plane)
    # Before the state file names this process: from then on `sie down` may ask it to stop.
    signal.signal(signal.SIGTERM, lambda *_: stack.request_stop())
    signal.signal(signal.SIGINT, lambda *_: stack.request_stop())
    stack.claim()  # refuses a run directory in use or not ours alone (SIEError: main says why)
    print(f"Starting SIE from {cluster.path} ({len(cluster.services)} models)")
    try:
        stack.start(ready_timeout_s=args.timeout)
        status = stack.status() or {}
        print()
        print(render(model_rows(status)))
        print()
        print(f"Envoy ingress  {stack.ep.envoy_url}     Envoy stats {stack.ep.envoy_stats_url}/stats/prometheus")
        print(f"SIE admin API  {stack.ep.admin_url}     Logs {run_dir / 'logs'}")
        print("\nTry:")
        for line in curl_examples(status, stack.ep.envoy_url):
            print(f"  {line}")
        # Envoy's admin is a Unix socket only this user can open (standalone.envoy_admin_socket).
        print(f"  curl -s --unix-socket {envoy_admin_socket(run_dir)} http://envoy/clusters | grep model.\n")
        if args.control_plane:
            print("Control plane only: add node hosts from other machines with")
            print(f"  sie token node NAME --run-dir {run_dir}   (here: mints NAME's node token)")
            join_url = stack.ep.join_url
            insecure = " --insecure-http" if plain_http_problem(join_url) else ""
            print(f"  sie join {join_url}{insecure} --node NAME --token-file TOKEN --trust-file TRUST  (there)")
            if stack.ep.join_note:
                print(f"  ({stack.ep.join_note})")
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


def _token(args: argparse.Namespace) -> int:
    """Mint a node's token from this control plane's signing key (run-dir/credentials)."""
    from sie.auth import Identity
    from sie.auth.store import SIGNING_KEY, CredentialDir, node_token_name, private_dir, write_private

    run_dir = _run_dir(args.run_dir)
    creds = CredentialDir(run_dir / "credentials")
    if not creds.file(SIGNING_KEY).exists():
        print(
            f"no signing key in {creds.path}: run `sie up` (or `sie up --control-plane`) there first", file=sys.stderr
        )
        return 1
    try:
        private_dir(run_dir, "run directory", create=False)  # the key is trusted only in a directory of ours
        creds.ensure()
        # A fresh token each time, expiring after --ttl-s: it is a join credential, shown to the control
        # plane once per node host start (the beats after show the token the replies renew, which expires
        # within the hour), so a copy left on a machine or in a shell history is worth a day, not for ever.
        token = creds.file(node_token_name(args.name))
        issued = creds.signer().issue(Identity.for_node(args.name), ttl_s=args.ttl_s or None)
        write_private(token, issued.encode() + b"\n")
    except (SIEError, ValueError) as exc:
        print(f"sie token: {exc}", file=sys.stderr)
        return 1
    ends = (
        "never expires"
        if not args.ttl_s
        else f"valid {args.ttl_s:g} s, until {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(time.time() + args.ttl_s))}"
    )
    print(
        f"node {args.name}: token {token} ({ends}; a node host started after that needs a new one), "
        f"trust bundle {creds.file('trust.pem')} (copy both to the node, mode 600)"
    )
    return 0


def plain_http_problem(
    control_url: str, exposed: str = "the node's token and every heartbeat", verb: str = "Join"
) -> str | None:
    """Why a command should not send a credential to `control_url` without --insecure-http, or None: over
    plain HTTP beyond this machine `exposed` (`sie join`: the node's token and every heartbeat; the admin
    commands: the admin token) cross the network readable, and any host that answers there is believed.
    Over https the client verifies the control plane against the CA in its trust bundle (sie.auth.tls)
    before it sends anything."""
    from urllib.parse import urlsplit

    parts = urlsplit(control_url)
    host = (parts.hostname or "").lower()
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if parts.scheme != "http" or loopback:
        return None
    return (
        f"{control_url} is plain HTTP to another machine: {exposed} would cross the network readable, and "
        f"whatever answers there would be believed. {verb} the https URL `sie up` prints (its admin API serves "
        "TLS when its host is not loopback, or with admin_tls: on); on a network you trust, pass --insecure-http"
    )


def _join(args: argparse.Namespace) -> int:
    """Run a node host here for a control plane elsewhere (in the foreground; Ctrl-C stops it)."""
    from sie.auth.store import private_dir
    from sie.run_dir import lock_run_dir
    from sie.standalone import node_flags

    problem = plain_http_problem(args.control_url)
    if problem is not None and not args.insecure_http:
        print(f"sie join: {problem}", file=sys.stderr)
        return 2
    run_dir = private_dir(_run_dir(args.run_dir, f".sie/nodes/{args.node}"), "run directory")
    # Held by the node host this process becomes (the descriptor survives exec) for as long as it runs:
    # a second `sie join` or a `sie up` on the same run directory is refused.
    os.set_inheritable(lock_run_dir(run_dir), True)
    argv = [sys.executable, "-m", "node_host", "--control-url", args.control_url, "--node", args.node]
    argv += ["--token-file", args.token_file, "--trust-file", args.trust_file]
    argv += ["--run-dir", str(run_dir), "--host", args.host]
    argv += node_flags(
        virtual_gpus=args.virtual_gpus,
        gpu_tiers=args.gpu_tiers,
        p0_only_tiers=args.p0_only_tiers,
        tier_cpus=args.tier_cpus,
        labels=args.labels,
        taints=args.taints,
    )
    os.execv(sys.executable, argv)  # the node host takes this process over: its signals, its exit code
    return 0  # not reached


def _down(args: argparse.Namespace) -> int:
    from sie.run_dir import read_state, state_owner_alive, stop_running
    from sie.standalone import STACK_STOP_S

    run_dir = _run_dir(args.run_dir)
    stop_running(run_dir, STACK_STOP_S)
    state = read_state(run_dir)
    return 1 if state is not None and state_owner_alive(state) else 0  # 1: it still runs


def _admin(args: argparse.Namespace) -> tuple[str, str, ssl.SSLContext | None] | None:
    """The control plane to ask, the admin token to ask with and how to verify an https one: --admin-url,
    --token-file and --trust-file, or the running `sie up` of --run-dir (its state file and the files of
    <run-dir>/credentials: admin.token, and trust.pem, whose CA the admin API's certificate chains to)."""
    from sie.auth import ADMIN_TOKEN, TRUST, CredentialError, read_secret
    from sie.auth.store import read_trust_bundle
    from sie.run_dir import read_state
    from sie.standalone import credentials

    run_dir = _run_dir(args.run_dir)
    admin_url = args.admin_url
    if admin_url is not None:
        # The admin token is the whole cluster's: not sent in clear to another machine unless told, as `sie
        # join` sends no node's. (The URL of this machine's own `sie up`, from its state file, is one of this
        # machine's addresses: it never crosses the network.)
        problem = plain_http_problem(admin_url, "the token (an admin's may change every model)", "Use")
        if problem is not None and not args.insecure_http:
            print(f"sie {args.command}: {problem}", file=sys.stderr)
            return None
    else:
        state = read_state(run_dir)
        if state is None:
            print(
                "SIE is not running here (no state file); pass --admin-url (and --token-file) to ask another "
                "control plane.",
                file=sys.stderr,
            )
            return None
        if "admin_url" not in state:
            print(f"the state file of {run_dir} names no admin URL; pass --admin-url", file=sys.stderr)
            return None
        admin_url = state["admin_url"]
    token_file = Path(args.token_file) if args.token_file else credentials(run_dir).file(ADMIN_TOKEN)
    try:
        token = read_secret(token_file, "admin token")
    except CredentialError as exc:
        print(f"sie: {exc}; pass --token-file with an admin token", file=sys.stderr)
        return None
    trust_file = Path(args.trust_file) if args.trust_file else credentials(run_dir).file(TRUST)
    tls = None  # an https control plane without a bundle here: the system's CAs
    if args.trust_file or trust_file.exists():
        try:
            tls = read_trust_bundle(trust_file).tls
        except CredentialError as exc:
            print(f"sie: {exc}; pass --trust-file with the control plane's trust bundle", file=sys.stderr)
            return None
    return admin_url.rstrip("/"), token, tls


def _status(args: argparse.Namespace) -> int:
    from sie.standalone import http_json
    from sie.status_table import gpu_rows, instance_rows, model_rows, node_rows, render

    found = _admin(args)
    if found is None:
        return 1
    admin_url, token, tls = found
    code, body = http_json(admin_url + "/v1/status", timeout=5, token=token, tls=tls)
    if code != 200 or not isinstance(body, dict):
        reason = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
        if code == 0 and isinstance(body, str):
            reason = body  # why nothing answered: refused, timed out, a certificate the trust file does not vouch for
        print(
            printable(f"the control plane at {admin_url} did not answer /v1/status (status {code}) {reason}").rstrip(),
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    print(render(model_rows(body)))
    print()
    print(render(instance_rows(body)))
    nodes = node_rows(body, time.time())
    if nodes:
        print()
        print(render(nodes))
    gpus = gpu_rows(body)
    if gpus:
        print()
        print(render(gpus))
    return 0


def _print_warnings(warnings: tuple[str, ...]) -> None:
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)


def _error_text(code: int, body: object) -> str:
    if code == 0:
        why = printable(body) if isinstance(body, str) and body else "nothing answered"
        return f"{why}; is SIE running? (`sie status` checks)"
    error = body.get("error", {}) if isinstance(body, dict) else {}
    return printable(f"status {code}: {error.get('message', body if isinstance(body, str) else '')}".rstrip(": "))


def _apply(args: argparse.Namespace) -> int:
    """PUT each ModelService of the file: a new model is created, a changed build of a serving one starts a
    rollout, any other change applies in place. 0 when every model was taken, 1 otherwise."""
    from urllib.parse import quote

    from sie.cluster import load_cluster
    from sie.standalone import http_json

    cluster = load_cluster(args.file)
    _print_warnings(cluster.warnings)
    found = _admin(args)
    if found is None:
        return 1
    admin_url, token, tls = found
    failed = 0
    suffix = "?allow_breaking=true" if args.allow_breaking else ""
    for svc in cluster.services:
        url = f"{admin_url}/v1/models/{quote(svc.model_id)}{suffix}"
        code, body = http_json(url, timeout=10, token=token, tls=tls, method="PUT", payload=svc.to_dict())
        if code == 202 and isinstance(body, dict):
            rollout = body.get("rollout") or {}
            steps = "/".join(str(s) for s in rollout.get("steps", []))
            print(
                f"rollout  {svc.model_id} {rollout.get('from_version')} -> {rollout.get('to_version')} "
                f"(steps {steps}%); `sie rollout status {svc.model_id}` follows it"
            )
        elif code in (200, 201):
            print(f"{'created' if code == 201 else 'updated'}  {svc.model_id}")
        else:
            failed += 1
            print(f"refused  {svc.model_id}: {_error_text(code, body)}", file=sys.stderr)
            if isinstance(body, dict):
                for diff in body.get("error", {}).get("differences", []):
                    print(printable(f"  BREAKING {diff.get('side')}: {diff.get('message')}"), file=sys.stderr)
    return 1 if failed else 0


def _rollout(args: argparse.Namespace) -> int:
    from urllib.parse import quote

    from sie.standalone import http_json

    found = _admin(args)
    if found is None:
        return 1
    admin_url, token, tls = found
    base = f"{admin_url}/v1/models/{quote(args.model)}/rollout"
    if args.action == "status":
        code, body = http_json(base, timeout=5, token=token, tls=tls)
    else:
        code, body = http_json(f"{base}/{args.action}", timeout=5, token=token, tls=tls, method="POST", payload={})
    if code != 200 or not isinstance(body, dict):
        print(f"sie rollout {args.action} {args.model}: {_error_text(code, body)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    print(rollout_text(body))
    return 0


def _or_dash(value: object, unit: str = "") -> str:
    return "-" if value is None else f"{value}{unit}"


def rollout_text(r: dict[str, Any]) -> str:
    """A rollout (GET /v1/models/<id>/rollout) as `sie rollout status` prints it."""
    share = r.get("share") or {}
    held = f", held {r['held_s']:.0f}/{r['hold_s']:g} s" if r.get("held_s") is not None else ""
    lines = [
        f"{r.get('model')}: {r.get('from_version')} -> {r.get('to_version')}  {str(r.get('phase')).upper()}",
        f"  step {r.get('step')}/{len(r.get('steps') or [])} ({r.get('step_share')}%"
        f"{'' if r.get('live') else ', preparing'}{held}); traffic new {share.get('new')}% / old {share.get('old')}%",
        f"  {r.get('reason')}",
    ]
    figures = r.get("figures") or {}
    for name in ("new", "old"):
        f = figures.get(name) or {}
        lines.append(
            f"  {name:<3}  ready {f.get('ready')}  requests {f.get('requests')}  p99 {_or_dash(f.get('p99_ms'), ' ms')}  "
            f"errors {_or_dash(f.get('error_rate'))}  queue {_or_dash(f.get('queue_time_ms'), ' ms')}"
        )
    for gate in r.get("gates") or []:
        mark = {True: "ok  ", False: "FAIL", None: "wait"}[gate.get("holds")]
        lines.append(f"  gate {mark} {gate.get('name')}: {gate.get('detail')}")
    if r.get("failed_gate"):
        lines.append(f"  failed: {r['failed_gate'].get('name')}: {r['failed_gate'].get('detail')}")
    return "\n".join(printable(line) for line in lines)


def _validate(args: argparse.Namespace) -> int:
    from sie.cluster import load_cluster

    cluster = load_cluster(args.file)
    _print_warnings(cluster.warnings)
    for svc in cluster.services:
        print(
            f"ok  {svc.model_id} ({svc.spec.backend.type.value}, {svc.spec.model.priority_level.value}, "
            f"{svc.spec.desired_replicas} instance(s))"
        )
    if args.against is None:
        return 0
    return _validate_against(args, cluster.services)


def _validate_against(args: argparse.Namespace, services: list[ModelService]) -> int:
    """Compare the file's ModelService named --against (or its only one) with the running model's schemas:
    0 when compatible, 1 when a change breaks clients, 2 when the comparison could not be made."""
    from urllib.parse import quote

    from sie.schema_compat import breaking, compare_specs
    from sie.spec import is_model_id
    from sie.spec_loader import parse_model_service
    from sie.standalone import http_json

    model_id = args.against
    if not is_model_id(model_id):
        print(f"sie validate: --against {model_id[:64]!r} is not a model id (a DNS-1123 label)", file=sys.stderr)
        return 2
    matches = [s for s in services if s.model_id == model_id] or (services if len(services) == 1 else [])
    if not matches:
        names = ", ".join(s.model_id for s in services) or "none"
        print(
            f"sie validate: {args.file} has no ModelService {model_id!r} (it has: {names}); "
            "name one of them with --against",
            file=sys.stderr,
        )
        return 2
    candidate = matches[0]
    found = _admin(args)
    if found is None:
        return 2
    admin_url, token, tls = found
    code, body = http_json(f"{admin_url}/v1/models/{quote(model_id)}", timeout=5, token=token, tls=tls)
    if code != 200 or not isinstance(body, dict):
        error = body.get("error", {}) if isinstance(body, dict) else {}
        if code == 404:
            known = ", ".join(error.get("known_models") or []) or "none"
            reason = f"model {model_id!r} is not running there (running: {known})"
        elif code == 0:
            reason = "nothing answered; is SIE running? (`sie status` checks)"
        else:
            reason = f"status {code} {error.get('message', '')}".rstrip()
        print(f"sie validate: cannot compare with the control plane at {admin_url}: {reason}", file=sys.stderr)
        return 2
    running = parse_model_service(body, f"the running model {model_id!r} from {admin_url}")
    print(
        f"comparing {candidate.model_id} {candidate.spec.model.version} ({args.file}) with the running "
        f"{running.model_id} {running.spec.model.version}"
    )
    changes = compare_specs(running.spec, candidate.spec)
    for change in changes:
        print(f"{'BREAKING' if change.breaking else 'additive'}  {change.side:<6}  {change.message}")
    broken = len(breaking(changes))
    if broken:
        print(f"{broken} breaking schema change(s) of {len(changes)}; clients of {running.model_id} would break")
        return 1
    print(f"compatible: {len(changes)} additive schema change(s)" if changes else "compatible: no schema changes")
    return 0


_TRUST_HELP = (
    "the control plane's trust bundle (trust.pem), whose CA an https --admin-url's certificate must chain to; "
    "default <run-dir>/credentials/trust.pem, else the system's CAs"
)


_INSECURE_HELP = (
    "send the admin token to an http --admin-url on another machine (one whose admin_tls is off): it crosses "
    "the network readable"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sie", description="SIE: one pool for many models.")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run the whole stack on this machine (xds_server, Envoy, node host)")
    up.add_argument("-f", "--file", default="examples/cluster.yaml", help="cluster file (ModelServices + Cluster)")
    up.add_argument("--host", help="address everything listens on (default 127.0.0.1)")
    up.add_argument("--envoy-port", type=int, help="Envoy ingress port (default 8080)")
    up.add_argument(
        "--envoy-admin-port",
        type=int,
        help="Envoy's stats port on loopback: GET /ready and /stats/prometheus only (default 9901; its whole "
        "admin interface is the Unix socket RUN_DIR/envoy/admin.sock)",
    )
    up.add_argument("--admin-port", type=int, help="SIE admin API port (default 8000)")
    up.add_argument("--xds-port", type=int, help="xDS gRPC port (default 18000)")
    up.add_argument(
        "--picker-port", type=int, help="the endpoint picker's gRPC port, for prefix affinity (default 18001; 0: none)"
    )
    up.add_argument("--virtual-gpus", help="simulate GPUs on a machine without one, e.g. 2x80GB")
    up.add_argument("--run-dir", help="where the pid file and logs go (default .sie/run)")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for every model to serve")
    up.add_argument(
        "--control-plane",
        action="store_true",
        help="the control plane and Envoy only; node hosts join from other machines (`sie join`)",
    )
    up.set_defaults(func=_up)

    token = sub.add_parser("token", help="mint credentials from this control plane's signing key")
    token.add_argument("kind", choices=("node",))
    token.add_argument("name", type=_node_name, help="the node's name, as it will join")
    token.add_argument("--run-dir", help="the run dir `sie up` used (default .sie/run)")
    token.add_argument(
        "--ttl-s",
        type=_ttl,
        default=86_400.0,
        help="seconds the token is valid for joining (default 86400, a day, as kubeadm's join tokens; 0: never)",
    )
    token.set_defaults(func=_token)

    join = sub.add_parser(
        "join",
        help="run a node host on this machine for a running control plane",
        description="Run a node host here that reports to CONTROL_URL as NODE, with the token and trust bundle "
        "`sie token node NODE` made on the control plane's machine. For the node host's other flags run it "
        "directly (python -m node_host --help).",
    )
    join.add_argument("control_url", help="the control plane's admin API, e.g. http://10.0.0.5:8000")
    join.add_argument(
        "--node", required=True, type=_node_name, help="this node's name (the one its token was minted for)"
    )
    join.add_argument("--token-file", required=True, help="the node's token (sie token node NODE)")
    join.add_argument("--trust-file", required=True, help="the control plane's trust bundle (trust.pem)")
    join.add_argument("--host", default="127.0.0.1", help="address this node's API and sidecars listen on")
    join.add_argument("--run-dir", help="this node host's run dir (default .sie/nodes/NODE)")
    join.add_argument("--virtual-gpus", help="simulated GPUs, e.g. 2x80GB")
    join.add_argument("--labels", help="KEY=VALUE,... for nodeSelector")
    join.add_argument("--taints", help="KEY=VALUE:EFFECT,...")
    join.add_argument("--gpu-tiers", help="INDEX=TIER,...")
    join.add_argument("--p0-only-tiers", help="TIER,...")
    join.add_argument("--tier-cpus", help="TIER=CPUS,... cores reserved per tier, e.g. gold=0-1")
    join.add_argument(
        "--insecure-http",
        action="store_true",
        help="join a control plane on another machine over plain HTTP (one whose admin_tls is off)",
    )
    join.set_defaults(func=_join)

    down = sub.add_parser("down", help="stop a running `sie up` and everything it started")
    down.add_argument("--run-dir", help="the run dir `sie up` used (default .sie/run)")
    down.set_defaults(func=_down)

    status = sub.add_parser("status", help="the live table of models and instances")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--admin-url", help="ask this control plane instead of the local one")
    status.add_argument("--token-file", help="an admin (or reader) token; default <run-dir>/credentials/admin.token")
    status.add_argument("--trust-file", help=_TRUST_HELP)
    status.add_argument("--insecure-http", action="store_true", help=_INSECURE_HELP)
    status.add_argument("--run-dir", help="the run dir `sie up` used (default .sie/run)")
    status.set_defaults(func=_status)

    validate = sub.add_parser(
        "validate",
        help="check a cluster or ModelService file and exit",
        description="Check a cluster or ModelService file. With --against, also compare a model's input and "
        "output schemas with the running version's: exit 0 when compatible, 1 when a change breaks clients, "
        "2 when the file is invalid or the comparison could not be made.",
    )
    validate.add_argument("file")
    validate.add_argument("--against", metavar="MODEL", help="the running model to compare the file's schemas with")
    validate.add_argument("--admin-url", help="with --against: ask this control plane instead of the local one")
    validate.add_argument("--token-file", help="an admin (or reader) token; default <run-dir>/credentials/admin.token")
    validate.add_argument("--trust-file", help=_TRUST_HELP)
    validate.add_argument("--insecure-http", action="store_true", help=_INSECURE_HELP)
    validate.add_argument("--run-dir", help="the run dir `sie up` used (default .sie/run)")
    validate.set_defaults(func=_validate)

    apply = sub.add_parser(
        "apply",
        help="create or update the models of a file on a running SIE (a new build rolls out)",
        description="PUT each ModelService of FILE to the control plane. A changed version, image, weights or "
        "backend of a serving model starts a rollout (its spec's `rollout` block: steps, holds, gates); any "
        "other change applies in place. A change whose schemas break clients is refused unless --allow-breaking.",
    )
    apply.add_argument("-f", "--file", required=True, help="cluster or ModelService file")
    apply.add_argument("--allow-breaking", action="store_true", help="apply schema changes that break clients")
    apply.add_argument("--admin-url", help="the control plane to update (default: the local `sie up`)")
    apply.add_argument("--token-file", help="an admin token; default <run-dir>/credentials/admin.token")
    apply.add_argument("--trust-file", help=_TRUST_HELP)
    apply.add_argument("--insecure-http", action="store_true", help=_INSECURE_HELP)
    apply.add_argument("--run-dir", help="the run dir `sie up` used (default .sie/run)")
    apply.set_defaults(func=_apply)

    rollout = sub.add_parser("rollout", help="a model's rollout: status, pause, resume, abort, undo")
    rollout.add_argument("action", choices=("status", "pause", "resume", "abort", "undo"))
    rollout.add_argument("model")
    rollout.add_argument("--json", action="store_true", help="machine-readable output")
    rollout.add_argument("--admin-url", help="the control plane to ask (default: the local `sie up`)")
    rollout.add_argument("--token-file", help="an admin token; default <run-dir>/credentials/admin.token")
    rollout.add_argument("--trust-file", help=_TRUST_HELP)
    rollout.add_argument("--insecure-http", action="store_true", help=_INSECURE_HELP)
    rollout.add_argument("--run-dir", help="the run dir `sie up` used (default .sie/run)")
    rollout.set_defaults(func=_rollout)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        func: Callable[[argparse.Namespace], int] = args.func  # set_defaults(func=...) on every subcommand
        return func(args)
    except SpecError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except SIEError as exc:
        print(f"sie: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`sie status | head`): stop quietly, as shell tools do. Standard output
        # goes to /dev/null so that the interpreter's last flush at exit does not fail on it again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE  # what a shell reports for a tool its reader's exit stopped


if __name__ == "__main__":
    sys.exit(main())
