"""`python -m node_host.backends.torch_engine`: the torch worker process (worker.py)."""

from node_host.backends.torch_engine.worker import main

if __name__ == "__main__":
    raise SystemExit(main())
