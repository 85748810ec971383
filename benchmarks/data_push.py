"""`nbbatch data push` / `pull` of a CIFAR-10-sized folder: first copy, unchanged, one file changed, and pull.

    python benchmarks/data_push.py [--mb 30] [--files 6]

Writes ``--files`` random files of ``--mb`` MB each (CIFAR-10's python batches are six files of about
30 MB) and copies them to a local folder share and to the Azure Files fake on 127.0.0.1 (the real
azure-storage-file-share client over HTTP; tests/fakes/azure_files_server.py), counting requests and
bytes at the fake. Prints a markdown table: seconds per step (median of 3), requests, bytes sent.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from machine import describe, median

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]


def timed(action) -> tuple[float, object]:
    start = time.perf_counter()
    result = action()
    return time.perf_counter() - start, result


def steps(share_for, source: Path, work: Path, rounds: int, counter=None) -> list[tuple[str, float, int, int]]:
    rows: dict[str, list[tuple[float, int, int]]] = {}
    for round_ in range(rounds):
        plan = _plan(share_for(round_), source, work / f"pulled-{round_}")
        for name, action in plan:
            before = counter() if counter else (0, 0)
            seconds, _ = timed(action)
            after = counter() if counter else (0, 0)
            rows.setdefault(name, []).append((seconds, after[0] - before[0], after[1] - before[1]))
    return [(name, median([s for s, _, _ in v]), v[-1][1], v[-1][2]) for name, v in rows.items()]


def _plan(share, source: Path, pulled: Path) -> list[tuple[str, object]]:
    from nbbatch.store.sync import pull, push

    return [("first push", lambda: push(source, share)),
            ("push again, unchanged", lambda: push(source, share)),
            ("push, one file changed", lambda: (_touch(source / "batch_0"), push(source, share))[1]),
            ("pull into an empty folder", lambda: pull(share, "", pulled)),
            ("pull again, unchanged", lambda: pull(share, "", pulled))]


def _touch(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=30.0)
    parser.add_argument("--files", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(describe("nbbatch data push / pull"))
    from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles

    from nbbatch.store.azfiles import AzureFileShare
    from nbbatch.store.share import FileShare

    with tempfile.TemporaryDirectory(prefix="nbbatch-bench-push-") as tmp:
        work = Path(tmp)
        source = work / "data"
        source.mkdir()
        for i in range(args.files):
            (source / f"batch_{i}").write_bytes(os.urandom(int(args.mb * 2**20)))
        total = args.files * args.mb
        print(f"\n{args.files} files × {args.mb:g} MB = {total:g} MB\n")
        local = steps(lambda r: FileShare(work / f"share-{r}"), source, work / "local", args.rounds)
        with FakeAzureFiles() as server:
            os.environ.update(NBBATCH_AZFILES_ENDPOINT=server.endpoint, AZURE_STORAGE_KEY=FAKE_KEY)

            def counter() -> tuple[int, int]:
                return len(server.requests), sum(len(r.body) for r in server.requests)

            remote = steps(lambda r: AzureFileShare(f"azfiles://{ACCOUNT}/bench{r}/data"), source, work / "remote",
                           args.rounds, counter)
        print("| step | folder share | Azure Files fake | requests | MB sent |")
        print("|---|---|---|---|---|")
        for (name, local_s, _, _), (_, remote_s, requests, sent) in zip(local, remote, strict=True):
            print(f"| {name} | {local_s:.2f} s | {remote_s:.2f} s | {requests} | {sent / 2**20:.1f} |")


if __name__ == "__main__":
    main()
