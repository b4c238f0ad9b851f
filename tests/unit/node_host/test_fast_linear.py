"""The numpy form of a binary logistic regression gives sklearn's probabilities and labels, covers only
that shape, and leaves non-finite input to sklearn; the sklearn engine uses it."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import skops.io as sio
from sklearn.feature_extraction.text import HashingVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import MinMaxScaler, StandardScaler

from node_host.backends.sklearn_engine.fast_linear import BinaryLinear, compile_binary_linear
from node_host.backends.sklearn_engine.worker import SklearnEngine
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService


def data(seed: int, n: int = 400, features: int = 5, classes: int = 2):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)) * rng.uniform(0.1, 1000, size=features) + rng.normal(size=features) * 50
    y = (x @ rng.normal(size=features) > 0).astype(int) if classes == 2 else rng.integers(0, classes, size=n)
    return x, y


MODELS = {
    "scaler+lr": lambda: make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)),
    "lr alone": lambda: LogisticRegression(max_iter=2000),
    "scaler without mean": lambda: make_pipeline(StandardScaler(with_mean=False), LogisticRegression(max_iter=2000)),
    "scaler without std": lambda: make_pipeline(StandardScaler(with_std=False), LogisticRegression(max_iter=2000)),
    "lr in a one-step pipeline": lambda: Pipeline([("lr", LogisticRegression(max_iter=2000))]),
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_probabilities_and_labels_are_sklearns(name, seed):
    x, y = data(seed)
    model = MODELS[name]().fit(x, y)
    fast = compile_binary_linear(model)
    assert fast is not None
    test = data(seed + 100, n=97)[0]
    positive = fast.positive_proba(test.tolist())
    assert positive is not None
    np.testing.assert_array_equal(positive, model.predict_proba(test)[:, 1])
    assert fast.labels(positive) == list(model.predict(test))


def test_string_classes_keep_their_labels():
    x, y = data(3)
    labels = np.where(y == 1, "fraud", "ok")
    model = make_pipeline(StandardScaler(), LogisticRegression()).fit(x, labels)
    fast = compile_binary_linear(model)
    assert fast is not None
    positive = fast.positive_proba(x[:50])
    assert fast.labels(positive) == list(model.predict(x[:50]))


@pytest.mark.parametrize(
    "make",
    [
        lambda: LogisticRegression().fit(*data(0, classes=3)),  # multiclass
        lambda: make_pipeline(MinMaxScaler(), LogisticRegression()).fit(*data(0)),  # another step
        lambda: make_pipeline(StandardScaler(), StandardScaler(), LogisticRegression()).fit(*data(0)),
        lambda: type("MyLR", (LogisticRegression,), {})().fit(*data(0)),  # a subclass may compute otherwise
        lambda: make_pipeline(HashingVectorizer(n_features=64), LogisticRegression()).fit(
            ["a b", "c d"] * 5, [0, 1] * 5
        ),
        lambda: LogisticRegression(),  # not fitted
    ],
)
def test_anything_else_is_left_to_sklearn(make):
    assert compile_binary_linear(make()) is None


def test_a_model_whose_probabilities_differ_is_refused_at_compile_time():
    model = make_pipeline(StandardScaler(), LogisticRegression()).fit(*data(0))
    real = model.predict_proba
    model.predict_proba = lambda x: (lambda p: np.stack([1 - p, p], axis=1))(real(x)[:, 1] ** 2)  # another formula
    assert compile_binary_linear(model) is None
    lr = LogisticRegression().fit(*data(0))
    lr.multi_class = "multinomial"  # scikit-learn < 1.8: a softmax over [-d, d]
    assert compile_binary_linear(lr) is None


def test_input_that_overflows_once_scaled_is_left_to_sklearn():
    tiny = BinaryLinear(
        mean=None, scale=np.full(2, 1e-300), coef=np.array([[1.0, -1.0]]), intercept=np.zeros(1), classes=(0, 1)
    )
    assert tiny.positive_proba([[1e-10, 0.0]]) is not None
    assert tiny.positive_proba([[1e10, 0.0]]) is None, "1e10 / 1e-300 is inf: sklearn refuses it"


def test_non_finite_or_misshapen_input_is_left_to_sklearn():
    fast = compile_binary_linear(make_pipeline(StandardScaler(), LogisticRegression()).fit(*data(0)))
    assert fast is not None
    row = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert fast.positive_proba([row]) is not None
    assert fast.positive_proba([row[:4]]) is None
    for bad in (math.nan, math.inf, -math.inf):
        assert fast.positive_proba([row, [bad, *row[1:]]]) is None


def test_the_engine_scores_a_linear_model_with_it_and_answers_as_sklearn(tmp_path):
    x, y = data(7, features=3)
    model = make_pipeline(StandardScaler(), LogisticRegression()).fit(x, np.where(y == 1, "fraud", "ok"))
    path = tmp_path / "lr.skops"
    sio.dump(model, path)
    service = ModelService.model_validate(
        {
            "metadata": {"name": "lr"},
            "spec": {
                "model": {"name": "lr", "service_type": "scoring", "path": str(path)},
                "backend": {"type": "sklearn"},
                "input_schema": {"fields": [{"name": n, "type": "float64"} for n in ("a", "b", "c")]},
                "output_schema": {
                    "fields": [
                        {"name": "score", "type": "float64", "range": [0.0, 1.0]},
                        {"name": "label", "type": "string"},
                    ]
                },
            },
        }
    )

    async def go():
        engine = SklearnEngine(service, ModelFilePolicy(roots=(tmp_path,)))
        await engine.start()
        try:
            assert engine._fast is not None, "a StandardScaler + LogisticRegression gets the numpy form"
            rows = [{"a": float(r[0]), "b": float(r[1]), "c": float(r[2])} for r in x[:20]]
            return await engine.infer(rows)
        finally:
            await engine.close()

    out = asyncio.run(go())
    expected = model.predict_proba(x[:20])[:, 1]
    assert [row["score"] for row in out] == expected.tolist()
    assert [row["label"] for row in out] == list(model.predict(x[:20]))
