"""The picker's process: Envoy's ext_proc service (gRPC) and what it knows of the instances.

    python -m xds_server.picker --listen 127.0.0.1:18001 --control-url http://127.0.0.1:8000 \
        --token-file reader.token

Per request of a model with prefix affinity, Envoy sends its buffered body, with the cluster it chose as
a request attribute (`xds.cluster_name`); the picker answers with the instance (scoring.choose) as the
request header `x-sie-endpoint: ip:port` (which Envoy removes from every client request before any filter
runs), and the cluster's override_host policy routes to it.
It also gets the response headers, which end the request's prefill (from then on it weighs
`decode_weight` in its instance's load, until Envoy closes the stream at the request's end) and name the
instance that answered (`x-sie-instance`): where Envoy sent a request elsewhere (no pick, a retry), that
instance is remembered as holding its prompt. Anything it cannot answer well (an unknown cluster, no prompt, no candidate) it answers
with no pick, and Envoy balances that request by least request, as for any other model.

The instances come from the control plane (`GET /v1/picker/endpoints`, a reader token), polled every
`poll_interval_s`; if the control plane cannot be reached the last view stands.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from sie.auth import CredentialError, TokenSource
from sie.auth.store import read_trust_bundle
from sie.auth.tls import client_context
from sie.settings_flags import add_flags, from_args
from sie.tasks import Policy, SupervisedTasks
from xds_server.picker import protocol
from xds_server.picker.scoring import BLOCK_CHARS, Candidate, Choice, PrefixIndex, choose, prompt_blocks

log = logging.getLogger("xds_server.picker")

SERVED_BY = "x-sie-instance"  # every sidecar's answer names its instance (sidecar/proxy.py)


@dataclass(frozen=True)
class PickerSettings:
    """The endpoint picker's settings; each field is a flag (--listen, --control-url, ...)."""

    control_url: str = "http://127.0.0.1:8000"
    """The control plane's admin API (default http://127.0.0.1:8000), where the picker reads the instances."""

    token_file: Path = Path(".sie/run/credentials/reader.token")
    """A reader token for the admin API (default .sie/run/credentials/reader.token, as `sie up` makes)."""

    trust_file: Path | None = None
    """The control plane's trust bundle (trust.pem): an https --control-url is verified against its CA
    certificate (sie.auth.tls). Default none: the system's CAs."""

    listen: str = "127.0.0.1:18001"
    """host:port the ext_proc gRPC service listens on (default 127.0.0.1:18001; port 0 picks one)."""

    poll_interval_s: float = 0.1
    """Seconds (default 0.1) between reads of the instances: a new or draining one is seen within this
    (at 0.5 s, a scale-up's woken instances waited that long for traffic while a backlog grew elsewhere)."""

    balance: float = 1.5
    """No instance gets a request for its cached prefix while it has more than this many times its
    weighted share of the load (+1) (default 1.5); the model's own routing.prefix_affinity.balance_factor comes with its instances."""

    block_chars: int = BLOCK_CHARS
    """Characters of prompt text per block (default 256): the grain at which prefixes are matched."""

    decode_weight: float = 0.25
    """How much a request that is past its first token (decoding) weighs in an instance's load, against 1
    for one waiting for it (default 0.25): prefill is what a new request waits behind."""

    capacity_blocks: int = 4096
    """Blocks remembered per instance (default 4096, about 1 MiB of prompt text): about what its prefix
    cache holds; older ones are forgotten first."""

    max_message_bytes: int = 16 * 1024 * 1024 + 65_536
    """The largest message from Envoy it reads, in bytes (default 16 MiB + 64 KiB: Envoy sends a request's
    whole body in one message, up to the ingress's max_body_bytes, 16 MiB by default, with its attributes;
    `sie up` passes its own max_body_bytes + 64 KiB).
    gRPC refuses a larger one before it is parsed, and Envoy balances that request by least request. Only the
    body's first 1 MiB is scanned for the prompt (scoring.SCAN_BYTES)."""

    max_streams: int = protocol.MAX_STREAMS
    """ext_proc streams served at once (default 1024, the most Envoy opens to the picker's cluster): each
    holds one request of a model with prefix affinity, from its headers to its end. A stream past it is
    refused at once, and Envoy balances its request by least request."""

    log_level: str = "INFO"
    """Log level (default INFO)."""


@dataclass
class Fleet:
    """The instances of each model cluster the control plane lets serve, and the picker's own counts."""

    clusters: dict[str, list[Candidate]] = field(default_factory=dict)
    balance: dict[str, float] = field(default_factory=dict)  # cluster -> the model's balance factor
    prefilling: dict[str, int] = field(default_factory=dict)  # instance id -> picked, no answer yet
    decoding: dict[str, int] = field(default_factory=dict)  # instance id -> answering, not yet done
    picks: int = 0
    misses: int = 0  # requests answered without a pick

    def update(self, doc: dict) -> set[str]:
        clusters: dict[str, list[Candidate]] = {}
        balance: dict[str, float] = {}
        for name, block in (doc.get("clusters") or {}).items():
            clusters[name] = [
                Candidate(str(e["instance_id"]), str(e["address"]), int(e.get("weight", 1)))
                for e in block.get("endpoints", [])
            ]
            balance[name] = float(block.get("balance_factor", 1.5))
        self.clusters, self.balance = clusters, balance
        return {c.instance_id for members in clusters.values() for c in members}


class Picker(ep_grpc.ExternalProcessorServicer):
    def __init__(self, settings: PickerSettings, fleet: Fleet):
        self.settings = settings
        self.fleet = fleet
        self.index = PrefixIndex(settings.capacity_blocks)

    def pick(self, cluster: str, blocks: list[int]) -> Choice | None:
        """The instance for this request, counted in its load; None: no pick (Envoy balances it)."""
        fleet = self.fleet
        candidates = fleet.clusters.get(cluster, [])
        balance = fleet.balance.get(cluster, self.settings.balance)
        w = self.settings.decode_weight
        loads = {
            c.instance_id: fleet.prefilling.get(c.instance_id, 0) + w * fleet.decoding.get(c.instance_id, 0)
            for c in candidates
        }
        choice = choose(candidates, blocks, self.index, loads, balance)
        if choice is None:
            fleet.misses += 1
            return None
        self.index.record(choice.instance_id, blocks)
        log.debug("%s: %s (%s)", cluster, choice.instance_id, choice.why)
        fleet.prefilling[choice.instance_id] = fleet.prefilling.get(choice.instance_id, 0) + 1
        fleet.picks += 1
        return choice

    async def Process(  # noqa: N802 - the gRPC method's name
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        picked: str | None = None  # instance id, from the pick to the first byte of the answer
        answering: str | None = None  # instance id, from then to the end
        blocks: list[int] = []
        cluster = ""
        try:
            async for request in request_iterator:
                attributes = request.attributes.get(protocol.FILTER)
                if attributes is not None and protocol.CLUSTER_ATTRIBUTE in attributes.fields:
                    cluster = attributes.fields[protocol.CLUSTER_ATTRIBUTE].string_value
                kind = request.WhichOneof("request")
                if kind == "request_headers":
                    yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
                elif kind == "request_body":
                    choice = None
                    if picked is None:
                        blocks = prompt_blocks(request.request_body.body, self.settings.block_chars)
                        choice = self.pick(cluster, blocks)
                        picked = choice.instance_id if choice is not None else None
                    # The body (up to max_message_bytes) is not kept while the request prefills: the
                    # stream waits here until the answer's headers, and the blocks are all it needs.
                    del request
                    yield _answer(choice)
                elif kind == "response_headers":
                    _less(self.fleet.prefilling, picked)
                    served = _header(request.response_headers.headers, SERVED_BY)
                    if served and served != picked and blocks:
                        # Envoy sent it elsewhere (no pick, a retry, a host gone): that instance holds it now.
                        self.index.record(served, blocks)
                    if picked is not None and served in ("", picked):
                        answering = picked
                        self.fleet.decoding[answering] = self.fleet.decoding.get(answering, 0) + 1
                    picked = None
                    yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        finally:
            # Envoy closes the stream when the request ends (or is abandoned).
            _less(self.fleet.prefilling, picked)
            _less(self.fleet.decoding, answering)


def _less(counts: dict[str, int], instance_id: str | None) -> None:
    if instance_id is not None and counts.get(instance_id, 0) > 0:
        counts[instance_id] -= 1


def _header(headers: base_pb2.HeaderMap, name: str) -> str:
    for h in headers.headers:
        if h.key == name:
            return h.raw_value.decode(errors="replace") if h.raw_value else h.value
    return ""


def _answer(choice: Choice | None) -> ep.ProcessingResponse:
    """The body's answer: the pick as a header, or none (Envoy balances the request itself)."""
    mutation = ep.HeaderMutation()
    if choice is not None:
        mutation.set_headers.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=protocol.HEADER, raw_value=choice.address.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        )
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(header_mutation=mutation)))


async def poll(settings: PickerSettings, fleet: Fleet, picker: Picker, session: aiohttp.ClientSession) -> None:
    """Read the instances every poll interval; keep the last view while the control plane is away."""
    url = settings.control_url.rstrip("/") + "/v1/picker/endpoints"
    reachable: bool | None = None
    credential: TokenSource | None = None
    while True:
        try:
            credential = credential or TokenSource(path=settings.token_file)
            async with session.get(url, headers=credential.headers(), timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                keep = fleet.update(await resp.json())
            picker.index.forget(keep)
            if reachable is not True:
                log.info("instances from %s: %d clusters", url, len(fleet.clusters))
            reachable = True
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError, CredentialError, OSError) as exc:
            if reachable is not False:
                log.warning("cannot read the instances from %s (%s); keeping the last view", url, exc)
            reachable = False
        await asyncio.sleep(settings.poll_interval_s)


def grpc_server(settings: PickerSettings, picker: Picker) -> tuple[grpc.aio.Server, int]:
    """The ext_proc service on settings.listen, not yet started, and the port it bound. Bounded as Envoy is
    (DESIGN §10): no message past what Envoy can send, no more streams than it opens."""
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", settings.max_message_bytes)],
        maximum_concurrent_rpcs=settings.max_streams,
    )
    ep_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    return server, server.add_insecure_port(settings.listen)


async def serve(settings: PickerSettings, stop: asyncio.Event) -> int:
    # Read before the server starts: a bad bundle is a startup error (CredentialError), not a poll failure.
    if settings.trust_file is not None:
        trust = read_trust_bundle(settings.trust_file)
        tls = trust.tls
        log.info("control plane: %s", trust.describe(settings.control_url))
    else:
        tls = client_context(None)
    fleet = Fleet()
    picker = Picker(settings, fleet)
    server, port = grpc_server(settings, picker)
    await server.start()
    host = settings.listen.rsplit(":", 1)[0]
    print(f"listening on {host}:{port}", flush=True)
    log.info("endpoint picker on %s:%d; instances from %s", host, port, settings.control_url)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as session:
        tasks = SupervisedTasks()
        tasks.start("picker-poll", Policy.RESTART, lambda: poll(settings, fleet, picker, session))
        try:
            await stop.wait()
        finally:
            await tasks.stop()
            await server.stop(grace=1.0)
    return 0


def parse_args(argv: Sequence[str] | None = None) -> PickerSettings:
    parser = argparse.ArgumentParser(prog="python -m xds_server.picker", description=__doc__.split("\n\n")[0])
    add_flags(parser, PickerSettings, "")
    return from_args(PickerSettings, parser.parse_args(argv), "", PickerSettings())


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    logging.basicConfig(
        level=settings.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await serve(settings, stop)

    try:
        return asyncio.run(run())
    except CredentialError as exc:
        log.error("%s", exc)
        return 2
