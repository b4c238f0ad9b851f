"""SIE: shared contracts (spec, telemetry, metric names) and the `sie` command."""

__version__ = "0.1.0"
