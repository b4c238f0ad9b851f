"""The endpoint picker: the prompt's text from a body, its blocks, the choice (longest held prefix under a
bounded load, least in flight otherwise), and the ext_proc exchange with Envoy (fake messages)."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from xds_server.picker import protocol
from xds_server.picker.scoring import Candidate, PrefixIndex, choose, prompt_blocks, prompt_text
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
    ],
)
def test_prompt_text(raw, expected):
    assert prompt_text(raw) == expected


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
