"""The `torch` backend: a Hugging Face causal LM served with continuous batching (torch, transformers).

Named `torch_engine`, not `torch`, so it can never shadow the torch library. Importing the package
imports nothing heavy; torch and transformers load only in the modules that need them.

- `worker`: the worker process's engine factory (`build_engine`, `main`).
- `engine`: `TorchEngine`, the scheduler, its lanes, and what one request can and cannot break.
- `step`: one iteration on the engine lane, each request's failure kept to itself (torch).
- `batch`: prefill, the decode batch and sampling, row by row (torch).
- `prompts`: chat template and tokenization, and the bounds a prompt is held to (no torch).
- `lanes`: a daemon thread that runs jobs in order and can stop one.
- its settings, `TorchSettings`, are part of the spec contract: `sie.engine_settings`.
- `kv_budget`: admission under a KV-token budget (pure).
- `detokenize`: incremental detokenization with stop strings (pure).
- `demo_model`: the tiny random-weight Qwen2 made for the demo and the tests.

    python -m node_host.backends.torch_engine --spec-file SPEC.json --host 127.0.0.1 --port PORT ...
"""
