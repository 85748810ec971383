"""Kernels started ahead import their run's framework first (``preload``): silently, binding no name, never
failing the run (a module missing, an import that hangs or kills the kernel), and saying so in the run's log."""

from __future__ import annotations

import os

import nbformat
import psutil
import pytest
from support.notebooks import make_notebook
from support.processes import gone, kernels_of
from support.waiting import wait_until

from nbbatch.api import submit
from nbbatch.execute.engine import execute_notebook_file
from nbbatch.execute.prestart import KernelPool

pytestmark = [pytest.mark.timeout(180), pytest.mark.kernel]  # every test starts kernels

# What the first cell shows: whether the modules are loaded, whether their names leaked into the user namespace,
# and which process ran it.
PROBE = ("import os, sys\n"
         "print(['xml.dom.minidom' in sys.modules, [n for n in ('xml', 'minidom', 'importlib') if n in globals()],"
         " os.getpid()])")


def _run(tmp_path, pool: KernelPool, preload: tuple[str, ...], env: dict[str, str]) -> tuple[list, int, object, int]:
    """Execute the probe notebook in the kernel ``pool`` started for it: what its cell printed, its execution count,
    the kernel that was started ahead and its process id."""
    make_notebook(tmp_path / "nb.ipynb", [PROBE], parameters=None)
    kernel = pool.take("run", "python3", env, str(tmp_path), preload)
    assert kernel is not None
    wait_until(kernel._launched.is_set, 60, "the kernel started ahead to start")
    ahead = kernel.km.provisioner.process.pid
    nb = execute_notebook_file(str(tmp_path / "nb.ipynb"), str(tmp_path / "out.ipynb"), kernel_name="python3",
                               kernel_env=env, kernel_cwd=str(tmp_path), prestarted=kernel, start_timeout=120)
    cell = nb.cells[0]
    return eval(cell.outputs[0].text), cell.execution_count, kernel, ahead  # noqa: S307 - the probe's own list


def _no_kernels_left() -> bool:
    return not [p for p in psutil.Process().children(recursive=True)
                if "ipykernel" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE]


def test_preloaded_modules_are_there_before_the_first_cell_and_bind_no_name(tmp_path):
    (tmp_path / "noisy_import.py").write_text("import warnings\nprint('printed-on-import')\nwarnings.warn('warned')\n")
    pool, env = KernelPool(1), dict(os.environ, PYTHONPATH=str(tmp_path))
    preload = ("json", "xml.dom.minidom", "noisy_import", "no_such_module_at_all")  # a missing module is skipped
    assert pool.prestart("run", "python3", env, str(tmp_path), preload)
    (loaded, leaked, pid), count, kernel, ahead = _run(tmp_path, pool, preload, env)
    assert pid == ahead, "the run must have run in the kernel started ahead"
    assert loaded is True and leaked == [], "the preload must import the modules and bind no name"
    assert count == 1, "the preload must not change the execution count the notebook sees"
    line = kernel.describe(kernel.km)
    assert line.startswith("kernel started ahead, json, xml.dom.minidom, noisy_import imported in ")
    assert "no_such_module_at_all not importable" in line
    assert "printed-on-import" in line and "warned" in line, "what importing printed goes to the run's log"
    assert "printed-on-import" not in (tmp_path / "out.ipynb").read_text(), "… never into its notebook"
    wait_until(_no_kernels_left, 15, "the kernel to end")
    pool.close()


def test_a_preloaded_module_changing_the_directory_environment_or_path_leaves_the_run_as_a_fresh_kernel(tmp_path):
    """The preload imports a module that changes the working directory, sets and removes environment variables and
    puts a folder first on sys.path: the run's first cell sees none of it (the module stays imported). (Before: such
    a module's chdir made 5 of 6 runs fail.)"""
    (tmp_path / "meddling.py").write_text("import os, sys\nos.chdir('/')\nos.environ['MEDDLED'] = '1'\n"
                                          "os.environ.pop('KEEP_ME', None)\nsys.path.insert(0, '/nowhere')\n")
    probe = ("import os, sys\nprint([os.getcwd(), os.environ.get('MEDDLED'), os.environ.get('KEEP_ME'), "
             "sys.path[:3].count('/nowhere'), 'meddling' in sys.modules, os.getpid()])")
    make_notebook(tmp_path / "nb.ipynb", [probe], parameters=None)
    pool, env = KernelPool(1), dict(os.environ, PYTHONPATH=str(tmp_path), KEEP_ME="kept")
    assert pool.prestart("run", "python3", env, str(tmp_path), ("meddling",))
    kernel = pool.take("run", "python3", env, str(tmp_path), ("meddling",))
    wait_until(kernel._launched.is_set, 60, "the kernel started ahead to start")
    ahead = kernel.km.provisioner.process.pid
    nb = execute_notebook_file(str(tmp_path / "nb.ipynb"), str(tmp_path / "out.ipynb"), kernel_name="python3",
                               kernel_env=env, kernel_cwd=str(tmp_path), prestarted=kernel, start_timeout=120)
    seen = eval(nb.cells[0].outputs[0].text)  # noqa: S307 - the probe's own list
    assert seen == [str(tmp_path), None, "kept", 0, True, ahead]
    pool.close()


@pytest.mark.parametrize("body", ["import time\nwhile True:\n    time.sleep(1)\n", "import os\nos._exit(3)\n"],
                         ids=["hangs", "kills the kernel"])
def test_a_preload_that_hangs_or_dies_leaves_the_run_its_own_kernel(tmp_path, body):
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "bad_import.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=str(modules))
    pool = KernelPool(1, preload_timeout=3.0)  # the hanging import never ends: any bound is reached
    assert pool.prestart("run", "python3", env, str(tmp_path), ("xml.dom.minidom", "bad_import"))
    (loaded, leaked, pid), count, kernel, ahead = _run(tmp_path, pool, ("xml.dom.minidom", "bad_import"), env)
    assert pid != ahead and not loaded and count == 1, "the run must have run in a fresh kernel of its own"
    assert kernel.describe(None).startswith("the kernel started ahead was not used (")
    assert gone(ahead)
    wait_until(_no_kernels_left, 15, "every kernel to end")


def test_a_kernel_discarded_while_it_imports_is_killed(tmp_path):
    (tmp_path / "bad_import.py").write_text("import time\nwhile True:\n    time.sleep(1)\n")
    pool = KernelPool(1)  # the default bound: only the discard can end this preload
    assert pool.prestart("run", "python3", dict(os.environ, PYTHONPATH=str(tmp_path)), str(tmp_path), ["bad_import"])
    kernel = pool._kernels["run"]
    wait_until(kernel._launched.is_set, 60, "the kernel to start")
    ahead = kernel.km.provisioner.process.pid
    assert not kernel._ready.is_set(), "the import hangs: the kernel is still preloading"
    pool.close()
    assert kernel._ready.is_set() and gone(ahead)
    wait_until(_no_kernels_left, 15, "the kernel to end")


def test_runs_of_a_recognised_framework_get_warm_kernels(project, write_experiment):
    """End to end: a notebook given by path, recognised by its imports as a project framework naming `preload`."""
    (project / "frameworks" / "toy").mkdir()
    (project / "frameworks" / "toy" / "framework.yaml").write_text(
        "title: Toy\nnotebook: nb.ipynb\nimports: [colorsys]\npreload: [colorsys]\n")
    (project / "frameworks" / "toy" / "requirements.txt").write_text("# its env is never built here\n")
    make_notebook(project / "nb.ipynb", ["import sys\nprint('colorsys' in sys.modules)", "import colorsys"])
    exp = write_experiment("experiment: warm\nnotebooks: [{path: nb.ipynb, kernel: python3}]\n"
                           "sweep: {grid: {A: [1, 2, 3]}}\nresources: {max_parallel: 1}\n"
                           "backend: {name: local, prestart: 2}\n")
    result = submit(exp, progress=False)
    assert result.ok and len(result.records) == 3
    warm = 0
    for record in result.records:
        folder = project / "results" / "warm" / record.run_id
        log = (folder / "log.txt").read_text()
        cells = nbformat.read(folder / "output.ipynb", as_version=4).cells
        probe = next(cell for cell in cells if "'colorsys' in sys.modules" in cell.source)
        preloaded = probe.outputs[0].text.strip() == "True"
        if "=== nbbatch: kernel started ahead, colorsys imported in " in log:
            warm += 1
            assert preloaded, log
        else:
            assert "kernel started ahead" not in log and not preloaded, log
    assert warm == 3, "every run gets a kernel started ahead, the first wave too"
    assert not kernels_of("warm"), "kernels were left running"
