"""Model files are not code by accident (DESIGN §10), tried through the admin API of the running stack with
files an attacker could plant: a pickle that runs a command when loaded, a skops file whose estimator is
`os.system`, a pickle renamed .skops, a file outside the model root, a symlink out of it, `..`, remote
code, and a demo model aimed outside the root. Each is refused with the reason, the planted code never
runs (its marker file never appears), nothing is written outside the root, and gold keeps serving."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest

from tests.integration.standalone_helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


class _Payload:
    """Unpickling this runs `touch MARKER`: what a hostile model file does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture()
def planted(target, tmp_path):
    """Hostile files inside and outside the stack's model root, and the marker they would create."""
    root = target.stack.workdir / "models"
    outside = tmp_path / "outside"
    outside.mkdir()
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Payload(marker))
    (root / "evil.pkl").write_bytes(evil)
    (root / "evil.skops").write_bytes(evil)  # a pickle under a safe name
    shutil.copy(root / "scorer.skops", outside / "scorer.skops")  # a genuine model, in the wrong place
    if not (root / "link.skops").exists():
        (root / "link.skops").symlink_to(outside / "scorer.skops")
    import skops.io as sio
    from sklearn.preprocessing import FunctionTransformer

    (root / "system.skops").write_bytes(sio.dumps(FunctionTransformer(os.system)))
    yield {"root": root, "outside": outside, "marker": marker}
    assert not marker.exists(), "a planted model file ran code"


def _scorer(name: str, path: str, **config) -> dict:
    return {
        "kind": "ModelService",
        "spec": {
            "model": {"name": name, "path": path, "service_type": "scoring", "priority_level": "P2"},
            "backend": {"type": "sklearn", "config": config},
            "input_schema": {"fields": [{"name": "text", "type": "string", "max_length": 64}]},
        },
    }


def _post(target, doc) -> tuple[int, dict]:
    code, _, body = target.stack.request("POST", target.stack.admin + "/v1/models", doc)
    return code, body


def _refused_on_the_node(target, name: str, why: str) -> None:
    """The model was accepted, and its node host refused to run it, saying why; then it is removed."""
    try:
        row = wait_until(
            lambda: next(
                (
                    i
                    for i in target.instances()
                    if i["model_id"] == name and i["state"] == "failed" and why in (i.get("detail") or "")
                ),
                None,
            ),
            60,
            f"{name} refused ({why})",
        )
        assert "refused" in row["detail"] or "worker" in row["detail"], row
    finally:
        target.stack.request("DELETE", target.stack.admin + f"/v1/models/{name}")


@pytest.mark.parametrize(
    "path, model, field, why",
    [
        ("models/evil.pkl", {}, "spec.model.path", "pickle/joblib files run code"),
        ("models/../models/scorer.skops", {}, "spec.model.path", "contains '..'"),
        ("models/evil.pkl", {"sha256": "0" * 64}, "spec.model.path", "pickle/joblib"),  # pinned, but not allowed
    ],
)
def test_a_spec_naming_an_unsafe_file_is_refused_by_the_admin_api(target, planted, path, model, field, why):
    doc = _scorer("hostile", path)
    doc["spec"]["model"].update(model)
    code, body = _post(target, doc)
    assert code == 400 and body["error"]["type"] == "invalid_spec", body
    assert any(p["path"] == field and why in p["reason"] for p in body["error"]["problems"]), body
    assert "hostile" not in {m["model_id"] for m in target.stack.status()["models"]}
    target.gold_serves()


@pytest.mark.parametrize("key", ["trust_remote_code", "tokenizer_trust_remote_code", "hf_overrides"])
def test_engine_arguments_that_run_model_code_are_refused(target, key):
    doc = {
        "kind": "ModelService",
        "spec": {
            "model": {"name": "remote", "path": "models/llm"},
            "backend": {"type": "torch", "config": {key: True}},
        },
    }
    code, body = _post(target, doc)
    assert code == 400 and any(p["path"] == f"spec.backend.config.{key}" for p in body["error"]["problems"]), body
    target.gold_serves()


def test_a_file_outside_the_model_root_is_never_loaded(target, planted):
    code, body = _post(target, _scorer("outsider", str(planted["outside"] / "scorer.skops")))
    assert code == 201, body
    _refused_on_the_node(target, "outsider", "outside the model roots")
    target.gold_serves()


def test_a_symlink_out_of_the_model_root_is_followed_and_refused(target, planted):
    code, body = _post(target, _scorer("linked", "models/link.skops"))
    assert code == 201, body
    _refused_on_the_node(target, "linked", "outside the model roots")


def test_a_demo_model_is_written_only_under_a_model_root(target, planted):
    aimed = planted["outside"] / "fresh" / "demo.skops"
    code, body = _post(target, _scorer("demo-elsewhere", str(aimed), demo=True))
    assert code == 201, body
    _refused_on_the_node(target, "demo-elsewhere", "outside the model roots")
    assert not aimed.parent.exists()


@pytest.mark.parametrize("name, path", [("disguised", "models/evil.skops"), ("system", "models/system.skops")])
def test_a_hostile_file_with_a_safe_name_fails_to_load_and_runs_nothing(target, planted, name, path):
    code, body = _post(target, _scorer(name, path))
    assert code == 201, body
    try:
        log = target.stack.run_dir / "logs" / f"{name}-0.worker.log"
        wait_until(
            lambda: (
                log.exists() and ("not a skops file" in log.read_text() or "skops does not trust" in log.read_text())
            ),
            60,
            f"{name}'s worker refuses the file",
        )
        assert all(i["state"] != "ready" for i in target.instances() if i["model_id"] == name)
    finally:
        target.stack.request("DELETE", target.stack.admin + f"/v1/models/{name}")
    target.gold_serves()


def test_a_spec_trusting_a_function_for_skops_is_refused_by_the_admin_api(target):
    """skops calls a trusted type with arguments from the file: trusting joblib.load would unpickle
    whatever file the model names, so it needs what a pickle needs (not allowed on this stack)."""
    code, body = _post(target, _scorer("trusting", "models/scorer.skops", trusted_types=["joblib.load"]))
    assert code == 400 and body["error"]["type"] == "invalid_spec", body
    assert any(
        p["path"] == "spec.backend.config.trusted_types" and "'joblib.load'" in p["reason"]
        for p in body["error"]["problems"]
    ), body
    target.gold_serves()


def test_a_model_directory_linking_out_of_the_root_is_refused_before_its_worker_starts(target, planted):
    """transformers follows every symlink in a model directory (config.json, chat_template.jinja): one
    that leaves the root is refused by the node host before any process starts."""
    from node_host.backends.torch_engine.demo_model import ensure_tiny_qwen2

    model = ensure_tiny_qwen2(planted["root"] / "linked-llm")
    secret = planted["outside"] / "secret-token"
    secret.write_text("not for the model")
    (model / "chat_template.jinja").unlink()
    (model / "chat_template.jinja").symlink_to(secret)
    doc = {
        "kind": "ModelService",
        "spec": {
            "model": {"name": "linked-llm", "path": "models/linked-llm", "priority_level": "P2"},
            "backend": {"type": "torch", "config": {"device": "cpu"}},
        },
    }
    code, body = _post(target, doc)
    assert code == 201, body
    _refused_on_the_node(target, "linked-llm", "'chat_template.jinja' is a symlink to")
    assert not (target.stack.run_dir / "logs" / "linked-llm-0.worker.log").exists()
    target.gold_serves()
