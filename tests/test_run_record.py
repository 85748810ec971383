"""run.json's typed entries: records of earlier versions load and write back as they were; a wrong nested value is
reported with its dotted path."""

from __future__ import annotations

import json

import pytest

from nbbatch.errors import ShareError
from nbbatch.store.runjson import (
    AttemptEntry,
    CheckpointSummary,
    ContainerInfo,
    ErrorKind,
    GpuSharing,
    InputBinding,
    RankOutcome,
    RunRecord,
)
from nbbatch.store.sync import FileEntry

# as nbbatch wrote it before the entries were typed (the keys of each entry as they were written)
EARLIER = {
    "run_id": "nb-0123456789", "experiment": "e", "notebook": "nb.ipynb", "kernel": "python3", "framework": None,
    "parameters": {"A": 1}, "status": "succeeded", "attempts": 3, "queued_at": None, "started_at": "t0",
    "ended_at": "t9", "duration_s": 1.5, "host": "h", "pid": 7, "backend": "local", "gpu_ids": [0],
    "environment": {"numpy": "2.0"}, "error": None, "metrics": {"loss": 0.5}, "cells_done": 2, "cells_total": 2,
    "timeout_s": None, "telemetry": {"memory_run_max_mb": 100.0},
    "gpu_share": {"runs_per_gpu": "auto", "shared": True, "exclusive": True, "mps": False, "need_mb": 120.0,
                  "need_from": "measured", "alone": True, "retried_after": "OutOfMemoryError: CUDA"},
    "container": {"engine": "podman", "image": "localhost/x:1", "image_id": "sha256:ab", "name": "nbbatch-x"},
    "inputs": {"DATA_DIR": {"source": "azfiles://a/data", "path": "/cache/data"}},
    "outputs": [{"name": "model.pt", "bytes": 3, "sha256": "0" * 64}],
    "attempt_log": [
        {"attempt": 1, "host": "lost-node", "started_at": "t0", "resumed_from": None, "status": "lost", "kind": "infra"},
        {"attempt": 2, "host": "h", "started_at": "t1", "resumed_from": {"files": 1, "bytes": 9, "latest": "s.json"},
         "ended_at": "t2", "status": "failed", "kind": "kernel_died"},
        {"attempt": 3, "host": "h", "started_at": "t3", "resumed_from": None, "ended_at": "t9", "status": "succeeded",
         "kind": None}],
    "world_size": 2,
    "ranks": [{"rank": 0, "node": 0, "host": "h", "gpus": [0], "status": "succeeded", "error": None},
              {"rank": 1, "node": 1, "host": "g", "gpus": [0], "status": "stopped", "error": "stopped after rank 0 failed"}],
    "rank": None, "schema_version": 1,
}


def test_a_record_of_earlier_versions_reads_into_typed_entries_and_writes_back_the_same():
    record = RunRecord.from_dict(EARLIER)
    assert record.gpu_share == GpuSharing(runs_per_gpu="auto", shared=True, exclusive=True, need_mb=120.0,
                                          need_from="measured", alone=True, retried_after="OutOfMemoryError: CUDA")
    assert record.container == ContainerInfo("podman", "localhost/x:1", "sha256:ab", "nbbatch-x")
    assert record.inputs == {"DATA_DIR": InputBinding("azfiles://a/data", "/cache/data")}
    assert record.outputs == [FileEntry("model.pt", 3, "0" * 64)]
    assert record.attempt_log[0] == AttemptEntry(1, "lost-node", "t0", status="lost", kind=ErrorKind.INFRA)
    assert record.attempt_log[1].resumed_from == CheckpointSummary(1, 9, "s.json")
    assert record.ranks[1] == RankOutcome(1, 1, "g", [0], "stopped", "stopped after rank 0 failed")
    assert json.loads(record.to_json()) == EARLIER
    assert RunRecord.from_json(record.to_json()) == record


def test_no_gpu_sharing_and_no_container_are_written_as_empty_objects_as_before():
    record = RunRecord.from_dict({**EARLIER, "gpu_share": {}, "container": {}})
    assert record.gpu_share is None and record.container is None
    written = json.loads(record.to_json())
    assert written["gpu_share"] == {} and written["container"] == {}


def test_keys_and_kinds_of_a_newer_nbbatch_are_left_out():
    entry = {**EARLIER["attempt_log"][1], "kind": "preempted", "zone": "b"}
    record = RunRecord.from_dict({**EARLIER, "attempt_log": [entry], "gpu_share": {**EARLIER["gpu_share"], "x": 1}})
    assert record.attempt_log[0].kind is None and record.attempt_log[0].status == "failed"
    assert record.gpu_share is not None and record.gpu_share.need_mb == 120.0


@pytest.mark.parametrize(("edit", "message"), [
    ({"attempt_log": [{"attempt": "1"}]}, "has `attempt_log[0].attempt` = '1', which must be an integer; fix it or"),
    ({"attempt_log": {}}, "has `attempt_log` = {}, which must be a list; fix it or delete it"),
    ({"ranks": [{"rank": 0}]}, "has a malformed `ranks[0]` (it lacks node, host, gpus, status); fix it or delete it"),
    ({"inputs": {"DATA_DIR": {"source": "x", "path": 3}}}, "has `inputs.DATA_DIR.path` = 3, which must be a string"),
    ({"outputs": [{"name": "m", "bytes": True, "sha256": ""}]}, "has `outputs[0].bytes` = True, which must be an integer"),
    ({"gpu_share": {"runs_per_gpu": None}}, "`gpu_share.runs_per_gpu` = None, which must be an integer or a string"),
    ({"container": []}, "has `container` = [], which must be a JSON object or null"),
    ({"attempt_log": [{**EARLIER["attempt_log"][1], "resumed_from": {"files": 1}}]},
     "has a malformed `attempt_log[0].resumed_from` (it lacks bytes, latest)"),
])
def test_a_wrong_nested_value_is_reported_with_its_path(edit, message):
    with pytest.raises(ShareError) as caught:
        RunRecord.from_dict({**EARLIER, **edit}, source="share/e/nb/run.json")
    assert str(caught.value).startswith("share/e/nb/run.json ") and message in str(caught.value)
