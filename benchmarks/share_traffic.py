"""Requests and bytes a local batch sends to a remote share (Azure Files), counted at the service.

    python benchmarks/share_traffic.py [--runs 8] [--cells 60]

The share is the protocol-level fake of Azure Files (tests/fakes/azure_files_server.py) on
127.0.0.1, driven by the real azure-storage-file-share SDK, so every request nbbatch makes is seen
and counted there. Two scenarios:

  * scheduler: ``--runs`` runs of a one-second notebook, one at a time: requests per second of the
    batch, and how many of them ask about one run's cancel marker (``HEAD``/``GET`` on a CANCEL path);
  * log: one run printing ``--cells`` × 2 kB, one cell every 0.1 s (checkpoints every second): bytes
    sent for ``log.txt`` against its final size.

Run it on two trees to compare (``PYTHONPATH=<old tree>/src python benchmarks/share_traffic.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles  # noqa: E402


def notebook(path: Path, cells: list[str]) -> Path:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("A = 0")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, *(nbformat.v4.new_code_cell(c) for c in cells)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def scheduler(fake: FakeAzureFiles, folder: Path, runs: int) -> dict[str, float]:
    import nbbatch

    notebook(folder / "sleep.ipynb", ["import time; time.sleep(1)"])
    fake.requests.clear()
    started = time.perf_counter()
    nbbatch.submit({"experiment": "sched", "notebooks": ["sleep.ipynb"], "sweep": {"grid": {"A": list(range(runs))}},
                    "resources": {"max_parallel": 1}, "share": f"azfiles://{ACCOUNT}/results/bench"}, progress=False)
    seconds = time.perf_counter() - started
    cancel_checks = sum(1 for r in fake.requests if r.method in ("HEAD", "GET") and "CANCEL" in r.path.upper()
                        and "/sched/CANCEL" not in r.path)
    return {"seconds": seconds, "requests": len(fake.requests), "per_s": len(fake.requests) / seconds,
            "run_cancel_checks": cancel_checks}


def log_traffic(fake: FakeAzureFiles, folder: Path, cells: int) -> dict[str, float]:
    import nbbatch

    notebook(folder / "chatty.ipynb", [f"print('{i} ' + 'x' * 2000); import time; time.sleep(0.1)" for i in range(cells)])
    fake.requests.clear()
    result = nbbatch.submit({"experiment": "chatty", "notebooks": ["chatty.ipynb"],
                             "share": f"azfiles://{ACCOUNT}/results/bench"}, progress=False)
    (record,) = result.records
    log_name = f"chatty/{record.run_id}/"
    sent = sum(len(r.body) for r in fake.requests if r.method == "PUT" and log_name in r.path
               and ("log.txt" in r.path or (".log.txt." in r.path)))
    final = len(fake.file_bytes("results", f"bench/chatty/{record.run_id}/log.txt"))
    return {"log_bytes": final, "sent_bytes": sent, "ratio": sent / final}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--cells", type=int, default=60)
    args = parser.parse_args()
    with FakeAzureFiles() as fake, tempfile.TemporaryDirectory() as tmp:
        fake.create_share("results")
        os.environ.update({"NBBATCH_AZFILES_ENDPOINT": fake.endpoint, "AZURE_STORAGE_KEY": FAKE_KEY})
        project = Path(tmp)
        (project / "frameworks").mkdir()
        (project / ".nbbatch").mkdir()
        os.chdir(project)
        import nbbatch

        print(f"nbbatch from {Path(nbbatch.__file__).parent}")
        sched = scheduler(fake, project, args.runs)
        kinds = Counter(r.method for r in fake.requests)
        print(f"scheduler: {args.runs} runs in {sched['seconds']:.1f} s: {sched['requests']} requests "
              f"({sched['per_s']:.1f}/s; {dict(kinds)}), {sched['run_cancel_checks']} on per-run cancel markers")
        log = log_traffic(fake, project, args.cells)
        print(f"log: {log['log_bytes'] / 1e3:.0f} kB log, {log['sent_bytes'] / 1e3:.0f} kB sent for it "
              f"({log['ratio']:.2f}x)")


if __name__ == "__main__":
    main()
