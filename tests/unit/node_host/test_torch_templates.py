"""Chat templates render in child processes: the text is apply_chat_template's, a template's own refusal
is the request's 400, and a template that runs past its deadline (Python loops or native arithmetic)
is killed with its process while other conversations render beside it."""

from __future__ import annotations

import asyncio
import time

import pytest

transformers = pytest.importorskip("transformers")

from node_host.backends.protocol import BadRequest, Unavailable, WorkerError  # noqa: E402
from node_host.backends.torch_engine.templates import TemplatePool  # noqa: E402

pytestmark = pytest.mark.timeout(60)

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# What a request can make a (bad) template do, by its content.
TRAPS = (
    "{% if messages[0].content == 'loop' %}"  # Python: nested loops of 10^10 iterations
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
    # native: minutes in one C call (an exponent of the input's, or Jinja would fold it at compile time)
    "{% if messages[0].content == 'pow' %}{{ 10 ** ((messages[0].content | length) * 33333334) }}{% endif %}"
    "{% if messages[0].content == 'refuse' %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "{% if messages[0].content == 'bug' %}{{ 1 / 0 }}{% endif %}"
    "{% if messages[0].content == 'long' %}{% for i in range(1000) %}{{ 'long' * 1000 }}{% endfor %}{% endif %}"
    # 4 GB at once: its process's address space is capped at 2 GiB
    "{% if messages[0].content == 'bomb' %}{{ 'x' * ((messages[0].content | length) * 1000000000) }}{% endif %}"
)
HI = [{"role": "user", "content": "hi"}]


def said(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


@pytest.fixture
async def pool_of():
    pools: list[TemplatePool] = []

    async def make(template: str, **kw) -> TemplatePool:
        pool = TemplatePool("m", template, {"eos_token": "<|im_end|>"}, 100_000, **kw)
        await pool.start()
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        await pool.close()


async def test_the_text_is_the_one_apply_chat_template_writes(pool_of, tiny_model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    pool = await pool_of(tok.get_chat_template())
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo\nthere \u2603"}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert await pool.render(messages, 10) == expected
    assert await pool.render(messages, 10) == expected  # the same child, reused


async def test_a_burst_waits_for_the_warm_children_rather_than_starting_one_each(pool_of):
    pool = await pool_of(CHATML, most=8)
    texts = await asyncio.gather(*(pool.render(said(f"m{i}"), 10) for i in range(20)))
    assert texts == [f"<|im_start|>user\nm{i}<|im_end|>\n<|im_start|>assistant\n" for i in range(20)]
    assert len(pool._children) <= 3  # a start takes 0.65 s; a render a millisecond


@pytest.mark.parametrize(
    "content, error, status, needle",
    [
        ("refuse", BadRequest, 400, "messages: the model's chat template refused them: Conversation roles must"),
        ("bug", WorkerError, 500, "its chat template failed on this request: ZeroDivisionError"),
        ("long", BadRequest, 400, "has 4000054 characters, more than this model's context can hold (100000)"),
        ("bomb", WorkerError, 500, "its chat template failed on this request: MemoryError"),
    ],
)
async def test_a_template_that_raises_or_writes_too_much_fails_its_request_alone(
    pool_of, content, error, status, needle
):
    pool = await pool_of(TRAPS + CHATML)
    with pytest.raises(error) as info:
        await pool.render(said(content), 10)
    assert info.value.status == status and needle in str(info.value)
    assert await pool.render(HI, 10) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("trap", ["loop", "pow"])
async def test_a_template_past_its_deadline_is_killed_and_others_render_meanwhile(pool_of, trap):
    """Behaviour, not speed: the stuck render ends with its deadline's 500 (never before the deadline), a
    render started meanwhile finishes while the stuck one still runs, and the pool serves after the kill.
    The deadline is generous (a child starts in 0.65 s alone), so a loaded machine changes how long this
    takes, not what it shows."""
    pool = await pool_of(TRAPS + CHATML)
    t0 = time.monotonic()
    stuck = asyncio.create_task(pool.render(said(trap), 10.0))
    await asyncio.sleep(0.3)
    assert await pool.render(HI, 60)  # in a child of its own, started meanwhile
    finished_meanwhile = not stuck.done()
    with pytest.raises(WorkerError) as info:
        await stuck
    assert info.value.status == 500 and "its chat template ran more than 10 s on this request and was stopped" in str(
        info.value
    )
    assert time.monotonic() - t0 >= 10.0
    assert finished_meanwhile, "the other render waited for the stuck one (a child start takes 0.65 s alone)"
    assert all(child.proc.returncode is None for child in pool._children)  # the killed one is gone
    assert await pool.render(HI, 60)


async def test_a_caller_that_goes_away_takes_its_child_with_it(pool_of):
    pool = await pool_of(TRAPS + CHATML)
    stuck = asyncio.create_task(pool.render(said("loop"), 30))
    await asyncio.sleep(0.5)
    (child,) = pool._children
    stuck.cancel()
    await asyncio.gather(stuck, return_exceptions=True)
    assert child.proc.returncode is not None and child not in pool._children


async def test_renders_beyond_the_most_wait_within_their_deadline(pool_of):
    pool = await pool_of(TRAPS + CHATML, most=1)
    stuck = asyncio.create_task(pool.render(said("loop"), 2.0))
    await asyncio.sleep(0.2)
    with pytest.raises(Unavailable, match="busy"):
        await pool.render(HI, 0.5)
    with pytest.raises(WorkerError):
        await stuck
    assert await pool.render(HI, 10)


async def test_close_ends_every_child(pool_of):
    pool = await pool_of(TRAPS + CHATML)
    stuck = asyncio.create_task(pool.render(said("loop"), 30))
    await asyncio.sleep(0.5)
    children = list(pool._children)
    await asyncio.wait_for(pool.close(), 5)
    assert children and all(child.proc.returncode is not None for child in children)
    await asyncio.gather(stuck, return_exceptions=True)
    with pytest.raises(Unavailable, match="shutting down"):
        await pool.render(HI, 5)
