"""The demo text scorer, made on the spot, so a fresh machine runs the demo and the tests with no download.

`ensure_demo_scorer(path)`: a scikit-learn Pipeline (HashingVectorizer + LogisticRegression) trained
on synthetic labelled text (positive vs negative reviews), saved in the safe skops format (no pickle:
loading it runs no code, see worker.py in this package).

It is idempotent (an existing file is left alone) and atomic (written to a temporary sibling, then
renamed into place), so two workers of one model starting together cannot see a half-written file.
A spec opts in with `backend.config.demo: true`; the worker creates the scorer at `model.path` if
nothing is there. Same seed, same model.

    python -m node_host.backends.sklearn_engine.demo_scorer PATH
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

_POSITIVE = "great excellent good love wonderful fast helpful friendly perfect happy recommend superb".split()
_NEGATIVE = "bad terrible awful hate slow broken rude useless poor angry refund worst".split()
_NEUTRAL = "the a product service order delivery it was and very item support staff price quality this".split()


def demo_scorer_corpus(seed: int = 0, n: int = 600) -> tuple[list[str], list[int]]:
    """Synthetic reviews: label 1 when built from positive words, 0 from negative ones."""
    import numpy as np

    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for i in range(n):
        label = i % 2
        vocab = _POSITIVE if label else _NEGATIVE
        words = list(rng.choice(_NEUTRAL, size=int(rng.integers(3, 8)))) + list(
            rng.choice(vocab, size=int(rng.integers(1, 3)))
        )
        rng.shuffle(words)
        texts.append(" ".join(words))
        labels.append(label)
    return texts, labels


def ensure_demo_scorer(path: str | Path, seed: int = 0) -> Path:
    """Train the demo text scorer and save it at `path` (a skops file) unless one is there."""
    path = Path(path)
    if path.is_file():
        return path
    from sklearn.feature_extraction.text import HashingVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline

    texts, labels = demo_scorer_corpus(seed)
    pipeline = Pipeline(
        [
            ("features", HashingVectorizer(n_features=2**12, alternate_sign=False)),
            ("classifier", LogisticRegression(random_state=seed, max_iter=200)),
        ]
    ).fit(texts, labels)
    return save_skops(pipeline, path)


def save_skops(estimator: Any, path: Path) -> Path:
    """Write `estimator` to `path` in the skops format atomically: to a temporary sibling, then renamed
    into place, so a reader never sees a half-written file."""
    import skops.io as sio

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        sio.dump(estimator, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m node_host.backends.sklearn_engine.demo_scorer PATH", file=sys.stderr)
        return 2
    print(ensure_demo_scorer(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
