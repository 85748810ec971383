"""One driver per experiment across machines: a lease kept on the share itself.

:class:`~nbbatch.store.lock.ExperimentLock` (a ``flock``) stops two drivers on one machine, but
``flock`` over NFS or SMB may be local to each client. The lease is a file in the experiment's
folder of the share, ``<experiment>/.lease``, created exclusively (``O_EXCL`` on a folder share,
an Azure Files lease on ``azfiles://``), naming its holder and renewed by a heartbeat thread.

A lease is stale, and taken over, when its holder is a dead process of this machine, or when it
has not been renewed for :data:`STALE_AFTER_S` (a holder on another machine that died, or lost
the share), or when it names no holder (empty or unparsable: a crash between its creation and its
write) and is older than :data:`UNNAMED_HOLDER_STALE_S`. Limits (docs/reliability.md): clocks of the
machines and of the share must agree within a minute; a holder cut off from the share for longer
than the stale time loses its lease, notices on its next renewal (:attr:`ShareLease.lost`) and starts no more runs.

A renewal that finds the lease file gone, with no other holder in its place, is not a takeover: the experiment's
folder (or the whole share) was deleted, renamed or unmounted under the driver. It also starts no more runs, and
:attr:`Halt.reason` names the folder that is gone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from nbbatch.errors import LockedError, ShareError
from nbbatch.store.layout import experiment_paths
from nbbatch.store.lock import pid_alive
from nbbatch.store.share import LeaseStore, Share

logger = logging.getLogger(__name__)

RENEW_EVERY_S = 20.0
STALE_AFTER_S = 120.0
RETRY_FAILED_RENEWAL_S = 2.0  # after a renewal failed (the share throttled past its retries): try again this soon
UNNAMED_HOLDER_STALE_S = 10.0  # a lease without a holder's name: left by a crash between its creation and its write
TAKEOVER_SETTLE_S = 1.0  # a breaker creates its lease right after removing ours: look again this much later
TAKEN_OVER = "another driver took the experiment over (its lease on the share)"


class Halt(threading.Event):
    """Set when a driver must start no more runs; :attr:`reason` says why (for records and the last line)."""

    def __init__(self) -> None:
        super().__init__()
        self.reason = TAKEN_OVER

    def halt(self, reason: str) -> None:
        """Set it, saying why."""
        self.reason = reason
        self.set()


class ShareLease:
    """Held while a process drives an experiment: ``with ShareLease(share, experiment):``.

    Shares without the lease capability (:class:`~nbbatch.store.share.LeaseStore`) get no lease;
    :attr:`supported` says so.
    """

    def __init__(self, share: Share, experiment: str, *, renew_every_s: float | None = None,
                 stale_after_s: float = STALE_AFTER_S, command: str = ""):
        self.share, self.experiment = share, experiment
        self.path = experiment_paths(experiment).lease
        self.renew_every_s = RENEW_EVERY_S if renew_every_s is None else renew_every_s
        self.stale_after_s = stale_after_s
        self.recovered_from: dict[str, Any] | None = None  # the stale holder taken over
        self.lost = Halt()  # set when another driver took the lease over, or the experiment's folder is gone
        self._holder = json.dumps({"token": uuid.uuid4().hex, "pid": os.getpid(), "host": socket.gethostname(),
                                   "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "command": command}).encode()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def supported(self) -> bool:
        return isinstance(self.share, LeaseStore)

    def __enter__(self) -> ShareLease:
        if self.supported:
            self._acquire()
            self._thread = threading.Thread(target=self._heartbeat, name=f"lease-{self.experiment}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            try:
                self.share.lease_release(self.path, self._holder)  # type: ignore[attr-defined]
            except (ShareError, OSError) as error:  # it goes stale and is taken over
                logger.warning("could not release the lease %s: %s", self.path, error)

    def _acquire(self) -> None:
        store: Any = self.share
        for _ in range(5):  # a few rounds: a breaker and a new holder may race us
            if store.lease_create(self.path, self._holder):
                return
            current = store.lease_read(self.path)
            if current is None:
                continue  # released meanwhile
            seen, age = current
            holder = _parse(seen)
            if not self._stale(holder, age):
                raise LockedError(_held_message(self.experiment, holder, age, self.share.url, self.stale_after_s))
            if store.lease_break(self.path, seen):
                self.recovered_from = holder
        raise LockedError(f"experiment `{self.experiment}` is being taken over by another driver right now; "
                          f"try again in a minute, or see who holds it: {self.share.url}/{self.path}")

    def _stale(self, holder: dict[str, Any], age: float) -> bool:
        if not holder:  # empty or unreadable: no driver of ours wrote it (one being written is seconds old at most)
            return age > min(UNNAMED_HOLDER_STALE_S, self.stale_after_s)
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            return not pid_alive(holder["pid"])  # this machine's holder: alive or not, no need to wait
        return age > self.stale_after_s

    def _heartbeat(self) -> None:
        wait = self.renew_every_s
        while not self._stop.wait(wait):
            next_wait = self.renew()
            if next_wait is None:
                return
            wait = next_wait

    def renew(self) -> float | None:
        """One heartbeat: renew the hold. The seconds until the next one (sooner after a failed renewal, e.g. a
        throttled share, so the hold is renewed as soon as the share answers again), None when the lease was lost."""
        store: Any = self.share
        try:
            if not store.lease_renew(self.path, self._holder):
                self.lost.halt(self._why_lost())
                logger.error("experiment %s: %s; this driver starts no more runs", self.experiment, self.lost.reason)
                return None
        except (ShareError, OSError) as error:  # tried again soon; stale only after stale_after_s without a renewal
            logger.warning("could not renew the lease of %s: %s", self.experiment, error)
            return min(self.renew_every_s, RETRY_FAILED_RENEWAL_S)
        return self.renew_every_s


    def _why_lost(self) -> str:
        """Why our lease is no longer ours: another holder in its place (a takeover), or no lease file at all (its
        folder, or the share, was deleted, renamed or unmounted)."""
        store: Any = self.share
        for settle in (0.0, TAKEOVER_SETTLE_S):
            time.sleep(settle)
            try:
                if store.lease_read(self.path) is not None:
                    return TAKEN_OVER
            except (ShareError, OSError):
                break
        return share_gone_reason(self.share, self.experiment)


def share_gone_reason(share: Share, experiment: str) -> str:
    """What is gone when an experiment's lease file vanished without a new holder: the share, the experiment's folder
    or the lease file alone (its folder deleted or renamed, then made again by a run writing its record)."""
    try:
        share_there, folder_there = share.exists(""), share.exists(experiment)
    except (ShareError, OSError):
        share_there = folder_there = False
    if not share_there:
        return f"the share {share.url} is gone (deleted, renamed or unmounted)"
    if not folder_there:
        return f"the experiment's folder {share.url}/{experiment} is gone from the share (deleted or renamed)"
    return (f"the experiment's lease {share.url}/{experiment_paths(experiment).lease} is gone: its folder was deleted or "
            "renamed (and made again by a run writing its record), or the file was deleted")


def _parse(data: bytes) -> dict[str, Any]:
    try:
        holder = json.loads(data)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _held_message(experiment: str, holder: dict[str, Any], age: float, url: str, stale_after_s: float) -> str:
    who = (f"process {holder.get('pid')} on {holder.get('host')} (since {holder.get('since')}, "
           f"command: {holder.get('command') or '?'})") if holder else "another driver"
    return (f"experiment `{experiment}` is already being run by {who}, which renewed its lease on {url} "
            f"{age:.0f} s ago. Wait for it, follow it with `nbbatch status {experiment}`, or stop it with "
            f"`nbbatch cancel {experiment}`; a lease not renewed for {stale_after_s:.0f} s is taken over.")

