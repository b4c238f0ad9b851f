"""The worker process runtime that every embedded engine shares, whatever the engine.

- `main`: `run_worker(build_engine, argv, ...)`, the composition root of a worker process (flags, spec,
  worker key, signals, logging) and `serve`, the server loop (also for tests and embedding).
- `app`: `WorkerApp`, the aiohttp side of the worker protocol over any `protocol.Engine`.
- `bodies`: parsing SGLang and OpenAI request bodies and building their answers (pure).
- `metrics`: the worker's /metrics under SGLang's metric names.

It depends on `node_host.backends.protocol` and `sie` only, never on an engine package.
"""
