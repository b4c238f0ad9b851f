"""`python -m bench.reaction [--quick] [--trials N] [--out bench/results/reaction.json]` (main.py)."""

from bench.reaction.main import main

if __name__ == "__main__":
    raise SystemExit(main())
