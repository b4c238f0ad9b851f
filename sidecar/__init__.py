"""The per-instance agent: admission and queueing, validation, metrics, telemetry, drain and eviction."""
