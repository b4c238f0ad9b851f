"""The torch engine sleeps for real: its weights go to a host copy and come back from it (never from disk),
the KV budget reads 0 while asleep, and the figures it reports add up (on CPU: the device is the host)."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from node_host.backends.protocol import EngineState, GenerateRequest, SamplingParams, Unavailable, collect  # noqa: E402
from node_host.backends.runtime.app import WorkerApp  # noqa: E402
from node_host.backends.torch_engine.engine import TorchEngine  # noqa: E402
from node_host.backends.torch_engine.offload import Offload, OffloadError  # noqa: E402
from sie.engine_settings import TorchSettings  # noqa: E402
from sie.model_files import ModelFilePolicy  # noqa: E402


@pytest.fixture
async def engine(tiny_model_dir, tmp_path):
    """A started CPU engine on its own copy of the tiny model (a test may take the files away)."""
    torch.set_num_threads(1)
    models = tmp_path / "models"
    shutil.copytree(tiny_model_dir, models / "tiny")
    settings = TorchSettings(model_path=str(models / "tiny"), served_model_name="tiny", device="cpu")
    eng = TorchEngine(settings, ModelFilePolicy(roots=(models,)))
    await eng.start()
    yield eng
    await eng.close()


def greedy(rid: str) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid=rid, params=params, text="The quick brown fox")


async def text_of(engine: TorchEngine, rid: str) -> str:
    return (await collect(engine.generate(greedy(rid)))).text


def weight_bytes(module: torch.nn.Module) -> int:
    """Parameters and buffers as torch lists them (each once: tied weights share one Parameter)."""
    return sum(p.nbytes for p in module.parameters()) + sum(b.nbytes for b in module.buffers())


async def test_resume_gives_the_same_greedy_text_from_the_host_copy_not_the_disk(engine, tmp_path):
    before = await text_of(engine, "before")
    await engine.release([])
    shutil.move(tmp_path / "models" / "tiny", tmp_path / "gone")  # a disk read would now fail
    await engine.resume([])
    assert engine.state is EngineState.READY
    assert await text_of(engine, "after") == before


async def test_asleep_the_kv_budget_reads_zero_and_generation_is_refused(engine):
    await text_of(engine, "warm")
    await engine.release(["weights", "kv_cache"])
    loads = engine.loads()
    assert engine.state is EngineState.SLEEPING
    assert (loads.running, loads.waiting, loads.used_tokens, loads.token_usage) == (0, 0, 0, 0.0)
    with pytest.raises(Unavailable, match="sleeping"):
        await text_of(engine, "asleep")


async def test_the_release_and_resume_responses_carry_figures_that_add_up(engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    weights = weight_bytes(reference)
    tensors = len(list(reference.parameters())) + len(list(reference.buffers()))
    app = WorkerApp(engine)
    async with TestClient(TestServer(app.build())) as client:
        released = await (await client.post("/release_memory_occupation", json={})).json()
        assert (await client.get("/v1/loads")).status == 200
        loads = await (await client.get("/v1/loads")).json()
        resumed = await (await client.post("/resume_memory_occupation", json={})).json()
    assert loads["num_used_tokens"] == 0 and loads["token_usage"] == 0.0
    for body, message in ((released, "released"), (resumed, "resumed")):
        assert (body["success"], body["message"]) == (True, message)  # SGLang's shape, with `memory` added
    rel, res = released["memory"], resumed["memory"]
    rows = [
        # (field, on release, on resume)
        ("kind", "release", "resume"),
        ("device", "cpu", "cpu"),
        ("host_is_device", True, True),
        ("pinned", False, False),
        ("tensors", tensors, tensors),
        ("bytes_moved", weights, weights),
        ("module_device_bytes_before", weights, 0),
        ("module_device_bytes_after", 0, weights),
        # one RAM: the weights count once wherever they sit, so nothing is freed either way
        ("device_allocated_before", weights, weights),
        ("device_allocated_after", weights, weights),
        ("device_freed_bytes", 0, 0),
        ("kv_used_tokens", 0, 0),
    ]
    for field, on_release, on_resume in rows:
        assert (field, rel[field], res[field]) == (field, on_release, on_resume)
    assert weights <= rel["host_copy_bytes"] < weights + 512 * tensors and res["host_copy_bytes"] == 0
    assert rel["seconds"] >= 0 and res["seconds"] >= 0 and "the device is the host" in rel["note"]
    assert engine.last_move is not None and engine.last_move.kind == "resume"


class Tied(torch.nn.Module):
    """The shapes the offload must survive: a tied weight, a 0-dim and an empty tensor, other dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(7, 3)
        self.head = torch.nn.Linear(3, 7, bias=False)
        self.head.weight = self.embed.weight
        self.scale = torch.nn.Parameter(torch.tensor(2.5))
        self.register_buffer("empty", torch.zeros(0, 4))
        self.register_buffer("fp16", torch.randn(5, dtype=torch.float16))
        self.register_buffer("ids", torch.arange(9))
        self.register_buffer("mask", torch.tensor([True, False, True]))


def test_round_trip_keeps_every_tensor_and_every_alias():
    torch.manual_seed(0)
    module = Tied()
    before = {name: t.clone() for name, t in module.state_dict(keep_vars=True).items()}
    offload = Offload(module)
    released = offload.release()
    assert offload.released and all(t.numel() == 0 for t in module.state_dict().values())
    resumed = offload.resume()
    after = module.state_dict()
    assert all(torch.equal(before[n], after[n]) and before[n].dtype == after[n].dtype for n in before)
    assert module.head.weight is module.embed.weight  # still one Parameter
    assert released.tensors == resumed.tensors == 6  # the tied weight once
    assert released.bytes_moved == weight_bytes(module) == resumed.bytes_moved


@pytest.mark.parametrize(
    "steps, message",
    [
        (("release", "release"), "already released"),
        (("resume",), "not released"),
        (("release", "resume", "resume"), "not released"),
    ],
)
def test_a_move_in_the_wrong_state_is_refused(steps, message):
    offload = Offload(torch.nn.Linear(2, 2))
    *first, last = steps
    for step in first:
        getattr(offload, step)()
    with pytest.raises(OffloadError, match=message):
        getattr(offload, last)()


def test_a_module_on_two_devices_is_refused_untouched():
    module = torch.nn.Module()
    module.a = torch.nn.Parameter(torch.ones(2))
    module.b = torch.nn.Parameter(torch.ones(2, device="meta"))
    with pytest.raises(OffloadError, match="one device"):
        Offload(module).release()
    assert module.a.numel() == 2
