"""The model's config.json as the GPU manager reads it: only under the model roots, only a regular file of
bounded size, and whatever it holds an admission decision, never an exception (DESIGN §10)."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node_host.agent import NodeAgent
from node_host.gpu_manager import CONFIG_MAX_BYTES, Evict, GPUManager, Placed, Refuse, Wait, read_model_config
from node_host.memory_estimate import EstimateError
from node_host.settings import AgentSettings, NodeTunables
from sie.auth import TokenSource
from sie.model_files import ModelFilePolicy
from sie.wire import Assignment, GPUInfo
from tests.unit.node_host.node_fakes import GIB, FakeControl, Spawner, assignment, supervisor
from tests.unit.node_host.test_gpu_manager import FACTS, QWEN2_0_5B, gpu, svc


def model_dir(root: Path, config: object = QWEN2_0_5B, name: str = "m") -> Path:
    model = root / name
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    return model


def under(root: Path) -> ModelFilePolicy:
    return ModelFilePolicy(roots=(root,))


def test_a_config_json_under_a_root_is_read(tmp_path):
    assert read_model_config(str(model_dir(tmp_path)), under(tmp_path)) == QWEN2_0_5B


def test_no_config_json_is_none(tmp_path):
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    (tmp_path / "empty").mkdir()
    policy = under(tmp_path)
    assert read_model_config(None, policy) is None
    assert read_model_config(str(tmp_path / "empty"), policy) is None
    assert read_model_config(str(tmp_path / "weights.gguf"), policy) is None  # a file, not a directory


def _outside(tmp_path: Path) -> tuple[str, ModelFilePolicy]:
    return str(model_dir(tmp_path / "elsewhere")), under(tmp_path / "models")


def _symlink_out(tmp_path: Path) -> tuple[str, ModelFilePolicy]:
    secret = model_dir(tmp_path / "elsewhere") / "config.json"
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").symlink_to(secret)
    return str(model), under(tmp_path / "models")


def _directory(tmp_path: Path) -> tuple[str, ModelFilePolicy]:
    (tmp_path / "m" / "config.json").mkdir(parents=True)
    return str(tmp_path / "m"), under(tmp_path)


def _file(tmp_path: Path, data: bytes) -> tuple[str, ModelFilePolicy]:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_bytes(data)
    return str(tmp_path / "m"), under(tmp_path)


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda tmp: (str(model_dir(tmp)), ModelFilePolicy()), "no model roots"),
        (_outside, "outside the model roots"),
        (_symlink_out, "outside the model roots"),  # config.json itself may not point out of the root
        (_directory, "not a regular file"),
        (lambda tmp: _file(tmp, b"{" + b" " * CONFIG_MAX_BYTES + b"}"), f"larger than {CONFIG_MAX_BYTES} bytes"),
        (lambda tmp: _file(tmp, b"{not json"), "not valid JSON"),
        (lambda tmp: _file(tmp, b'{"hidden_size": 1, "hidden_size": 2}'), "appears twice"),
        (lambda tmp: _file(tmp, b"[" * 100 + b"]" * 100), "nested deeper"),
        (lambda tmp: _file(tmp, b"[1, 2]"), "not an object"),
        (lambda tmp: _file(tmp, b'{"vocab_size": 1e999}'), "overflows"),
    ],
)
def test_a_config_json_the_node_may_not_or_cannot_read_is_refused(tmp_path, make, fragment):
    path, policy = make(tmp_path)
    with pytest.raises(EstimateError, match=fragment):
        read_model_config(path, policy)


def test_a_fifo_named_config_json_is_refused_without_blocking(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    fifo = model / "config.json"
    os.mkfifo(fifo)
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(read_model_config(str(model), under(tmp_path)))
        except EstimateError as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    blocked = reader.is_alive()
    if blocked:  # let it go: a writer that opens and closes the FIFO ends the reader's open and read
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
    assert not blocked, "reading config.json blocked on a FIFO"
    assert isinstance(outcome[0], EstimateError) and "not a regular file" in str(outcome[0])


# ---- whatever config.json holds, admission decides --------------------------------------------------


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({**QWEN2_0_5B, "num_hidden_layers": -2000}, "num_hidden_layers must be an integer from 1 to 16384, got -2000"),
        ({**QWEN2_0_5B, "hidden_size": "big"}, "hidden_size must be an integer from 1 to 1048576, got 'big'"),
        ([1, 2], "not an object"),
        ({**QWEN2_0_5B, "num_attention_heads": 0}, "num_attention_heads must be an integer from 1 to 16384, got 0"),
    ],
)
def test_admit_refuses_a_config_it_cannot_use_and_reserves_nothing(tmp_path, config, fragment):
    manager = GPUManager([gpu()], facts=FACTS, files=under(tmp_path))
    decision = manager.admit("s-0", svc(backend="sglang", path=str(model_dir(tmp_path, config))), 0.0)
    assert isinstance(decision, Refuse) and fragment in decision.reason and "cannot budget" in decision.reason
    assert not manager.holds("s-0") and manager.ledger.gpus[0].level_mb == 0.0


def test_a_sim_outside_the_roots_gets_the_default_size_and_its_config_is_not_read(tmp_path):
    """A simulator loads no file, so its path may lie anywhere (the supervisor lets it): not read there."""
    model = model_dir(tmp_path / "elsewhere", {**QWEN2_0_5B, "num_hidden_layers": -2000})
    manager = GPUManager([gpu()], facts=FACTS, files=under(tmp_path / "models"))
    decision = manager.admit("s-0", svc(backend="sim", gpus=1, path=str(model)), 0.0)
    assert isinstance(decision, Placed) and manager.sources["s-0"] == "default"


def test_an_sglang_model_outside_the_roots_is_refused_with_the_reason(tmp_path):
    manager = GPUManager([gpu()], facts=FACTS, files=under(tmp_path / "models"))
    decision = manager.admit("s-0", svc(backend="sglang", path=str(model_dir(tmp_path / "elsewhere"))), 0.0)
    assert isinstance(decision, Refuse) and "outside the model roots" in decision.reason


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
CONFIG_BYTES = (
    st.dictionaries(st.sampled_from([*QWEN2_0_5B, "head_dim", "text_config", "dtype"]), JSON, max_size=4).map(
        lambda changes: json.dumps({**QWEN2_0_5B, **changes}).encode()
    )
    | JSON.map(lambda value: json.dumps(value).encode())
    | st.binary(max_size=64)
)


def test_whatever_config_json_holds_admit_decides_and_the_ledger_stays_sound():
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = model_dir(root)

        @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(CONFIG_BYTES)
        def check(data: bytes) -> None:
            (model / "config.json").write_bytes(data)
            manager = GPUManager([gpu()], facts=FACTS, files=under(root))
            decision = manager.admit("s-0", svc(backend="sglang", path=str(model)), 0.0)
            assert isinstance(decision, (Placed, Refuse, Wait, Evict))
            level = manager.ledger.gpus[0].level_mb
            assert 0.0 <= level <= 80 * GIB
            assert (level > 0) == isinstance(decision, Placed)

        check()


# ---- the node agent: a bad config.json is refused and the queue moves on ------------------------------


async def test_a_bad_config_json_is_refused_and_what_waits_behind_it_starts(tmp_path):
    model = model_dir(tmp_path / "models", {**QWEN2_0_5B, "hidden_size": "big"}, name="llm")
    manager = GPUManager([gpu()], facts={}, files=under(tmp_path / "models"))
    sup = supervisor(tmp_path, Spawner(), gpu_for=lambda iid, service: manager.gpu_of(iid))
    session = aiohttp.ClientSession()

    async def ledger_view() -> list[GPUInfo]:
        return manager.gpu_infos()

    agent = NodeAgent(
        AgentSettings("n1", "http://127.0.0.1:9", NodeTunables(post_timeout_s=0.2)),
        sup,
        session,
        credential=TokenSource(token="node-token"),
        gpus=ledger_view,
        facts={},
        manager=manager,
        control=FakeControl(),
    )
    try:
        spec = {
            "metadata": {"name": "llm"},
            "spec": {
                "model": {"name": "llm", "priority_level": "P0", "path": str(model)},
                "backend": {"type": "sglang"},
            },
        }
        agent.apply([Assignment("llm-0", "llm", spec), assignment("small-0", "P2", 1024)])
        await agent.tick()
        assert "llm-0" not in agent.pending and "hidden_size" in agent.refused["llm-0"].reason
        assert "small-0" in agent.supervisor.instances
    finally:
        await agent.shutdown()
        await session.close()


def test_a_config_is_parsed_once_until_the_file_changes(tmp_path, monkeypatch):
    """An instance waiting for memory is admitted again every tick: its config.json is parsed once, and
    again only when the file is rewritten."""
    from node_host import gpu_manager

    parsed = []
    real_loads = gpu_manager.strict_json.loads
    monkeypatch.setattr(gpu_manager.strict_json, "loads", lambda *a, **k: parsed.append(1) or real_loads(*a, **k))
    model = model_dir(tmp_path)
    policy = under(tmp_path)
    for _ in range(5):
        assert read_model_config(str(model), policy) == QWEN2_0_5B
    assert len(parsed) == 1
    changed = {**QWEN2_0_5B, "num_hidden_layers": 48}
    (model / "config.json").write_text(json.dumps(changed))
    assert read_model_config(str(model), policy) == changed and len(parsed) == 2
    with pytest.raises(TypeError):  # shared between callers, so nobody may change it
        read_model_config(str(model), policy)["num_hidden_layers"] = 1  # type: ignore[index]
