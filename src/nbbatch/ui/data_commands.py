"""``nbbatch data push SRC DEST | pull SRC DEST``: copy a folder of data to a share and back (:mod:`nbbatch.store.sync`)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.filesize import decimal
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

from nbbatch.store.share import Share, open_share
from nbbatch.store.sync import SyncResult, pull, push

SHARE_HELP = "a share: azfiles://<account>/<share>[/<folder>] or a folder path"


def add_data_parser(sub: Any) -> None:
    """Register ``nbbatch data push | pull`` on the top-level subparsers ``sub``."""
    p = sub.add_parser("data", help="copy a data folder to a share and back, skipping unchanged files: push | pull")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    push = actions.add_parser("push", help="copy a local folder to a share (only new or changed files; resumable)",
                              description="Copy the folder SRC to the share DEST, e.g. "
                                          "`nbbatch data push ./data azfiles://acct/share/data`.")
    push.add_argument("src", metavar="SRC", help="the local folder")
    push.add_argument("dest", metavar="DEST", help=SHARE_HELP)
    push.add_argument("--delete", action="store_true",
                      help="remove files from DEST that SRC no longer has (only files an earlier push copied)")
    push.set_defaults(func=cmd_data_push)
    pull = actions.add_parser("pull", help="copy a share's folder to a local folder (only missing or changed files)",
                              description="Copy the share folder SRC to the local folder DEST, e.g. "
                                          "`nbbatch data pull azfiles://acct/share/data ./data`.")
    pull.add_argument("src", metavar="SRC", help=SHARE_HELP)
    pull.add_argument("dest", metavar="DEST", help="the local folder (created when absent)")
    pull.add_argument("--delete", action="store_true", help="delete local files that SRC does not have")
    pull.set_defaults(func=cmd_data_pull)
    for q in (push, pull):
        q.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def cmd_data_push(args: argparse.Namespace) -> int:
    """``nbbatch data push SRC DEST``."""
    share = open_share(args.dest)
    try:
        with _progress_bar(args.quiet, f"reading {args.src}") as progress:
            result = push(Path(args.src), share, "", delete=args.delete, progress=progress)
    finally:
        _close(share)
    for warning in result.warnings:  # files the share cannot hold by name: left out, the rest pushed
        print(f"nbbatch: warning: {warning}", file=sys.stderr)
    print(f"pushed {_counts(result, args.delete)}, to {share.url}")
    return 0


def cmd_data_pull(args: argparse.Namespace) -> int:
    """``nbbatch data pull SRC DEST``."""
    share = open_share(args.src)
    try:
        with _progress_bar(args.quiet, f"reading {share.url}") as progress:
            result = pull(share, "", Path(args.dest), delete=args.delete, progress=progress)
    finally:
        _close(share)
    for warning in result.warnings:  # symlinks on the share, never followed
        print(f"nbbatch: warning: {warning}", file=sys.stderr)
    print(f"pulled {_counts(result, args.delete)}, from {share.url} into {args.dest}")
    return 0


def _counts(result: SyncResult, delete: bool) -> str:
    """``3 file(s) (12.3 MB), 5 unchanged[, 1 removed]``."""
    text = f"{len(result.copied)} file(s) ({decimal(result.bytes_copied)}), {len(result.skipped)} unchanged"
    return text + (f", {len(result.removed)} removed" if delete else "")


def _close(share: Share) -> None:
    close = getattr(share, "close", None)  # AzureFileShare: its HTTP session
    if callable(close):
        close()


@contextlib.contextmanager
def _progress_bar(quiet: bool, first: str) -> Iterator[Callable[[str, int, int], None] | None]:
    """A rich progress bar on stderr (a terminal, not ``-q``), as the sync's ``progress`` callback; else None."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    columns = (TextColumn("{task.description}", markup=False),  # file names are never read as markup
               BarColumn(), DownloadColumn(), TimeElapsedColumn())  # updated per file: a speed would mislead
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(first, total=None)  # hashing and listing first: no total yet

        def update(name: str, done: int, total: int) -> None:
            if not name and not done:  # transfers start: the clock restarts, hashing left out
                bar.reset(task, total=total or None, description="copying")
                return
            label = name if len(name) <= 40 else "…" + name[-39:]
            bar.update(task, description=label, completed=done, total=total or None)

        yield update
