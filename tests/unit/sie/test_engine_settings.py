"""The embedded engines' settings (backend.config): defaults, the values a spec may give, and a refusal
that names each wrong field, all of them at once: when the spec is read (sie validate, the admin API,
the Kubernetes controller, the node host all read specs with parse_model_service) and again when the
engine is built from its spec."""

from __future__ import annotations

import pytest

from node_host.backends.sklearn_engine.worker import SklearnEngine
from sie import cli
from sie.engine_settings import TorchSettings, engine_settings_problems
from sie.engine_settings.sklearn_engine import MAX_TRUSTED_TYPES, SklearnSettings
from sie.errors import SpecError
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService
from sie.spec_loader import parse_model_service


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


# ---- part of the spec: every reader of a spec refuses a wrong engine setting, naming it ------------------


def doc(backend: str, path: str | None = "models/m", **config) -> dict:
    model: dict = {"name": "m"}
    if path is not None:
        model["path"] = path
    return {"metadata": {"name": "m"}, "spec": {"model": model, "backend": {"type": backend, "config": config}}}


@pytest.mark.parametrize(
    ("backend", "key", "value"),
    [
        ("sklearn", "demo", "yes"),
        ("sklearn", "seed", "3"),
        ("sklearn", "trusted_types", "mylib.Scaler"),
        ("torch", "max_total_tokens", 0),
        ("torch", "max_total_tokens", 10**10),
        ("torch", "max_total_num_tokens", "4096"),
        ("torch", "max_running_requests", True),
        ("torch", "max_prefill_tokens", 1.5),
        ("torch", "seed", -1),
        ("torch", "seed", 2**64),
        ("torch", "device", "tpu"),
        ("torch", "device", 0),
        ("torch", "dtype", "float8"),
        ("torch", "num_threads", 0),
        ("torch", "num_threads", 100_000),
        ("torch", "demo", "true"),
        ("torch", "kv_budget_scale", 2),
        ("sglang", "kv_budget_scale", 0),
        ("sim", "kv_budget_scale", "half"),
    ],
)
def test_the_spec_loader_refuses_a_wrong_engine_setting_naming_it(backend, key, value):
    with pytest.raises(SpecError) as caught:
        parse_model_service(doc(backend, **{key: value}), "the file")
    (problem,) = caught.value.problems
    assert problem.path == f"spec.backend.config.{key}"
    assert str(caught.value).startswith("the file (ModelService 'm')")


def test_the_spec_loader_names_every_wrong_engine_setting_at_once():
    with pytest.raises(SpecError) as caught:
        parse_model_service(doc("torch", device="tpu", dtype=1, num_threads="2"))
    assert {p.path for p in caught.value.problems} == {
        f"spec.backend.config.{key}" for key in ("device", "dtype", "num_threads")
    }


@pytest.mark.parametrize(
    ("backend", "config"),
    [
        ("sklearn", {"demo": True, "seed": 2**32 - 1, "trusted_types": ["a.B"], "fast_path": False}),
        ("torch", {"device": "cuda:1", "dtype": "bfloat16", "max_total_num_tokens": 512, "kv_budget_scale": 0.5}),
        ("sglang", {"kv_budget_scale": 1}),
        ("sim", {"kv_budget_scale": 0.25}),
        # Other engines' arguments pass through (spec.py): an sklearn spec does not read max_running_requests.
        ("sklearn", {"max_running_requests": "any", "kv_budget_scale": 0.5}),
    ],
)
def test_right_engine_settings_are_accepted(backend, config):
    service = parse_model_service(doc(backend, **config))
    assert engine_settings_problems(service) == []


def test_a_spec_without_a_model_path_parses_but_the_engine_needs_one():
    # On Kubernetes a spec may name an image that serves the model itself; SIE's worker refuses it.
    service = parse_model_service(doc("torch", path=None))
    with pytest.raises(SpecError, match=r"spec\.model\.path"):
        TorchSettings.from_spec(service)


def test_the_worker_reads_the_settings_the_spec_loader_checked():
    s = TorchSettings.from_spec(parse_model_service(doc("torch", max_total_tokens=1000, kv_budget_scale=0.5, seed=9)))
    assert (s.max_total_tokens, s.seed, s.device, s.num_threads) == (500, 9, "auto", 1)


def test_sie_validate_refuses_a_file_with_a_wrong_engine_setting(tmp_path, capsys):
    file = tmp_path / "models.yaml"
    file.write_text(
        "apiVersion: sie.io/v1alpha1\nkind: ModelService\nmetadata: {name: lr}\n"
        "spec:\n  model: {name: lr, path: lr.skops, service_type: scoring}\n"
        "  backend: {type: sklearn, config: {demo: 'yes'}}\n"
    )
    assert cli.main(["validate", str(file)]) == 2
    err = capsys.readouterr().err
    assert "spec.backend.config.demo" in err and "expected true or false, got 'yes'" in err


@pytest.mark.parametrize(
    ("key", "edge", "beyond"),
    [
        ("max_total_tokens", 10**9, 10**9 + 1),
        ("max_running_requests", 10**9, 10**9 + 1),
        ("num_threads", 1024, 1025),
        ("seed", 2**64 - 1, 2**64),  # torch.manual_seed's range
        ("device", "cuda:127", "cuda:1000"),
        ("device", "cuda", "cuda:"),
        ("device", "cpu", "cuda:x"),
        ("kv_budget_scale", 1, 1.01),
    ],
)
def test_torch_bounds_take_their_edge_and_refuse_beyond_it(key, edge, beyond):
    parse_model_service(doc("torch", **{key: edge}))
    with pytest.raises(SpecError, match=rf"spec\.backend\.config\.{key}"):
        parse_model_service(doc("torch", **{key: beyond}))


def test_a_value_too_large_to_show_is_refused_not_raised():
    # An integer of more than 4,300 digits has no repr; in-process callers can hand one over.
    service = ModelService.model_validate(doc("torch"))
    service = service.model_copy(
        update={
            "spec": service.spec.model_copy(
                update={
                    "backend": service.spec.backend.model_copy(
                        update={"config": type(service.spec.backend.config)(seed=10**5000)}
                    )
                }
            )
        }
    )
    (problem,) = engine_settings_problems(service)
    assert problem.path == "spec.backend.config.seed" and "too large to show" in problem.reason


def _triton(config: dict, **spec) -> dict:
    return {
        "metadata": {"name": "t"},
        "spec": {
            "model": {"name": "t", "service_type": "scoring", "path": "/models/t.skops"},
            "backend": {"type": "triton", "config": config},
            **spec,
        },
    }


@pytest.mark.parametrize(
    "config, spec, field",
    [
        (
            {"dynamic_batching": {"max_queue_delay_microseconds": -1}},
            {},
            "dynamic_batching.max_queue_delay_microseconds",
        ),
        ({"dynamic_batching": {"wait": 1}}, {}, "dynamic_batching"),
        ({"instance_count": 0}, {}, "instance_count"),
        (
            {},
            {"kafka_input": {"bootstrap_servers": "h:1", "topic": "a", "group_id": "g", "output_topic": "b"}},
            "spec.kafka_input",
        ),
    ],
)
def test_a_triton_spec_is_refused_when_read_naming_the_field(config, spec, field):
    # Checked where every door reads specs (parse_model_service), not first when the node host writes the
    # model repository: a wrong setting is a 4xx at the admin API, not an instance that never starts.
    with pytest.raises(SpecError) as exc:
        parse_model_service(_triton(config, **spec), "test")
    assert any(field in p.path for p in exc.value.problems), exc.value.problems
    assert engine_settings_problems(ModelService.model_validate(_triton({}))) == []
