"""Chat templates, rendered in child processes that are killed at their deadline.

A chat template is Jinja: Python code from the model's files. Rendered in a thread of the worker, it
competes with the engine for the GIL, and one that runs long stalls every generation although it runs
elsewhere (measured on the demo model: a template looping until its 10 s deadline held a 300-token
stream, 0.4 s alone, for 10 s); what it runs in native code (big-integer arithmetic) cannot be stopped
at all. A child process has an interpreter of its own: the engine never waits for it, and at the
deadline it is killed, whatever it runs.

Protocol of a child (`python -m node_host.backends.torch_engine.templates`, over its stdin and stdout,
one JSON document per line; json.dumps never writes a raw newline): the first line is {"template",
"specials", "max_chars"} (the template's source, the tokenizer's special tokens, which templates read,
and the longest text the model's context can hold: prompts.PromptRules.max_chars); then each line a
conversation [{"role", "content"}, ...], answered by ["ok", text], ["too_long", characters] (the
request's 400), ["refused", why] (the template's own raise_exception() or a Jinja error: the
request's 400, as vLLM answers it) or ["failed", why] (anything else: a 500). It renders with
transformers' own renderer, so the text is the one apply_chat_template(tokenize=False) writes. Its
stdout carries only the protocol: whatever else writes to file descriptor 1 goes to stderr. Its
address space is capped (MEMORY_BYTES), so a template that builds an endless string fails with a
MemoryError in its own process, not by the kernel's OOM killer choosing a process (the worker, which
holds the model, is the largest).

The pool runs at most `most` children and keeps at most `keep` of them idle; one is started with the
engine, so that the first chat request does not wait for a start (0.65 s and 60 MB here). A render takes
an idle child; when none frees up within SPAWN_AFTER_S (a render normally takes a millisecond, so a
burst waits for one rather than starting more) and fewer than `most` run, a new one, so a slow template
holds only its own child. All of it within the render's deadline. A child whose render ran out of time,
or whose caller went away, is killed rather than reused (its answer would reach the next caller).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from node_host.backends.protocol import BadRequest, Unavailable, WorkerError

log = logging.getLogger(__name__)

# A line holds a whole conversation or its rendering: as long as a body may be (limits.max_body_bytes
# is at most 64 MiB), with room for JSON escapes and the template's own text.
LINE_LIMIT = 256 * 2**20
COMMAND = (sys.executable, "-m", "node_host.backends.torch_engine.templates")
# A child takes 180 MB of address space once it has imported the renderer (60 MB resident); the rest is
# for conversations up to the largest body a spec allows (64 MiB) and their rendering.
MEMORY_BYTES = 2 * 2**30
SPAWN_AFTER_S = 0.05  # how long a render waits for a busy child before it starts one (see above)
_ROOT = Path(__file__).resolve().parents[3]  # the directory that holds the node_host package


class _Child:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    async def ask(self, line: bytes) -> list[Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line)
        await self.proc.stdin.drain()
        answer = await self.proc.stdout.readline()
        if not answer.endswith(b"\n"):
            raise ConnectionError(f"the template process ended (exit code {self.proc.returncode})")
        return list(json.loads(answer))

    async def stop(self, kill: bool) -> None:
        """End the child: at once (kill), or by closing its input (it exits after its current line); then
        reap it."""
        if kill and self.proc.returncode is None:
            self.proc.kill()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        await self.proc.wait()


class TemplatePool:
    def __init__(
        self,
        model: str,
        template: str,
        specials: Mapping[str, str],
        max_chars: int,
        *,
        keep: int = 2,
        most: int = 4,
        command: Sequence[str] = COMMAND,
    ):
        self._model = model
        setup = {"template": template, "specials": dict(specials), "max_chars": max_chars}
        self._setup = json.dumps(setup).encode() + b"\n"
        self._max_chars = max_chars
        self._keep = keep
        self._most = most
        self._command = tuple(command)
        self._idle: asyncio.Queue[_Child] = asyncio.Queue()
        self._children: set[_Child] = set()
        self._closed = False

    async def start(self, deadline_s: float = 60.0) -> None:
        """One child ready before the first request: started, and through one render, which imports the
        renderer. A template that cannot render it is only logged: the text endpoints do not need it,
        and each chat request will be told what failed."""
        self._idle.put_nowait(await self._spawn())
        try:
            await self.render([{"role": "user", "content": "Hello"}], deadline_s)
        except BadRequest:
            pass  # the template's own refusal (of one short message): the child is fine
        except (WorkerError, Unavailable) as exc:
            log.error("%s: the chat template does not render: %s", self._model, exc)

    async def render(self, messages: Sequence[Mapping[str, str]], deadline_s: float) -> str:
        """The conversation as the model's chat template writes it, or the request's error."""
        line = json.dumps([dict(m) for m in messages]).encode() + b"\n"
        child: _Child | None = None
        answer: list[Any] | None = None
        try:
            async with asyncio.timeout(deadline_s):
                child = await self._acquire()
                answer = await child.ask(line)
        except TimeoutError:
            if child is None:
                raise Unavailable(
                    f"model {self._model!r}: all {self._most} chat template processes were busy for "
                    f"{deadline_s:.3g} s; retry"
                ) from None
            raise WorkerError(
                f"model {self._model!r}: its chat template ran more than {deadline_s:.3g} s on this request and "
                "was stopped; the model's files need fixing (a chat template this slow)"
            ) from None
        except ConnectionError as exc:
            raise WorkerError(f"model {self._model!r}: rendering its chat template failed: {exc}") from None
        finally:
            if child is not None:
                await self._done(child, whole=answer is not None)
        assert answer is not None  # every other way out of the try raised
        kind, value = answer
        if kind == "ok":
            return str(value)
        if kind == "too_long":
            raise BadRequest(
                f"the conversation (after the chat template) has {value} characters, more than this model's "
                f"context can hold ({self._max_chars}); shorten it"
            )
        if kind == "refused":
            raise BadRequest(f"messages: the model's chat template refused them: {value}")
        raise WorkerError(f"model {self._model!r}: its chat template failed on this request: {value}")

    async def close(self) -> None:
        self._closed = True
        children, self._children = list(self._children), set()
        await asyncio.gather(*(child.stop(kill=True) for child in children), return_exceptions=True)

    async def _acquire(self) -> _Child:
        while True:
            try:
                # A get that times out leaves the queue as it was (asyncio.Queue hands an item over only
                # to a getter that resumes).
                child = await asyncio.wait_for(self._idle.get(), SPAWN_AFTER_S)
            except TimeoutError:
                if len(self._children) < self._most:
                    return await self._spawn()
                continue
            if child.proc.returncode is None:
                return child
            self._children.discard(child)  # it died while idle

    async def _spawn(self) -> _Child:
        if self._closed:
            raise Unavailable(f"model {self._model!r} is shutting down; retry elsewhere")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
        proc = await asyncio.create_subprocess_exec(
            *self._command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=LINE_LIMIT,
            env=env,
        )
        child = _Child(proc)
        self._children.add(child)
        assert proc.stdin is not None
        proc.stdin.write(self._setup)
        return child

    async def _done(self, child: _Child, *, whole: bool) -> None:
        """Back to the idle ones if its exchange ended whole and there is room; else it goes, killed when it
        may still be rendering (before the first await: a caller cancelled again while it is reaped has
        still ended it)."""
        if whole and not self._closed and self._idle.qsize() < self._keep:
            self._idle.put_nowait(child)
            return
        self._children.discard(child)
        await child.stop(kill=not whole)


def main() -> int:
    """The child: render each conversation read from stdin (see the module docstring)."""
    import resource

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints (a library's) must not corrupt the protocol
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    source = sys.stdin.buffer
    setup = json.loads(source.readline() or b"null")
    if not isinstance(setup, dict):
        return 2
    template, specials, max_chars = setup["template"], setup["specials"], setup["max_chars"]
    for line in source:
        answer: list[Any]
        try:
            # (rendered conversations, generation indices); transformers annotates it as a str
            result: Any = render_jinja_template(
                conversations=[json.loads(line)], chat_template=template, add_generation_prompt=True, **specials
            )
            text = result[0][0]
            answer = ["ok", text] if len(text) <= max_chars else ["too_long", len(text)]
        except TemplateError as exc:
            answer = ["refused", str(exc)]
        except Exception as exc:  # the template's own bug: its request's 500, and the child goes on
            answer = ["failed", f"{type(exc).__name__}: {exc}"]
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
