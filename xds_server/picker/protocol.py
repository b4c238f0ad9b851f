"""What Envoy and the picker agree on (used by xds_server's resource builders and by the picker)."""

from __future__ import annotations

FILTER = "envoy.filters.http.ext_proc"
CLUSTER = "sie_picker"  # Envoy's cluster of the picker (xds_server.resources builds it)
HEADER = "x-sie-endpoint"  # the picker's answer, "ip:port" of the instance; removed from every client request
CLUSTER_ATTRIBUTE = "xds.cluster_name"  # the request attribute that names the model's cluster
MESSAGE_TIMEOUT_S = 0.25  # past this Envoy goes on without a pick (least request)
