"""A card-fraud scorer for the Kafka benchmark: logistic regression over six numeric features of a
payment, the kind of real-time scorer a data pipeline feeds from Kafka (the source article's scenario
4.2; its scenario 4.1 names a logistic-regression scorer too).

Trained on the spot on synthetic payments and saved in the safe skops format, so a fresh machine needs
no download. Same seed, same model; an existing file is left alone.

    FIELDS            the input schema's fields (name, type, range), in the estimator's feature order
    payments(n, seed) request bodies: what an upstream pipeline would put on the topic
    ensure_fraud_scorer(path, seed)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from node_host.backends.sklearn_engine.demo_scorer import save_skops

# name, type, range: the sidecar validates each message against these before the worker sees it.
FIELDS: list[dict[str, Any]] = [
    {"name": "amount", "type": "float64", "range": [0.0, 1_000_000.0]},
    {"name": "merchant_risk", "type": "float64", "range": [0.0, 1.0]},
    {"name": "card_age_days", "type": "int64", "range": [0, 36_500]},
    {"name": "payments_last_hour", "type": "int64", "range": [0, 10_000]},
    {"name": "distance_km", "type": "float64", "range": [0.0, 40_000.0]},
    {"name": "card_present", "type": "bool"},
]


def _payment(rng: Any) -> dict[str, Any]:
    return {
        "amount": round(float(rng.lognormal(3.5, 1.2)), 2),
        "merchant_risk": round(float(rng.beta(1.5, 8.0)), 4),
        "card_age_days": int(rng.integers(0, 3_650)),
        "payments_last_hour": int(rng.poisson(1.5)),
        "distance_km": round(float(rng.exponential(25.0)), 1),
        "card_present": bool(rng.random() < 0.6),
    }


def payments(n: int, seed: int = 1) -> list[dict[str, Any]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [_payment(rng) for _ in range(n)]


def _fraud_probability(p: dict[str, Any]) -> float:
    import math

    z = (
        -4.0
        + 0.6 * math.log1p(p["amount"]) / 3.0
        + 4.0 * p["merchant_risk"]
        - 0.0008 * p["card_age_days"]
        + 0.35 * p["payments_last_hour"]
        + 0.01 * p["distance_km"]
        - 1.2 * p["card_present"]
    )
    return 1.0 / (1.0 + math.exp(-z))


def ensure_fraud_scorer(path: str | Path, seed: int = 0) -> Path:
    """Train the scorer (StandardScaler + LogisticRegression) and save it at `path` unless one is there."""
    path = Path(path)
    if path.is_file():
        return path
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(seed)
    rows = [_payment(rng) for _ in range(4_000)]
    x = np.array([[float(row[f["name"]]) for f in FIELDS] for row in rows])
    y = np.array([int(rng.random() < _fraud_probability(row)) for row in rows])
    model = Pipeline([("scale", StandardScaler()), ("classifier", LogisticRegression(max_iter=500))]).fit(x, y)
    return save_skops(model, path)
