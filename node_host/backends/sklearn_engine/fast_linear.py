"""A binary logistic regression, optionally behind a StandardScaler, scored with numpy alone (pure).

scikit-learn checks its input on every call (check_array, dataframe detection, tags, output wrapping):
for a Pipeline(StandardScaler, LogisticRegression) that is about 0.35 ms per predict_proba on this
machine whatever the batch size, 17 us per row for the 24-row batches a Kafka connector sends, while
the arithmetic takes a few microseconds. The worker has already checked and converted the rows
(scorer_io.features), so for this common scorer it can do the arithmetic itself:

    compile_binary_linear(estimator) -> BinaryLinear | None     (None: not this shape; use sklearn)
    BinaryLinear.positive_proba(x) -> P(classes_[1]) per row, or None when x is not all finite

The operations are sklearn's own, in its order: x - mean_, / scale_, @ coef_.T + intercept_, expit.
So the probabilities are the ones predict_proba returns (tests/unit/node_host/test_fast_linear.py
compares them on random data), and `compile_binary_linear` checks that on probe rows before it hands
out the fast form. Non-finite input, or input that overflows once scaled, is left to sklearn, which
refuses it with its message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import expit


@dataclass(frozen=True)
class BinaryLinear:
    mean: np.ndarray | None  # StandardScaler.mean_, or None (no scaler, or with_mean=False)
    scale: np.ndarray | None  # StandardScaler.scale_, or None
    coef: np.ndarray  # coef_, shape (1, n_features)
    intercept: np.ndarray  # shape (1,)
    classes: tuple[Any, Any]

    def positive_proba(self, rows: Any) -> np.ndarray | None:
        x = np.array(rows, dtype=np.float64)  # a copy: the steps below work in place
        if x.ndim != 2 or x.shape[1] != self.coef.shape[1] or not np.isfinite(x).all():
            return None
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is checked just below
            if self.mean is not None:
                x -= self.mean
            if self.scale is not None:
                x /= self.scale
            decision = (x @ self.coef.T + self.intercept).ravel()
        if not np.isfinite(decision).all():
            return None  # finite input that overflowed once scaled: sklearn refuses it, so let it
        return expit(decision)

    def labels(self, positive: np.ndarray) -> list[Any]:
        """predict_proba's argmax labels: the second class where p > 1 - p; a tie is the first class."""
        first, second = self.classes
        return [second if p > 1 - p else first for p in positive.tolist()]


def compile_binary_linear(estimator: Any) -> BinaryLinear | None:
    """The fast form of `estimator` when it is exactly a fitted binary LogisticRegression, or a Pipeline
    of a StandardScaler then one; None for anything else (other steps, multiclass, sparse coefficients,
    a subclass that might override what it computes)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    scaler = None
    model = estimator
    if type(estimator) is Pipeline:
        steps = [step for _name, step in estimator.steps if step not in (None, "passthrough")]
        if len(steps) == 2 and type(steps[0]) is StandardScaler:
            scaler, model = steps
        elif len(steps) == 1:
            model = steps[0]
        else:
            return None
    if type(model) is not LogisticRegression:
        return None
    coef = getattr(model, "coef_", None)
    classes = getattr(model, "classes_", None)
    if not isinstance(coef, np.ndarray) or coef.ndim != 2 or coef.shape[0] != 1 or classes is None:
        return None
    if len(classes) != 2:
        return None
    # scikit-learn before 1.8 had multi_class="multinomial", whose binary predict_proba is a softmax
    # over [-d, d] (expit(2d)), not expit(d).
    if getattr(model, "multi_class", None) == "multinomial":
        return None
    mean = scale = None
    if scaler is not None:
        mean = getattr(scaler, "mean_", None) if scaler.with_mean else None
        scale = getattr(scaler, "scale_", None) if scaler.with_std else None
        for value in (mean, scale):
            if value is not None and (not isinstance(value, np.ndarray) or value.shape != (coef.shape[1],)):
                return None
    fast = BinaryLinear(
        mean=mean,
        scale=scale,
        coef=coef,
        intercept=np.asarray(model.intercept_, dtype=np.float64),
        classes=(classes[0], classes[1]),
    )
    return fast if _agrees(fast, estimator, coef.shape[1]) else None


def _agrees(fast: BinaryLinear, estimator: Any, features: int) -> bool:
    """Whether the numpy form gives this estimator's own probabilities on a few probe rows: a guard
    against a scikit-learn version that computes them otherwise."""
    rng = np.random.default_rng(0)
    center = fast.mean if fast.mean is not None else np.zeros(features)
    spread = fast.scale if fast.scale is not None else np.ones(features)
    probe = center + rng.normal(size=(8, features)) * spread
    mine = fast.positive_proba(probe)
    try:
        theirs = estimator.predict_proba(probe)[:, 1]
    except Exception:  # noqa: BLE001 - whatever sklearn refuses, the fast form must not take over
        return False
    return mine is not None and bool(np.allclose(mine, theirs, rtol=1e-9, atol=1e-12))
