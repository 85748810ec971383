"""The ``lease_*`` primitives of :class:`~nbbatch.store.azfiles.AzureFileShare` (see :mod:`nbbatch.store.lease`).

They are built on the File service's infinite file leases: the holder's bytes are the leased file's content,
and only the lease's owner can rewrite or delete it. A mixin: it uses the share's client (``_client``), its
paths (``_full``, ``_writable``, ``_check_case``, ``_with_parents``), its errors (``_error``) and its ranged
upload (``_upload_ranges``).
"""

from __future__ import annotations

import email.utils
import time
from typing import Any

from azure.core.exceptions import AzureError, HttpResponseError, ResourceExistsError, ResourceNotFoundError
from azure.storage.fileshare import ShareClient, ShareFileClient, ShareLeaseClient

__all__ = ["AzureFilesLeases"]


class AzureFilesLeases:
    """The lease operations of an Azure File share; mixed into :class:`~nbbatch.store.azfiles.AzureFileShare`."""

    _client: ShareClient
    _leases: dict[str, ShareLeaseClient]  # full path -> the lease this object holds on it
    _lease_seen: dict[str, tuple[bytes, str]]  # full path -> (holder, ETag) lease_read last saw

    @staticmethod
    def _lost_lease(exc: AzureError) -> bool:
        """Whether an error is about someone else's lease (or ours gone): 409 Lease* on a lease call, 412 on a write."""
        if not isinstance(exc, HttpResponseError):
            return False
        return exc.status_code == 412 or (exc.status_code == 409 and str(exc.error_code or "").startswith("Lease"))

    def _write_holder(self, client: ShareFileClient, lease: ShareLeaseClient, holder: bytes) -> None:
        # Resize, then overwrite: when the size is unchanged (a renewal) a reader never sees zeros.
        client.resize_file(len(holder), lease=lease)
        self._upload_ranges(client, holder, 0, lease=lease)

    def lease_create(self, path: str, holder: bytes) -> bool:
        """Take ``path`` for this share object when nobody holds it, writing ``holder`` into it; True when we now hold it.

        An infinite lease on the file (created empty first when absent) is the hold; ``holder``
        is written as the file's content under it. A folder of ``path`` that exists under another case is a
        :class:`ShareError` (Azure Files ignores case: the hold would land in that folder).
        """
        full = self._writable(path)
        self._check_case(full)
        client = self._client.get_file_client(full)
        try:
            try:
                lease = client.acquire_lease()
            except ResourceNotFoundError:
                self._with_parents(full.rpartition("/")[0], lambda: client.create_file(0))
                lease = client.acquire_lease()
        except AzureError as exc:
            if self._lost_lease(exc):  # LeaseAlreadyPresent, or leased between our create and acquire
                return False
            raise self._error("lease", path, exc) from exc
        try:
            self._write_holder(client, lease, holder)
        except AzureError as exc:
            if self._lost_lease(exc):  # broken already
                return False
            try:
                lease.release()  # do not keep a hold whose holder bytes were never written
            except AzureError:
                pass
            raise self._error("lease", path, exc) from exc
        self._leases[full] = lease
        return True

    def lease_read(self, path: str) -> tuple[bytes, float] | None:
        """The holder's bytes and the seconds since it last renewed, or None when absent or not leased.

        The age is the file's last-modified time against the service's clock (the response's
        ``Date``), so clock skew between machines does not matter; this machine's clock is the
        fallback when the response has no ``Date``.
        """
        full = self._full(path)
        dates: list[str] = []

        def keep_date(pipeline_response: Any) -> None:
            date = pipeline_response.http_response.headers.get("Date")
            if date and not dates:
                dates.append(date)

        try:
            stream = self._client.get_file_client(full).download_file(raw_response_hook=keep_date)
            data = stream.readall()
        except (ResourceNotFoundError, ResourceExistsError):
            return None
        except AzureError as exc:
            raise self._error("read the lease", path, exc) from exc
        props = stream.properties
        if props.lease.state != "leased" or props.last_modified is None:
            return None
        self._lease_seen[full] = (data, props.etag)
        now = email.utils.parsedate_to_datetime(dates[0]).timestamp() if dates else time.time()
        return data, max(0.0, now - props.last_modified.timestamp())

    def lease_renew(self, path: str, holder: bytes) -> bool:
        """Renew our hold: rewrite ``holder`` under our lease (moving last-modified); False when the lease is no longer ours."""
        full = self._full(path)
        lease = self._leases.get(full)
        if lease is None:
            return False
        try:
            self._write_holder(self._client.get_file_client(full), lease, holder)
        except ResourceNotFoundError:
            self._leases.pop(full, None)
            return False
        except AzureError as exc:
            if self._lost_lease(exc):  # LeaseNotPresentWithFileOperation (broken) / LeaseIdMismatch (taken over)
                self._leases.pop(full, None)
                return False
            raise self._error("renew the lease on", path, exc) from exc
        return True

    def lease_break(self, path: str, seen: bytes) -> bool:
        """End a stale hold whose holder bytes are still ``seen``; False when they changed meanwhile.

        True also when the file is gone or no longer leased: the hold has ended anyway. When this
        object's :meth:`lease_read` saw ``seen``, a renewal since (same bytes, new ETag) also counts
        as a change. The check and the break are two calls (the File service has no conditional
        break), so a renewal between them is broken all the same; its holder finds out on its next
        :meth:`lease_renew`.
        """
        full = self._full(path)
        client = self._client.get_file_client(full)
        read = self._lease_seen.pop(full, None)
        try:
            stream = client.download_file()
            if stream.readall() != bytes(seen):
                return False
            if read is not None and read[0] == bytes(seen) and stream.properties.etag != read[1]:
                return False  # renewed since lease_read judged it stale
            ShareLeaseClient(client).break_lease()  # an infinite file lease breaks at once
        except ResourceNotFoundError:  # released: free to take
            return True
        except AzureError as exc:
            if self._lost_lease(exc):  # LeaseNotPresentWithLeaseOperation: the hold has ended already
                return True
            raise self._error("break the lease on", path, exc) from exc
        return True

    def lease_release(self, path: str, holder: bytes) -> None:
        """Give our hold up: delete the file under our lease; errors are ignored (a lease lost is fine)."""
        full = self._full(path)
        lease = self._leases.pop(full, None)
        if lease is None:
            return
        try:
            self._client.get_file_client(full).delete_file(lease=lease)
        except AzureError:
            pass
