"""A job's own log stream as lines: ``MLClient.jobs.stream`` prints to stdout, so its thread's writes are caught."""

from __future__ import annotations

import io
import queue
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from azure.ai.ml import MLClient

from nbbatch.backends.azureml.workspace import error_text


class _ThreadStdout(io.TextIOBase):
    """``sys.stdout`` stand-in: one thread's writes go to a queue, everyone else's to the real stdout."""

    def __init__(self, original: Any, owner: int, sink: queue.Queue[str | None]):
        self.original, self.owner, self.sink = original, owner, sink

    def write(self, text: str) -> int:
        if threading.get_ident() == self.owner:
            self.sink.put(text)
        else:
            self.original.write(text)
        return len(text)

    def flush(self) -> None:
        self.original.flush()


_STDOUT_LOCK = threading.Lock()


def stream_job(ml_client: MLClient, job_name: str) -> Iterator[str]:
    """Lines of ``MLClient.jobs.stream`` (which prints to stdout) as an iterator."""
    sink: queue.Queue[str | None] = queue.Queue()
    failure: list[BaseException] = []
    started = threading.Event()

    def worker() -> None:
        started.wait()
        try:
            ml_client.jobs.stream(job_name)
        except Exception as exc:  # noqa: BLE001 - reported to the consumer as the stream's last line
            failure.append(exc)
        finally:
            sink.put(None)

    thread = threading.Thread(target=worker, name=f"azureml-stream-{job_name}", daemon=True)
    with _redirected_stdout(thread, sink):
        started.set()
        buffer = ""
        while True:
            chunk = sink.get()
            if chunk is None:
                break
            buffer += chunk
            while "\n" in buffer:
                line, buffer = buffer.split("\n", 1)
                yield line + "\n"
        if buffer:
            yield buffer
    thread.join(timeout=5)
    if failure:
        yield f"(log stream ended: {type(failure[0]).__name__}: {error_text(failure[0])})\n"


@contextmanager
def _redirected_stdout(thread: threading.Thread, sink: queue.Queue[str | None]) -> Iterator[None]:
    with _STDOUT_LOCK:
        original = sys.stdout
        thread.start()
        proxy = _ThreadStdout(original, thread.ident or 0, sink)
        sys.stdout = proxy
    try:
        yield
    finally:
        with _STDOUT_LOCK:
            if sys.stdout is proxy:
                sys.stdout = original
