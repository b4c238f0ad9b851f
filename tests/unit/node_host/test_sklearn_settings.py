"""The sklearn engine's settings (backend.config): defaults, the values a spec may give, and a refusal that
names each wrong field, all of them at once, when the engine is built from its spec."""

from __future__ import annotations

import pytest

from node_host.backends.sklearn_engine.settings import MAX_TRUSTED_TYPES, SklearnSettings
from node_host.backends.sklearn_engine.worker import SklearnEngine
from sie.errors import SpecError
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService


def service(path: str | None = "/models/lr.skops", **config) -> ModelService:
    model: dict = {"name": "lr", "service_type": "scoring"}
    if path is not None:
        model["path"] = path
    return ModelService.model_validate(
        {"metadata": {"name": "lr"}, "spec": {"model": model, "backend": {"type": "sklearn", "config": config}}}
    )


def test_defaults():
    s = SklearnSettings.from_spec(service())
    assert s == SklearnSettings(model_path="/models/lr.skops", served_model_name="lr")
    assert (s.demo, s.seed, s.trusted_types, s.fast_path) == (False, 0, (), True)


def test_values_a_spec_gives_are_kept_and_other_engines_keys_left_alone():
    s = SklearnSettings.from_spec(
        service(demo=True, seed=7, trusted_types=["mylib.Scaler"], fast_path=False, max_running_requests=4)
    )
    assert (s.demo, s.seed, s.trusted_types, s.fast_path) == (True, 7, ("mylib.Scaler",), False)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("demo", "true"),
        ("demo", 1),
        ("fast_path", "false"),
        ("fast_path", None),
        ("seed", "3"),
        ("seed", -1),
        ("seed", 2**32),
        ("seed", True),
        ("seed", 1.5),
        ("trusted_types", "mylib.Scaler"),
        ("trusted_types", [1]),
        ("trusted_types", [""]),
        ("trusted_types", ["x" * 256]),
        ("trusted_types", ["a.B"] * (MAX_TRUSTED_TYPES + 1)),
    ],
)
def test_a_wrong_value_is_refused_naming_its_field(key, value):
    with pytest.raises(SpecError) as caught:
        SklearnSettings.from_spec(service(**{key: value}))
    (problem,) = caught.value.problems
    assert problem.path == f"spec.backend.config.{key}"
    assert len(str(caught.value)) < 600, "the value is shown cut short"


def test_every_wrong_field_is_named_at_once():
    with pytest.raises(SpecError) as caught:
        SklearnSettings.from_spec(service(path=None, demo="yes", seed="x", fast_path=0))
    assert {p.path for p in caught.value.problems} == {
        "spec.model.path",
        "spec.backend.config.demo",
        "spec.backend.config.seed",
        "spec.backend.config.fast_path",
    }


def test_the_engine_is_refused_when_it_is_built_and_a_right_one_keeps_the_settings(tmp_path):
    # Built from the spec (the worker does this before it listens): a wrong setting ends the worker
    # with the field's name (exit code 2), it never reaches start().
    with pytest.raises(SpecError, match=r"spec\.backend\.config\.demo"):
        SklearnEngine(service(str(tmp_path / "lr.skops"), demo="true"), ModelFilePolicy(roots=(tmp_path,)))
    engine = SklearnEngine(service(str(tmp_path / "lr.skops"), seed=5), ModelFilePolicy(roots=(tmp_path,)))
    assert engine.settings == SklearnSettings(model_path=str(tmp_path / "lr.skops"), served_model_name="lr", seed=5)
