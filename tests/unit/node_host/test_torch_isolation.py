"""One request cannot fail the others: what it brings is refused up front with a 400 naming the problem,
what fails for it alone (prefill, sampling) fails only it, and its chat template runs in a process of
its own under a deadline. The engine is also held to this when called directly (not only through the
worker's body parser), since nothing guarantees it is only called that way."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from node_host.backends.protocol import (  # noqa: E402
    BadRequest,
    Delta,
    EngineState,
    GenerateRequest,
    SamplingParams,
    WorkerError,
    collect,
)
from node_host.backends.torch_engine.engine import TorchEngine  # noqa: E402
from node_host.backends.torch_engine.prompts import PromptRules, tokenize  # noqa: E402
from node_host.backends.torch_engine.step import Seq, Stepper  # noqa: E402
from sie.engine_settings import TorchSettings  # noqa: E402
from sie.model_files import ModelFilePolicy  # noqa: E402

pytestmark = pytest.mark.timeout(120)

EXTRA = [f"<extra_{i}>" for i in range(8)]
# Nested loops of 10^10 iterations in all: the template never ends on its own.
ENDLESS_TEMPLATE = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}hello"


def params(n: int = 6, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **({"temperature": 0.0} | kw))


def text(rid: str, prompt: str = "The quick brown fox", **kw) -> GenerateRequest:
    return GenerateRequest(rid=rid, params=params(**kw), text=prompt)


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory):
    """The tiny model three ways: as made; with tokens added to its tokenizer but not to its embedding
    table (a fine-tune that did not resize the model); with a chat template that never ends."""
    root = tmp_path_factory.mktemp("isolation")
    dirs = {}
    for name in ("plain", "extra", "endless"):
        dirs[name] = root / name
        shutil.copytree(tiny_model_dir, dirs[name])
    tok = transformers.AutoTokenizer.from_pretrained(dirs["extra"])
    tok.add_tokens(EXTRA)
    tok.save_pretrained(dirs["extra"])
    (dirs["endless"] / "chat_template.jinja").write_text(ENDLESS_TEMPLATE)
    return root, dirs


@pytest.fixture
async def engine_for(model_dirs):
    root, dirs = model_dirs
    engines: list[TorchEngine] = []

    async def make(name: str, **kw) -> TorchEngine:
        torch.set_num_threads(1)
        settings = TorchSettings(model_path=str(dirs[name]), served_model_name=name, device="cpu")
        engine = TorchEngine(settings, ModelFilePolicy(roots=(root,)), **kw)
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.close()


# ---- the engine lane's step, with a model that fails for one request ----------------------------------


class Poisoned(torch.nn.Module):
    """The tiny model, except for rows that hold `poison`: their prefill raises ("raise"), or their
    logits come out NaN ("nan"), as a model can for one input."""

    def __init__(self, inner: torch.nn.Module, poison: int, how: str):
        super().__init__()
        self.inner, self.poison, self.how = inner, poison, how

    def forward(self, input_ids=None, cache=None, logits_to_keep=0, **kwargs):  # the names batch.py passes
        hit = (input_ids == self.poison).any(-1)
        if self.how == "raise" and bool(hit.any()):
            raise RuntimeError("index out of range in self")
        out = self.inner(input_ids=input_ids, cache=cache, logits_to_keep=logits_to_keep, **kwargs)
        if self.how == "nan":
            out.logits[hit] = float("nan")
        return out


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).eval()
    return model, transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


POISON = 7


def stepper(tiny, how: str) -> Stepper:
    model, tok = tiny
    return Stepper(
        Poisoned(model, POISON, how),
        tok,
        torch.device("cpu"),
        eos=frozenset(),
        embeddings=model.get_input_embeddings().num_embeddings,
        generator=torch.Generator().manual_seed(0),
    )


def seq(rid: str, prompt: list[int], **kw) -> Seq:
    request = GenerateRequest(rid=rid, params=params(20, **kw), input_ids=tuple(prompt))
    return Seq(request=request, prompt=prompt, reserved=len(prompt) + 20)


def outcome(events) -> dict[str, object]:
    return {s.request.rid: (type(item).__name__ if not isinstance(item, Delta) else "Delta") for s, item in events}


def test_a_prefill_that_raises_fails_only_its_request(tiny):
    step = stepper(tiny, "raise")
    a, b = seq("a", [20, 21, 22]), seq("b", [30, 31], temperature=1.0)
    running, events = step.step([], [a, b])
    assert running == [a, b] and outcome(events) == {"a": "Delta", "b": "Delta"}
    bad = seq("bad", [40, POISON, 41])
    running, events = step.step(running, [bad])
    assert running == [a, b]
    assert outcome(events) == {"a": "Delta", "b": "Delta", "bad": "WorkerError"}
    error = next(item for s, item in events if s is bad)
    assert error.status == 500 and "prefill" in str(error) and "index out of range" in str(error)
    for _ in range(3):  # the batch goes on
        running, events = step.step(running, [])
        assert outcome(events) == {"a": "Delta", "b": "Delta"}


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_non_finite_logits_for_one_row_fail_only_its_request(tiny, where):
    step = stepper(tiny, "nan")
    a, b = seq("a", [20, 21, 22], temperature=1.0), seq("b", [30, 31], temperature=1.0)
    running, _ = step.step([], [a, b])
    if where == "prefill":
        bad = seq("bad", [40, POISON], temperature=1.0)
        running, events = step.step(running, [bad])
    else:
        bad = seq("bad", [40, 41], temperature=1.0)
        running, _ = step.step(running, [bad])
        bad.last_token = POISON  # what the row is fed next: its logits come out NaN
        running, events = step.step(running, [])
    assert running == [a, b]
    assert outcome(events) == {"a": "Delta", "b": "Delta", "bad": "WorkerError"}
    assert "not finite" in str(next(item for s, item in events if s is bad))


def test_sampling_parameters_no_parser_checked_do_not_fail_the_batch(tiny):
    """top_p 0 and a temperature of 1e-40 reach the step (a caller other than the worker's parser):
    they are greedy for their own row, and nobody fails."""
    step = stepper(tiny, "none")
    seqs = [seq("a", [20, 21], temperature=1.0, top_p=0.0), seq("b", [30, 31], temperature=1e-40), seq("c", [5, 6])]
    running, events = step.step([], seqs)
    for _ in range(4):
        assert running == seqs and set(outcome(events).values()) == {"Delta"}
        running, events = step.step(running, [])


# ---- prompts: the bounds before and after tokenizing -------------------------------------------------

RULES = PromptRules(context=100, embeddings=766, longest_token=14, vocabulary=774, kv_budget=1000)


@pytest.mark.parametrize(
    "check, needle",
    [
        (lambda: RULES.check_text(RULES.max_chars + 1, "text"), "more than this model's context of 100 tokens"),
        (lambda: RULES.check_fits(0, 5), "empty"),
        (lambda: RULES.check_fits(90, 11), "over the context length 100"),
        (lambda: PromptRules(100, 766, 14, 774, kv_budget=50).check_fits(40, 11), "KV budget"),
        (lambda: RULES.check_ids([5, 766, 767], 1), "token ids [766, 767] are outside"),
        (lambda: RULES.check_ids([5] * 101, 0), "over the context length"),
    ],
)
def test_prompt_rules_refuse_naming_the_problem(check, needle):
    with pytest.raises(BadRequest, match=None) as info:
        check()
    assert needle in str(info.value)


def test_prompt_rules_accept_what_fits():
    RULES.check_text(RULES.max_chars, "text")
    RULES.check_fits(95, 5)
    RULES.check_ids([0, 765], 98)


def test_text_tokens_past_the_embedding_table_are_refused_by_name(model_dirs):
    _, dirs = model_dirs
    tok = transformers.AutoTokenizer.from_pretrained(dirs["extra"])
    rules = PromptRules(context=2048, embeddings=766, longest_token=14, vocabulary=len(tok), kv_budget=8192)
    with pytest.raises(BadRequest) as info:
        tokenize(tok, "hi <extra_3>", rules, "text", special=True)
    assert "'<extra_3>'" in str(info.value) and "embedding table only 766 rows" in str(info.value)
    assert tokenize(tok, "hi there", rules, "text", special=True)


# ---- the engine ----------------------------------------------------------------------------------------


async def test_ids_and_text_past_the_embedding_table_are_400s_and_the_batch_goes_on(engine_for):
    engine = await engine_for("extra")
    victims = [asyncio.create_task(collect(engine.generate(text(f"v{i}", f"Hello {i}", n=60)))) for i in range(2)]
    await asyncio.sleep(0.2)
    for bad, needle in [
        (GenerateRequest(rid="ids", params=params(), input_ids=(767,)), "embedding table has 766 rows"),
        (text("text", "hi <extra_3>"), "'<extra_3>'"),
    ]:
        with pytest.raises(BadRequest) as info:
            await collect(engine.generate(bad))
        assert needle in str(info.value)
    assert [(await v).completion_tokens for v in victims] == [60, 60]


async def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(engine_for):
    engine = await engine_for("plain")
    huge = "The quick brown fox jumps over the lazy dog. " * 95_000  # 4.3 M characters
    t0 = time.monotonic()
    with pytest.raises(BadRequest, match="characters, more than this model's context"):
        await collect(engine.generate(text("big", huge)))
    assert time.monotonic() - t0 < 1.0  # tokenizing it takes seconds


async def test_an_endless_chat_template_fails_its_request_at_the_deadline_and_nothing_else(engine_for):
    engine = await engine_for("endless", prompt_deadline=lambda chars: 3.0)
    chat = GenerateRequest(rid="chat", params=params(), messages=({"role": "user", "content": "hi"},))
    alone = time.monotonic()
    await collect(engine.generate(text("warm", n=40)))
    alone = time.monotonic() - alone
    t0 = time.monotonic()
    pending = asyncio.create_task(collect(engine.generate(chat)))
    await asyncio.sleep(0.5)
    # served while the template runs, neither queued behind it nor slowed by it (it has a process of its own)
    t1 = time.monotonic()
    done = await asyncio.wait_for(collect(engine.generate(text("plain", n=40))), 5)
    assert done.completion_tokens == 40 and not pending.done()
    assert time.monotonic() - t1 < 3 * alone + 0.5, (time.monotonic() - t1, alone)
    with pytest.raises(WorkerError) as info:
        await asyncio.wait_for(pending, 10)
    message = str(info.value)
    assert info.value.status == 500 and "its chat template ran more than 3 s on this request and was stopped" in message
    assert 3.0 <= time.monotonic() - t0 < 6.0
    assert engine.state is EngineState.READY


async def test_close_gives_up_on_a_thread_that_does_not_return_within_its_grace(engine_for):
    engine = await engine_for("plain", close_grace_s=0.5)
    never = threading.Event()
    engine._lane.submit(never.wait)  # a step stuck in native code, as a hung kernel would be
    t0 = time.monotonic()
    await asyncio.wait_for(engine.close(), 5)
    assert time.monotonic() - t0 < 2.0 and engine.state is EngineState.FAILED
    never.set()
