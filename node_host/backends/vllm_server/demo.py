"""`backend.config.demo: true` for vLLM: make the tiny demo model, then become the vLLM server.

    python -m node_host.backends.vllm_server.demo MODEL_DIR -- VLLM_ARGV...

Run with SIE's own interpreter (which has torch and transformers: the README's demo install), it writes
node_host.backends.torch_engine.demo_model's tiny Qwen2 at MODEL_DIR, 256 wide so that its head size is 64
(vLLM's CPU attention refuses the default model's 16), when nothing is there, and then execs VLLM_ARGV,
vLLM's own command line, in the same process: the node host supervises one process, as for any worker,
and vLLM's environment (its key, its cores) is the one this process was given. Idempotent and atomic
(demo_model.ensure_tiny_qwen2), so two instances starting together agree.
"""

from __future__ import annotations

import os
import sys

DEMO_HIDDEN_SIZE = 256


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m node_host.backends.vllm_server.demo MODEL_DIR -- VLLM_ARGV...", file=sys.stderr)
        return 2
    path, command = args[0], args[2:]
    from node_host.backends.torch_engine.demo_model import ensure_tiny_qwen2

    ensure_tiny_qwen2(path, hidden_size=DEMO_HIDDEN_SIZE)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)  # never returns: this process becomes the vLLM server


if __name__ == "__main__":
    raise SystemExit(main())
