"""The `sglang` backend: real SGLang servers, launched by node_host; nothing here imports SGLang.

Named `sglang_server`, not `sglang`, so it can never shadow the sglang library.

- `launch`: the pure parts: the `python -m sglang.launch_server` command line with its memory budget
  (`launch_command`, `mem_fraction_for`), the start order on one GPU (`SequentialStarter`) and the
  sleep/wake calls (`memory_call`). The I/O is node_host's worker supervisor.
"""
