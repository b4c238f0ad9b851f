"""The endpoint picker: the prompt's text from a body, its blocks, the choice (longest held prefix under a
bounded load, least in flight otherwise), and the ext_proc exchange with Envoy (fake messages)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from xds_server.picker import protocol
from xds_server.picker.scoring import (
    MAX_FIELDS,
    MAX_PROMPT_CHARS,
    SCAN_BYTES,
    Candidate,
    PrefixIndex,
    choose,
    prompt_blocks,
    prompt_text,
)
from xds_server.picker.server import Fleet, Picker, PickerSettings

A, B, C = (Candidate(f"m-{i}", f"127.0.0.1:90{i}0", 1000) for i in range(3))


def body(system: str, question: str = "hello") -> bytes:
    doc = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "raw, expected",
    [
        (body("be brief", "hi"), b"be brief\nhi"),
        (b'{"model": "m", "prompt": "once upon a time"}', b"once upon a time"),
        (b'{"text": "sglang style", "sampling_params": {"max_new_tokens": 4}}', b"sglang style"),
        (b'{"input": ["a", "b"]}', b""),  # a list of inputs: no single prompt
        (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]}', b"parts"),
        (b'{"prompt": "say \\"hi\\" twice"}', b'say \\"hi\\" twice'),  # escapes kept as sent
        (b'{"model": "content", "prompt": "p"}', b"p"),  # "content" as a value is no key
        (b"not json at all", b""),
        (b"", b""),
        (b'{"prompt": "never closed', b""),
        # A string longer than the limit counts only as far as the limit: the rest is not read, closed or not.
        (b'{"prompt": "' + b"x" * (MAX_PROMPT_CHARS + 10), b"x" * MAX_PROMPT_CHARS),
    ],
)
def test_prompt_text(raw, expected):
    assert prompt_text(raw) == expected


@contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail (TimeoutError) if the block runs past `seconds`: a quadratic scan fails here in that time instead
    of running for minutes. The scan is Python between C calls of at most a scan of the body, so the alarm
    interrupts it promptly."""

    def expire(signum, frame):
        raise TimeoutError(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _chat(**extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


HOSTILE = {
    # A key's name as a value, again and again (the reviewer's body: 27 s at 512 KB on the old scan).
    "names as values": _chat(stop=["text"] * (SCAN_BYTES // 8)),
    "names as values, spaced": b'{"content": "hi", "x": [' + b'"text" , ' * (SCAN_BYTES // 9) + b"0]}",
    "keys of numbers": json.dumps({"x": [{"text": 1}] * (SCAN_BYTES // 12)}).encode(),
    "keys of short strings": json.dumps({"x": [{"text": "a"}] * (SCAN_BYTES // 14)}).encode(),
    "escaped quotes": b'{"prompt": "' + b'\\"' * (SCAN_BYTES // 2) + b'"}',
    "backslash runs": b'{"prompt": "' + (b"\\" * 999 + b'"') * (SCAN_BYTES // 1000 + 1),
    "a name then spaces": (b'"text"' + b" " * 1000 + b",") * (SCAN_BYTES // 1007 + 1),
    "one long prompt": json.dumps({"prompt": "x" * SCAN_BYTES}).encode(),
    "never closed": b'{"messages": [{"content": "' + b"y" * SCAN_BYTES,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_prompt_scan_is_linear_in_the_body_whatever_it_repeats(name):
    """The picker scans on its one event loop, within Envoy's 250 ms message timeout: a body a client
    shapes must cost about what its size does. Each of these is at least SCAN_BYTES (the most ever
    scanned); a linear scan takes milliseconds, the quadratic one took minutes. The bound is generous
    (a slow shared machine) and only there to tell the two apart."""
    raw = HOSTILE[name]
    assert len(raw) >= SCAN_BYTES
    started = time.perf_counter()
    with within(2.0):
        prompt_blocks(raw)
    assert time.perf_counter() - started < 2.0


def test_the_scan_takes_at_most_max_fields_keys():
    """Each key matched is a step in Python: their number is bounded, not only the bytes."""
    raw = json.dumps({"messages": [{"role": "user", "content": "a"}] * (MAX_FIELDS + 10)}).encode()
    assert prompt_text(raw) == b"\n".join([b"a"] * MAX_FIELDS)


PROMPT_KEYS = ("content", "prompt", "text", "input")
_json_text = st.lists(st.sampled_from([*'ab "\\/:{}[],\n\té\x00', '"text":', "content"]), max_size=12).map("".join)
# Key names without a quote: a key named `x"text` is spelled `"x\"text":`, which a scan (not a parse) takes
# for the key "text". Values may hold anything: only a key is followed by a colon.
_json_key = _json_text.filter(lambda key: '"' not in key)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | _json_text,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from([*PROMPT_KEYS, "role", "model", "x"]) | _json_key, inner, max_size=4)
    ),
    max_leaves=24,
)


def _reference(doc: object, ensure_ascii: bool) -> list[bytes]:
    """What prompt_text means, from the parsed document: the prompt keys' string values in document order,
    as the JSON text spells them (escapes kept)."""
    out: list[bytes] = []

    def walk(value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key in PROMPT_KEYS and isinstance(item, str):
                    out.append(json.dumps(item, ensure_ascii=ensure_ascii)[1:-1].encode())
                else:
                    walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(doc)
    return out


@settings(max_examples=300, deadline=None)
@given(doc=_json, ensure_ascii=st.booleans(), indent=st.sampled_from([None, 1, "\t"]), limit=st.integers(1, 64))
def test_prompt_text_is_the_prompt_keys_string_values_of_any_json(doc, ensure_ascii, indent, limit):
    raw = json.dumps(doc, ensure_ascii=ensure_ascii, indent=indent).encode()
    whole = b"\n".join(_reference(doc, ensure_ascii))
    assert prompt_text(raw) == whole
    # Under a limit: a prefix of the whole, cut at the limit or at most one separator short of it.
    cut = prompt_text(raw, limit)
    assert whole.startswith(cut) and len(cut) >= min(len(whole), limit - 1)


def test_blocks_are_shared_exactly_as_far_as_the_text_is():
    system = "x" * 600
    one, two = prompt_blocks(body(system, "first")), prompt_blocks(body(system, "second question"))
    assert len(one) == 2 and one == two[:2], "600 shared characters are two whole blocks of 256"
    other = prompt_blocks(body("y" + "x" * 599, "first"))
    assert other[0] != one[0] and other[1] != one[1], "a block's name depends on every block before it"
    assert prompt_blocks(body("short")) == []


def test_the_longest_held_prefix_wins_then_the_least_in_flight():
    index = PrefixIndex(capacity_blocks=100)
    index.record(A.instance_id, [1, 2, 3])
    index.record(B.instance_id, [1, 2])
    got = choose([A, B, C], [1, 2, 3, 4], index, {"m-0": 1, "m-1": 0, "m-2": 0}, balance=1.5)
    assert got is not None and got.instance_id == "m-0" and got.held_blocks == 3
    assert "holds 3 of 4" in got.why
    # Nothing held anywhere: least in flight; equal load: the emptiest cache (new prefixes spread).
    fresh = choose([A, B, C], [9], index, {"m-0": 0, "m-1": 1, "m-2": 0}, balance=1.5)
    assert fresh is not None and fresh.instance_id == "m-2" and "least in flight" in fresh.why


def test_the_bound_keeps_a_hot_prefix_off_a_loaded_instance():
    index = PrefixIndex(capacity_blocks=100)
    index.record(A.instance_id, [1, 2, 3])
    loads = {"m-0": 5, "m-1": 1, "m-2": 0}  # mean 2, bound 1.5 x 2 + 1 = 4
    got = choose([A, B, C], [1, 2, 3], index, loads, balance=1.5)
    assert got is not None and got.instance_id == "m-2" and "1 over the bound" in got.why
    loose = choose([A, B, C], [1, 2, 3], index, loads, balance=3.0)
    assert loose is not None and loose.instance_id == "m-0"


def test_the_pushed_weights_shape_the_bound_and_the_least_loaded():
    slow = Candidate("m-0", "127.0.0.1:9000", 100)  # SIE found it slow: a tenth of the others' weight
    index = PrefixIndex(capacity_blocks=100)
    index.record(slow.instance_id, [1, 2, 3])
    loads = {"m-0": 2, "m-1": 3, "m-2": 3}  # total 8; m-0's weighted share 8 x 100/2100, bound 1.5 x that + 1
    got = choose([slow, B, C], [1, 2, 3], index, loads, balance=1.5)
    assert got is not None and got.instance_id != "m-0", "the slow instance holds the prefix but is over its share"
    assert "1 over the bound" in got.why
    # Nothing held: Envoy's weighted least request, (in flight + 1) / weight, not the raw count.
    fresh = choose([slow, B, C], [9], index, {"m-0": 0, "m-1": 2, "m-2": 3}, balance=1.5)
    assert fresh is not None and fresh.instance_id == "m-1"


def test_no_candidate_no_pick_and_the_index_is_bounded_and_forgets():
    index = PrefixIndex(capacity_blocks=3)
    assert choose([], [1], index, {}, 1.5) is None
    index.record("m-0", [1, 2, 3, 4, 5])
    assert index.held("m-0", [1]) == 0 and index.held("m-0", [3, 4, 5]) == 3, "least recently used go first"
    index.forget({"m-1"})
    assert index.size("m-0") == 0


def attributes(cluster: str) -> dict[str, struct_pb2.Struct]:
    s = struct_pb2.Struct()
    s.fields[protocol.CLUSTER_ATTRIBUTE].string_value = cluster
    return {protocol.FILTER: s}


async def exchange(picker: Picker, cluster: str, raw: bytes, served: str | None) -> list[ep.ProcessingResponse]:
    """One request through the picker as Envoy drives it: headers, the body, then the answer's headers."""
    messages = [
        ep.ProcessingRequest(request_headers=ep.HttpHeaders(), attributes=attributes(cluster)),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=True), attributes=attributes(cluster)),
    ]
    if served is not None:
        headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="x-sie-instance", raw_value=served.encode())])
        messages.append(ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=headers)))

    async def stream():
        for m in messages:
            yield m

    return [r async for r in picker.Process(stream(), None)]


def picked(responses: list[ep.ProcessingResponse]) -> str | None:
    mutation = responses[1].request_body.response.header_mutation
    values = [h.header.raw_value.decode() for h in mutation.set_headers if h.header.key == protocol.HEADER]
    return values[0] if values else None


async def test_the_exchange_picks_by_prefix_and_counts_in_flight_until_the_answer():
    fleet = Fleet()
    fleet.update({"clusters": {"model.m": {"balance_factor": 1.5, "endpoints": [a.__dict__ for a in (A, B, C)]}}})
    picker = Picker(PickerSettings(), fleet)
    system = "z" * 1000
    first = await exchange(picker, "model.m", body(system, "one"), served=None)
    home = picked(first)
    assert home in {A.address, B.address, C.address}
    assert sum(fleet.prefilling.values()) + sum(fleet.decoding.values()) == 0, "a stream Envoy closed is done"
    again = await exchange(picker, "model.m", body(system, "two"), served="m-x")
    assert picked(again) == home, "the same system prompt goes where it went"
    assert picker.index.held("m-x", prompt_blocks(body(system, "two"))) > 0, "where Envoy really sent it, it is held"
    # A cluster the control plane offers nothing for (another model, a direct response): no pick.
    assert picked(await exchange(picker, "model.other", body(system), served=None)) is None
    assert picked(await exchange(picker, "", body(system), served=None)) is None and fleet.misses == 2


async def test_a_request_weighs_in_full_until_its_first_byte_then_as_decoding_until_its_end():
    import asyncio

    fleet = Fleet()
    fleet.update({"clusters": {"model.m": {"endpoints": [A.__dict__]}}})
    picker = Picker(PickerSettings(), fleet)
    inbox: asyncio.Queue = asyncio.Queue()

    async def stream():
        while (message := await inbox.get()) is not None:
            yield message

    answers = picker.Process(stream(), None)
    await inbox.put(ep.ProcessingRequest(request_headers=ep.HttpHeaders(), attributes=attributes("model.m")))
    await anext(answers)
    await inbox.put(ep.ProcessingRequest(request_body=ep.HttpBody(body=body("q")), attributes=attributes("model.m")))
    await anext(answers)
    assert fleet.prefilling == {"m-0": 1} and not fleet.decoding
    await inbox.put(ep.ProcessingRequest(response_headers=ep.HttpHeaders()))
    await anext(answers)
    assert fleet.prefilling == {"m-0": 0} and fleet.decoding == {"m-0": 1}
    await inbox.put(None)  # Envoy closes the stream: the request ended
    assert [r async for r in answers] == []
    assert fleet.decoding == {"m-0": 0}


async def test_the_poll_outlives_a_bad_token_file_and_an_unreachable_control_plane(tmp_path, caplog):
    import asyncio

    import aiohttp

    from xds_server.picker.server import poll

    settings = PickerSettings(
        control_url="http://127.0.0.1:9", token_file=tmp_path / "missing.token", poll_interval_s=0.01
    )
    fleet = Fleet()
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(poll(settings, fleet, Picker(settings, fleet), session))
        await asyncio.sleep(0.1)
        (tmp_path / "missing.token").write_text("tok")  # there now, but readable by others: refused too
        await asyncio.sleep(0.1)
        assert not task.done(), "the picker keeps trying; Envoy balances by load meanwhile"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert fleet.clusters == {} and "keeping the last view" in caplog.text


async def test_the_grpc_server_refuses_a_message_or_a_stream_past_its_bounds():
    """Past max_message_bytes or max_streams a stream fails at once (Envoy then balances the request by
    least request) and the picker goes on answering the others."""
    import asyncio

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    from xds_server.picker.server import grpc_server

    settings = PickerSettings(listen="127.0.0.1:0", max_message_bytes=64 * 1024, max_streams=2)
    fleet = Fleet()
    fleet.update({"clusters": {"model.m": {"endpoints": [A.__dict__]}}})
    server, port = grpc_server(settings, Picker(settings, fleet))
    await server.start()
    try:
        async with asyncio.timeout(20), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)

            def body_message(raw: bytes) -> ep.ProcessingRequest:
                return ep.ProcessingRequest(request_body=ep.HttpBody(body=raw), attributes=attributes("model.m"))

            too_big = stub.Process()
            await too_big.write(body_message(b"x" * (65 * 1024)))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await too_big.read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

            held = [stub.Process() for _ in range(2)]  # two requests in flight: the bound
            for call in held:
                await call.write(body_message(body("q")))
                assert (await call.read()).HasField("request_body")
            third = stub.Process()
            await third.write(body_message(body("q")))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await third.read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for call in held:  # their requests end; a new one is answered again
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF
            again = stub.Process()
            await again.write(body_message(body("q")))
            assert picked([ep.ProcessingResponse(), await again.read()]) == A.address
            await again.done_writing()
    finally:
        await server.stop(None)
