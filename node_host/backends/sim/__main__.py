"""`python -m node_host.backends.sim`: the sim worker process (worker.py)."""

from node_host.backends.sim.worker import main

if __name__ == "__main__":
    raise SystemExit(main())
