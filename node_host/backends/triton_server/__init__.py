"""The `triton` backend: a real Triton Inference Server (PyPI nvidia-pytriton's `tritonserver`) per model
instance, launched by node_host; nothing here imports Triton.

Named `triton_server`, not `triton`, so it can never shadow the triton library.

- `repository`: the model repository SIE writes from the spec (config.pbtxt, and SIE's model checked as
  the sklearn engine checks one), or an operator's own Triton model with remote code allowed.
- `launch`: the pure parts: the `tritonserver` command line with the worker key (`launch_command`), its
  environment (`launch_env`), finding the binary in its venv (`find_tritonserver`).
- `model`: SIE's Python-backend model, run by Triton's stub with the Triton venv's packages (no SIE import).

How SIE talks to it (readiness, metrics, /infer as KServe v2, sleep by unload) is `sie.engines.triton`.
"""
