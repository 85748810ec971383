"""A run that starts from another run's checkpoints (``Run.resume_from``): its id, the copy before its first attempt
(a folder share and a remote one), a retry that keeps its own newer checkpoints, and what its record says.

The kernel test runs the real PyTorch notebook twice: one epoch, then two epochs continuing the first run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import nbformat
import pytest
from support.machine import REPO
from support.notebooks import make_notebook
from support.plugins import MemoryShare

from nbbatch.execute.attempts import execute_run
from nbbatch.execute.folders import RunFolders
from nbbatch.execute.launch import LaunchSpec
from nbbatch.metrics import HISTORY_MIME, metrics_from_notebook
from nbbatch.plan.runs import Plan, Run, plan, run_id_for, run_id_maker
from nbbatch.spec.experiment import load_experiment
from nbbatch.store.layout import run_paths
from nbbatch.store.runjson import RunRecord
from nbbatch.store.share import FileShare
from nbbatch.store.sync import push

SOURCE = "nb-source"


def _run(run_id: str = "nb-next", **fields) -> Run:
    return Run(run_id=run_id, experiment="cont", notebook="/nowhere/nb.ipynb", notebook_rel="nb.ipynb",
               kernel="python3", **fields)


def _tree(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``folder`` (hidden ones too): its SHA-256 and modification time."""
    return {p.relative_to(folder).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _source_checkpoints(share_root: Path) -> Path:
    folder = share_root / run_paths("cont", SOURCE).checkpoints
    (folder / "optimizer").mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"weights after epoch 3")
    (folder / "optimizer" / "state.bin").write_bytes(b"momentum")
    return folder


# --- the run's id --------------------------------------------------------------------------------------------

def test_resume_from_enters_the_run_id_only_when_set():
    plain = run_id_for("nb", b"{}", {"A": 1, "LR": 0.1}, "lock")
    assert plain == "nb-c2daa6fd1f"  # pinned: the id every run without resume_from had before it existed
    assert run_id_for("nb", b"{}", {"A": 1}, "lock", gpus=1) == "nb-afdf76905a"
    continued = run_id_for("nb", b"{}", {"A": 1, "LR": 0.1}, "lock", resume_from="nb-1234567890")
    assert continued != plain and continued.startswith("nb-")
    assert run_id_for("nb", b"{}", {"A": 1, "LR": 0.1}, "lock", resume_from="nb-0987654321") != continued


def test_a_trial_carries_resume_from_into_its_run_and_its_launch():
    maker = run_id_maker("nb", b"{}", "lock")
    template = _run(maker({"EPOCHS": 3}), parameters={"EPOCHS": 3})
    plan_ = Plan(experiment=None, runs=[template], run_ids={template.run_id: maker})  # type: ignore[arg-type]
    first = plan_.trial(template, {"LR": 0.1}, keep_checkpoints=True)
    assert first.resume_from is None and first.keep_checkpoints
    assert first.run_id == run_id_for("nb", b"{}", {"EPOCHS": 3, "LR": 0.1}, "lock")  # as any trial's
    longer = plan_.trial(template, {"LR": 0.1, "EPOCHS": 9}, resume_from=first.run_id)
    assert longer.resume_from == first.run_id and not longer.keep_checkpoints
    assert longer.run_id == run_id_for("nb", b"{}", {"EPOCHS": 9, "LR": 0.1}, "lock", resume_from=first.run_id)
    assert Run.from_dict(json.loads(longer.to_json())) == longer
    spec = LaunchSpec.from_json(LaunchSpec(run=longer, share="/share").to_json())  # what run-one reads
    assert spec.run.resume_from == first.run_id and spec.run == longer
    assert LaunchSpec.from_json(LaunchSpec(run=first, share="/share").to_json()).run.keep_checkpoints


# --- the copy, on a folder share -------------------------------------------------------------------------------

def test_on_a_folder_share_the_source_checkpoints_are_copied_once_and_never_changed(tmp_path):
    share = FileShare(tmp_path)
    source = _source_checkpoints(tmp_path)
    before = _tree(source)
    run = _run(resume_from=SOURCE)

    folders = RunFolders(run, share)
    assert not folders.remote and folders.copied
    own = folders.checkpoints
    assert own == tmp_path / run_paths("cont", run.run_id).checkpoints
    assert {name: digest for name, (digest, _) in _tree(own).items()} == \
        {name: digest for name, (digest, _) in before.items()}  # every file, and nothing hidden left behind
    assert _tree(source) == before
    assert folders.continues == {"run_id": SOURCE, "checkpoint": {"files": 2, "bytes": 29, "latest": "optimizer/state.bin"}}
    assert folders.resuming(folders.checkpoint_summary()) == \
        f", resuming from optimizer/state.bin (2 checkpoint file(s) of run {SOURCE})"
    folders.close()

    # the run trains on: its own checkpoint is newer than the source's; a retry (a new process) keeps it
    (own / "model.pt").write_bytes(b"weights after epoch 4")
    retry = RunFolders(run, share)  # also what another node of a gang sees, once the first node copied them
    assert not retry.copied and retry.continues["run_id"] == SOURCE
    assert (own / "model.pt").read_bytes() == b"weights after epoch 4"
    assert "of run" not in retry.resuming(retry.checkpoint_summary())
    assert _tree(source) == before


def test_a_source_without_checkpoints_leaves_the_run_to_start_from_scratch_and_says_so(tmp_path):
    share = FileShare(tmp_path)
    (tmp_path / run_paths("cont", SOURCE).folder).mkdir(parents=True)  # it ran, but saved no checkpoint
    folders = RunFolders(_run(resume_from=SOURCE), share)
    assert folders.checkpoint_summary() is None
    assert folders.continues == {"run_id": SOURCE, "checkpoint": None}
    warning = folders.resuming(None)
    assert warning.startswith("\n=== nbbatch: warning:") and SOURCE in warning and "from scratch" in warning
    assert RunFolders(_run(), share).continues is None  # a run that continues nothing says nothing
    assert RunFolders(_run("other"), share).resuming(None) == ""


def test_a_half_done_copy_is_never_taken_for_a_checkpoint(tmp_path, monkeypatch):
    """A copy that fails midway leaves no checkpoint (it fails the run's start, naming both runs), and nothing
    hidden stays behind: the next start copies again, whole."""
    import shutil

    share = FileShare(tmp_path)
    _source_checkpoints(tmp_path)
    run = _run(resume_from=SOURCE)
    real_copy = shutil.copyfile
    copied = []

    def copy_then_fail(src, dst, **kw):  # the share fills up after the first file
        if copied:
            raise OSError(28, "No space left on device")
        copied.append(src)
        return real_copy(src, dst, **kw)

    monkeypatch.setattr(shutil, "copyfile", copy_then_fail)
    from nbbatch.errors import ShareError

    with pytest.raises(ShareError, match=f"cannot copy the checkpoints of run {SOURCE} .*No space left"):
        RunFolders(run, share)
    own = tmp_path / run_paths("cont", run.run_id).checkpoints
    assert _tree(own) == {}
    monkeypatch.setattr(shutil, "copyfile", real_copy)
    assert RunFolders(run, share).continues["checkpoint"]["files"] == 2


# --- the copy, on a remote share (Azure Files over HTTPS; here in memory) -----------------------------------------

def test_on_a_remote_share_the_source_is_pulled_and_pushed_as_the_runs_own(tmp_path):
    share = MemoryShare(f"memory://resume-{tmp_path.name}")
    share.files.clear()
    push(_source_checkpoints(tmp_path / "made"), share, run_paths("cont", SOURCE).checkpoints, delete=True)
    source_prefix = run_paths("cont", SOURCE).checkpoints + "/"
    before = {k: v for k, v in share.files.items() if k.startswith(source_prefix)}
    run = _run(resume_from=SOURCE)

    folders = RunFolders(run, share)
    assert folders.remote
    assert (folders.checkpoints / "model.pt").read_bytes() == b"weights after epoch 3"
    assert folders.continues["run_id"] == SOURCE and folders.continues["checkpoint"]["files"] == 2
    (folders.checkpoints / "model.pt").write_bytes(b"weights after epoch 4")  # the notebook trains on
    folders.save()
    folders.close()
    own = run_paths("cont", run.run_id).checkpoints
    assert share.read_bytes(f"{own}/model.pt") == b"weights after epoch 4"
    assert share.read_bytes(f"{own}/optimizer/state.bin") == b"momentum"
    assert {k: v for k, v in share.files.items() if k.startswith(source_prefix)} == before

    retry = RunFolders(run, share)  # a new process: its own checkpoints, not the source's
    assert not retry.copied and retry.continues["checkpoint"]["files"] == 2
    assert (retry.checkpoints / "model.pt").read_bytes() == b"weights after epoch 4"
    retry.close()


def test_on_a_remote_share_a_source_without_checkpoints_is_told(tmp_path):
    share = MemoryShare(f"memory://resume-none-{tmp_path.name}")
    share.files.clear()
    folders = RunFolders(_run(resume_from=SOURCE), share)
    assert folders.continues == {"run_id": SOURCE, "checkpoint": None}
    folders.close()


# --- the record ----------------------------------------------------------------------------------------------

def test_the_record_writes_continues_only_when_set():
    plain = RunRecord(run_id="r", experiment="e", notebook="nb.ipynb", kernel="python3")
    assert "continues" not in plain.to_dict()
    plain.continues = {"run_id": SOURCE, "checkpoint": None}
    again = RunRecord.from_json(plain.to_json())
    assert again.continues == {"run_id": SOURCE, "checkpoint": None}
    assert again.schema_version == plain.schema_version == 1


# --- a run, in a kernel ---------------------------------------------------------------------------------------

GOES_ON = """\
import json
from nbbatch import record
from nbbatch.artifacts import atomic_path, checkpoint_path
ckpt = checkpoint_path('state.json')
start = json.loads(ckpt.read_text())['epoch'] if ckpt.exists() else 0
record(started_at_epoch=start)
with atomic_path(ckpt) as tmp:
    tmp.write_text(json.dumps({'epoch': EPOCHS}))
"""


@pytest.mark.kernel
def test_a_run_continues_the_checkpoint_it_was_given_or_starts_from_scratch_and_says_why(project):
    make_notebook(project / "nb.ipynb", [GOES_ON], parameters="EPOCHS = 5")
    share = FileShare(project / "results")

    def run(run_id: str, source: str) -> Run:
        return Run(run_id=run_id, experiment="cont", notebook=str(project / "nb.ipynb"), notebook_rel="nb.ipynb",
                   kernel="python3", resume_from=source)

    (project / "results" / run_paths("cont", "empty").folder).mkdir(parents=True)  # ran, saved no checkpoint
    scratch = execute_run(run("from-empty", "empty"), share)
    assert scratch.status == "succeeded", scratch.error
    assert scratch.metrics["started_at_epoch"] == 0
    assert scratch.continues == {"run_id": "empty", "checkpoint": None}
    log = share.read_bytes(run_paths("cont", "from-empty").log).decode()
    assert "=== nbbatch: warning: run empty, which this run continues, left no checkpoint" in log
    assert json.loads(share.read_bytes(run_paths("cont", "from-empty").record))["continues"]["checkpoint"] is None

    source = project / "results" / run_paths("cont", SOURCE).checkpoints
    source.mkdir(parents=True)
    (source / "state.json").write_text('{"epoch": 3}')
    continued = execute_run(run("from-three", SOURCE), share)
    assert continued.status == "succeeded", continued.error
    assert continued.metrics["started_at_epoch"] == 3
    assert continued.continues == {"run_id": SOURCE, "checkpoint": {"files": 1, "bytes": 12, "latest": "state.json"}}
    assert f"resuming from state.json (1 checkpoint file(s) of run {SOURCE})" in \
        share.read_bytes(run_paths("cont", "from-three").log).decode().splitlines()[0]
    assert (source / "state.json").read_text() == '{"epoch": 3}'


# --- the real notebook ----------------------------------------------------------------------------------------

@pytest.mark.kernel
@pytest.mark.timeout(300)
def test_the_pytorch_notebook_continues_another_runs_checkpoint(pytorch_env, tmp_path, monkeypatch):
    """Run A trains one epoch and keeps its checkpoints; run B (A's parameters with two epochs, resume_from A)
    trains only the second: its history has step 2 only, and A's checkpoint files are as A left them."""
    monkeypatch.setenv("NBBATCH_PROJECT", str(REPO))  # the real frameworks and their envs
    exp = tmp_path / "cont.yaml"
    exp.write_text(json.dumps({"experiment": "cont", "frameworks": ["pytorch"], "share": "results",
                               "parameters": {"DATASET": "digits", "EPOCHS": 1, "MAX_SAMPLES": 256}}))
    planned = plan(load_experiment(exp))
    share = FileShare(tmp_path / "results")
    (template,) = planned.runs

    first = planned.trial(template, {}, keep_checkpoints=True)
    a = execute_run(first, share)
    assert a.status == "succeeded", a.error
    assert a.continues is None
    a_checkpoints = tmp_path / "results" / run_paths("cont", first.run_id).checkpoints
    kept = _tree(a_checkpoints)
    assert kept, "run A kept no checkpoint"

    second = planned.trial(template, {"EPOCHS": 2}, resume_from=first.run_id)
    b = execute_run(second, share)
    assert b.status == "succeeded", b.error
    assert b.metrics.get("resumed_from_epoch") == 1, b.metrics
    assert b.continues["run_id"] == first.run_id and b.continues["checkpoint"]["files"] >= 1
    assert b.attempt_log[0].resumed_from is not None
    folder = tmp_path / "results" / run_paths("cont", second.run_id).folder
    notebook = nbformat.read(folder / "output.ipynb", as_version=4)
    history = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert {point["step"] for point in history} == {2}, history  # epoch 1 is A's, not trained again
    assert [out["data"][HISTORY_MIME]["step"] for cell in notebook.cells for out in cell.get("outputs", [])
            if HISTORY_MIME in out.get("data", {})] == [2]
    assert metrics_from_notebook(notebook)["resumed_from_epoch"] == 1
    assert f"of run {first.run_id})" in (folder / "log.txt").read_text().splitlines()[0]
    assert _tree(a_checkpoints) == kept  # byte for byte, untouched
    assert not (tmp_path / "results" / run_paths("cont", second.run_id).checkpoints).exists()  # B succeeded
