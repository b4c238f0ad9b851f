"""A lane: one daemon thread that runs the jobs given to it in order.

The torch engine keeps two: the engine lane (the only user of the model, the engine's tokenizer and the
batch tensors) and the prompt lane (the only user of its own tokenizer instance, for tokenization). A
lane is the sole owner of what its jobs touch, so neither needs a lock, and HF fast tokenizers, which
must not be shared across threads, never are.

Why not a ThreadPoolExecutor: its threads are joined when the interpreter exits (concurrent.futures
registers an exit hook that waits for them), so one job that never returned kept the worker alive after
SIGTERM until its SIGKILL. A lane's thread is a daemon: the engine waits for it only as long as its stop
grace allows (`wait_closed`), and the process exits regardless.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: Future = field(default_factory=Future)


class Lane:
    def __init__(self, name: str):
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue fn(*args); its future holds the result or the exception it raised."""
        if self._closed:
            raise RuntimeError(f"lane {self.name} is closed")
        job = _Job(fn, args)
        self._jobs.put(job)
        return job.future

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """submit() awaited from the event loop. A caller cancelled before the job starts unqueues it
        (the lane skips a cancelled future); once started, the job runs to its end."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def close(self) -> None:
        """No more jobs; the thread ends after the ones queued. Does not wait (see `wait_closed`)."""
        self._closed = True
        self._jobs.put(None)

    async def wait_closed(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Wait up to timeout_s for the thread to end, without blocking the event loop (nor using a
        thread of the loop's executor, which asyncio.run would wait for at exit); False if it is still
        in a job."""
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        return not self._thread.is_alive()

    @property
    def daemon(self) -> bool:
        return self._thread.daemon

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue  # its caller went away before it started
            try:
                result = job.fn(*job.args)
            except BaseException as exc:  # the job's own error is its caller's to handle
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)
