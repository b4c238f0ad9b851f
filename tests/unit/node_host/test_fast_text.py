"""The text form of a HashingVectorizer + binary logistic regression gives the pipeline's own
probabilities and labels on any text, covers only that shape, and the sklearn engine scores the demo
scorer with it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.feature_extraction.text import HashingVectorizer, TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import MaxAbsScaler

from node_host.backends.sklearn_engine.demo_scorer import demo_scorer_corpus
from node_host.backends.sklearn_engine.fast_linear import (
    BinaryLinear,
    HashedTextLinear,
    compile_binary_linear,
    compile_hashed_text_linear,
    compile_scorer,
)
from node_host.backends.sklearn_engine.worker import SklearnEngine
from sie.errors import SpecError
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService

TEXTS, LABELS = demo_scorer_corpus(seed=3, n=300)

VECTORIZERS = {
    "demo (4096, no alternate sign)": dict(n_features=2**12, alternate_sign=False),
    "sklearn defaults, 2**10": dict(n_features=2**10),
    "l1 norm": dict(n_features=512, norm="l1"),
    "no norm": dict(n_features=512, norm=None),
    "binary counts": dict(n_features=512, binary=True),
    "bigrams, case kept": dict(n_features=2048, ngram_range=(1, 2), lowercase=False),
    "character n-grams": dict(n_features=1024, analyzer="char_wb", ngram_range=(2, 3)),
    "accents stripped": dict(n_features=512, strip_accents="unicode"),
}


def fitted(vectorizer: dict, labels=LABELS):
    return make_pipeline(HashingVectorizer(**vectorizer), LogisticRegression(max_iter=500)).fit(TEXTS, labels)


MODELS = {name: fitted(config) for name, config in VECTORIZERS.items()}


@pytest.mark.parametrize("name", sorted(MODELS))
@settings(max_examples=40, deadline=None)
@given(texts=st.lists(st.text(max_size=120), min_size=1, max_size=12))
def test_probabilities_and_labels_are_the_pipelines_on_any_text(name, texts):
    model = MODELS[name]
    fast = compile_hashed_text_linear(model)
    assert isinstance(fast, HashedTextLinear)
    positive = fast.positive_proba(texts)
    assert positive is not None
    np.testing.assert_array_equal(positive, model.predict_proba(texts)[:, 1])
    assert fast.labels(positive) == list(model.predict(texts))


def test_string_classes_keep_their_labels_and_a_big_batch_is_the_same():
    model = fitted(VECTORIZERS["demo (4096, no alternate sign)"], np.where(np.array(LABELS) == 1, "fraud", "ok"))
    fast = compile_scorer(model)
    assert isinstance(fast, HashedTextLinear)
    texts = TEXTS * 3  # 900 rows, many repeated
    positive = fast.positive_proba(texts)
    np.testing.assert_array_equal(positive, model.predict_proba(texts)[:, 1])
    assert fast.labels(positive) == list(model.predict(texts))


@pytest.mark.parametrize(
    "make",
    [
        lambda: make_pipeline(TfidfVectorizer(), LogisticRegression()).fit(TEXTS, LABELS),  # another vectorizer
        lambda: make_pipeline(HashingVectorizer(n_features=64, input="filename"), LogisticRegression()).fit(
            [__file__] * 4, [0, 1, 0, 1]
        ),  # reads files: never through a fast path
        lambda: make_pipeline(HashingVectorizer(n_features=64, dtype=np.float32), LogisticRegression()).fit(
            TEXTS, LABELS
        ),
        lambda: make_pipeline(HashingVectorizer(n_features=64), MaxAbsScaler(), LogisticRegression()).fit(
            TEXTS, LABELS
        ),  # another step
        lambda: make_pipeline(HashingVectorizer(n_features=64), LogisticRegression()).fit(
            TEXTS, np.arange(len(TEXTS)) % 3
        ),  # multiclass
        lambda: make_pipeline(HashingVectorizer(n_features=64), type("MyLR", (LogisticRegression,), {})()).fit(
            TEXTS, LABELS
        ),  # a subclass may compute otherwise
        lambda: make_pipeline(HashingVectorizer(n_features=64), LogisticRegression()),  # not fitted
        lambda: LogisticRegression().fit([[0.0], [1.0]], [0, 1]),  # not a pipeline (the numeric form's)
    ],
)
def test_anything_else_is_left_to_sklearn(make):
    assert compile_hashed_text_linear(make()) is None


def test_compile_scorer_picks_the_form_for_the_input():
    numeric = LogisticRegression().fit([[0.0], [1.0], [2.0], [3.0]], [0, 0, 1, 1])
    assert isinstance(compile_scorer(numeric), BinaryLinear)
    assert compile_binary_linear(MODELS["no norm"]) is None
    assert isinstance(compile_scorer(MODELS["no norm"]), HashedTextLinear)
    assert compile_scorer(make_pipeline(TfidfVectorizer(), LogisticRegression()).fit(TEXTS, LABELS)) is None


def test_a_pipeline_whose_probabilities_differ_is_refused_at_compile_time():
    model = fitted(VECTORIZERS["demo (4096, no alternate sign)"])
    real = model.predict_proba
    model.predict_proba = lambda x: (lambda p: np.stack([1 - p, p], axis=1))(np.nextafter(real(x)[:, 1], 2))
    assert compile_hashed_text_linear(model) is None, "one ulp off on the probe texts is a different formula"


def test_an_empty_batch_or_a_non_string_is_left_to_sklearn():
    fast = compile_hashed_text_linear(MODELS["demo (4096, no alternate sign)"])
    assert fast is not None
    assert fast.positive_proba([]) is None  # sklearn refuses it: "Cannot vectorize empty sequence"
    assert fast.positive_proba(["fine", b"bytes"]) is None  # type: ignore[list-item]


def demo_service(tmp_path, **config):
    return ModelService.model_validate(
        {
            "metadata": {"name": "demo"},
            "spec": {
                "model": {"name": "demo", "service_type": "scoring", "path": str(tmp_path / "demo.skops")},
                "backend": {"type": "sklearn", "config": {"demo": True, **config}},
            },
        }
    )


def test_the_engine_scores_the_demo_scorer_with_it_and_answers_as_sklearn(tmp_path):
    service = demo_service(tmp_path)
    texts = ["wire transfer 12 to a new account, urgent, reference 95028", "", "weekly groceries", "ÜBERWEISUNG"]

    async def go():
        engine = SklearnEngine(service, ModelFilePolicy(roots=(tmp_path,)))
        await engine.start()
        try:
            assert isinstance(engine._fast, HashedTextLinear), "the demo scorer gets the text form"
            return await engine.infer([{"text": t} for t in texts]), engine._estimator
        finally:
            await engine.close()

    out, estimator = asyncio.run(go())
    expected = estimator.predict_proba(texts)[:, 1]
    assert [row["score"] for row in out] == expected.tolist()


def test_fast_path_false_scores_every_call_through_the_estimator(tmp_path):
    async def go():
        engine = SklearnEngine(demo_service(tmp_path, fast_path=False), ModelFilePolicy(roots=(tmp_path,)))
        await engine.start()
        try:
            assert engine._fast is None
            calls = []
            real = engine._estimator.predict_proba
            engine._estimator.predict_proba = lambda x: calls.append(len(x)) or real(x)
            out = await engine.infer([{"text": "wire transfer"}, {"text": "groceries"}])
            return out, calls
        finally:
            await engine.close()

    out, calls = asyncio.run(go())
    assert calls == [2] and len(out) == 2


@pytest.mark.parametrize("value", ["false", 0, None, [True]])
def test_fast_path_must_be_a_boolean(tmp_path, value):
    with pytest.raises(SpecError) as caught:
        SklearnEngine(demo_service(tmp_path, fast_path=value), ModelFilePolicy(roots=(tmp_path,)))
    assert "spec.backend.config.fast_path" in str(caught.value)
