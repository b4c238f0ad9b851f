"""What Envoy and the picker agree on (used by xds_server's resource builders and by the picker)."""

from __future__ import annotations

FILTER = "envoy.filters.http.ext_proc"
CLUSTER = "sie_picker"  # Envoy's cluster of the picker (xds_server.resources builds it)
HEADER = "x-sie-endpoint"  # the picker's answer, "ip:port" of the instance; removed from every client request
CLUSTER_ATTRIBUTE = "xds.cluster_name"  # the request attribute that names the model's cluster
MESSAGE_TIMEOUT_S = 0.25  # past this Envoy goes on without a pick (least request)
# Envoy opens one ext_proc stream per request of a model with prefix affinity, held from its headers to its
# end, and at most this many at once to the picker's cluster: Envoy's default circuit breaker (max_requests),
# which that cluster does not change. Past it a request goes without a pick (least request).
MAX_STREAMS = 1024
