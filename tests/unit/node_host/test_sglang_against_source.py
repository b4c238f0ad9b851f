"""SIE's SGLang adapter against SGLang's own server code, without SGLang.

SGLang needs a CUDA GPU, so no test here runs it. tests/fixtures/sglang/<version>.json holds what the
adapter depends on, read from each release's source by tests/fixtures/sglang/extract.py: the flags of
`python -m sglang.launch_server`, the HTTP routes with their methods, the `sglang:*` metrics, the keys of
the /v1/loads answer, the memory-occupation tags and the SGLANG_* environment. Every test runs against
every fixture inside the pin SIE declares (pyproject's `sglang` extra); a fixture outside it fails.

What SIE sends or reads that a release does not have is a strict xfail naming what the release has
instead (KNOWN_* below): fix SIE and the case turns into a failure that says to drop the mark.
"""

from __future__ import annotations

import ast
import asyncio
import json
import tomllib
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.version import Version
from prometheus_client.parser import text_string_to_metric_families

from node_host.backends.sglang_server import launch
from sie import metric_names, worker_loads
from sie.engine_settings import sglang_args
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService
from sie_testing import sglang_standin

ROOT = Path(__file__).resolve().parents[3]
FIXTURE_DIR = ROOT / "tests" / "fixtures" / "sglang"
FIXTURES: dict[str, dict[str, Any]] = {
    p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(FIXTURE_DIR.glob("*.json"))
}


def _pin() -> Requirement:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    (requirement,) = (Requirement(r) for r in extras["sglang"] if Requirement(r).name == "sglang")
    return requirement


PIN = _pin()
PINNED = sorted((v for v in FIXTURES if PIN.specifier.contains(v)), key=Version)

# (version or None for every version, what) -> what that release has instead. Each is a defect in SIE.
KNOWN_ALLOWLIST: dict[tuple[str | None, str], str] = {}
KNOWN_DEPRECATED = {
    (
        None,
        "disable_cuda_graph",
    ): "deprecated: use --cuda-graph-backend-decode=disabled / --cuda-graph-backend-prefill=disabled",
    ("0.5.23", "enable_dp_attention"): (
        "deprecated: use --attn-dp-size <dp-size> instead of --dp-size N --enable-dp-attention "
        "(server_args.py: flag to be removed after 2026-12-31)"
    ),
}
_NO_AGGREGATE = "the /v1/loads answer is {timestamp, version, accelerator, num_accelerators, loads}: no 'aggregate'"
KNOWN_LOADS = {
    (None, "top_level", "aggregate"): _NO_AGGREGATE + " (an older SGLang's v1_loads._compute_aggregate made it)",
    (None, "aggregate", "total_running_reqs"): _NO_AGGREGATE,
    (None, "aggregate", "total_waiting_reqs"): _NO_AGGREGATE,
    (None, "aggregate", "avg_token_usage"): _NO_AGGREGATE,
    (
        None,
        "per_rank",
        "num_queue_reqs",
    ): "per-rank objects say num_waiting_reqs; num_queue_reqs is only a /metrics gauge",
}
KNOWN_STANDIN_OPTIONS: dict[tuple[str | None, str, str], str] = {}
KNOWN_STANDIN_LOADS = {
    (None, "top_level", "dp_rank_count"): "not in the answer: it has accelerator and num_accelerators instead",
    (None, "top_level", "aggregate"): _NO_AGGREGATE,
    (
        None,
        "per_rank",
        "num_total_reqs",
    ): "not a LoadSnapshot field (num_total_tokens is; requests are running + waiting)",
}


def _cases(items: Any, known: dict[tuple, str]) -> list[Any]:
    """pytest params (version, *item) over every pinned fixture, known mismatches as strict xfails."""
    out = []
    for version in PINNED:
        for item in items(FIXTURES[version]) if callable(items) else items:
            key = item if isinstance(item, tuple) else (item,)
            reason = known.get((version, *key)) or known.get((None, *key))
            marks = [pytest.mark.xfail(strict=True, reason=f"SGLang {version}: {reason}")] if reason else []
            out.append(pytest.param(version, *key, id="-".join((version, *map(str, key))), marks=marks))
    return out


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


# ---- the fixtures and the pin ----------------------------------------------------------------------


def test_a_fixture_is_there_for_the_pinned_sglang_and_none_outside_the_pin():
    assert PINNED, f"no fixture in {FIXTURE_DIR} for {PIN}: run tests/fixtures/sglang/extract.py on that release"
    stale = sorted(set(FIXTURES) - set(PINNED))
    assert not stale, f"fixtures {stale} are outside the pin {PIN}: regenerate for the pinned release, delete these"


@pytest.mark.parametrize("version", sorted(FIXTURES))
def test_each_fixture_names_its_release_and_how_it_was_made(version):
    header = FIXTURES[version]["header"]
    assert header["sglang_version"] == version
    assert (ROOT / header["extracted_by"]).is_file()
    assert header["files"] and all(f.startswith("python/sglang/") for f in header["files"])
    assert header["commit"] or "wheel" in header["source"]  # a wheel records no commit; its source says which


# ---- the launch command ----------------------------------------------------------------------------


def _full_launch(tmp_path: Path, *, engine_args: bool = True) -> list[str]:
    """launch_command with every optional argument set, and (engine_args) pass-through engine arguments of
    each value shape; without them, the flags are only those node_host sets itself."""
    root = tmp_path / "models"
    (root / "llm").mkdir(parents=True)
    (root / "tok").mkdir()
    (root / "chat.jinja").write_text("{{ messages }}")
    config: dict[str, Any] = {
        "max_seq_len": 8192,
        "max_total_tokens": 65_536,
        "tp_size": 2,
    }
    if engine_args:
        config |= {
            "chunked_prefill_size": 4096,  # a value
            "disable_radix_cache": True,  # a bare flag
            "tokenizer_path": str(root / "tok"),  # a path resolved under the model roots
            "chat_template": str(root / "chat.jinja"),
        }
    spec = ModelService.model_validate(
        {
            "spec": {
                "model": {"name": "qwen", "path": str(root / "llm")},
                "backend": {"type": "sglang", "config": config},
                "resources": {"max_concurrent_requests": 48},
            }
        }
    )
    return launch.launch_command(
        spec,
        "127.0.0.1",
        30001,
        None,
        free_mb=80_000,
        budget_mb=24_000,
        nccl_port=30002,
        api_key="k",
        files=ModelFilePolicy(roots=(root,)),
        python="/usr/bin/python3",
    )


def _flags_used(argv: list[str]) -> dict[str, bool]:
    """Each --flag of a command line -> whether it was given a value."""
    out: dict[str, bool] = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            name, eq, _ = word.partition("=")
            out[name] = bool(eq) or (i + 1 < len(argv) and not argv[i + 1].startswith("--"))
    return out


@pytest.mark.parametrize("version", PINNED)
def test_every_flag_launch_command_emits_is_a_real_flag_taking_a_value_as_sglang_expects(version, tmp_path):
    argv = _full_launch(tmp_path)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    flags = FIXTURES[version]["flags"]
    used = _flags_used(argv[3:])
    assert {"--api-key", "--nccl-port", "--context-length", "--chat-template"} <= set(used)  # every option was set
    unknown = sorted(set(used) - set(flags))
    assert not unknown, f"SGLang {version} has no {unknown}"
    wrong = {f: v for f, v in used.items() if flags[f]["takes_value"] not in (None, v)}
    assert not wrong, f"SGLang {version}: these flags take a value iff False here: {wrong}"
    deprecated = {f: flags[f].get("use") for f in used if flags[f].get("deprecated")}
    assert not deprecated, f"SGLang {version} deprecates {deprecated}"


@pytest.mark.parametrize(
    "version, key", _cases(sorted(sglang_args.PASS_THROUGH | sglang_args.PATH_ARGS), KNOWN_ALLOWLIST)
)
def test_every_engine_argument_a_spec_may_pass_is_a_real_flag(version, key):
    # Exactly, not as an abbreviation: argparse takes a unique prefix, which the next release can make
    # ambiguous (--cuda-graph-bs) or point at another flag (--enable-flashinfer).
    assert _flag(key) in FIXTURES[version]["flags"]


@pytest.mark.parametrize(
    "version, key",
    _cases(
        lambda fx: sorted(k for k in sglang_args.PASS_THROUGH | sglang_args.PATH_ARGS if _flag(k) in fx["flags"]),
        KNOWN_DEPRECATED,
    ),
)
def test_no_engine_argument_a_spec_may_pass_is_deprecated(version, key):
    flag = FIXTURES[version]["flags"][_flag(key)]
    assert not flag.get("deprecated"), f"use {flag.get('use')}"


@pytest.mark.parametrize("version", PINNED)
def test_every_spelling_of_a_flag_node_host_sets_is_refused_as_an_engine_argument(version, tmp_path):
    # Aliases included (--model, --tensor-parallel-size): a spec passing one would fight the ledger.
    flags = FIXTURES[version]["flags"]
    dests = {flags[f]["dest"] for f in _flags_used(_full_launch(tmp_path, engine_args=False)[3:]) if f in flags}
    assert {"model_path", "port", "mem_fraction_static", "api_key"} <= dests
    accepted = []
    for spelling in sorted(f for f, v in flags.items() if v["dest"] in dests and f.startswith("--")):
        key = spelling[2:].replace("-", "_")
        if key in sglang_args.SPEC_KEYS:
            continue  # SIE reads these itself and never passes them on
        try:
            launch.engine_args({key: "1"})
        except launch.SGLangConfigError:
            continue
        accepted.append(spelling)
    assert not accepted, f"backend.config may set {accepted}, which node_host sets itself"


@pytest.mark.parametrize("version", PINNED)
def test_the_environment_node_host_sets_is_sglangs(version):
    env = FIXTURES[version]["environment"]
    ours = {k: v for k, v in launch.launch_env([0]).items() if k.startswith("SGLANG_")}
    assert ours and set(ours) <= set(env), f"SGLang {version} has no {sorted(set(ours) - set(env))}"
    assert all(env[k]["type"] == "EnvBool" for k in ours if ours[k] in ("0", "1"))


# ---- routes ----------------------------------------------------------------------------------------

# How node_host uses each path: memory_call's (path, JSON body) is POSTed; the probes are GETs.
SIE_ROUTES = [
    ("RELEASE_PATH", "POST"),
    ("RESUME_PATH", "POST"),
    ("HEALTH_PATH", "GET"),
    ("LOADS_PATH", "GET"),
    ("METRICS_PATH", "GET"),
]


def _serving(fixture: dict[str, Any], path: str, method: str) -> list[dict]:
    """The routes (or mounts) of a release that answer `method path` under their default names."""
    return [
        r
        for r in fixture["routes"]
        if r["env"] is None
        and (method in r["methods"] or "*" in r["methods"])
        and (r["path"] == path if r["kind"] == "route" else path == r["path"] or path.startswith(r["path"] + "/"))
    ]


@pytest.mark.parametrize("version, name, method", _cases(SIE_ROUTES, {}))
def test_the_paths_launch_calls_are_real_routes_with_that_method(version, name, method, tmp_path):
    path = getattr(launch, name)
    routes = _serving(FIXTURES[version], path, method)
    assert routes, f"SGLang {version} does not answer {method} {path}"
    # A route registered under a condition must have it met by a flag node_host passes (/metrics needs
    # --enable-metrics); any other condition is one SIE does not control.
    bare = {f[2:].replace("-", "_") for f, v in _flags_used(_full_launch(tmp_path)[3:]).items() if not v}
    unmet = [r for r in routes if r["condition"] and not any(d in r["condition"] for d in bare)]
    assert len(unmet) < len(routes), f"{method} {path} exists only when {[r['condition'] for r in unmet]}"


@pytest.mark.parametrize("version", PINNED)
def test_the_memory_tags_are_sglangs(version):
    tags = set(FIXTURES[version]["memory_tags"]["all"])
    assert set(launch.MEMORY_TAGS) == tags
    assert set(sglang_standin.TAGS) == tags


# ---- metrics ---------------------------------------------------------------------------------------

SIE_SGLANG_METRICS = sorted(
    v
    for k, v in vars(metric_names).items()
    if k.startswith("SGLANG_") and isinstance(v, str) and v.startswith("sglang:")
)


def _names_used_in(function: str) -> set[str]:
    """The metric_names constants a function of sie/worker_loads.py reads (`M.SGLANG_...`)."""
    tree = ast.parse(Path(worker_loads.__file__).read_text(encoding="utf-8"))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    return {
        getattr(metric_names, n.attr)
        for n in ast.walk(fn)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "M"
    }


def test_sie_names_sglang_metrics():
    assert len(SIE_SGLANG_METRICS) >= 6  # the constants are found at all
    assert _names_used_in("parse_metrics_text") <= set(SIE_SGLANG_METRICS)


@pytest.mark.parametrize("version, name", _cases(SIE_SGLANG_METRICS, {}))
def test_every_sglang_metric_sie_names_is_exported(version, name):
    assert name in FIXTURES[version]["metrics"]


@pytest.mark.parametrize("version, name", _cases(sorted(_names_used_in("parse_metrics_text")), {}))
def test_the_metrics_sie_reads_as_gauges_are_gauges(version, name):
    # parse_metrics_text compares sample names to these: a histogram's samples are _bucket/_sum/_count.
    assert FIXTURES[version]["metrics"][name]["type"] == "Gauge"


# ---- /v1/loads -------------------------------------------------------------------------------------


def _loads_keys_sie_reads() -> list[tuple[str, str]]:
    """(where, key) for every key sie/worker_loads.py reads from a /v1/loads answer: `doc.get(k)` on the
    answer, `r.get(k)` on a per-rank object, _AGGREGATE_NAMES' keys in the "aggregate" object."""
    tree = ast.parse(Path(worker_loads.__file__).read_text(encoding="utf-8"))
    receivers = {"doc": "top_level", "r": "per_rank"}
    out: set[tuple[str, Any]] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name)
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            where = receivers.get(node.func.value.id)
            assert where, f"worker_loads reads .get() on {node.func.value.id!r}: teach this test what it is"
            out.add((where, node.args[0].value))
    out |= {("aggregate", k) for k in worker_loads._AGGREGATE_NAMES}
    return sorted(out)


def _answer_has(fixture: dict[str, Any], where: str, key: str) -> bool:
    loads = fixture["v1_loads"]
    if where == "top_level":
        return key in loads["top_level"]
    if where == "per_rank":
        return key in loads["per_rank"]
    return key in loads["sections"].get(where, [])  # a nested object (SGLang has none named "aggregate")


def test_sie_reads_load_keys():
    keys = _loads_keys_sie_reads()
    assert ("top_level", "loads") in keys and ("per_rank", "num_running_reqs") in keys


@pytest.mark.parametrize("version, where, key", _cases(_loads_keys_sie_reads(), KNOWN_LOADS))
def test_every_loads_key_sie_reads_is_in_the_answer(version, where, key):
    assert FIXTURES[version]["v1_loads"], f"SGLang {version} has no /v1/loads"
    assert _answer_has(FIXTURES[version], where, key)


# ---- the stand-in ----------------------------------------------------------------------------------


def _standin() -> sglang_standin.StandIn:
    args = sglang_standin.build_parser().parse_args(
        ["--model-path", "m", "--max-total-tokens", "100", "--enable-metrics", "--enable-memory-saver"]
    )
    return sglang_standin.StandIn(args, startup_delay_s=0, token_delay_s=0)


def _standin_routes() -> list[tuple[str, str]]:
    app = sglang_standin.make_app(_standin())
    return sorted({(r.method, r.resource.canonical) for r in app.router.routes() if r.resource and r.method != "HEAD"})


@pytest.mark.parametrize("version, method, path", _cases(_standin_routes(), {}))
def test_the_stand_in_serves_only_routes_the_real_server_has(version, method, path):
    assert _serving(FIXTURES[version], path, method), f"SGLang {version} does not answer {method} {path}"


def _resolves(fixture: dict[str, Any], option: str) -> str | None:
    """The dest SGLang's parser gives `option`: exact, or (allow_abbrev) a prefix of exactly one flag."""
    flags = fixture["flags"]
    if option in flags:
        return flags[option]["dest"]
    longer = [f for f in flags if f.startswith(option)]
    return flags[longer[0]]["dest"] if fixture["parser"]["allow_abbrev"] and len(longer) == 1 else None


def _standin_options() -> list[tuple[str, str]]:
    parser = sglang_standin.build_parser()
    return sorted(
        (o, a.dest) for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"
    )


@pytest.mark.parametrize("version, option, dest", _cases(_standin_options(), KNOWN_STANDIN_OPTIONS))
def test_the_stand_in_takes_only_flags_the_real_server_takes_with_the_same_meaning(version, option, dest):
    real = _resolves(FIXTURES[version], option)
    assert real is not None, f"SGLang {version}'s parser refuses {option} (exit status 2)"
    if not FIXTURES[version]["flags"].get(option, {}).get("deprecated"):  # a deprecated alias writes the new field
        assert real == dest


def _standin_loads_keys() -> list[tuple[str, str]]:
    response = asyncio.run(_standin().loads(None))  # type: ignore[arg-type]
    doc = json.loads(response.text or "")
    return sorted({("top_level", k) for k in doc} | {("per_rank", k) for r in doc["loads"] for k in r})


@pytest.mark.parametrize("version, where, key", _cases(_standin_loads_keys(), KNOWN_STANDIN_LOADS))
def test_the_stand_ins_loads_answer_has_only_keys_the_real_one_has(version, where, key):
    assert _answer_has(FIXTURES[version], where, key)


def _standin_metrics() -> list[tuple[str, str]]:
    response = asyncio.run(_standin().metrics(None))  # type: ignore[arg-type]
    return sorted((f.name, f.type) for f in text_string_to_metric_families(response.text or ""))


@pytest.mark.parametrize("version, name, kind", _cases(_standin_metrics(), {}))
def test_the_stand_ins_metrics_are_sglangs_with_the_same_type(version, name, kind):
    assert FIXTURES[version]["metrics"][name]["type"].lower() == kind


def test_the_stand_in_is_checked_at_all():
    assert len(_standin_routes()) >= 10 and len(_standin_options()) >= 20 and _standin_metrics()
    assert isinstance(_standin().args, Namespace)
