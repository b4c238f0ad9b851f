"""Worker backends. Every backend speaks the worker protocol (DESIGN.md section 3).

- `protocol`: the contract an engine implements (Engine protocols, EngineState, request and response
  values, WorkerError and its subclasses); it imports nothing else from node_host.
- `registry`: the one place that maps a backend type to its worker command and environment.
- `runtime/`: the worker process every embedded engine shares (command line, HTTP app, bodies, metrics).
- one package per engine, each run as `python -m node_host.backends.<package>`:
  `sim/` (the SGLang timing simulator), `torch_engine/` (Hugging Face causal LMs), `sklearn_engine/`
  (scikit-learn scorers); and `sglang_server/`, which only builds SGLang's own launch command and its
  sleep/wake calls (SGLang runs as `python -m sglang.launch_server`).

Package names never shadow the third-party libraries they wrap (`torch`, `sklearn`, `sglang`).
"""
