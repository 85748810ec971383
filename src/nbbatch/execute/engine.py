"""nbbatch's papermill engine: papermill's nbclient engine with the changes that matter in a batch.

* Saves are atomic and coalesced (at most one every ``save_every`` seconds, plus the final one),
  instead of papermill's non-atomic rewrite before and after every cell.
* The kernel is killed as soon as the notebook is done (no graceful-shutdown wait), and reaped
  without jupyter_client's 0.1-s polling (see :mod:`nbbatch.execute.kernels`).
* A kernel is ready once one ``kernel_info`` round trip has been seen on both shell and IOPub,
  without jupyter_client's fixed 0.2-s IOPub flush.
* A kernel may be started ahead of its run (:class:`nbbatch.execute.prestart.KernelPool`), with the run's own kernel,
  environment and working directory, so that its start-up overlaps the runs before it. A kernel
  only ever executes the one notebook it was started for.
* A cell's output is read to its end while it keeps coming, also after the cell's reply (nbclient waits
  4 s, then papermill fails the cell: a cell that printed faster than the driver reads was failed), and a
  cell timeout says which cell ran too long.
* The caller sees the kernel's process (to enforce run timeouts and cancel), each cell's
  progress, and each point of the metric history as the kernel sends it (``on_point``: the
  ``nbbatch.record(step=...)`` displays and display updates).

It is registered as papermill engine ``nbbatch`` (``papermill --engine nbbatch`` works too, though
papermill then writes the final notebook itself, in place; :func:`execute_notebook_file`, behind
``nbbatch run``, keeps that write atomic as well).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbclient.util import ensure_async, run_sync


def __getattr__(name: str) -> object:
    # Imported before papermill, this module imports papermill, whose entry-point scan asks this (half
    # imported) module for NbbatchEngine: hand it a stand-in, replaced by the register() call at the end.
    if name == "NbbatchEngine":
        return type("NbbatchEngine", (), {"__doc__": "stand-in while nbbatch.execute.engine is importing"})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# papermill.execute is half imported when papermill's entry-point scan loads this module: its names are read when called
import nbformat  # noqa: E402
import papermill.execute as papermill_execute  # noqa: E402
from papermill.clientwrap import PapermillNotebookClient  # noqa: E402 - after the stand-in
from papermill.engines import NBClientEngine, NotebookExecutionManager, papermill_engines  # noqa: E402
from papermill.exceptions import PapermillExecutionError  # noqa: E402
from papermill.iorw import load_notebook_node, local_file_io_cwd  # noqa: E402
from papermill.parameterize import add_builtin_parameters, parameterize_notebook, parameterize_path  # noqa: E402

from nbbatch.execute.kernels import BatchKernelManager, reap_kernel  # noqa: E402
from nbbatch.execute.prestart import PrestartedKernel  # noqa: E402
from nbbatch.execute.watchdog import REAPER  # noqa: E402, F401 - for `nbbatch run`, whose api loads this module lazily
from nbbatch.metrics import HISTORY_MIME  # noqa: E402
from nbbatch.store.notebook_io import cell_number, user_cells, write_notebook_atomic  # noqa: E402
from nbbatch.store.runjson import cell_label  # noqa: E402

Saver = Callable[[Any], None]
PointCallback = Callable[[dict[str, Any]], None]
_DISPLAYS = {"display_data", "update_display_data", "execute_result"}
_MERGED_OUTPUT = 1 << 16  # characters a stream output grows to by merging the cell's next printed text into it


class BatchExecutionManager(NotebookExecutionManager):
    """papermill's execution manager, saving through a callback no more often than ``save_every``.

    The first checkpoint is written ``save_every`` seconds after the start (a notebook done sooner is
    written once, at the end); with ``final_save=False`` the caller writes the final notebook itself.
    """

    def __init__(self, nb: Any, saver: Saver | None = None, save_every: float = 1.0,
                 on_cell: Callable[[int, int], None] | None = None, final_save: bool = True, **kwargs: Any):
        super().__init__(nb, output_path=None, progress_bar=False, **kwargs)
        self.saver = saver
        self.save_every = save_every
        self.on_cell = on_cell
        self.final_save = final_save
        self._last_saved = time.monotonic()

    def save(self, force: bool = False, **kwargs: Any) -> None:  # type: ignore[override]
        now = time.monotonic()
        if self.saver and (force or now - self._last_saved >= self.save_every):
            self.saver(self.nb)
            self._last_saved = time.monotonic()
        self.last_save_time = self.now()

    def autosave_cell(self) -> None:
        # Long cells still reach the share while they stream output, at the same coalesced rate.
        if self.saver and time.monotonic() - self._last_saved >= max(self.save_every, 5.0):
            self.save()

    def cell_complete(self, cell: Any, cell_index: int | None = None, **kwargs: Any) -> None:
        super().cell_complete(cell, cell_index=cell_index, **kwargs)
        if self.on_cell and cell_index is not None:  # counted as the user's notebook has its cells
            self.on_cell(user_cells(self.nb.cells, cell_index + 1), user_cells(self.nb.cells))

    def notebook_complete(self, **kwargs: Any) -> None:
        super().notebook_complete(**kwargs)
        if self.final_save:
            self.save(force=True)


ELIDED = ("\n[nbbatch: this cell printed more than {limit:g} MiB; the rest of its printed output is only in "
          "log.txt (max_output_mb)]\n")


class _BatchClient(PapermillNotebookClient):
    """Reports the kernel manager as soon as the kernel process exists (started here or before), and keeps
    at most ``max_output_bytes`` of each cell's printed output in the notebook, consecutive printed text of one
    stream merged into one output (see :func:`_add_stream`).

    What a cell prints beyond that still reaches ``log.txt`` (papermill logs every output as it
    comes); the notebook gets a note instead. The driver's memory is then bounded by the limit, not
    by what the notebook prints.

    A cell's output is read to its end after the cell's reply for as long as it keeps coming (nbclient
    gives it ``iopub_timeout`` seconds in all, and papermill then fails the cell: a kernel that printed
    faster than the driver reads is still sending). A cell timeout names the cell.
    """

    def __init__(self, nb_man: Any, on_kernel: Callable[[Any], None] | None = None,
                 max_output_bytes: int | None = None, on_point: PointCallback | None = None, **kwargs: Any):
        super().__init__(nb_man, **kwargs)
        self._on_kernel = on_kernel
        self._on_point = on_point
        self._max_output = max_output_bytes
        self._printed: dict[int, int] = {}  # cell index → characters of stream output kept or seen
        self._messages_read = 0  # of the cells' output, read so far: the drain after a reply goes on while it grows
        self._output_task: asyncio.Future[Any] | None = None

    async def async_execute_cell(self, cell: Any, cell_index: int, execution_count: int | None = None,
                                 store_history: bool = True) -> Any:
        try:
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        except CellTimeoutError as exc:
            _name_the_cell(exc, cell, cell_number(self.nb.cells, cell_index), self._get_timeout(cell))
            raise
        finally:  # nbclient leaves its output reader pending after a cell timeout: asyncio would complain of it
            task, self._output_task = self._output_task, None
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait({task})

    # nbclient binds its sync wrapper to the base coroutine; rebind it to ours.
    execute_cell = run_sync(async_execute_cell)

    async def _async_poll_output_msg(self, parent_msg_id: str, cell: Any, cell_index: int) -> None:
        self._output_task = asyncio.current_task()
        await super()._async_poll_output_msg(parent_msg_id, cell, cell_index)

    async def _async_poll_for_reply(self, msg_id: str, cell: Any, timeout: int | None,
                                    task_poll_output_msg: asyncio.Future[Any],
                                    task_poll_kernel_alive: asyncio.Future[Any]) -> dict[str, Any]:
        # nbclient's wait for the reply, told the output is read already: the wait for it is _drain_output's
        read = asyncio.get_running_loop().create_future()
        read.set_result(None)
        reply = await super()._async_poll_for_reply(msg_id, cell, timeout, read, task_poll_kernel_alive)
        await self._drain_output(task_poll_output_msg)
        return reply

    async def _drain_output(self, output: asyncio.Future[Any]) -> None:
        """Wait for the rest of a replied cell's output while it keeps coming; a quiet, live kernel ends the wait."""
        while True:
            read_before = self._messages_read
            done, _ = await asyncio.wait({output}, timeout=self.iopub_timeout)
            if done:
                output.result()  # its error, if any
                return
            if self._messages_read != read_before or await ensure_async(self.kc.iopub_channel.msg_ready()):
                continue
            output.cancel()
            if not await ensure_async(self.kc.is_alive()):
                raise DeadKernelError("Kernel died")
            # Its end (the kernel's idle status) never came: lost by the kernel's full output queue. Go on.
            note = f"\n[nbbatch: the rest of this cell's output did not come within {self.iopub_timeout} s]\n"
            self.log.warning(note.strip())
            if self.stderr_file:
                self.stderr_file.write(note)
            return

    def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
        self._messages_read += 1
        if self._on_point is not None and msg.get("msg_type") in _DISPLAYS:
            point = (msg.get("content", {}).get("data") or {}).get(HISTORY_MIME)
            if isinstance(point, dict):  # every point, also those a later update of the same output replaces
                self._on_point(point)
        return super().process_message(msg, cell, cell_index)

    def output(self, outs: list[Any], msg: dict[str, Any], display_id: str | None, cell_index: int) -> Any:
        if self.clear_before_next_output:  # a delayed clear_output empties the cell first
            self._printed.pop(cell_index, None)
        out = super().output(outs, msg, display_id, cell_index)
        text = out.get("text") if out is not None and out.get("output_type") == "stream" else None
        if not isinstance(text, str) or not outs or outs[-1] is not out:
            return out
        outs.pop()  # kept below, merged into the cell's last output where that is the same stream
        name = out.get("name", "stdout")
        for kept in self._within_limit(cell_index, text):
            _add_stream(outs, name, kept)
        return out  # whole: papermill writes it to log.txt

    def _within_limit(self, cell_index: int, text: str) -> list[str]:
        """What the notebook keeps of a cell's next printed ``text``: all of it, its head and the note, or nothing."""
        if self._max_output is None:
            return [text]
        before = self._printed.get(cell_index, 0)
        self._printed[cell_index] = before + len(text)
        if before + len(text) <= self._max_output:
            return [text]
        if before > self._max_output:  # the note is there already
            return []
        head = text[:self._max_output - before]
        return [*([head] if head else []), ELIDED.format(limit=self._max_output / 2**20)]

    def log_output_message(self, output: Any) -> None:
        # papermill's joins a stream's text into a copy first: one message of a cell that printed tens of MiB
        # between two flushes is held twice more
        text = output.get("text") if output.get("output_type") == "stream" else None
        sink = {"stdout": self.stdout_file, "stderr": self.stderr_file}.get(output.get("name"))
        if not isinstance(text, str) or self.log_output or sink is None:
            super().log_output_message(output)
            return
        sink.write(text)
        sink.flush()

    def clear_output(self, outs: list[Any], msg: dict[str, Any], cell_index: int) -> None:
        super().clear_output(outs, msg, cell_index)
        if not msg["content"].get("wait"):
            self._printed.pop(cell_index, None)

    async def async_start_new_kernel_client(self) -> Any:
        if self._on_kernel:
            self._on_kernel(self.km)
        return await super().async_start_new_kernel_client()

    # nbclient binds its sync wrapper to the base coroutine; rebind it to ours.
    start_new_kernel_client = run_sync(async_start_new_kernel_client)


class NbbatchEngine(NBClientEngine):
    """papermill engine ``nbbatch``: coalesced atomic saves, immediate kernel shutdown, kernel hooks."""

    @classmethod
    def execute_notebook(cls, nb: Any, kernel_name: str, output_path: str | None = None, progress_bar: bool = False,
                         log_output: bool = False, autosave_cell_every: int = 30, saver: Saver | None = None,
                         save_every: float = 1.0, on_cell: Callable[[int, int], None] | None = None,
                         final_save: bool = True, **kwargs: Any) -> Any:
        """Execute ``nb``; ``final_save=False`` when the caller saves the returned notebook (also after a failure:
        the notebook object passed in is the one executed, partial outputs included)."""
        if saver is None and output_path:  # plain `papermill --engine nbbatch`: save to the output path atomically
            saver = _atomic_path_saver(output_path)
        nb_man = BatchExecutionManager(nb, saver=saver, save_every=save_every, on_cell=on_cell, final_save=final_save,
                                       log_output=log_output, autosave_cell_every=autosave_cell_every)
        nb_man.notebook_start()
        try:
            cls.execute_managed_notebook(nb_man, kernel_name, log_output=log_output, **kwargs)
        finally:
            nb_man.notebook_complete()
        return nb_man.nb

    @classmethod
    def execute_managed_notebook(cls, nb_man: Any, kernel_name: str, log_output: bool = False,
                                 stdout_file: Any = None, stderr_file: Any = None, start_timeout: int = 60,
                                 execution_timeout: float | None = None, kernel_env: dict[str, str] | None = None,
                                 kernel_cwd: str | None = None, kernel_stderr: Any = None,
                                 on_kernel: Callable[[Any], None] | None = None, on_point: PointCallback | None = None,
                                 prestarted: PrestartedKernel | None = None, **kwargs: Any) -> Any:
        """Execute in a new kernel, or in ``prestarted`` (a kernel started for this notebook) when it is usable."""
        kwargs.pop("input_path", None)
        kwargs.pop("startup_timeout", None)
        timeout = execution_timeout or kwargs.pop("timeout", None)
        km = prestarted.claim(kernel_stderr, wait=start_timeout) if prestarted is not None else None
        client = _BatchClient(
            nb_man, km=km, on_kernel=on_kernel, on_point=on_point, timeout=timeout, startup_timeout=start_timeout,
            kernel_name=kernel_name,
            log_output=log_output, stdout_file=stdout_file, stderr_file=stderr_file, shutdown_kernel="immediate",
            kernel_manager_class=BatchKernelManager,
            resources={"metadata": {"path": kernel_cwd}} if kernel_cwd else {}, **kwargs,
        )
        client.owns_km = True  # also a prestarted kernel: nbclient shuts it down at the end, like its own
        start: dict[str, Any] = {}
        if kernel_env is not None:
            start["env"] = kernel_env
        if kernel_stderr is not None:  # the kernel process's own stdout/stderr (not its cells' output)
            start["stdout"] = start["stderr"] = kernel_stderr
        try:
            return client.execute(**start)
        finally:
            if km is not None:
                if km.has_kernel:  # execute() failed before nbclient's own clean-up
                    reap_kernel(km)
                prestarted.release_output()  # type: ignore[union-attr]


def execute_notebook_file(input_path: str, output_path: str, parameters: dict[str, Any] | None = None,
                          kernel_name: str | None = None, **kwargs: Any) -> Any:
    """``papermill.execute_notebook(..., engine_name="nbbatch")`` with every write of ``output_path`` atomic.

    papermill itself rewrites the output in place after the engine is done, and again to add its error
    marker: a reader could see half a notebook. Here those writes go through the same temporary file and
    rename as the checkpoints. ``kwargs`` are the engine's (``kernel_cwd``, ``stdout_file``, ``execution_timeout``…).
    On a failing cell the output keeps papermill's error marker and PapermillExecutionError is raised.
    """
    path_parameters = add_builtin_parameters(parameters)
    input_path = parameterize_path(str(input_path), path_parameters)
    output_path = parameterize_path(str(output_path), path_parameters)
    saver = _atomic_path_saver(output_path)
    with local_file_io_cwd():
        nb = load_notebook_node(input_path)
        if parameters:
            nb = parameterize_notebook(nb, parameters, kernel_name=kernel_name, engine_name="nbbatch")
        nb = papermill_execute.prepare_notebook_metadata(nb, input_path, output_path)
        nb = papermill_execute.remove_error_markers(nb)
        kernel_name = papermill_engines.nb_kernel_name(engine_name="nbbatch", nb=nb, name=kernel_name)
        try:
            nb = NbbatchEngine.execute_notebook(nb, kernel_name, saver=saver, final_save=False, input_path=input_path,
                                                **kwargs)
            with tempfile.TemporaryDirectory(prefix="nbbatch-") as scratch:  # papermill's own (in-place) error write
                raise_for_cell_errors(nb, os.path.join(scratch, "failed.ipynb"))
        except PapermillExecutionError:
            saver(nb)  # with papermill's error marker at the top
            raise
        except BaseException:
            saver(nb)  # partial outputs, as far as the kernel got
            raise
        saver(nb)
    return nb


def _add_stream(outs: list[Any], name: str, text: str) -> None:
    """Append printed ``text`` to a cell's outputs: to its last output when that is the same stream, else as a new one.

    One output per message made 300,000 short prints a notebook of 232,190 outputs (20.8 MB, and seconds per save).
    An output stops growing at ``_MERGED_OUTPUT`` characters, so that a merge never copies more than that (a new
    output follows; Jupyter shows consecutive outputs of one stream as one).
    """
    last = outs[-1] if outs else None
    if (last is not None and last.get("output_type") == "stream" and last.get("name") == name
            and isinstance(last.get("text"), str) and len(last["text"]) < _MERGED_OUTPUT):
        last["text"] += text
    else:
        outs.append(nbformat.v4.new_output("stream", name=name, text=text))


def _name_the_cell(exc: CellTimeoutError, cell: Any, number: int | None, timeout: float | None) -> None:
    """nbclient's message ends in a line of dashes, and names no cell: say which cell (``number``: as the user's
    notebook numbers it), with its first line."""
    source = str(cell.get("source", ""))
    limit = f" ({timeout:g} s)" if timeout else ""
    exc.args = (f"{cell_label(number, source) or 'a cell'} ran longer than the cell timeout{limit}",)
    # what nbbatch records (the cell's number and source are fields of their own)
    exc.evalue = f"ran longer than {timeout:g} s" if timeout else "ran too long"  # type: ignore[attr-defined]
    exc.cell_number, exc.source, exc.timeout = number, source, timeout  # type: ignore[attr-defined]


def raise_for_cell_errors(nb: Any, failed_output: str) -> None:
    """papermill's ``raise_for_execution_errors`` (which adds its error marker to ``nb`` and writes it to
    ``failed_output``), its PapermillExecutionError naming the cell as the user's notebook numbers it
    (``cell_number``, see :func:`~nbbatch.store.notebook_io.cell_number`)."""
    cells = list(nb.cells)  # before papermill inserts its markers
    try:
        papermill_execute.raise_for_execution_errors(nb, failed_output)
    except PapermillExecutionError as exc:
        exc.cell_number = cell_number(cells, exc.cell_index)  # type: ignore[attr-defined]
        raise


def _atomic_path_saver(path: str) -> Saver:
    return lambda nb: write_notebook_atomic(nb, path)


papermill_engines.register("nbbatch", NbbatchEngine)
