"""The `sim` backend: a simulator of an SGLang server's timing, labelled as a simulator everywhere.

- `core`: `SimCore` and `SimParams`, the pure scheduler model over an explicit `now` (also driven in
  simulated time by the closed-loop tests and bench/routing).
- `engine`: `SimEngine`, the asyncio shell that runs the core in real time.
- `worker`: `SimWorkerEngine` behind the worker protocol, plus /sim/config.

    python -m node_host.backends.sim --spec-file SPEC.json --host 127.0.0.1 --port PORT ...
"""
