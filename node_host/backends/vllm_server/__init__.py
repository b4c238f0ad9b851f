"""The `vllm` backend: real vLLM OpenAI servers, launched by node_host; nothing here imports vLLM.

Named `vllm_server`, not `vllm`, so it can never shadow the vllm library.

- `launch`: the pure parts: the `python -m vllm.entrypoints.openai.api_server` command line
  (`launch_command`), the KV cache it is given (`kv_cache_bytes_for`, `gpu_memory_utilization_for`) and
  its environment (`launch_env`, `server_env`).
  The I/O is node_host's worker supervisor; which arguments a spec may pass is sie.engine_settings.vllm_args.
"""
