"""sie.schema_compat: every compatibility rule, on both sides, and `sie validate --against`."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sie.cli import main
from sie.schema_compat import SchemaChange, breaking, compare_schemas, compare_side, compare_specs
from sie.spec import FieldSpec, IOSchema, ModelService, ModelServiceSpec


def f(name: str = "x", type: str = "string", required: bool = False, **kw: Any) -> FieldSpec:
    return FieldSpec.model_validate({"name": name, "type": type, "required": required, **kw})


def schema(*fields: FieldSpec, extra: bool = True) -> IOSchema:
    return IOSchema(fields=list(fields), allow_extra_fields=extra)


def summary(changes: list[SchemaChange]) -> list[tuple[str, str, bool]]:
    return [(c.field, c.kind, c.breaking) for c in changes]


# (old schema, new schema, the changes as (field, kind, breaking)), read on the input side.
INPUT_CASES = {
    "identical": (schema(f("a", required=True, max_length=5)), schema(f("a", required=True, max_length=5)), []),
    "no schema either side": (None, None, []),
    "removed, extras allowed": (schema(f("a"), f("b")), schema(f("a")), [("b", "field_removed", True)]),
    "removed, extras refused": (
        schema(f("a"), f("b"), extra=False),
        schema(f("a"), extra=False),
        [("b", "field_removed", True)],
    ),
    "optional field added": (schema(f("a")), schema(f("a"), f("b")), [("b", "field_added", False)]),
    "required field added": (
        schema(f("a")),
        schema(f("a"), f("b", required=True)),
        [("b", "required_field_added", True)],
    ),
    "optional -> required": (schema(f("a")), schema(f("a", required=True)), [("a", "field_now_required", True)]),
    "required -> optional": (schema(f("a", required=True)), schema(f("a")), [("a", "field_now_optional", False)]),
    "int64 -> int32": (schema(f(type="int64")), schema(f(type="int32")), [("x", "type_narrowed", True)]),
    "float64 -> float32": (schema(f(type="float64")), schema(f(type="float32")), [("x", "type_narrowed", True)]),
    "float32 -> int64": (schema(f(type="float32")), schema(f(type="int64")), [("x", "type_narrowed", True)]),
    "int32 -> int64": (schema(f(type="int32")), schema(f(type="int64")), [("x", "type_widened", False)]),
    "int64 -> float64": (schema(f(type="int64")), schema(f(type="float64")), [("x", "type_widened", False)]),
    "int32 -> float32": (schema(f(type="int32")), schema(f(type="float32")), [("x", "type_widened", False)]),
    # Unrelated types: only the type is reported, the old constraints say nothing about the new values.
    "string -> int32": (schema(f(max_length=5)), schema(f(type="int32", range=[0, 5])), [("x", "type_changed", True)]),
    "bool -> string": (schema(f(type="bool")), schema(f(type="string")), [("x", "type_changed", True)]),
    "array -> object": (schema(f(type="array")), schema(f(type="object")), [("x", "type_changed", True)]),
    "range low raised": (
        schema(f(type="int32", range=[0, 10])),
        schema(f(type="int32", range=[1, 10])),
        [("x", "range_narrowed", True)],
    ),
    "range high lowered": (
        schema(f(type="int32", range=[0, 10])),
        schema(f(type="int32", range=[0, 9])),
        [("x", "range_narrowed", True)],
    ),
    "range added": (
        schema(f(type="float32")),
        schema(f(type="float32", range=[0, 1])),
        [("x", "range_narrowed", True)],
    ),
    "range widened": (
        schema(f(type="int32", range=[0, 10])),
        schema(f(type="int32", range=[-1, 11])),
        [("x", "range_widened", False)],
    ),
    "range removed": (schema(f(type="int32", range=[0, 10])), schema(f(type="int32")), [("x", "range_widened", False)]),
    "range shifted": (
        schema(f(type="int32", range=[0, 10])),
        schema(f(type="int32", range=[5, 20])),
        [("x", "range_changed", True)],
    ),
    "max_length lowered": (schema(f(max_length=10)), schema(f(max_length=5)), [("x", "length_narrowed", True)]),
    "max_length added": (schema(f()), schema(f(max_length=5)), [("x", "length_narrowed", True)]),
    "min_length raised": (schema(f(min_length=1)), schema(f(min_length=2)), [("x", "length_narrowed", True)]),
    "min_length added": (
        schema(f(type="array")),
        schema(f(type="array", min_length=1)),
        [("x", "length_narrowed", True)],
    ),
    "min_length 0 is no min_length": (schema(f(min_length=0)), schema(f()), []),
    "max_length raised": (schema(f(max_length=5)), schema(f(max_length=10)), [("x", "length_widened", False)]),
    "max_length removed": (schema(f(max_length=5)), schema(f()), [("x", "length_widened", False)]),
    "min_length lowered": (schema(f(min_length=2)), schema(f(min_length=1)), [("x", "length_widened", False)]),
    "length shifted": (
        schema(f(min_length=1, max_length=5)),
        schema(f(min_length=2, max_length=10)),
        [("x", "length_changed", True)],
    ),
    "enum value removed": (schema(f(enum=["a", "b"])), schema(f(enum=["a"])), [("x", "enum_narrowed", True)]),
    "enum added": (schema(f()), schema(f(enum=["a"])), [("x", "enum_narrowed", True)]),
    "enum value added": (schema(f(enum=["a"])), schema(f(enum=["a", "b"])), [("x", "enum_widened", False)]),
    "enum removed": (schema(f(enum=["a"])), schema(f()), [("x", "enum_widened", False)]),
    "enum swapped a value": (schema(f(enum=["a", "b"])), schema(f(enum=["b", "c"])), [("x", "enum_changed", True)]),
    "enum reordered": (schema(f(enum=["a", "b"])), schema(f(enum=["b", "a"])), []),
    "enum 1 is 1.0": (schema(f(type="float64", enum=[1])), schema(f(type="float64", enum=[1.0])), []),
    "extras now refused": (schema(f("a")), schema(f("a"), extra=False), [("", "extra_fields_refused", True)]),
    "extras now allowed": (schema(f("a"), extra=False), schema(f("a")), [("", "extra_fields_allowed", False)]),
    "schema added, a field required": (None, schema(f("a", required=True)), [("", "schema_added", True)]),
    "schema added, extras refused": (None, schema(f("a"), extra=False), [("", "schema_added", True)]),
    "schema added, all optional": (None, schema(f("a"), f("b", type="int32")), [("", "schema_added", False)]),
    "schema removed": (schema(f("a", required=True), extra=False), None, [("", "schema_removed", False)]),
    "type widened, range added": (
        schema(f(type="int32")),
        schema(f(type="int64", range=[0, 5])),
        [("x", "type_widened", False), ("x", "range_narrowed", True)],
    ),
}

# The same changes read on the output side, where clients read what the model returns.
OUTPUT_CASES = {
    "identical": (schema(f("a", type="float32", range=[0, 1])), schema(f("a", type="float32", range=[0, 1])), []),
    "no schema either side": (None, None, []),
    "removed": (schema(f("a"), f("b")), schema(f("a")), [("b", "field_removed", True)]),
    "optional field added": (schema(f("a")), schema(f("a"), f("b")), [("b", "field_added", False)]),
    "required field added": (
        schema(f("a")),
        schema(f("a"), f("b", required=True)),
        [("b", "required_field_added", False)],
    ),
    "required -> optional": (schema(f("a", required=True)), schema(f("a")), [("a", "field_now_optional", True)]),
    "optional -> required": (schema(f("a")), schema(f("a", required=True)), [("a", "field_now_required", False)]),
    "int32 -> int64": (schema(f(type="int32")), schema(f(type="int64")), [("x", "type_widened", True)]),
    "float32 -> float64": (schema(f(type="float32")), schema(f(type="float64")), [("x", "type_widened", True)]),
    "int64 -> int32": (schema(f(type="int64")), schema(f(type="int32")), [("x", "type_narrowed", False)]),
    "string -> int32": (schema(f()), schema(f(type="int32")), [("x", "type_changed", True)]),
    "range widened": (
        schema(f(type="float32", range=[0, 1])),
        schema(f(type="float32", range=[-1, 1])),
        [("x", "range_widened", True)],
    ),
    "range removed": (
        schema(f(type="float32", range=[0, 1])),
        schema(f(type="float32")),
        [("x", "range_widened", True)],
    ),
    "range narrowed": (
        schema(f(type="float32", range=[0, 1])),
        schema(f(type="float32", range=[0, 0.5])),
        [("x", "range_narrowed", False)],
    ),
    "range added": (
        schema(f(type="float32")),
        schema(f(type="float32", range=[0, 1])),
        [("x", "range_narrowed", False)],
    ),
    "range shifted": (
        schema(f(type="int32", range=[0, 10])),
        schema(f(type="int32", range=[5, 20])),
        [("x", "range_changed", True)],
    ),
    "max_length raised": (schema(f(max_length=5)), schema(f(max_length=10)), [("x", "length_widened", True)]),
    "max_length removed": (
        schema(f(type="array", max_length=5)),
        schema(f(type="array")),
        [("x", "length_widened", True)],
    ),
    "max_length lowered": (schema(f(max_length=10)), schema(f(max_length=5)), [("x", "length_narrowed", False)]),
    "min_length raised": (schema(f(min_length=1)), schema(f(min_length=2)), [("x", "length_narrowed", False)]),
    "enum value added": (
        schema(f(enum=["pos", "neg"])),
        schema(f(enum=["pos", "neg", "mixed"])),
        [("x", "enum_widened", True)],
    ),
    "enum removed": (schema(f(enum=["pos"])), schema(f()), [("x", "enum_widened", True)]),
    "enum value removed": (schema(f(enum=["pos", "neg"])), schema(f(enum=["pos"])), [("x", "enum_narrowed", False)]),
    "enum added": (schema(f()), schema(f(enum=["pos"])), [("x", "enum_narrowed", False)]),
    "extras now allowed": (schema(f("a"), extra=False), schema(f("a")), [("", "extra_fields_allowed", True)]),
    "extras now refused": (schema(f("a")), schema(f("a"), extra=False), [("", "extra_fields_refused", False)]),
    "schema removed": (schema(f("a")), None, [("", "schema_removed", True)]),
    "schema added": (None, schema(f("a", required=True), extra=False), [("", "schema_added", False)]),
}


@pytest.mark.parametrize(("old", "new", "expected"), INPUT_CASES.values(), ids=INPUT_CASES.keys())
def test_input_rules(old, new, expected):
    changes = compare_side("input", old, new)
    assert summary(changes) == expected
    assert all(c.side == "input" for c in changes)


@pytest.mark.parametrize(("old", "new", "expected"), OUTPUT_CASES.values(), ids=OUTPUT_CASES.keys())
def test_output_rules(old, new, expected):
    changes = compare_side("output", old, new)
    assert summary(changes) == expected
    assert all(c.side == "output" for c in changes)


@pytest.mark.parametrize(
    ("old", "new", "says"),
    [
        (f("n", type="int64"), f("n", type="int32"), ["'n'", "int64", "int32", "refused"]),
        (f("n", type="int32", range=[1, 256]), f("n", type="int32", range=[1, 128]), ["'n'", "[1, 256]", "[1, 128]"]),
        (f("n", type="float32"), f("n", type="float32", range=[0, 0.5]), ["'n'", "no range", "[0, 0.5]"]),
        (f("n", max_length=4096), f("n", max_length=512), ["'n'", "max_length 4096", "max_length 512"]),
        (f("n"), f("n", min_length=1), ["'n'", "no length bound", "min_length 1"]),
        (
            f("n", enum=["a", "b"]),
            f("n", enum=["b", "c"]),
            ["'n'", "{'a', 'b'}", "{'b', 'c'}", "without 'a'", "with 'c'"],
        ),
        (f("n"), f("n", enum=["a"]), ["'n'", "any value", "{'a'}"]),
        (f("n"), f("n", required=True), ["'n'", "optional", "required"]),
    ],
)
def test_messages_name_the_field_and_both_values(old, new, says):
    (change,) = compare_side("input", schema(old), schema(new))
    for text in says:
        assert text in change.message, (text, change.message)


def test_removed_field_messages_say_what_happens_to_a_client_that_sends_it():
    (open_,) = compare_side("input", schema(f("a"), f("b")), schema(f("a")))
    (closed,) = compare_side("input", schema(f("a"), f("b"), extra=False), schema(f("a"), extra=False))
    assert "'b'" in open_.message and "no longer reads" in open_.message
    assert "'b'" in closed.message and "refused" in closed.message


def test_changes_are_ordered_input_then_output_schema_wide_then_by_field():
    old_in = schema(f("zeta"), f("alpha", type="int64"), f("mid"))
    new_in = schema(f("mid", required=True), f("alpha", type="int32"), f("beta"), extra=False)
    old_out = schema(f("score", type="float32", range=[0, 1]), f("label"))
    new_out = schema(f("label", enum=["x"]))
    changes = compare_schemas(old_in, old_out, new_in, new_out)
    assert [(c.side, c.field, c.kind) for c in changes] == [
        ("input", "", "extra_fields_refused"),
        ("input", "alpha", "type_narrowed"),
        ("input", "beta", "field_added"),
        ("input", "mid", "field_now_required"),
        ("input", "zeta", "field_removed"),
        ("output", "label", "enum_narrowed"),
        ("output", "score", "field_removed"),
    ]
    # Field order in the schema does not matter: the same schemas reordered give the same list.
    shuffled = compare_schemas(
        schema(*reversed(old_in.fields)), old_out, schema(*reversed(new_in.fields), extra=False), new_out
    )
    assert shuffled == changes


def _spec(input_schema: IOSchema | None, output_schema: IOSchema | None) -> ModelServiceSpec:
    return ModelServiceSpec.model_validate(
        {
            "model": {"name": "scorer", "service_type": "scoring"},
            "backend": {"type": "sim"},
            "input_schema": input_schema.model_dump() if input_schema else None,
            "output_schema": output_schema.model_dump() if output_schema else None,
        }
    )


def test_compare_specs_reads_both_schemas_and_breaking_keeps_the_breaking_ones():
    old = _spec(schema(f("text", max_length=4096)), schema(f("score", type="float32", range=[0, 1])))
    new = _spec(schema(f("text", max_length=8192)), schema(f("score", type="float64", range=[0, 1])))
    changes = compare_specs(old, new)
    assert summary(changes) == [("text", "length_widened", False), ("score", "type_widened", True)]
    assert breaking(changes) == [changes[1]]
    assert compare_specs(old, old) == [] and breaking([]) == []


def test_to_json_is_plain_json():
    changes = compare_schemas(
        None,
        schema(f("s", type="int32", range=[0, 9], enum=[1, 2]), f("t", max_length=3)),
        schema(f("a", required=True)),
        schema(f("s", type="int32", range=[0, 10], enum=[1, 2, 3]), f("t", max_length=4)),
    )
    out = json.loads(json.dumps([c.to_json() for c in changes]))
    assert [c["kind"] for c in out] == ["schema_added", "range_widened", "enum_widened", "length_widened"]
    assert out[0]["old"] is None and out[0]["new"]["fields"][0]["name"] == "a" and out[0]["breaking"] is True
    assert out[1]["old"] == [0, 9] and out[1]["new"] == [0, 10]
    assert out[2]["old"] == [1, 2] and out[2]["new"] == [1, 2, 3]
    assert out[3]["old"] == {"min_length": None, "max_length": 3} and out[3]["new"]["max_length"] == 4
    assert set(out[0]) == {"side", "field", "kind", "breaking", "old", "new", "message"}


# ---- sie validate FILE --against MODEL ----

TOKEN = "test-admin-token"


class _AdminStandIn(ThreadingHTTPServer):
    """GET /v1/models/<id> as the admin API answers it: the ModelService JSON with `status`, or the
    error body of a model that is not there."""

    def __init__(self, models: dict[str, dict[str, Any]]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.models = models
        self.paths: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _AdminStandIn

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self.server.paths.append(self.path)
        mid = self.path.removeprefix("/v1/models/")
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._answer(401, {"error": {"type": "unauthenticated", "message": "no token"}})
        elif mid in self.server.models:
            self._answer(200, self.server.models[mid])
        else:
            error = {
                "type": "model_not_found",
                "message": f"no model {mid!r}",
                "known_models": sorted(self.server.models),
            }
            self._answer(404, {"error": error})

    def _answer(self, code: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass


def _service(name: str, version: str, input_fields: list[dict[str, Any]], output_fields: list[dict[str, Any]]) -> dict:
    return ModelService.model_validate(
        {
            "metadata": {"name": name},
            "spec": {
                "model": {"name": name, "version": version, "service_type": "scoring"},
                "backend": {"type": "sim"},
                "input_schema": {"fields": input_fields},
                "output_schema": {"fields": output_fields},
            },
        }
    ).to_dict()


RUNNING = _service(
    "scorer",
    "1.0.0",
    [{"name": "text", "type": "string", "max_length": 4096}],
    [{"name": "score", "type": "float32", "range": [0, 1]}],
)


@pytest.fixture
def admin() -> Iterator[_AdminStandIn]:
    running = {**RUNNING, "status": {"source": "file", "desired_instances": 1, "ready_instances": 1}}
    server = _AdminStandIn({"scorer": running})
    thread = threading.Thread(target=server.serve_forever, name="admin-stand-in", daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "admin.token"
    path.write_text(TOKEN)
    os.chmod(path, 0o600)
    return path


def _write(tmp_path: Path, *services: dict) -> Path:
    path = tmp_path / "models.json"
    path.write_text(json.dumps(list(services)))
    return path


def _validate(file: Path, model: str, admin: _AdminStandIn, token_file: Path) -> int:
    return main(["validate", str(file), "--against", model, "--admin-url", admin.url, "--token-file", str(token_file)])


def test_validate_against_a_compatible_version_exits_0(tmp_path, admin, token_file, capsys):
    new = _service(
        "scorer",
        "1.1.0",
        [{"name": "text", "type": "string", "max_length": 8192}, {"name": "lang", "type": "string", "required": False}],
        [{"name": "score", "type": "float32", "range": [0, 1]}],
    )
    assert _validate(_write(tmp_path, new), "scorer", admin, token_file) == 0
    out = capsys.readouterr().out
    assert "with the running scorer 1.0.0" in out
    assert "additive  input   input field 'lang'" in out and "additive  input   input field 'text'" in out
    assert "BREAKING" not in out and "compatible: 2 additive schema change(s)" in out
    assert admin.paths == ["/v1/models/scorer"]


def test_validate_against_a_breaking_version_exits_1_and_says_why(tmp_path, admin, token_file, capsys):
    new = _service(
        "scorer",
        "2.0.0",
        [{"name": "text", "type": "string", "max_length": 512}],
        [{"name": "score", "type": "float64", "range": [0, 1]}],
    )
    other = _service("chat", "1.0.0", [], [])
    assert _validate(_write(tmp_path, other, new), "scorer", admin, token_file) == 1
    out = capsys.readouterr().out
    assert "BREAKING  input   input field 'text' length changed from max_length 4096 to max_length 512" in out
    assert "BREAKING  output  output field 'score' changed type from float32 to float64" in out
    assert "2 breaking schema change(s) of 2" in out


def test_validate_against_the_same_schemas_says_no_changes(tmp_path, admin, token_file, capsys):
    assert _validate(_write(tmp_path, RUNNING), "scorer", admin, token_file) == 0
    assert "compatible: no schema changes" in capsys.readouterr().out


def test_the_only_model_of_a_file_is_compared_whatever_its_name(tmp_path, admin, token_file, capsys):
    renamed = _service("scorer-v2", "2.0.0", [], [{"name": "score", "type": "float32", "range": [0, 1]}])
    assert _validate(_write(tmp_path, renamed), "scorer", admin, token_file) == 1
    out = capsys.readouterr().out
    assert "comparing scorer-v2 2.0.0" in out and "BREAKING  input   input field 'text'" in out


def test_a_model_that_is_not_running_is_a_clear_error(tmp_path, admin, token_file, capsys):
    path = _write(tmp_path, _service("ranker", "1.0.0", [], []))
    assert _validate(path, "ranker", admin, token_file) == 2
    err = capsys.readouterr().err
    assert "model 'ranker' is not running there (running: scorer)" in err and admin.url in err


def test_a_file_without_the_model_is_a_clear_error(tmp_path, admin, token_file, capsys):
    path = _write(tmp_path, _service("chat", "1.0.0", [], []), _service("ranker", "1.0.0", [], []))
    assert _validate(path, "scorer", admin, token_file) == 2
    err = capsys.readouterr().err
    assert "has no ModelService 'scorer' (it has: chat, ranker)" in err
    assert admin.paths == [], "nothing is asked before the file names the model"


def test_a_control_plane_that_refuses_the_token_is_a_clear_error(tmp_path, admin, capsys):
    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-the-token")
    os.chmod(wrong, 0o600)
    assert _validate(_write(tmp_path, RUNNING), "scorer", admin, wrong) == 2
    assert "status 401 no token" in capsys.readouterr().err


def test_validate_without_against_asks_no_control_plane(tmp_path, capsys):
    assert main(["validate", str(_write(tmp_path, RUNNING)), "--run-dir", str(tmp_path / "no-run")]) == 0
    assert capsys.readouterr().out.startswith("ok  scorer (sim, P1, 1 instance(s))")
