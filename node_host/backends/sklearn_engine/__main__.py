"""`python -m node_host.backends.sklearn_engine`: the sklearn scorer worker process (worker.py)."""

from node_host.backends.sklearn_engine.worker import main

if __name__ == "__main__":
    raise SystemExit(main())
