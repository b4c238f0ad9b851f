"""The `sklearn` backend: a fitted scikit-learn estimator behind the worker protocol's /infer.

Named `sklearn_engine`, not `sklearn`, so it can never shadow scikit-learn.

- `worker`: `SklearnEngine` (safe skops loading; pickle/joblib only when the node allows it) and `main`.
- its settings, `SklearnSettings`, are part of the spec contract: `sie.engine_settings`.
- `scorer_io`: typed rows to estimator features and scores back to typed rows (pure).
- `demo_scorer`: the demo text scorer made for the demo and the tests.

    python -m node_host.backends.sklearn_engine --spec-file SPEC.json --host 127.0.0.1 --port PORT ...
"""
