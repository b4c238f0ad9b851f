"""Worker backends. Every backend speaks the worker protocol (DESIGN.md section 3).

- `protocol`: the contract an engine implements (Engine protocols, EngineState, request and response
  values, WorkerError and its subclasses); it imports nothing else from node_host.
- `registry`: the one place that maps a backend type to its worker command and environment.
- `runtime/`: the worker process every embedded engine shares (command line, HTTP app, bodies, metrics).
- one package per engine, each run as `python -m node_host.backends.<package>`:
  `sim/` (the SGLang timing simulator), `torch_engine/` (Hugging Face causal LMs), `sklearn_engine/`
  (scikit-learn scorers); and the engines run as they are, whose packages only build their launch
  (they run in their own processes and virtual environments, never imported): `sglang_server/`
  (`python -m sglang.launch_server`), `vllm_server/` (vLLM's OpenAI server, its CPU build included) and
  `triton_server/` (tritonserver, with the model repository SIE writes for a scorer). How SIE talks to
  each engine once it runs is its dialect, sie.engines.

Package names never shadow the third-party libraries they wrap (`torch`, `sklearn`, `sglang`).
"""
