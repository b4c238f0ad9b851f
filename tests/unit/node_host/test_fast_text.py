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
    plain_hashing_vectorizer,
)
from node_host.backends.sklearn_engine.worker import INLINE_ROWS, SklearnEngine
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
    "english stop words": dict(n_features=512, stop_words="english"),
    "characters": dict(n_features=512, analyzer="char", ngram_range=(1, 2)),
    "a tokenizer of its own": dict(n_features=512, tokenizer=str.split, token_pattern=None),
}


def fitted(vectorizer: dict, labels=LABELS, **regression):
    return make_pipeline(HashingVectorizer(**vectorizer), LogisticRegression(max_iter=500, **regression)).fit(
        TEXTS, labels
    )


MODELS = {name: fitted(config) for name, config in VECTORIZERS.items()}
MODELS["no intercept"] = fitted(VECTORIZERS["demo (4096, no alternate sign)"], fit_intercept=False)


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


@pytest.mark.parametrize(
    "change",
    [
        dict(input="filename"),  # reads files named by the request: never on a fast path
        dict(input="file"),
        dict(dtype=np.float32),
        dict(analyzer=str.split),  # a callable may return what FeatureHasher treats otherwise
        dict(analyzer="words"),
        dict(norm=["l2"]),  # not even hashable
        dict(norm="max"),
        dict(n_features=64.0),
    ],
)
def test_only_a_plain_hashing_vectorizer_is_reproduced(change):
    assert plain_hashing_vectorizer(HashingVectorizer(n_features=64))
    vectorizer = HashingVectorizer(n_features=64)
    for name, value in change.items():
        setattr(vectorizer, name, value)  # as a loaded model file may carry, unvalidated
    assert not plain_hashing_vectorizer(vectorizer)


def test_an_odd_vectorizer_leaves_the_model_to_sklearn_without_failing_the_load():
    model = fitted(VECTORIZERS["demo (4096, no alternate sign)"])
    model.steps[0][1].norm = ["l2"]
    assert compile_scorer(model) is None
    model.steps[0][1].norm = "l2"
    model.steps[1][1].coef_ = "not an array"
    assert compile_scorer(model) is None
    model.steps = [("features", np.array([1.0, 2.0])), model.steps[1]]  # comparing it raises
    assert compile_scorer(model) is None


def test_a_tokenizer_that_returns_a_string_is_left_to_sklearn():
    # FeatureHasher refuses a first sample that is a string; the text form must not score it instead.
    model = fitted(dict(n_features=512, tokenizer=lambda s: s if len(s) > 500 else s.split(), token_pattern=None))
    fast = compile_hashed_text_linear(model)
    assert fast is not None, "the probe texts are short: the tokenizer gives lists there"
    texts = ["y" * 600, "ok"]
    with pytest.raises(ValueError, match="single string"):
        model.predict_proba(texts)
    assert fast.positive_proba(texts) is None
    assert fast.positive_proba(texts[::-1]) is not None  # only the first sample is checked, as sklearn does
    np.testing.assert_array_equal(fast.positive_proba(texts[::-1]), model.predict_proba(texts[::-1])[:, 1])


def test_lone_surrogates_and_control_characters_score_as_in_sklearn():
    model = MODELS["demo (4096, no alternate sign)"]
    fast = compile_hashed_text_linear(model)
    texts = ["wire \ud800 transfer", "\udfff", "nul \x00 in the middle", "tab\tand\nnewline", "\u200b" * 50]
    np.testing.assert_array_equal(fast.positive_proba(texts), model.predict_proba(texts)[:, 1])


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


def test_a_batch_scored_off_the_event_loop_answers_as_sklearn(tmp_path):
    texts = [f"transfer {i} to account {i * 7919 % 1000}, urgent" for i in range(INLINE_ROWS + 44)]

    async def go():
        engine = SklearnEngine(demo_service(tmp_path), ModelFilePolicy(roots=(tmp_path,)))
        await engine.start()
        try:
            assert isinstance(engine._fast, HashedTextLinear)
            return await engine.infer([{"text": t} for t in texts]), engine._estimator
        finally:
            await engine.close()

    out, estimator = asyncio.run(go())
    assert [row["score"] for row in out] == estimator.predict_proba(texts)[:, 1].tolist()


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
