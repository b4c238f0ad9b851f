import pytest

from node_host.backends.sglang_server.launch import (
    NotDrainedError,
    SequentialStarter,
    SGLangConfigError,
    engine_args,
    launch_command,
    launch_env,
    mem_fraction_for,
    memory_call,
)
from sie.errors import SpecError
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService
from sie.worker_loads import EngineLoad, LoadsFormatError, parse_loads
from sie.worker_loads import parse_metrics_text as parse_metrics


def service(config=None, resources=None, path="/models/qwen2-7b"):
    return ModelService.model_validate(
        {
            "spec": {
                "model": {"name": "qwen", "path": path},
                "backend": {"type": "sglang", "config": config or {}},
                "resources": resources or {"max_concurrent_requests": 48},
            }
        }
    )


def flag_value(args, flag):
    return args[args.index(flag) + 1]


@pytest.mark.parametrize(
    "budget, free, fraction",
    [
        (20_000, 80_000, 0.25),
        (20_000, 60_000, 0.333),  # rounded down: never more than the budget
        (1, 80_000, 0.01),  # clamped up to the smallest fraction SGLang is given
        (76_000, 80_000, 0.95),
    ],
)
def test_mem_fraction_is_budget_over_free_memory_at_start(budget, free, fraction):
    assert mem_fraction_for(budget, free) == fraction
    assert mem_fraction_for(budget, free) * free <= max(budget, 0.01 * free)


@pytest.mark.parametrize(
    "budget, free, fragment", [(77_000, 80_000, "needs 5% left"), (10, 0, "no free GPU memory"), (0, 10, "positive")]
)
def test_mem_fraction_refuses_what_cannot_be_honoured(budget, free, fragment):
    with pytest.raises(SGLangConfigError, match=fragment):
        mem_fraction_for(budget, free)


def test_launch_command_carries_the_budget_ports_and_flags():
    args = launch_command(
        service({"max_seq_len": 8192, "max_total_tokens": 65_536, "tp_size": 2}),
        "127.0.0.1",
        30001,
        None,
        free_mb=80_000,
        budget_mb=24_000,
        nccl_port=30002,
        python="/usr/bin/python3",
    )
    assert args[:3] == ["/usr/bin/python3", "-m", "sglang.launch_server"]
    expected = {
        "--model-path": "/models/qwen2-7b",
        "--served-model-name": "qwen",
        "--host": "127.0.0.1",
        "--port": "30001",
        "--nccl-port": "30002",
        "--mem-fraction-static": "0.3",
        "--max-total-tokens": "65536",
        "--max-running-requests": "48",
        "--context-length": "8192",
        "--tp-size": "2",
    }
    assert {flag: flag_value(args, flag) for flag in expected} == expected
    for flag in ("--enable-metrics", "--enable-memory-saver", "--enable-weights-cpu-backup", "--skip-server-warmup"):
        assert flag in args
    assert "--max-seq-len" not in args  # spec fields are translated, not passed through


def test_launch_defaults_kv_budget_and_omits_what_the_spec_does_not_say():
    args = launch_command(service(), "127.0.0.1", 30001, 0.2)
    assert flag_value(args, "--max-total-tokens") == "32768"
    assert "--context-length" not in args and "--nccl-port" not in args
    assert flag_value(args, "--mem-fraction-static") == "0.2"


def test_an_oom_cut_kv_budget_reaches_max_total_tokens_and_is_no_flag():
    args = launch_command(service({"kv_budget_scale": 0.5}), "127.0.0.1", 30001, 0.2)
    assert flag_value(args, "--max-total-tokens") == "16384"
    assert "--kv-budget-scale" not in args
    with pytest.raises(SGLangConfigError, match="kv_budget_scale must be a fraction"):
        launch_command(service({"kv_budget_scale": 2}), "127.0.0.1", 30001, 0.2)


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"chunked_prefill_size": 4096}, ["--chunked-prefill-size=4096"]),
        ({"disable_radix_cache": True}, ["--disable-radix-cache"]),
        ({"disable_radix_cache": False}, []),
        ({"attention_backend": None}, []),
        ({"cuda_graph_bs_decode": [1, 2, 4]}, ["--cuda-graph-bs-decode", "1", "2", "4"]),
        (
            {"json_model_override_args": {"rope_scaling": {"factor": 2}}},
            ['--json-model-override-args={"rope_scaling":{"factor":2}}'],
        ),
        ({"dtype": "bfloat16", "trust_remote_code": True}, ["--dtype=bfloat16", "--trust-remote-code"]),
        ({"Random-Seed": "-1"}, ["--random-seed=-1"]),  # the spelling that was checked; a negative number
    ],
)
def test_engine_args_pass_through(extra, expected):
    assert engine_args(extra) == expected


@pytest.mark.parametrize(
    "key, managed",
    [
        ("port", "is port"),
        ("mem_fraction_static", "is mem_fraction_static"),
        ("max_running_requests", "is max_running_requests"),
        ("enable_metrics", "is enable_metrics"),
        ("mem-fraction-static", "is mem_fraction_static"),
        ("MEM_fraction", "abbreviates mem_fraction_static"),  # argparse takes any unambiguous prefix
        ("model", "is model"),  # SGLang's alias of --model-path
        ("tensor-parallel-size", "is tensor_parallel_size"),
    ],
)
def test_engine_args_that_fight_the_ledger_are_refused(key, managed):
    with pytest.raises(SGLangConfigError, match=f"backend.config.{key} {managed}, which node_host sets"):
        launch_command(service({key: 1}), "127.0.0.1", 1, 0.5)


@pytest.mark.parametrize("items", [["--trust-remote-code"], [1, "-x"], [{"a": 1}]])
def test_a_value_that_would_read_as_a_flag_is_refused(items):
    with pytest.raises(SGLangConfigError, match="cuda_graph_bs_decode"):
        engine_args({"cuda_graph_bs_decode": items})
    with pytest.raises(SGLangConfigError, match="tokenizer_path: '--trust-remote-code' starts with '-'"):
        engine_args({"tokenizer_path": "--trust-remote-code"})
    assert engine_args({"cuda_graph_bs_decode": [1, -2, "-3.5"]}) == ["--cuda-graph-bs-decode", "1", "-2", "-3.5"]


def test_file_naming_arguments_and_the_model_path_are_resolved_under_the_model_roots(tmp_path):
    root = tmp_path / "models"
    (root / "llm").mkdir(parents=True)
    (root / "tok").mkdir()
    (root / "chat.jinja").write_text("{{ messages }}")
    files = ModelFilePolicy(roots=(root,))
    builtin = launch_command(service({"chat_template": "chatml"}, path=str(root / "llm")), "h", 1, 0.5, files=files)
    assert "--chat-template=chatml" in builtin  # one of SGLang's own templates, by name
    inside = {"tokenizer_path": str(root / "tok"), "chat_template": str(root / "chat.jinja")}
    args = launch_command(service(inside, path=str(root / "llm") + "/"), "127.0.0.1", 1, 0.5, files=files)
    assert flag_value(args, "--model-path") == str((root / "llm").resolve())
    assert f"--tokenizer-path={(root / 'tok').resolve()}" in args
    assert f"--chat-template={(root / 'chat.jinja').resolve()}" in args
    for key, outside in (("tokenizer_path", "/etc"), ("chat_template", "/etc/passwd")):
        with pytest.raises(SpecError, match=f"spec.backend.config.{key}.*outside the model roots"):
            launch_command(service({key: outside}, path=str(root / "llm")), "127.0.0.1", 1, 0.5, files=files)
    with pytest.raises(SpecError, match="spec.model.path.*outside the model roots"):
        launch_command(service(path="/etc"), "127.0.0.1", 1, 0.5, files=files)


def test_a_model_or_tokenizer_directory_linking_out_of_the_roots_is_refused(tmp_path):
    root, outside = tmp_path / "models", tmp_path / "outside"
    (root / "llm").mkdir(parents=True)
    (root / "tok").mkdir()
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    (root / "llm" / "config.json").symlink_to(outside / "config.json")
    (root / "tok" / "tokenizer.json").symlink_to(outside / "config.json")
    files = ModelFilePolicy(roots=(root,))
    with pytest.raises(SpecError, match="spec.model.path.*'config.json' is a symlink to .*outside the model roots"):
        launch_command(service(path=str(root / "llm")), "127.0.0.1", 1, 0.5, files=files)
    (root / "llm" / "config.json").unlink()
    with pytest.raises(SpecError, match="spec.backend.config.tokenizer_path.*'tokenizer.json' is a symlink"):
        launch_command(service({"tokenizer_path": str(root / "tok")}, path=str(root / "llm")), "h", 1, 0.5, files=files)


def test_launch_needs_a_model_path_and_a_fraction():
    with pytest.raises(SGLangConfigError, match="needs model.path"):
        launch_command(service(path=None), "127.0.0.1", 1, 0.5)
    with pytest.raises(SGLangConfigError, match="budget_mb and free_mb"):
        launch_command(service(), "127.0.0.1", 1, None, budget_mb=1000)


def test_launch_env_pins_the_gpus():
    assert launch_env([2, 3]) == {"CUDA_VISIBLE_DEVICES": "2,3", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}


@pytest.mark.parametrize(
    "action, in_flight, queued, tags, expected",
    [
        ("release", 0, 0, None, ("/release_memory_occupation", {})),
        ("release", 0, 0, ["kv_cache"], ("/release_memory_occupation", {"tags": ["kv_cache"]})),
        ("resume", 3, 1, None, ("/resume_memory_occupation", {})),  # waking with requests waiting is the point
        ("release", 1, 0, None, NotDrainedError),
        ("release", 0, 2, None, NotDrainedError),
        ("release", 0, 0, ["optimizer"], SGLangConfigError),
        ("pause", 0, 0, None, SGLangConfigError),
    ],
)
def test_memory_calls_release_only_when_drained(action, in_flight, queued, tags, expected):
    if isinstance(expected, type):
        with pytest.raises(expected):
            memory_call(action, in_flight=in_flight, queued=queued, tags=tags)
    else:
        assert memory_call(action, in_flight=in_flight, queued=queued, tags=tags) == expected


def test_sequential_starter_one_start_per_gpu():
    s = SequentialStarter()
    s, now = s.submit("a", [0])
    assert now == ("a",)
    s, now = s.submit("b", [0])
    assert now == ()  # GPU 0 is busy starting a
    s, now = s.submit("c", [1])
    assert now == ("c",)  # another GPU starts in parallel
    s, now = s.submit("a", [0])
    assert now == ()  # resubmitting a running start changes nothing
    s, now = s.finished("a")
    assert now == ("b",)
    s, now = s.finished("b")
    assert now == () and s.starting == {1: "c"}


def test_sequential_starter_does_not_starve_tensor_parallel_starts():
    s = SequentialStarter()
    s, _ = s.submit("a", [0])
    s, now = s.submit("tp", [0, 1])
    assert now == ()
    s, now = s.submit("late", [1])
    assert now == ()  # GPU 1 is free, but tp asked for it first
    s, now = s.finished("a")
    assert now == ("tp",)
    s, now = s.finished("tp")
    assert now == ("late",)


def test_sequential_starter_forgets_a_waiter_that_was_cancelled():
    s = SequentialStarter()
    s, _ = s.submit("a", [0])
    s, _ = s.submit("b", [0])
    s, now = s.finished("b")  # cancelled before it started
    assert now == () and s.waiting == ()


REAL_LOADS = {  # the shape SGLang's /v1/loads router returns, two DP ranks
    "timestamp": "2026-01-01T00:00:00+00:00",
    "version": "0.5.23",
    "dp_rank_count": 2,
    "loads": [
        {
            "dp_rank": 0,
            "num_running_reqs": 3,
            "num_waiting_reqs": 1,
            "num_used_tokens": 3000,
            "max_total_num_tokens": 10000,
            "token_usage": 0.3,
            "num_total_reqs": 4,
        },
        {
            "dp_rank": 1,
            "num_running_reqs": 1,
            "num_waiting_reqs": 0,
            "num_used_tokens": 1000,
            "max_total_num_tokens": 10000,
            "token_usage": 0.1,
            "num_total_reqs": 1,
        },
    ],
    "aggregate": {"total_running_reqs": 4, "total_waiting_reqs": 1, "avg_token_usage": 0.2},
}


@pytest.mark.parametrize(
    "doc, expected",
    [
        (REAL_LOADS, EngineLoad(4, 1, 0.2, 4000, 20000)),
        (REAL_LOADS["loads"], EngineLoad(4, 1, 0.2, 4000, 20000)),
        ({"num_running_reqs": 2, "num_waiting_reqs": 5, "token_usage": 0.75}, EngineLoad(2, 5, 0.75, None, None)),
        ({"num_running_reqs": 0, "num_queue_reqs": 3}, EngineLoad(0, 3, None, None, None)),
        ([{"token_usage": 0.5}, {"token_usage": 0.7}], EngineLoad(None, None, 0.6, None, None)),
    ],
)
def test_parse_loads_shapes(doc, expected):
    out = parse_loads(doc)
    assert (out.running, out.waiting, out.used_tokens, out.max_tokens) == (
        expected.running,
        expected.waiting,
        expected.used_tokens,
        expected.max_tokens,
    )
    if expected.kv_usage is None:
        assert out.kv_usage is None
    else:
        assert out.kv_usage == pytest.approx(expected.kv_usage)


@pytest.mark.parametrize("doc", [{}, [], "busy", {"loads": []}, {"status": "ok"}])
def test_parse_loads_rejects_what_is_not_a_load(doc):
    with pytest.raises(LoadsFormatError):
        parse_loads(doc)


def test_parse_metrics_gauges():
    text = (
        '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="qwen"} 3.0\n'
        '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name="qwen"} 7.0\n'
        '# TYPE sglang:token_usage gauge\nsglang:token_usage{model_name="qwen",dp_rank="0"} 0.4\n'
        'sglang:token_usage{model_name="qwen",dp_rank="1"} 0.2\n'
        '# TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens{model_name="qwen"} 65536.0\n'
    )
    out = parse_metrics(text)
    assert (out.running, out.waiting, out.max_tokens, out.used_tokens) == (3, 7, 65536, None)
    assert out.kv_usage == pytest.approx(0.3)
