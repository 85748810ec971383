"""Whether a folder share is one that a cluster's nodes see: file system types, this machine's addresses, ages.

Ray and Slurm run on other machines that see a folder share only through a network file system mounted at the
same path; these helpers tell a folder that only this machine sees from one they all may see.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from nbbatch.store.runjson import RunRecord, utc_now

NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                       "fuse.blobfuse", "fuse.blobfuse2", "fuse.gcsfuse", "fuse.s3fs", "fuse.cephfs",
                       "fuse.glusterfs", "fuse.juicefs", "fuse.sshfs", "fuse.lustre", "azurefile", "wekafs",
                       "fuse.weka", "vast")


def filesystem_type(path: str | os.PathLike[str]) -> str | None:
    """The file system type of the mount holding ``path`` (from /proc/mounts), or None when unknown."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = Path(path).resolve()
    while not target.exists() and target != target.parent:
        target = target.parent
    best, best_type = "", None
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount_point = parts[1].replace("\\040", " ")
        if (str(target) == mount_point or str(target).startswith(mount_point.rstrip("/") + "/")) \
                and len(mount_point) >= len(best):
            best, best_type = mount_point, parts[2]
    return best_type


def on_network_filesystem(path: str | os.PathLike[str]) -> tuple[bool, str | None]:
    """Whether ``path`` is on a network file system, and the file system's type (None: unknown)."""
    fs_type = filesystem_type(path)
    return bool(fs_type and fs_type.startswith(NETWORK_FILESYSTEMS)), fs_type


def local_addresses(more: Iterable[str] = ()) -> set[str]:
    """Names and addresses by which this machine knows itself."""
    addresses = {"127.0.0.1", "::1", "localhost", *more}
    with contextlib.suppress(OSError):
        addresses.add(socket.gethostname())
        addresses.add(socket.gethostbyname(socket.gethostname()))
    return addresses


def record_age_s(record: RunRecord) -> float:
    """Seconds since the run started (or was queued); infinite when its record says neither."""
    stamp = record.started_at or record.queued_at
    if not stamp:
        return float("inf")
    with contextlib.suppress(ValueError):
        return (datetime.fromisoformat(utc_now()) - datetime.fromisoformat(stamp)).total_seconds()
    return float("inf")
