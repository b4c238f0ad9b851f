"""A binary logistic regression, behind a StandardScaler, a HashingVectorizer or nothing, scored
without scikit-learn's per-call checks (pure).

scikit-learn checks its input on every call (check_array, dataframe detection, tags, output wrapping):
for a Pipeline(StandardScaler, LogisticRegression) that is about 0.35 ms per predict_proba on this
machine whatever the batch size, 17 us per row for the 24-row batches a Kafka connector sends, while
the arithmetic takes a few microseconds; for the demo text scorer, Pipeline(HashingVectorizer,
LogisticRegression), 373 us for one text, of which hashing the text's tokens is a few microseconds.
The worker has already checked and converted the rows (scorer_io.features), so for these common
scorers it can do the arithmetic itself:

    compile_scorer(estimator) -> FastScorer | None   (BinaryLinear or HashedTextLinear; None: use sklearn)
    fast.positive_proba(rows or texts) -> P(classes_[1]) per row, or None: leave these to sklearn
    fast.labels(positive) -> predict_proba's argmax labels

The operations are sklearn's own, in its order. Numeric rows: x - mean_, / scale_, @ coef_.T +
intercept_, expit. Texts: the vectorizer's analyzer, FeatureHasher's hashing, sum_duplicates, the
norm's in-place row normalization, the sparse product with coef_.T, + intercept_, expit. So the
probabilities are the ones predict_proba returns (tests/unit/node_host/test_fast_linear.py compares
them on random data, test_fast_text.py on arbitrary text), and each compile function checks that on
probe input before it hands out the fast form (texts: to the bit; rows: within 1e-9 relative). Input
the fast form does not take (non-finite or overflowing rows, an empty batch) goes to sklearn, which
answers or refuses it with its own message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
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


@dataclass(frozen=True)
class HashedTextLinear:
    """A Pipeline(HashingVectorizer, binary LogisticRegression) with the vectorizer's per-call work done
    once: its analyzer is built at compile time, and each call runs what HashingVectorizer.transform and
    FeatureHasher.transform run (analyze, hash, sum duplicates, normalize the rows in place), then the
    logistic regression's sparse product, without the checks, validation and estimator objects each of
    them makes per call (the demo scorer: 37 us for one text, against 373 us through the Pipeline)."""

    analyzer: Callable[[str], Any]  # the vectorizer's build_analyzer(): preprocess, tokenize, n-grams
    hash_features: Callable[..., tuple[np.ndarray, np.ndarray, np.ndarray]]  # FeatureHasher's own hashing
    n_features: int
    alternate_sign: bool
    binary: bool
    normalize_rows: Callable[[Any], None] | None  # in place, as sklearn's normalize does for CSR rows
    linear: BinaryLinear  # the regression's coefficients (no scaler)

    def positive_proba(self, texts: Sequence[str]) -> np.ndarray | None:
        if not texts or not all(isinstance(text, str) for text in texts):
            return None  # sklearn's to refuse (an empty batch) or to convert
        analyze = self.analyzer
        tokens = [analyze(text) for text in texts]
        if isinstance(tokens[0], str):
            return None  # a tokenizer that gave a string: FeatureHasher refuses that first sample
        indices, indptr, values = self.hash_features(
            (((token, 1) for token in row) for row in tokens),
            self.n_features,
            np.float64,
            self.alternate_sign,
            seed=0,
        )
        x = sp.csr_array((values, indices, indptr), dtype=np.float64, shape=(len(texts), self.n_features))
        x.sum_duplicates()  # also sorts each row's indices, as FeatureHasher's output is
        if self.binary:
            x.data.fill(1)
        if self.normalize_rows is not None:
            self.normalize_rows(x)
        decision = np.asarray(x @ self.linear.coef.T + self.linear.intercept).reshape(-1)
        if not np.isfinite(decision).all():
            return None  # only non-finite coefficients do this: sklearn's path gives its own answer
        return expit(decision)

    def labels(self, positive: np.ndarray) -> list[Any]:
        return self.linear.labels(positive)


FastScorer = BinaryLinear | HashedTextLinear  # what compile_scorer hands out


def compile_scorer(estimator: Any) -> FastScorer | None:
    """The fast form of `estimator`, if it has one: numeric rows (compile_binary_linear) or texts
    (compile_hashed_text_linear). None: score it with sklearn, as for any estimator these do not
    recognise or that fails their checks in any way (the fast form is only ever a shortcut)."""
    try:
        return compile_binary_linear(estimator) or compile_hashed_text_linear(estimator)
    except Exception:  # noqa: BLE001 - an odd estimator is sklearn's to serve (or refuse) per request
        return None


def compile_hashed_text_linear(estimator: Any) -> HashedTextLinear | None:
    """The fast form of exactly a Pipeline(HashingVectorizer, fitted binary LogisticRegression) whose
    vectorizer reads its documents as given (input="content") into float64 with an l1, l2 or no norm;
    None for anything else, or when this scikit-learn lacks the functions it calls (they are its own
    internals, so they are looked up here and the result is checked against predict_proba)."""
    from sklearn.pipeline import Pipeline

    if type(estimator) is not Pipeline:
        return None
    steps = _steps(estimator)
    if len(steps) != 2 or not plain_hashing_vectorizer(steps[0]):
        return None
    vectorizer, linear = steps[0], _binary_logistic(steps[1])
    if linear is None or linear.coef.shape[1] != vectorizer.n_features:
        return None
    try:
        from sklearn.feature_extraction._hashing_fast import transform as hash_features
        from sklearn.utils.sparsefuncs_fast import inplace_csr_row_normalize_l1, inplace_csr_row_normalize_l2
    except ImportError:
        return None
    normalizers = {"l1": inplace_csr_row_normalize_l1, "l2": inplace_csr_row_normalize_l2, None: None}
    try:
        vectorizer._validate_ngram_range()  # what transform checks on every call
        analyzer = vectorizer.build_analyzer()
    except Exception:  # noqa: BLE001 - a vectorizer sklearn would refuse stays sklearn's to refuse
        return None
    fast = HashedTextLinear(
        analyzer=analyzer,
        hash_features=hash_features,
        n_features=int(vectorizer.n_features),
        alternate_sign=bool(vectorizer.alternate_sign),
        binary=bool(vectorizer.binary),
        normalize_rows=normalizers[vectorizer.norm],
        linear=linear,
    )
    return fast if _agrees_on_texts(fast, estimator) else None


def plain_hashing_vectorizer(vectorizer: Any) -> bool:
    """Whether `vectorizer` is exactly a HashingVectorizer that the text form reproduces: it reads each
    document as given (input="content", not a file name), with one of sklearn's own analyzers (word,
    char, char_wb; a custom callable may return what FeatureHasher treats otherwise), into float64, with
    an l1, l2 or no norm."""
    from sklearn.feature_extraction.text import HashingVectorizer

    if type(vectorizer) is not HashingVectorizer:
        return False
    analyzer, norm, dtype = vectorizer.analyzer, vectorizer.norm, vectorizer.dtype
    return (
        vectorizer.input == "content"
        and isinstance(analyzer, str)
        and analyzer in ("word", "char", "char_wb")
        and (norm is None or (isinstance(norm, str) and norm in ("l1", "l2")))
        and dtype in (np.float64, "float64")
        and isinstance(vectorizer.n_features, int)
    )


def compile_binary_linear(estimator: Any) -> BinaryLinear | None:
    """The fast form of `estimator` when it is exactly a fitted binary LogisticRegression, or a Pipeline
    of a StandardScaler then one; None for anything else (other steps, multiclass, sparse coefficients,
    a subclass that might override what it computes)."""
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    scaler = None
    model = estimator
    if type(estimator) is Pipeline:
        steps = _steps(estimator)
        if len(steps) == 2 and type(steps[0]) is StandardScaler:
            scaler, model = steps
        elif len(steps) == 1:
            model = steps[0]
        else:
            return None
    linear = _binary_logistic(model)
    if linear is None:
        return None
    mean = scale = None
    if scaler is not None:
        mean = getattr(scaler, "mean_", None) if scaler.with_mean else None
        scale = getattr(scaler, "scale_", None) if scaler.with_std else None
        for value in (mean, scale):
            if value is not None and (not isinstance(value, np.ndarray) or value.shape != (linear.coef.shape[1],)):
                return None
    fast = BinaryLinear(mean=mean, scale=scale, coef=linear.coef, intercept=linear.intercept, classes=linear.classes)
    return fast if _agrees(fast, estimator, linear.coef.shape[1]) else None


def _steps(pipeline: Any) -> list[Any]:
    return [step for _name, step in pipeline.steps if step not in (None, "passthrough")]


def _binary_logistic(model: Any) -> BinaryLinear | None:
    """`model`'s coefficients when it is exactly a fitted binary LogisticRegression (no scaler)."""
    from sklearn.linear_model import LogisticRegression

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
    intercept = np.asarray(model.intercept_, dtype=np.float64)
    return BinaryLinear(mean=None, scale=None, coef=coef, intercept=intercept, classes=(classes[0], classes[1]))


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


# Probe texts for the text form: empty, blank, punctuation only, repeated tokens (duplicates summed),
# case and accents, digits, and more tokens than the batch has rows.
PROBE_TEXTS = (
    "",
    "   ",
    "!!! ... ???",
    "wire transfer wire transfer wire",
    "Wire TRANSFER to a new account, urgent: reference 95028",
    "café déjà vu naïve Ωmega ünïcödé",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9",
    "refund refund refund refund refund refund refund refund",
)


def _agrees_on_texts(fast: HashedTextLinear, estimator: Any) -> bool:
    """Whether the text form gives this pipeline's own probabilities, to the bit, on the probe texts."""
    try:
        mine = fast.positive_proba(list(PROBE_TEXTS))
        theirs = estimator.predict_proba(list(PROBE_TEXTS))[:, 1]
    except Exception:  # noqa: BLE001 - whatever fails here stays sklearn's to report, on the request
        return False
    return mine is not None and bool(np.array_equal(mine, theirs))
