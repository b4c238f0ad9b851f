"""How the weight policy's outputs reach Envoy: the balancer the weights combine with (--lb-policy), and
the local reply that turns a request shed by drop_overloads into SIE's JSON 503 with Retry-After."""

from __future__ import annotations

import json

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm
from google.protobuf import json_format

from sie.spec_loader import parse_model_service
from xds_server.ingress import IngressConfig, build_listener, local_replies
from xds_server.picker.protocol import MAX_STREAMS
from xds_server.picker.server import PickerSettings
from xds_server.policy.decisions import ModelDecision
from xds_server.resources import CLUSTER, ModelInputs, ResourceCache, build_cluster
from xds_server.settings import parse_args

SVC = parse_model_service({"spec": {"model": {"name": "chat"}, "backend": {"type": "sim"}}})


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], "least_request"),
        (["--lb-policy", "round_robin"], "round_robin"),
        (["--lb-policy", "least_request", "--policy", "equal"], "least_request"),
    ],
)
def test_lb_policy_flag(argv, expected):
    assert parse_args(argv).loop.lb_policy == expected


def test_an_unknown_lb_policy_is_refused():
    with pytest.raises(SystemExit):
        parse_args(["--lb-policy", "maglev"])
    with pytest.raises(ValueError, match="lb_policy 'maglev' is not one of"):
        build_cluster(SVC, 1, "maglev")


@pytest.mark.parametrize(
    "name, affinity, picker, enum, picked",
    [
        # an LLM gets prefix affinity by default when a picker runs: its choice, least request as fallback
        ("least_request", True, "127.0.0.1:18001", None, True),
        ("least_request", True, None, cluster_pb2.Cluster.LEAST_REQUEST, False),  # no picker: load alone
        ("least_request", False, "127.0.0.1:18001", cluster_pb2.Cluster.LEAST_REQUEST, False),  # a baseline
        ("round_robin", True, "127.0.0.1:18001", cluster_pb2.Cluster.ROUND_ROBIN, False),
    ],
)
def test_the_resource_cache_builds_every_cluster_with_its_lb_policy(name, affinity, picker, enum, picked):
    cache = ResourceCache(lb_policy=name, prefix_affinity=affinity, picker=picker)
    resources = cache.build({"chat": ModelInputs(SVC, ModelDecision("chat"))}, IngressConfig(picker=picker))
    cluster = cluster_pb2.Cluster()
    resources[CLUSTER]["model.chat"].packed.Unpack(cluster)
    assert cluster.HasField("load_balancing_policy") == picked
    if picked:
        (policy,) = cluster.load_balancing_policy.policies
        assert policy.typed_extension_config.name == "envoy.load_balancing_policies.override_host"
    else:
        assert cluster.lb_policy == enum
    assert ("sie_picker" in resources[CLUSTER]) == (picker is not None)
    if picker is not None:  # Envoy opens no more streams to the picker than it serves (it refuses the rest)
        picker_cluster = cluster_pb2.Cluster()
        resources[CLUSTER]["sie_picker"].packed.Unpack(picker_cluster)
        (limits,) = picker_cluster.circuit_breakers.thresholds
        assert limits.max_requests.value == PickerSettings().max_streams == MAX_STREAMS
    # the model id travels with the cluster, for Envoy's own answers about it (the shed reply)
    assert cluster.metadata.filter_metadata["sie"]["model"] == "chat"


def test_the_shed_reply_maps_both_drop_flags_to_a_json_503_with_retry_after():
    mapper = local_replies().mappers[0]  # first: a shed request is never mistaken for another failure
    assert sorted(mapper.filter.response_flag_filter.flags) == ["DO", "UDO"]
    assert mapper.status_code.value == 503
    headers = {h.header.key: h.header.value for h in mapper.headers_to_add}
    assert headers == {"retry-after": "1"}
    body = json_format.MessageToDict(mapper.body_format_override.json_format)
    assert body["error"]["type"] == "overloaded"
    assert body["error"]["model"] == "%CLUSTER_METADATA(sie:model)%"
    assert "retry later" in body["error"]["message"] and "drop overload" in body["error"]["message"]


def test_the_listener_carries_the_shed_reply():
    listener = build_listener(IngressConfig())
    manager = hcm.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    assert manager.local_reply_config == local_replies()
    json.dumps(json_format.MessageToDict(manager))  # serialisable as Envoy reads it
