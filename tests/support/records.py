"""Run records written as a share holds them, for tests that read them back (status, its watch)."""

from __future__ import annotations

import os
from pathlib import Path

from nbbatch.store.layout import RUN_RECORD
from nbbatch.store.runjson import RunError, RunRecord


def write_records(root: Path, records: list[RunRecord]) -> None:
    for record in records:
        folder = root / record.experiment / record.run_id
        folder.mkdir(parents=True, exist_ok=True)
        part = folder / f".{RUN_RECORD}.part"
        part.write_bytes(record.to_json())
        os.replace(part, folder / RUN_RECORD)  # whole or not at all, as the share writes it


def two_runs(experiment: str = "w") -> tuple[list[RunRecord], list[RunRecord]]:
    """Two running runs, and the same two after they ended (one succeeded, one failed)."""
    running = [RunRecord(run_id=f"toy-{i}a2b3c4d5e", experiment=experiment, notebook="toy.ipynb", kernel="python3",
                         framework="toy", parameters={"LR": lr, "EPOCHS": 3}, status="running", attempts=1,
                         started_at="2024-05-01T10:00:00+00:00", metrics={"loss": 0.5})
               for i, lr in enumerate((0.01, 0.1))]
    final = [RunRecord.from_dict(r.to_dict()) for r in running]
    final[0].status, final[0].duration_s, final[0].metrics = "succeeded", 12.0, {"loss": 0.1, "accuracy": 0.93}
    final[1].status, final[1].duration_s = "failed", 4.0
    final[1].error = RunError("ValueError", "bad LR", cell_index=3)
    return running, final
