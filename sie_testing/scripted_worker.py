"""FAKE worker for tests only: a raw HTTP/1.1 server on 127.0.0.1 that plays scripted answers byte for
byte, for the tests of how the sidecar's worker client (sidecar/worker_http.py), and what is built on it,
handle a misbehaving worker. It is not a worker and checks nothing it sends.

A real worker cannot be made to misbehave on cue (a lone CR in a header, a body cut short, a close right
after reading a request, a stray answer behind the framed one), so this one answers with whatever bytes
the test gives it. It reads each request as a client sends it: the head up to its blank line, then
Content-Length bytes of body (none without a Content-Length), kept whole in `requests`. Then it plays
`answer(n)`, n counting the requests over all connections from 1:

- bytes: written as they are, well formed or not (empty: nothing is written, and the client waits);
- None: the connection is closed without a word, its request read (a worker that crashed on it);
- an async iterable of bytes: each part written and drained as it comes, so a test can hold a part back
  (on its own event, or on `go`) and see what the client does with what it has.
  `ScriptedWorker.paced(parts)` answers every request with `parts`, each part only once the test lets
  it go (`worker.go.put_nowait(None)`).

After an answer it reads the next request on the same connection (keep-alive), or with `keep_alive=False`
closes it, as a one-shot worker does, or a worker's keep-alive timeout while the client is idle.
`connections` counts the connections it accepted; `closed` is set once a client ends a connection.

    async with ScriptedWorker(lambda n: b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\n{}") as worker:
        ... WorkerHTTP("127.0.0.1", worker.port) ...

Cleanup, whatever happens in the block: on its exit the listening socket is closed, every connection's
task is cancelled and awaited and every connection closed, all within `CLOSE_TIMEOUT_S`; a connection
that arrives meanwhile is closed at once. What it reads is bounded: a request head over 64 KiB (the
stream's limit) or a body over `MAX_REQUEST_BYTES` ends its connection. That, or an exception of the
script itself, is raised again when the block exits (unless the block is already raising), so a broken
request or script fails the test instead of passing as a worker's silence. A client's reset is no error.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Sequence
from typing import Self

CLOSE_TIMEOUT_S = 5.0  # at most this long for the exit to end the connections' tasks and close them
MAX_REQUEST_BYTES = 1 << 20  # a request body over this is not read: the client's framing is at fault

Reply = bytes | None | AsyncIterable[bytes]
Script = Callable[[int], Reply]  # the reply to the n-th request, n from 1 over all connections


class ScriptedWorker:
    """A fake worker on 127.0.0.1 answering each request with `answer(n)` (see the module's docstring)."""

    def __init__(self, answer: Script, *, keep_alive: bool = True):
        self.answer = answer  # a test may script the requests still to come by assigning it
        self.keep_alive = keep_alive
        self.port = 0
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed = asyncio.Event()
        self.go = asyncio.Queue[None]()
        self._server: asyncio.Server | None = None
        self._open: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._failures: list[BaseException] = []
        self._exiting = False

    @classmethod
    def paced(cls, parts: Sequence[bytes], *, keep_alive: bool = True) -> ScriptedWorker:
        """Answers every request with `parts`, written one at a time, each only once the test lets it go
        (`go.put_nowait(None)` a part), so a test can see what the client hands over before the rest exists."""

        async def release(n: int) -> AsyncIterator[bytes]:
            for part in parts:
                await worker.go.get()
                yield part

        worker = cls(release, keep_alive=keep_alive)
        return worker

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        assert self._server is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_TIMEOUT_S
        self._exiting = True
        self._server.close()
        tasks, writers = list(self._open), list(self._open.values())
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
            if pending:
                self._failures.append(TimeoutError(f"{len(pending)} connection task(s) outlived the exit"))
        for writer in writers:
            writer.close()
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)
                await self._server.wait_closed()
        except TimeoutError:
            self._failures.append(TimeoutError(f"connections not closed within {CLOSE_TIMEOUT_S} s"))
        if self._failures and exc is None:
            raise self._failures[0]

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Called as the connection is made (a plain callback, not a task), so that every connection's task
        is known from its start and none can escape the exit."""
        if self._exiting:
            writer.close()
            return
        self.connections += 1
        task = asyncio.get_running_loop().create_task(
            self._serve(reader, writer), name=f"scripted worker connection {self.connections}"
        )
        self._open[task] = writer
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._open.pop(task).close()  # also for a task cancelled before it ran
        if not task.cancelled() and (failure := task.exception()) is not None:
            self._failures.append(failure)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                    request = head + await reader.readexactly(_content_length(head))
                except asyncio.IncompleteReadError:
                    self.closed.set()
                    return
                self.requests.append(request)
                if not await self._play(self.answer(len(self.requests)), writer) or not self.keep_alive:
                    return
        except ConnectionError:
            self.closed.set()
        finally:
            writer.close()

    async def _play(self, reply: Reply, writer: asyncio.StreamWriter) -> bool:
        """Write `reply`; False: close the connection instead."""
        if reply is None:
            return False
        if isinstance(reply, bytes):
            writer.write(reply)
            await writer.drain()
            return True
        parts = aiter(reply)
        try:
            async for part in parts:
                writer.write(part)
                await writer.drain()
        finally:
            if isinstance(parts, AsyncGenerator):  # held at a yield when the client left or the exit came
                await parts.aclose()
        return True


def _content_length(head: bytes) -> int:
    """The request's Content-Length, 0 without one; ValueError for one that is not a length it reads."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
            if not 0 <= length <= MAX_REQUEST_BYTES:
                raise ValueError(f"a request's Content-Length of {length} is not one the scripted worker reads")
            return length
    return 0
