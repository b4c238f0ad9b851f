"""sie.records (wire records from untrusted JSON) and sie.model_files (what a node may load)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from enum import Enum

import pytest

from sie.errors import SpecError
from sie.model_files import ModelFilePolicy, check_model_dir, read_pinned, resolve, spec_may_trust, spec_problems
from sie.records import bounds, decode
from sie.spec import ModelService


class Colour(str, Enum):
    RED = "red"


@dataclass(frozen=True)
class Inner:
    n: int = field(metadata=bounds(low=0, high=10))


@dataclass(frozen=True)
class Outer:
    name: str = field(metadata=bounds(max_len=8))
    colour: Colour
    ratio: float = field(default=0.5, metadata=bounds(low=0, high=1))
    inner: list[Inner] = field(default_factory=list, metadata=bounds(max_items=2))
    tags: dict[str, str] = field(default_factory=dict)
    note: str | None = None


def test_a_record_decodes_with_its_types():
    got = decode(Outer, {"name": "a", "colour": "red", "ratio": 1, "inner": [{"n": 3}], "tags": {"k": "v"}}, "x")
    assert got == Outer("a", Colour.RED, 1.0, [Inner(3)], {"k": "v"}) and isinstance(got.ratio, float)


@pytest.mark.parametrize(
    "data, path",
    [
        ({"colour": "red"}, "name"),
        ({"name": "a" * 9, "colour": "red"}, "name"),
        ({"name": "a", "colour": "blue"}, "colour"),
        ({"name": "a", "colour": "red", "ratio": 2}, "ratio"),
        ({"name": "a", "colour": "red", "ratio": True}, "ratio"),
        ({"name": "a", "colour": "red", "ratio": "0.5"}, "ratio"),
        ({"name": "a", "colour": "red", "inner": [{"n": 1}] * 3}, "inner"),
        ({"name": "a", "colour": "red", "inner": [{"n": 11}]}, "inner[0].n"),
        ({"name": "a", "colour": "red", "inner": [{"n": 1.5}]}, "inner[0].n"),
        ({"name": "a", "colour": "red", "tags": {"k": 1}}, "tags.k"),
        ({"name": "a", "colour": "red", "note": 5}, "note"),
        ({"name": "a", "colour": "red", "surprise": 1}, "surprise"),
        (["not", "an", "object"], ""),
    ],
)
def test_every_wrong_field_is_named(data, path):
    with pytest.raises(SpecError) as err:
        decode(Outer, data, "the record")
    assert path in [p.path for p in err.value.problems], err.value.problems


def _sklearn(path: str, **model) -> ModelService:
    return ModelService.model_validate(
        {"spec": {"model": {"name": "s", "path": path, **model}, "backend": {"type": "sklearn"}}}
    )


def test_pickles_need_the_operator_and_a_pinned_digest():
    strict, lax = ModelFilePolicy(), ModelFilePolicy(allow_unsafe_formats=True)
    assert [p.path for p in spec_problems(_sklearn("m/x.joblib"), strict)] == ["spec.model.path"]
    assert [p.path for p in spec_problems(_sklearn("m/x.PKL"), lax)] == ["spec.model.sha256"]
    assert spec_problems(_sklearn("m/x.pkl", sha256="a" * 64), lax) == []
    assert spec_problems(_sklearn("m/x.skops"), strict) == []
    assert [p.path for p in spec_problems(_sklearn("m/../x.skops"), lax)] == ["spec.model.path"]


@pytest.mark.parametrize(
    "name, trusted",
    [
        ("sklearn.tree._tree.Tree", True),  # what a forest needs
        ("sklearn.neural_network._stochastic_optimizers.AdamOptimizer", True),
        ("joblib.load", False),  # a function that unpickles whatever file the skops file names
        ("builtins.eval", False),
        ("posix.system", False),
        ("subprocess.Popen", False),  # a class, and constructing it runs a command
        ("numpy.memmap", False),  # a class, and constructing it writes a file
        ("mylib.Scaler", False),  # importing another package runs its code
        ("sklearn", False),
        ("sklearnx.Tree", False),
        ("sklearn.tests.test_base.T", False),  # scikit-learn's test code
        ("sklearn.conftest.X", False),
        ("sklearn.tree.._tree", False),
        ("sklearn.tree.Tree;rm", False),
    ],
)
def test_a_spec_alone_may_trust_only_scikit_learns_classes(name, trusted):
    assert spec_may_trust(name) is trusted
    config = {"trusted_types": ["sklearn.tree._tree.Tree", name]}
    svc, pinned = (
        ModelService.model_validate(
            {
                "spec": {
                    "model": {"name": "s", "path": "m/x.skops", **pin},
                    "backend": {"type": "sklearn", "config": config},
                }
            }
        )
        for pin in ({}, {"sha256": "a" * 64})
    )
    problems = [(p.path, repr(name) in p.reason) for p in spec_problems(svc, ModelFilePolicy())]
    assert problems == ([] if trusted else [("spec.backend.config.trusted_types", True)])
    # otherwise what a pickle needs: the operator's leave, then the file pinned
    lax = ModelFilePolicy(allow_unsafe_formats=True)
    assert [p.path for p in spec_problems(svc, lax)] == ([] if trusted else ["spec.model.sha256"])
    assert spec_problems(pinned, lax) == []


@pytest.mark.parametrize(
    "config",
    [
        {"trust_remote_code": True},
        {"trust-remote-code": "true"},
        {"hf_overrides": {"architectures": ["X"]}},
        {"worker_extension_cls": "m.C"},
    ],
)
def test_engine_arguments_that_run_code_need_the_operator(config):
    svc = ModelService.model_validate(
        {"spec": {"model": {"name": "l", "path": "m/l"}, "backend": {"type": "sglang", "config": config}}}
    )
    assert spec_problems(svc, ModelFilePolicy()) and not spec_problems(svc, ModelFilePolicy(allow_remote_code=True))
    off = ModelService.model_validate(
        {
            "spec": {
                "model": {"name": "l", "path": "m/l"},
                "backend": {"type": "sglang", "config": {"trust_remote_code": False}},
            }
        }
    )
    assert spec_problems(off, ModelFilePolicy()) == []


def _engine(backend: str, config: dict) -> ModelService:
    return ModelService.model_validate(
        {"spec": {"model": {"name": "l", "path": "m/l"}, "backend": {"type": backend, "config": config}}}
    )


@pytest.mark.parametrize(
    "config",
    [
        {"trust-remote_code": True},  # mixed spellings
        {"Trust_Remote_Code": True},
        {"trust_remote": True},  # argparse would expand the abbreviation
        {"config": "/tmp/args.yaml"},  # SGLang's file of further arguments
        {"custom_weight_loader": ["evil.module.load"]},
        {"disable_radix_cache": ["--trust-remote-code"]},  # a value read as a flag
        {"dtype": "--trust-remote-code"},
    ],
)
def test_sglang_takes_only_the_arguments_a_spec_may_pass_without_the_operators_leave(config):
    problems = spec_problems(_engine("sglang", config), ModelFilePolicy())
    assert [p.path for p in problems] == [f"spec.backend.config.{next(iter(config))}"]


def test_sglang_tuning_arguments_pass_and_the_operator_may_allow_any():
    tuning = {"dtype": "bfloat16", "chunked_prefill_size": 4096, "cuda_graph_bs_decode": [1, 2, 4], "random_seed": "-1"}
    tuning |= {"tokenizer_path": "/models/tok", "chat_template": "chatml", "max_seq_len": 4096, "tp_size": 2}
    tuning |= {"trust_remote_code": False, "json_model_override_args": None}  # left off the command line
    assert spec_problems(_engine("sglang", tuning), ModelFilePolicy()) == []
    anything = _engine("sglang", {"trust_remote_code": True, "json_model_override_args": {"a": 1}})
    assert spec_problems(anything, ModelFilePolicy(allow_remote_code=True)) == []
    flag_like = _engine("sglang", {"json_model_override_args": "-x"})  # still a flag where it would be a value
    assert [p.path for p in spec_problems(flag_like, ModelFilePolicy(allow_remote_code=True))] == [
        "spec.backend.config.json_model_override_args"
    ]


@pytest.mark.parametrize("key", ["Trust-Remote-Code", "trust_remote", "hf_over", "worker_extension"])
def test_other_engines_refuse_code_arguments_in_any_spelling_or_abbreviation(key):
    problems = spec_problems(_engine("vllm", {key: True}), ModelFilePolicy())
    assert [p.path for p in problems] == [f"spec.backend.config.{key}"]
    assert spec_problems(_engine("vllm", {key: True}), ModelFilePolicy(allow_remote_code=True)) == []
    assert spec_problems(_engine("vllm", {"dtype": "float32"}), ModelFilePolicy()) == []


def test_a_path_resolves_only_under_a_root_with_symlinks_followed(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    (outside / "m.skops").write_bytes(b"x")
    (root / "ok.skops").write_bytes(b"x")
    (root / "escape.skops").symlink_to(outside / "m.skops")
    (root / "sub").symlink_to(outside, target_is_directory=True)
    policy = ModelFilePolicy(roots=(root,))
    assert resolve(root / "ok.skops", policy) == (root / "ok.skops").resolve()
    for bad in (
        outside / "m.skops",
        root / "escape.skops",
        root / "sub" / "m.skops",
        root / "a" / ".." / "ok.skops",
        tmp_path / "rootx" / "m.skops",
    ):
        with pytest.raises(SpecError, match="outside the model roots|contains '..'"):
            resolve(bad, policy)
    with pytest.raises(SpecError, match="no model roots"):
        resolve(root / "ok.skops", ModelFilePolicy())
    assert ModelFilePolicy(roots=(root,), allow_unsafe_formats=True).argv() == [
        "--model-root",
        str(root),
        "--allow-unsafe-model-formats",
    ]


def test_the_bytes_hashed_are_the_bytes_loaded(tmp_path):
    path = tmp_path / "m.pkl"
    path.write_bytes(b"model")
    digest = hashlib.sha256(b"model").hexdigest()
    assert read_pinned(path, digest) == b"model"
    path.write_bytes(b"swapped")
    with pytest.raises(SpecError, match="the file changed"):
        read_pinned(path, digest)
    with pytest.raises(SpecError, match="more than"):
        read_pinned(path, None, limit_bytes=3)
    assert os.path.exists(path)


def _model_dir(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "llm" / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_text("token")
    (root / "llm" / "config.json").write_text("{}")
    (root / "blobs").mkdir()
    (root / "blobs" / "w").write_bytes(b"w")
    # a Hugging Face cache snapshot: links out of the directory, into blobs under the same root
    (root / "llm" / "model.safetensors").symlink_to(root / "blobs" / "w")
    (root / "llm" / "again").symlink_to(root / "llm", target_is_directory=True)  # a loop ends where it began
    return root, outside, ModelFilePolicy(roots=(root,))


def test_a_model_directory_may_link_only_under_the_roots(tmp_path):
    root, outside, policy = _model_dir(tmp_path)
    check_model_dir(resolve(root / "llm", policy), policy)
    check_model_dir(root / "llm" / "config.json", policy)  # a file: resolve has checked it
    check_model_dir(root / "absent", policy)  # a demo model not made yet
    (root / "llm" / "sub" / "chat_template.jinja").symlink_to(outside / "secret")
    with pytest.raises(SpecError, match=r"'sub/chat_template.jinja' is a symlink to .*outside the model roots"):
        check_model_dir(root / "llm", policy)
    (root / "llm" / "sub" / "chat_template.jinja").unlink()
    (root / "llm" / "tokenizer").symlink_to(outside, target_is_directory=True)
    with pytest.raises(SpecError, match="'tokenizer' is a symlink to"):
        check_model_dir(root / "llm", policy, "spec.backend.config.tokenizer_path")


def test_a_model_directory_holds_only_files_and_directories_within_bounds(tmp_path):
    root, _, policy = _model_dir(tmp_path)
    os.mkfifo(root / "llm" / "tokenizer.json")  # opening it would block the loader for ever
    with pytest.raises(SpecError, match="'tokenizer.json' is neither a regular file nor a directory"):
        check_model_dir(root / "llm", policy)
    (root / "llm" / "tokenizer.json").unlink()
    with pytest.raises(SpecError, match="more than 3 entries"):
        check_model_dir(root / "llm", policy, max_entries=3)
    (root / "llm" / "sub" / "a" / "b").mkdir(parents=True)
    with pytest.raises(SpecError, match="'sub/a/b' is more than 2 directories deep"):
        check_model_dir(root / "llm", policy, max_depth=2)
    check_model_dir(root / "llm", policy, max_depth=3)
