"""SIE's control plane: model registry, weight policy, snapshot cache, ADS server, admin API."""
