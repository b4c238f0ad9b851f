"""Kafka in a whole `sie up` stack (issue 6), from examples/kafka.yaml: the scorer's ModelService has a
`kafka_input` block, so every sidecar the node host starts for it joins the model's consumer group on a
real Kafka-protocol broker (Tansu, started here), scores each request on its own worker and writes the
result to the output topic.

Two instances share the topic's four partitions. Of 200 requests, 20 are invalid (not JSON, or breaking
the input_schema): each of the 180 valid ones gets exactly one result (told apart by its source offset
header) and each invalid one exactly one dead-letter record; the sidecars count them in their metrics,
invalid ones also in the unified `inference_invalid_schema_total`. Stopping the stack drains the
connectors (the sidecar's before_drain hook) and leaves every offset committed.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter

import pytest
import yaml

from sidecar.kafka.records import HEADER_ERROR, HEADER_INSTANCE, header, source_of
from sie_testing.tansu import TansuBroker, produce, read_topic
from tests.integration.standalone_helpers import REPO, request, start_stack, stop_stack, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(360)]

PARTITIONS = 4
N = 200
INSTANCES = 2  # examples/kafka.yaml's min_replicas
REQUESTS, RESULTS, DEAD = "risk-requests", "risk-scores", "risk-requests-dead"  # its topics


def cluster_yaml(bootstrap: str, group: str) -> str:
    """examples/kafka.yaml with this test's broker and a fresh consumer group (the ports come from start_stack)."""
    docs = list(yaml.safe_load_all((REPO / "examples" / "kafka.yaml").read_text()))
    for doc in docs:
        if doc.get("kind") == "ModelService":
            doc["spec"]["kafka_input"].update(bootstrap_servers=bootstrap, group_id=group)
    return yaml.safe_dump_all(docs)


def requests_to_send() -> tuple[list[bytes], set[int]]:
    """N values; the indexes of the invalid ones (one in ten: not JSON, a number for text, too long)."""
    values, invalid = [], set()
    for i in range(N):
        if i % 10 == 3:
            invalid.add(i)
            values.append(
                [b"not json {", json.dumps({"text": 7}).encode(), json.dumps({"text": "y" * 4097}).encode()][i % 3]
            )
        else:
            values.append(json.dumps({"text": f"wire transfer number {i} to a new account"}).encode())
    return values, invalid


def sidecar_metric(stack, address: str, name: str) -> float:
    code, _, text = request("GET", f"http://{address}/-/metrics", timeout=5, headers=stack.headers)
    assert code == 200, text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


async def test_sidecars_of_a_sie_up_stack_consume_the_models_topic(tmp_path):
    group = f"risk-{uuid.uuid4().hex[:8]}"
    async with TansuBroker.started(tmp_path) as broker:
        for topic, partitions in ((REQUESTS, PARTITIONS), (RESULTS, PARTITIONS), (DEAD, 1)):
            await broker.create_topic(topic, partitions)
        cluster_file = tmp_path / "cluster.yaml"
        cluster_file.write_text(cluster_yaml(broker.bootstrap, group))
        stack = await asyncio.to_thread(start_stack, tmp_path, cluster_file, 200)
        try:
            _, _, targets = stack.request("GET", stack.admin + "/v1/prometheus/targets")
            sidecars = [g["targets"][0] for g in targets]
            assert len(sidecars) == INSTANCES, targets

            values, invalid = requests_to_send()
            sent = await produce(broker.bootstrap, values, topic=REQUESTS)
            index_of = {place: i for i, place in enumerate(sent)}  # (partition, offset) -> index, in send order
            results = await read_topic(broker.bootstrap, RESULTS, N - len(invalid), timeout_s=120)
            dead = await read_topic(broker.bootstrap, DEAD, len(invalid), timeout_s=30)

            def counted(name: str) -> float:
                return sum(sidecar_metric(stack, a, name) for a in sidecars)

            await asyncio.to_thread(
                wait_until,
                lambda: counted("inference_kafka_produced_total") >= N - len(invalid),
                30,
                "the sidecars count every result",
            )
            assert counted("inference_kafka_consumed_total") >= N
            assert counted("inference_kafka_invalid_total") == len(invalid)
            assert counted("inference_invalid_schema_total") == len(invalid)
            assert counted("inference_kafka_dead_lettered_total") == len(invalid)
        finally:
            await asyncio.to_thread(stop_stack, stack)
        committed = await broker.committed(group, REQUESTS, PARTITIONS)

    result_sources = Counter((s.partition, s.offset) for s in (source_of(r.headers) for r in results))
    assert max(result_sources.values()) == 1, "a request got more than one result"
    assert {index_of[p] for p in result_sources} == set(range(N)) - invalid
    for record in results:
        assert 0.0 <= json.loads(record.value)["score"] <= 1.0
    dead_sources = Counter((s.partition, s.offset) for s in (source_of(r.headers) for r in dead))
    assert max(dead_sources.values()) == 1 and {index_of[p] for p in dead_sources} == invalid
    for record in dead:
        assert record.value == sent[(source_of(record.headers).partition, source_of(record.headers).offset)]
        assert header(record.headers, HEADER_ERROR)
    answered_by = Counter(header(r.headers, HEADER_INSTANCE) for r in results)
    print("results by instance:", dict(answered_by))
    assert set(answered_by) <= {f"risk-scorer-{i}" for i in range(INSTANCES)}, answered_by
    # `sie down` drained the connectors: every request's offset is committed, so nothing is read twice.
    ends: dict[int, int] = {}
    for partition, offset in sent:
        ends[partition] = max(ends.get(partition, 0), offset + 1)
    assert committed == {p: ends.get(p, -1) for p in range(PARTITIONS)}
