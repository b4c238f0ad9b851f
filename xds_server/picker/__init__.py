"""The endpoint picker: prefix-cache-aware routing for models with prefix affinity (sie.spec.PrefixAffinity).

A small process beside each Envoy (`python -m xds_server.picker`). Envoy's ext_proc filter sends it each
request of such a model (its buffered body and the cluster Envoy chose), and it answers with the instance
to use, as dynamic metadata that the cluster's override_host policy routes to: the one holding the
longest run of the prompt's leading blocks, under a bounded load (scoring.py). It learns the instances
the control plane lets serve, with their weights, from the admin API (`GET /v1/picker/endpoints`).

If it is down or slow, Envoy goes on without it (failure_mode_allow, a short message timeout): the
cluster's fallback is least request over SIE's weights, as for any model. Why a picker and not Envoy's
own consistent hashing: bench/prefix_designs.py measured both (ARCHITECTURE.md, "Prefix affinity").
"""
