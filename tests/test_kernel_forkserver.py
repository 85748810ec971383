"""Kernels forked from a fork server that imported their framework once: as fresh as a kernel started cold (cwd,
environment, sys.path, argv, namespace, execution count, random streams), nothing of one run seen by the next, the
preload's side effects gone, killed with their process group, and a server that cannot fork leaves the run a kernel
started as usual, said in its log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import nbformat
import psutil
import pytest
from support.notebooks import make_notebook
from support.processes import gone, kernels_of
from support.waiting import wait_until

from nbbatch.api import submit
from nbbatch.execute.engine import execute_notebook_file
from nbbatch.execute.forkserver import ForkServer, import_env, split_command
from nbbatch.execute.kernels import kill_kernel_group, reap_kernel
from nbbatch.execute.prestart import KernelPool

# What a kernel shows of itself: everything a fresh `python -m ipykernel_launcher -f …` in its cwd has as it starts.
PROBE = ("import os, sys\n"
         "import numpy\n"
         "print(repr([os.getcwd(), os.environ.get('NBBATCH_RUN_ID'), os.environ.get('LEAKED'), sys.path, sys.argv[0],"
         " sys.argv[1], sorted(n for n in globals() if not n.startswith('_') and n not in ('In', 'Out', 'exit', 'quit',"
         " 'get_ipython', 'open', 'os', 'sys', 'numpy')), os.getsid(0) == os.getpid(), 'json' in sys.modules,"
         " getattr(sys.modules.get('json'), 'leak', None), numpy.random.rand(), os.getpid()]))\n"
         "LEAK = 1\nos.environ['LEAKED'] = '1'\nimport json\njson.leak = 1")


def _execute(folder, kernel, env: dict[str, str]) -> tuple[list, int]:
    """Run the probe notebook in ``folder``, in ``kernel`` (started ahead) or, when None, a kernel of its own."""
    make_notebook(folder / "nb.ipynb", [PROBE], parameters=None)
    nb = execute_notebook_file(str(folder / "nb.ipynb"), str(folder / "out.ipynb"), kernel_name="python3",
                               kernel_env=env, kernel_cwd=str(folder), prestarted=kernel, start_timeout=120)
    cell = nb.cells[0]
    return eval(cell.outputs[0].text), cell.execution_count  # noqa: S307 - the probe's own list


def _folders(tmp_path, *names: str):
    for name in names:
        (tmp_path / name).mkdir()
    return [tmp_path / name for name in names]


@pytest.mark.kernel
@pytest.mark.timeout(180)
def test_forked_kernels_are_as_fresh_as_cold_ones_and_share_nothing(tmp_path):
    cold_dir, first_dir, second_dir = _folders(tmp_path, "cold", "first", "second")
    env = dict(os.environ, NBBATCH_RUN_ID="cold")
    cold, cold_count = _execute(cold_dir, None, env)

    pool = KernelPool(2)
    pool.warm("python3", env, ("json", "numpy.random"))
    seen = []
    for key, folder in (("first", first_dir), ("second", second_dir)):  # one after the other: the first sets LEAK…
        run_env = dict(env, NBBATCH_RUN_ID=key)  # set per run: the server serves both
        assert pool.prestart(key, "python3", run_env, str(folder), ("json", "numpy.random"))
        kernel = pool.take(key, "python3", run_env, str(folder), ("json", "numpy.random"))
        result, count = _execute(folder, kernel, run_env)
        assert kernel.km.fork_error is None and "; forked from a process that had imported json, numpy.random" in \
            kernel.describe(kernel.km), kernel.describe(kernel.km)
        assert count == cold_count == 1, "the first cell's execution count is 1"
        seen.append(result)
    pool.close()
    for (cwd, value, leaked, path, argv0, argv1, names, session, has_json, leak, _rand, _pid), folder, key in \
            zip(seen, (first_dir, second_dir), ("first", "second"), strict=True):
        assert cwd == str(folder) and value == key, "the run's own working directory and environment"
        assert leaked is None and names == [] and leak is None, "nothing the run before set is seen"
        assert path == [str(folder) if p == str(cold_dir) else p for p in cold[3]], "sys.path as a fresh kernel's"
        assert (argv0, argv1) == (cold[4], cold[5]) == (cold[4], "-f")
        assert session, "a forked kernel leads a session of its own, as a cold one"
        assert has_json, "the preloaded module is there"
    assert cold[6] == [] and cold[2] is None
    assert seen[0][10] != seen[1][10], "numpy's global random streams of two forked kernels differ"
    assert all(gone(result[-1]) for result in seen)


@pytest.mark.kernel
@pytest.mark.timeout(120)
def test_generators_a_preload_seeded_at_import_are_seeded_anew_in_each_forked_kernel(tmp_path):
    """A stand-in `torch` seeded from the OS at import, as PyTorch's default generator is: two forks differ."""
    modules, one, two = _folders(tmp_path, "modules", "one", "two")
    (modules / "torch.py").write_text("import os\n_seed = os.urandom(8).hex()\n"
                                      "def seed():\n    global _seed\n    _seed = os.urandom(8).hex()\n"
                                      "def initial_seed():\n    return _seed\n")
    pool, seeds = KernelPool(2), []
    env = dict(os.environ, PYTHONPATH=str(modules))
    pool.warm("python3", env, ("torch",))
    for key, folder in (("one", one), ("two", two)):
        make_notebook(folder / "nb.ipynb", ["import torch\nprint(torch.initial_seed())"], parameters=None)
        assert pool.prestart(key, "python3", env, str(folder), ("torch",))
        kernel = pool.take(key, "python3", env, str(folder), ("torch",))
        nb = execute_notebook_file(str(folder / "nb.ipynb"), str(folder / "out.ipynb"), kernel_name="python3",
                                   kernel_env=env, kernel_cwd=str(folder), prestarted=kernel, start_timeout=120)
        assert kernel.km.fork_error is None and kernel.km.fork_server is not None
        seeds.append(nb.cells[0].outputs[0].text.strip())
    pool.close()
    assert seeds[0] != seeds[1]


@pytest.mark.kernel
@pytest.mark.timeout(120)
def test_a_preloaded_modules_side_effects_do_not_reach_the_forked_kernel(tmp_path):
    modules, run = _folders(tmp_path, "modules", "run")
    (modules / "meddling.py").write_text("import os, sys\nos.chdir('/')\nos.environ['MEDDLED'] = '1'\nprint('on-import')\n"
                                         "os.environ.pop('KEEP_ME', None)\nsys.path.insert(0, '/nowhere')\n")
    probe = ("import os, sys\nprint(repr([os.getcwd(), os.environ.get('MEDDLED'), os.environ.get('KEEP_ME'), "
             "sys.path.count('/nowhere'), 'meddling' in sys.modules]))")
    make_notebook(run / "nb.ipynb", [probe], parameters=None)
    env = dict(os.environ, PYTHONPATH=str(modules), KEEP_ME="kept")
    pool = KernelPool(1)
    pool.warm("python3", env, ("meddling",))
    assert pool.prestart("run", "python3", env, str(run), ("meddling",))
    kernel = pool.take("run", "python3", env, str(run), ("meddling",))
    nb = execute_notebook_file(str(run / "nb.ipynb"), str(run / "out.ipynb"), kernel_name="python3",
                               kernel_env=env, kernel_cwd=str(run), prestarted=kernel, start_timeout=120)
    assert kernel.km.fork_error is None
    assert eval(nb.cells[0].outputs[0].text) == [str(run), None, "kept", 0, True]  # noqa: S307
    assert "importing printed:\non-import" in kernel.describe(kernel.km), "what the server's imports printed is said"
    pool.close()


@pytest.mark.kernel
@pytest.mark.timeout(120)
def test_a_server_that_cannot_fork_leaves_the_run_a_kernel_started_as_usual(tmp_path):
    """An import that starts a Python thread makes forking unsafe: the server says so and the kernel starts cold."""
    modules, run = _folders(tmp_path, "modules", "run")
    (modules / "threaded.py").write_text("import threading, time\n"
                                         "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    env = dict(os.environ, PYTHONPATH=str(modules))
    pool = KernelPool(1)
    pool.warm("python3", env, ("threaded",))
    assert pool.prestart("run", "python3", env, str(run), ("threaded",))
    kernel = pool.take("run", "python3", env, str(run), ("threaded",))
    (cwd, *_rest), count = _execute(run, kernel, env)
    assert cwd == str(run) and count == 1
    line = kernel.describe(kernel.km)
    assert "; not forked (the fork server did not start: the imports started 1 Python threads): started as usual" \
        in line, line
    pool.close()


@pytest.mark.kernel
@pytest.mark.timeout(120)
def test_a_forked_kernel_is_killed_with_its_process_group_and_its_exit_code_reported(tmp_path):
    server, km, client = _forked_kernel(tmp_path)
    kernel = km.provisioner.process
    assert kernel.pid not in {p.pid for p in psutil.Process().children()}, "a child of the server, not of this process"
    client.execute("import subprocess; p = subprocess.Popen(['sleep', '300']); open('child', 'w').write(str(p.pid))")
    wait_until(lambda: (tmp_path / "child").exists() and (tmp_path / "child").read_text(), 30, "the kernel's child")
    child = int((tmp_path / "child").read_text())
    client.stop_channels()
    assert kernel.poll() is None
    kill_kernel_group(km)
    assert kernel.wait(timeout=10) == -signal.SIGKILL, "the server reports how the kernel ended"
    wait_until(lambda: gone(child), 10, "the kernel's own child to be killed with its group")
    reap_kernel(km)
    server.close()
    wait_until(lambda: not server._process or server._process.poll() is not None, 10, "the server to end")


def _forked_kernel(folder):
    """A kernel of the driver's venv forked from a server that imported json, and its client, ready."""
    import asyncio

    from nbbatch.execute.kernels import BatchKernelManager

    server = ForkServer(split_command([sys.executable, "-m", "ipykernel_launcher"])[0], ("json",), dict(os.environ))
    assert server.ready(), server.error
    km = BatchKernelManager(kernel_name="python3")
    km.fork_server = server
    km.kernel_spec.argv[0] = server.python[0]
    asyncio.run(km.start_kernel(cwd=str(folder), env=dict(os.environ)))
    assert km.fork_error is None, km.fork_error
    client = km.client()
    client.start_channels()
    asyncio.run(client.wait_for_ready(timeout=60))
    return server, km, client


@pytest.mark.kernel
@pytest.mark.timeout(120)
def test_a_forked_kernel_that_is_shut_down_ends_as_an_interpreter_does(tmp_path):
    """Its `atexit` functions run (a notebook's own: a tracker's last write), as in a kernel started cold."""
    server, km, client = _forked_kernel(tmp_path)
    client.execute("import atexit\natexit.register(lambda: open('at-exit', 'w').write('ran'))")
    wait_until(lambda: km.provisioner.process.poll() is None, 5, "the kernel to run")
    client.shutdown()
    assert km.provisioner.process.wait(timeout=30) == 0
    assert (tmp_path / "at-exit").read_text() == "ran"
    client.stop_channels()
    reap_kernel(km)
    server.close()


@pytest.mark.kernel
@pytest.mark.timeout(60)
def test_a_server_whose_imports_touched_the_gpu_never_forks(tmp_path):
    """A preload that initialised NVML or CUDA's driver (a GPU device file is open) asked about the GPUs as the server
    saw them: no fork from it. Stand-in device files here; a library merely loaded (as a CUDA build of PyTorch loads
    CUDA's driver at import, seen on an H200) is fine."""
    import ctypes.util

    (tmp_path / "nvidiactl").write_text("")
    (tmp_path / "asks_the_gpus.py").write_text(f"held = open({str(tmp_path / 'nvidiactl')!r})\n")
    found = ctypes.util.find_library("z")
    (tmp_path / "loads_a_library.py").write_text(f"import ctypes\nlib = ctypes.CDLL({found!r})\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), FORKSERVER_GPU_DEVICES=str(tmp_path / "nvidia"))
    server = ForkServer([sys.executable], ("asks_the_gpus",), env)
    try:
        assert not server.ready()
        assert server.error == "the fork server did not start: the imports loaded CUDA's driver or NVML"
    finally:
        server.close()
    if found:
        server = ForkServer([sys.executable], ("loads_a_library",), env)
        try:
            assert server.ready(), server.error
        finally:
            server.close()


@pytest.mark.kernel
@pytest.mark.timeout(60)
def test_a_server_under_a_temporary_folder_too_long_for_a_socket_path_still_starts(tmp_path, monkeypatch):
    import tempfile

    long_folder = tmp_path / ("x" * 100)
    long_folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_folder))
    server = ForkServer([sys.executable], ("json",), dict(os.environ))
    try:
        assert server.ready(), server.error
        assert len(os.fsencode(server.socket_path)) < 100
    finally:
        server.close()


def test_a_kernel_command_is_forkable_only_as_python_m_ipykernel_launcher():
    assert split_command(["/v/bin/python", "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "{cf}"]) == \
        (["/v/bin/python", "-Xfrozen_modules=off"], ["-f", "{cf}"])
    assert split_command(["python", "-m", "ipykernel_launcher"]) == (["python"], [])
    assert split_command(["/wrap.sh", "python", "-m", "ipykernel_launcher", "-f", "x"]) is None
    assert split_command(["python", "-c", "code", "-m", "ipykernel_launcher"]) is None
    assert split_command(["julia", "-i", "kernel.jl", "{cf}"]) is None


def test_runs_that_differ_only_in_what_nbbatch_sets_per_run_share_a_server():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "2"}
    one = dict(base, NBBATCH_RUN_ID="a", CUDA_VISIBLE_DEVICES="0", NBBATCH_CPUS="0")
    two = dict(base, NBBATCH_RUN_ID="b", CUDA_VISIBLE_DEVICES="1", NBBATCH_OUTPUT_DIR="/o")
    assert import_env(one) == import_env(two) == base
    assert import_env(dict(base, OMP_NUM_THREADS="4")) != import_env(one), "a variable read at import is the key's"
    shared = dict(one, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    assert import_env(shared, per_run=("PYTORCH_CUDA_ALLOC_CONF",)) == base, "a sharing variable is set per run"


@pytest.mark.kernel
@pytest.mark.timeout(180)
def test_the_first_wave_of_a_recognised_framework_starts_forked(project, write_experiment):
    """End to end: every run of the first wave gets a kernel forked from a process that imported its framework, and
    the kernel process's own output still reaches each run's log."""
    _toy_framework(project)
    make_notebook(project / "nb.ipynb", [
        "import os, sys\nprint('colorsys' in sys.modules, os.environ['NBBATCH_RUN_ID'])",
        "import colorsys\nget_ipython().kernel.log.warning('kernel-process-output %s', A)"])
    exp = write_experiment("experiment: forked\nnotebooks: [{path: nb.ipynb, kernel: python3}]\n"
                           "sweep: {grid: {A: [1, 2]}}\nresources: {max_parallel: 2}\n")
    result = submit(exp, progress=False)
    assert result.ok and len(result.records) == 2
    for record in result.records:
        folder = project / "results" / "forked" / record.run_id
        log = (folder / "log.txt").read_text()
        assert "=== nbbatch: kernel started ahead, colorsys imported in " in log, log
        assert "; forked from a process that had imported colorsys" in log, log
        assert f"kernel-process-output {record.parameters['A']}" in log, "the kernel's own output goes to its log"
        probe = next(cell for cell in nbformat.read(folder / "output.ipynb", as_version=4).cells
                     if "'colorsys' in sys.modules" in cell.source)
        assert probe.outputs[0].text.split() == ["True", record.run_id]
    assert not kernels_of("forked"), "kernels were left running"


def _toy_framework(project) -> None:
    """A project framework recognised by `import colorsys`, preloading it."""
    (project / "frameworks" / "toy").mkdir()
    (project / "frameworks" / "toy" / "framework.yaml").write_text(
        "title: Toy\nnotebook: nb.ipynb\nimports: [colorsys]\npreload: [colorsys]\n")
    (project / "frameworks" / "toy" / "requirements.txt").write_text("# its env is never built here\n")


@pytest.mark.kernel
@pytest.mark.timeout(180)
def test_a_sigkilled_driver_leaves_no_fork_server_forked_kernel_or_kernel_child(project, write_experiment):
    _toy_framework(project)
    make_notebook(project / "nb.ipynb", [
        "import colorsys, os, pathlib, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "pathlib.Path(f'pids-{A}').write_text(f'{os.getpid()} {os.getppid()} {child.pid}')\ntime.sleep(120)"])
    write_experiment("experiment: killedfork\nnotebooks: [{path: nb.ipynb, kernel: python3}]\n"
                     "sweep: {grid: {A: [1, 2]}}\nresources: {max_parallel: 2}\n")
    driver = subprocess.Popen([sys.executable, "-m", "nbbatch", "submit", "exp.yaml", "-q"], cwd=project,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: all((project / f"pids-{a}").exists() for a in (1, 2)), 120, "both runs to start")
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
    kernels, parents, children = zip(*(map(int, (project / f"pids-{a}").read_text().split()) for a in (1, 2)),
                                     strict=True)
    assert parents[0] == parents[1] != driver.pid, "both kernels were forked by one fork server"
    for pid in (*kernels, parents[0], *children):
        wait_until(lambda pid=pid: gone(pid), 15, f"process {pid} to end")
