"""The Triton repository SIE writes (config.pbtxt from the schemas, dynamic batching within bounds, the
model file checked as the sklearn engine checks one, refusals naming the field), the server's command
line and environment, and the pure helpers of SIE's Python-backend model. No tritonserver needed."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import skops.io as sio
from google.protobuf import text_encoding
from hypothesis import given
from hypothesis import strategies as st
from sklearn.linear_model import LogisticRegression

from node_host.backends.triton_server import launch, model, repository
from node_host.backends.triton_server.repository import config_pbtxt, pbtxt_string
from sie.engine_settings.triton_engine import TritonSettings
from sie.errors import SpecError
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService

KEY = "k3y_-" * 8


def _service(path: Path | str = "m.skops", *, config=None, inputs=None, outputs=None, batching=None, **model_):
    spec: dict = {
        "model": {"name": "m", "path": str(path), "service_type": "scoring", **model_},
        "backend": {"type": "triton", "config": config or {}},
        "batching": batching or {},
    }
    if inputs is not None:
        spec["input_schema"] = {"fields": inputs}
    if outputs is not None:
        spec["output_schema"] = {"fields": outputs}
    return ModelService.model_validate({"spec": spec})


def _settings(service: ModelService) -> TritonSettings:
    return TritonSettings.from_spec(service)


# ---- config.pbtxt ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field_type, config_type",
    [
        ("string", "TYPE_STRING"),
        ("float32", "TYPE_FP32"),
        ("float64", "TYPE_FP64"),
        ("int32", "TYPE_INT32"),
        ("int64", "TYPE_INT64"),
        ("bool", "TYPE_BOOL"),
    ],
)
def test_each_scalar_field_is_one_tensor_of_its_type_with_one_value_per_row(field_type, config_type):
    service = _service(inputs=[{"name": "x", "type": field_type}], outputs=[{"name": "y", "type": field_type}])
    text = config_pbtxt(service, _settings(service), {})
    assert f'input [\n  {{ name: "x" data_type: {config_type} dims: [ 1 ] }}\n]' in text
    assert f'output [\n  {{ name: "y" data_type: {config_type} dims: [ 1 ] }}\n]' in text


def test_the_config_names_the_model_its_backend_batch_and_instances():
    service = _service(
        config={"instance_count": 3},
        inputs=[{"name": "a", "type": "float32"}, {"name": "b", "type": "int64"}],
        outputs=[{"name": "score", "type": "float32"}, {"name": "label", "type": "int32"}],
        batching={"max_batch_size": 64},
    )
    text = config_pbtxt(service, _settings(service), {"sie_model_path": "/m/a.skops"})
    assert text.splitlines()[:3] == ['name: "m"', 'backend: "python"', "max_batch_size: 64"]
    assert '{ name: "a" data_type: TYPE_FP32 dims: [ 1 ] },\n  { name: "b" data_type: TYPE_INT64 dims: [ 1 ] }' in text
    assert "instance_group [ { kind: KIND_CPU count: 3 } ]" in text
    assert 'parameters [\n  { key: "sie_model_path" value: { string_value: "/m/a.skops" } }\n]' in text
    assert "dynamic_batching" not in text  # off unless backend.config asks for it


def test_without_schemas_the_scorer_takes_text_and_answers_a_score():
    service = _service()
    text = config_pbtxt(service, _settings(service), {})
    assert '{ name: "text" data_type: TYPE_STRING dims: [ 1 ] }' in text
    assert '{ name: "score" data_type: TYPE_FP32 dims: [ 1 ] }' in text


@pytest.mark.parametrize(
    "text, literal",
    [
        ("plain", '"plain"'),
        ('a"b', '"a\\"b"'),
        ("a\\b", '"a\\\\b"'),
        ("line\nbreak", '"line\\012break"'),
        ("é", '"\\303\\251"'),
    ],
)
def test_strings_are_escaped_for_the_text_format(text, literal):
    assert pbtxt_string(text) == literal


@given(st.text(max_size=200))
def test_every_string_reads_back_as_its_own_bytes(text):
    literal = pbtxt_string(text)
    assert literal.startswith('"') and literal.endswith('"')
    assert re.fullmatch(r'"([\x20-\x7e])*"', literal)  # printable ASCII only, whatever the text held
    assert text_encoding.CUnescape(literal[1:-1]) == text.encode("utf-8")


# ---- backend.config: dynamic batching and instances -----------------------------------------------------


@pytest.mark.parametrize(
    "batching, line",
    [
        ({}, "dynamic_batching { max_queue_delay_microseconds: 0 }"),
        ({"max_queue_delay_microseconds": 100}, "dynamic_batching { max_queue_delay_microseconds: 100 }"),
        (
            {"max_queue_delay_microseconds": 1_000_000, "preferred_batch_size": [8, 4]},
            "dynamic_batching { max_queue_delay_microseconds: 1000000 preferred_batch_size: [ 4, 8 ] }",
        ),
        (
            {"preferred_batch_size": [256]},
            "dynamic_batching { max_queue_delay_microseconds: 0 preferred_batch_size: [ 256 ] }",
        ),
    ],
)
def test_dynamic_batching_is_written_as_given(batching, line):
    service = _service(config={"dynamic_batching": batching})
    assert line in config_pbtxt(service, _settings(service), {}).splitlines()


@pytest.mark.parametrize(
    "config, path",
    [
        ({"dynamic_batching": True}, "spec.backend.config.dynamic_batching"),
        ({"dynamic_batching": [100]}, "spec.backend.config.dynamic_batching"),
        ({"dynamic_batching": {"max_queue_delay_us": 5}}, "spec.backend.config.dynamic_batching"),
        (
            {"dynamic_batching": {"max_queue_delay_microseconds": -1}},
            "spec.backend.config.dynamic_batching.max_queue_delay_microseconds",
        ),
        (
            {"dynamic_batching": {"max_queue_delay_microseconds": 1_000_001}},
            "spec.backend.config.dynamic_batching.max_queue_delay_microseconds",
        ),
        (
            {"dynamic_batching": {"max_queue_delay_microseconds": True}},
            "spec.backend.config.dynamic_batching.max_queue_delay_microseconds",
        ),
        (
            {"dynamic_batching": {"max_queue_delay_microseconds": 1.5}},
            "spec.backend.config.dynamic_batching.max_queue_delay_microseconds",
        ),
        (
            {"dynamic_batching": {"preferred_batch_size": [0]}},
            "spec.backend.config.dynamic_batching.preferred_batch_size",
        ),
        (
            {"dynamic_batching": {"preferred_batch_size": [257]}},
            "spec.backend.config.dynamic_batching.preferred_batch_size",
        ),
        (
            {"dynamic_batching": {"preferred_batch_size": [4, 4]}},
            "spec.backend.config.dynamic_batching.preferred_batch_size",
        ),
        (
            {"dynamic_batching": {"preferred_batch_size": list(range(1, 18))}},
            "spec.backend.config.dynamic_batching.preferred_batch_size",
        ),
        (
            {"dynamic_batching": {"preferred_batch_size": 8}},
            "spec.backend.config.dynamic_batching.preferred_batch_size",
        ),
        ({"instance_count": 0}, "spec.backend.config.instance_count"),
        ({"instance_count": 65}, "spec.backend.config.instance_count"),
        ({"instance_count": "2"}, "spec.backend.config.instance_count"),
        ({"trusted_types": "sklearn.tree._tree.Tree"}, "spec.backend.config.trusted_types"),
    ],
)
def test_a_wrong_setting_is_refused_naming_its_path(config, path):
    with pytest.raises(SpecError) as caught:
        _settings(_service(config=config))
    assert [p.path for p in caught.value.problems] == [path]


def test_every_wrong_setting_is_named_at_once():
    service = _service(config={"instance_count": 0, "dynamic_batching": {"max_queue_delay_microseconds": -1}})
    with pytest.raises(SpecError) as caught:
        _settings(service)
    assert {p.path for p in caught.value.problems} == {
        "spec.backend.config.instance_count",
        "spec.backend.config.dynamic_batching.max_queue_delay_microseconds",
    }


@pytest.mark.parametrize("side, field_type", [("input", "array"), ("input", "object"), ("output", "array")])
def test_fields_without_a_tensor_type_are_refused(side, field_type):
    fields = [{"name": "ok", "type": "float32"}, {"name": "bad", "type": field_type}]
    service = _service(**{f"{side}s": fields})
    with pytest.raises(SpecError) as caught:
        _settings(service)
    assert [p.path for p in caught.value.problems] == [f"spec.{side}_schema.fields[1].type"]
    assert "scalar fields only" in caught.value.problems[0].reason


def test_a_spec_without_a_model_path_is_refused():
    service = ModelService.model_validate({"spec": {"model": {"name": "m"}, "backend": {"type": "triton"}}})
    with pytest.raises(SpecError, match="spec.model.path"):
        _settings(service)


# ---- writing the repository -----------------------------------------------------------------------------


@pytest.fixture
def demo(tmp_path) -> tuple[ModelService, ModelFilePolicy, Path]:
    root = tmp_path / "models"
    root.mkdir()
    service = _service(root / "risk.skops", config={"demo": True})
    return service, ModelFilePolicy(roots=(root,)), tmp_path / "repo"


def test_the_demo_scorer_is_written_with_the_checked_file_in_the_parameters(demo):
    service, files, repo = demo
    target = repository.write_repository(service, files, repo)
    assert target == repo / "m"
    assert (target / "1" / "model.py").read_bytes() == repository.MODEL_SOURCE.read_bytes()
    config = (target / "config.pbtxt").read_text()
    real = (files.roots[0] / "risk.skops").resolve()
    digest = hashlib.sha256(real.read_bytes()).hexdigest()
    assert f'{{ key: "sie_model_path" value: {{ string_value: "{real}" }} }}' in config
    assert f'{{ key: "sie_sha256" value: {{ string_value: "{digest}" }} }}' in config
    assert '{ key: "sie_trusted_types" value: { string_value: "[]" } }' in config  # skops' defaults suffice
    assert sorted(p.name for p in repo.iterdir()) == ["m"]  # no temporary left behind


def test_writing_again_replaces_the_model(demo):
    service, files, repo = demo
    repository.write_repository(service, files, repo)
    (repo / "m" / "stale").write_text("x")
    repository.write_repository(service, files, repo)
    assert not (repo / "m" / "stale").exists() and (repo / "m" / "config.pbtxt").is_file()
    assert sorted(p.name for p in repo.iterdir()) == ["m"]


def test_a_path_outside_the_model_roots_is_refused(tmp_path):
    files = ModelFilePolicy(roots=(tmp_path / "models",))
    (tmp_path / "models").mkdir()
    with pytest.raises(SpecError, match="outside the model roots"):
        repository.write_repository(
            _service(tmp_path / "elsewhere.skops", config={"demo": True}), files, tmp_path / "r"
        )
    assert not (tmp_path / "elsewhere.skops").exists() and not (tmp_path / "r").exists()


def test_a_missing_file_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(SpecError, match="demo: true"):
        repository.write_repository(
            _service(tmp_path / "none.skops"), ModelFilePolicy(roots=(tmp_path,)), tmp_path / "r"
        )


def test_a_pickle_is_refused_even_pinned_with_unsafe_formats_allowed(tmp_path):
    path = tmp_path / "m.skops"
    path.write_bytes(pickle.dumps(LogisticRegression()))
    pinned = _service(path, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    lax = ModelFilePolicy(roots=(tmp_path,), allow_unsafe_formats=True)
    with pytest.raises(SpecError, match="not a skops file"):
        repository.write_repository(pinned, lax, tmp_path / "r")


def test_a_file_that_changed_from_its_pin_is_refused(demo):
    service, files, repo = demo
    repository.write_repository(service, files, repo)  # made the demo file
    wrong = _service(files.roots[0] / "risk.skops", sha256="0" * 64)
    with pytest.raises(SpecError, match="not the pinned"):
        repository.write_repository(wrong, files, repo)


def _archive(schema: object) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("schema.json", json.dumps(schema))
    return buf.getvalue()


def _call(module: str, name: str, *args: object) -> dict:
    """A skops schema whose root skops builds by calling module.name(*args)."""
    content = [
        {
            "__class__": type(a).__name__,
            "__module__": "builtins",
            "__loader__": "JsonNode",
            "content": json.dumps(a),
            "is_json": True,
        }
        for a in args
    ]
    return {
        "__class__": name,
        "__module__": module,
        "__loader__": "ConstructorFromReduceNode",
        "content": {"__class__": "tuple", "__module__": "builtins", "__loader__": "TupleNode", "content": content},
        "protocol": 2,
        "_skops_version": "0.16.0",
    }


def test_a_file_needing_an_untrusted_type_is_refused_naming_trusted_types(tmp_path):
    path = tmp_path / "m.skops"
    path.write_bytes(_archive(_call("joblib", "load", "x")))
    with pytest.raises(SpecError) as caught:
        repository.write_repository(_service(path), ModelFilePolicy(roots=(tmp_path,)), tmp_path / "r")
    assert caught.value.problems[0].path == "spec.backend.config.trusted_types"
    assert "joblib.load" in caught.value.problems[0].reason


def test_a_trusted_function_needs_what_a_pickle_needs(tmp_path):
    """Listed by the spec, joblib.load is still code: refused without unsafe formats and a pin; with both,
    it goes to the model as a type it may trust."""
    path = tmp_path / "m.skops"
    path.write_bytes(_archive(_call("joblib", "load", "x")))
    trusting = {"trusted_types": ["joblib.load"]}
    with pytest.raises(SpecError, match="not a class defined in scikit-learn"):
        repository.write_repository(_service(path, config=trusting), ModelFilePolicy(roots=(tmp_path,)), tmp_path / "r")
    pinned = _service(path, config=trusting, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    lax = ModelFilePolicy(roots=(tmp_path,), allow_unsafe_formats=True)
    target = repository.write_repository(pinned, lax, tmp_path / "r")
    assert '\\"joblib.load\\"' in (target / "config.pbtxt").read_text()


def test_an_archive_beyond_the_bounds_is_refused_before_skops_reads_it(tmp_path):
    path = tmp_path / "m.skops"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("other.json", "{}")
    path.write_bytes(buf.getvalue())
    with pytest.raises(SpecError, match="no schema.json"):
        repository.write_repository(_service(path), ModelFilePolicy(roots=(tmp_path,)), tmp_path / "r")


def test_a_real_estimator_passes_with_its_needed_types(tmp_path):
    x = np.random.default_rng(0).normal(size=(40, 2))
    path = tmp_path / "lr.skops"
    sio.dump(LogisticRegression().fit(x, (x[:, 0] > 0).astype(int)), path)
    inputs = [{"name": "a", "type": "float64"}, {"name": "b", "type": "float64"}]
    target = repository.write_repository(
        _service(path, inputs=inputs), ModelFilePolicy(roots=(tmp_path,)), tmp_path / "r"
    )
    assert '{ name: "b" data_type: TYPE_FP64 dims: [ 1 ] }' in (target / "config.pbtxt").read_text()


# ---- an operator's own Triton model -------------------------------------------------------------------


def _operator_model(root: Path, name: str | None = "m") -> Path:
    directory = root / "own"
    (directory / "1").mkdir(parents=True)
    (directory / "1" / "model.py").write_text("raise SystemExit('never imported by these tests')\n")
    (directory / "config.pbtxt").write_text((f'name: "{name}"\n' if name else "") + 'backend: "python"\n')
    return directory


def test_an_operator_model_is_refused_without_remote_code_naming_the_flag(tmp_path):
    directory = _operator_model(tmp_path)
    with pytest.raises(SpecError) as caught:
        repository.write_repository(_service(directory), ModelFilePolicy(roots=(tmp_path,)), tmp_path / "r")
    assert caught.value.problems[0].path == "spec.model.path"
    assert "--allow-remote-code" in caught.value.problems[0].reason
    assert not (tmp_path / "r" / "m").exists()


@pytest.mark.parametrize("name", ["m", None])
def test_an_operator_model_is_linked_as_it_is_with_remote_code_allowed(tmp_path, name):
    directory = _operator_model(tmp_path, name)
    files = ModelFilePolicy(roots=(tmp_path,), allow_remote_code=True)
    target = repository.write_repository(_service(directory), files, tmp_path / "r")
    assert target.is_symlink() and target.resolve() == directory.resolve()
    assert (target / "config.pbtxt").read_text() == (directory / "config.pbtxt").read_text()


def test_an_operator_model_of_another_name_or_without_config_is_refused(tmp_path):
    files = ModelFilePolicy(roots=(tmp_path,), allow_remote_code=True)
    directory = _operator_model(tmp_path, "other")
    with pytest.raises(SpecError, match="names the model 'other'"):
        repository.write_repository(_service(directory), files, tmp_path / "r")
    (directory / "config.pbtxt").unlink()
    with pytest.raises(SpecError, match="without config.pbtxt"):
        repository.write_repository(_service(directory), files, tmp_path / "r")


def test_an_operator_model_linking_outside_the_roots_is_refused(tmp_path):
    root = tmp_path / "models"
    directory = _operator_model(root)
    (tmp_path / "secret").write_text("x")
    (directory / "1" / "leak").symlink_to(tmp_path / "secret")
    files = ModelFilePolicy(roots=(root,), allow_remote_code=True)
    with pytest.raises(SpecError, match="outside the model roots"):
        repository.write_repository(_service(directory), files, tmp_path / "r")


# ---- the server's backend directory, command line and environment -------------------------------------


def _fake_venv(tmp_path: Path, version: str = "3.11") -> tuple[Path, Path]:
    venv = tmp_path / "venv"
    site = venv / "lib" / f"python{version}" / "site-packages"
    server = site / "pytriton" / "tritonserver"
    for path in (
        server / "bin" / "tritonserver",
        server / "backends" / "python" / "libtriton_python.so",
        server / "backends" / "python" / "triton_python_backend_utils.py",
        server / "python_backend_stubs" / version / "triton_python_backend_stub",
        server / "python_backend_stubs" / "3.12" / "triton_python_backend_stub",
        site / "nvidia_pytriton.libs" / "libz.so",
        tmp_path / "python" / "lib" / "libpython3.11.so.1.0",
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    (venv / "pyvenv.cfg").write_text(f"home = {tmp_path / 'python' / 'bin'}\nversion = {version}.7\n")
    return venv, server / "bin" / "tritonserver"


def test_the_backend_directory_links_the_stub_of_the_venvs_python(tmp_path):
    venv, binary = _fake_venv(tmp_path)
    assert launch.find_tritonserver(venv) == binary
    backends = repository.write_backends(binary, tmp_path / "backends")
    links = {p.name: p.resolve() for p in (backends / "python").iterdir()}
    assert (
        links["triton_python_backend_stub"]
        == binary.parents[1] / "python_backend_stubs" / "3.11" / "triton_python_backend_stub"
    )
    assert set(links) == {"libtriton_python.so", "triton_python_backend_utils.py", "triton_python_backend_stub"}
    repository.write_backends(binary, tmp_path / "backends")  # again: the links are replaced


def test_a_venv_without_the_stub_is_refused(tmp_path):
    _venv, binary = _fake_venv(tmp_path, "3.13")
    (binary.parents[1] / "python_backend_stubs" / "3.13" / "triton_python_backend_stub").unlink()
    with pytest.raises(FileNotFoundError, match="triton_python_backend_stub"):
        repository.write_backends(binary, tmp_path / "backends")


def test_no_binary_no_server(tmp_path):
    assert launch.find_tritonserver(tmp_path) is None


def test_the_environment_puts_the_venv_and_its_interpreters_libraries_first(tmp_path):
    venv, binary = _fake_venv(tmp_path)
    env = launch.launch_env(venv=venv, base={"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib"})
    assert env["PATH"] == f"{venv / 'bin'}:/usr/bin"
    assert env["LD_LIBRARY_PATH"].split(":") == [
        str(tmp_path / "python" / "lib"),
        str(binary.parents[3] / "nvidia_pytriton.libs"),
        "/opt/lib",
    ]
    assert env["PYTHONNOUSERSITE"] == "1"


def test_a_system_interpreter_adds_no_libdir(tmp_path):
    venv, _binary = _fake_venv(tmp_path)
    (venv / "pyvenv.cfg").write_text("home = /nonexistent/bin\n")
    assert launch.launch_env(venv=venv)["LD_LIBRARY_PATH"].split(":")[0].endswith("nvidia_pytriton.libs")


def _command(**overrides) -> list[str]:
    args = dict(
        tritonserver="/t/tritonserver",
        repository=Path("/run/repo"),
        model_id="m",
        host="127.0.0.1",
        http_port=8000,
        metrics_port=8002,
        api_key=KEY,
        backend_directory=Path("/run/backends"),
    )
    return launch.launch_command(**{**args, **overrides})


def _flags(argv: list[str]) -> dict[str, str]:
    out, i = {}, 1
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if eq:
            out[flag] = value
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[flag] = argv[i + 1]
            i += 2
        else:
            out[flag] = ""
            i += 1
    return out


def test_the_command_serves_one_model_on_the_host_with_the_key_required():
    argv = _command()
    assert argv[0] == "/t/tritonserver"
    flags = _flags(argv)
    assert flags["--model-repository"] == "/run/repo" and flags["--load-model"] == "m"
    assert flags["--model-control-mode"] == "explicit"
    assert flags["--backend-directory"] == "/run/backends"
    assert (flags["--http-address"], flags["--http-port"]) == ("127.0.0.1", "8000")
    assert (flags["--metrics-address"], flags["--metrics-port"]) == ("127.0.0.1", "8002")
    assert flags["--allow-grpc"] == "false" and flags["--allow-metrics"] == "true"
    assert flags["--log-verbose"] == "0"
    apis, _, header = flags["--http-restricted-api"].partition(":")
    assert header == f"x-sie-worker-key={KEY}"
    assert set(apis.split(",")) == {
        "inference",
        "model-repository",
        "metadata",
        "model-config",
        "statistics",
        "shared-memory",
        "trace",
        "logging",
    }  # every API but health


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"api_key": "short"}, "worker key"),
        ({"api_key": "a" * 20 + ":b"}, "worker key"),
        ({"api_key": "a" * 20 + ",inference"}, "worker key"),
        ({"api_key": "a" * 20 + " x"}, "worker key"),
        ({"http_port": 0}, "http_port"),
        ({"metrics_port": 70000}, "metrics_port"),
        ({"metrics_port": 8000}, "must differ"),
    ],
)
def test_a_key_that_would_break_the_flag_or_a_bad_port_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        _command(**overrides)


# ---- SIE's Python-backend model, its pure helpers --------------------------------------------------------


def test_one_string_input_is_the_estimators_texts():
    texts = np.array([b"good", "caf\u00e9".encode()], dtype=np.object_)
    assert model.features([("text", "TYPE_STRING", texts)]) == ["good", "caf\u00e9"]


def test_numeric_inputs_are_a_feature_matrix_in_config_order():
    columns = [
        ("a", "TYPE_FP32", np.array([1.5, 2.5], dtype=np.float32)),
        ("note", "TYPE_STRING", np.array([b"x", b"y"], dtype=np.object_)),  # not a feature
        ("b", "TYPE_BOOL", np.array([True, False])),
        ("c", "TYPE_INT64", np.array([7, 8], dtype=np.int64)),
    ]
    assert model.features(columns).tolist() == [[1.5, 1.0, 7.0], [2.5, 0.0, 8.0]]


def test_strings_only_beyond_one_are_no_features():
    columns = [("a", "TYPE_STRING", np.array([b"x"], dtype=np.object_))] * 2
    with pytest.raises(model.RowError):
        model.features(columns)


def test_missing_values_are_named_within_their_own_request():
    columns = [("a", "TYPE_FP64", np.array([1.0, np.nan, 2.0, np.nan])), ("b", "TYPE_INT32", np.array([1, 2, 3, 4]))]
    assert model.missing(columns, starts=[0, 2]) == ["instances[1].a", "instances[1].a"]
    assert model.missing(columns, starts=[0, 1, 3]) == ["instances[0].a", "instances[0].a"]


@pytest.mark.parametrize(
    "kind, values, is_score, expected",
    [
        ("TYPE_FP32", [0.25, 0.75], True, [[0.25], [0.75]]),
        ("TYPE_FP64", [0.25], True, [[0.25]]),
        ("TYPE_INT32", [0.4, 0.6], True, [[0], [1]]),
        ("TYPE_INT64", [np.int64(3)], False, [[3]]),
        ("TYPE_BOOL", [0.4, 0.5], True, [[False], [True]]),
        ("TYPE_BOOL", [np.int64(0), np.int64(1)], False, [[False], [True]]),
        ("TYPE_STRING", ["spam", np.int64(1)], False, [[b"spam"], [b"1"]]),
    ],
)
def test_outputs_are_columns_of_their_config_type(kind, values, is_score, expected):
    out = model.column(values, kind, is_score)
    assert out.shape == (len(values), 1) and out.dtype == np.dtype(model.NUMPY_TYPES[kind])
    assert out.tolist() == expected


def test_the_model_loads_only_the_bytes_that_were_checked(tmp_path):
    path = tmp_path / "m.skops"
    sio.dump(LogisticRegression().fit([[0.0], [1.0]], [0, 1]), path)
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    assert model.read_checked(str(path), digest, len(data)) == data
    with pytest.raises(ValueError, match="more than"):
        model.read_checked(str(path), digest, len(data) - 1)
    path.write_bytes(data + b"\0")
    with pytest.raises(ValueError, match="changed after"):
        model.read_checked(str(path), digest, 2 * len(data))
    estimator = model.load_estimator(data, [])
    scores, labels = model.score(estimator, np.array([[0.0], [1.0]]))
    assert scores.shape == (2,) and labels == [0, 1]


def test_the_model_refuses_types_the_node_host_did_not_allow():
    with pytest.raises(ValueError, match="joblib.load"):
        model.load_estimator(_archive(_call("joblib", "load", "x")), [])
