"""How nbbatch signs in to Azure Files, and how it retries a busy service.

Credentials, per storage account, in this order:

1. ``AZURE_STORAGE_KEY_<ACCOUNT>`` (the account's name in upper case, e.g. ``AZURE_STORAGE_KEY_MYSTORAGEACCT``):
   that account's key.
2. ``AZURE_STORAGE_KEY``: the key of the account named in ``AZURE_STORAGE_ACCOUNT`` (the pair the ``az``
   CLI reads), and of that account only. Without ``AZURE_STORAGE_ACCOUNT`` it is taken as the key of
   whichever account is opened (one account); a key the service refuses is then a clear error naming
   ``AZURE_STORAGE_KEY_<ACCOUNT>``, never a datastore registered with another account's key.
3. otherwise :class:`azure.identity.DefaultAzureCredential` (``az login``, a managed identity, …) with
   ``token_intent="backup"``, as the File service requires for OAuth.

Keys are read from the environment when a share is opened and are written nowhere.

The storage SDK's default retry (:class:`~azure.storage.fileshare.ExponentialRetry`: 3 retries 18, 24 and 42 s
apart, whatever the service's ``Retry-After`` says) holds one throttled call for over a minute. :class:`ThrottleRetry`
is that policy waiting what ``Retry-After`` asks (a short backoff when it says nothing) and giving up once
:data:`MAX_RETRY_WAIT_S` of waiting would be exceeded, so a caller such as the lease's heartbeat gets its
answer in time to try again.
"""

from __future__ import annotations

import email.utils
import os
import time
from typing import Any

from azure.core.credentials import AzureNamedKeyCredential
from azure.core.exceptions import AzureError, ClientAuthenticationError
from azure.storage.fileshare import ExponentialRetry, ShareClient

from nbbatch.errors import ShareError

ENDPOINT_ENV = "NBBATCH_AZFILES_ENDPOINT"
KEY_ENV = "AZURE_STORAGE_KEY"
ACCOUNT_ENV = "AZURE_STORAGE_ACCOUNT"
CLOUD_ENV = "AZUREML_CURRENT_CLOUD"  # azure-ai-ml's name for the cloud in use (MLClient(cloud=…) sets it)
# Storage endpoint suffixes of the clouds azure-ai-ml knows by name (azure.ai.ml._azure_environments, storage_endpoint)
STORAGE_SUFFIXES = {"AzureCloud": "core.windows.net", "AzureChinaCloud": "core.chinacloudapi.cn",
                    "AzureUSGovernment": "core.usgovcloudapi.net"}
MAX_RETRY_WAIT_S = 30.0
RETRIED_CONFLICTS = ("SharingViolation",)  # 409s that pass: "The specified resource is in use by an SMB client"
# The File service takes OAuth (Entra ID) on share-level calls (create, properties) from this REST version on
# (azure-storage-file-share 12.18.0's "service version 2024-11-04: Entra ID authentication for all data plane file
# operations"): a token client asks for at least this version.
OAUTH_API_VERSION = "2024-11-04"  # the most one request waits on a busy service before its caller hears of it
# The keywords ShareClient hands its default retry policy: they configure ThrottleRetry instead.
RETRY_OPTIONS = ("retry_total", "retry_connect", "retry_read", "retry_status", "retry_to_secondary",
                 "initial_backoff", "increment_base", "random_jitter_range")

__all__ = ["ENDPOINT_ENV", "KEY_ENV", "ACCOUNT_ENV", "CLOUD_ENV", "MAX_RETRY_WAIT_S", "OAUTH_API_VERSION", "ThrottleRetry",
           "account_key_env", "storage_key", "resolve_credential", "default_endpoint", "storage_suffix", "retry_policy",
           "key_hint", "check_account_key"]


def account_key_env(account: str) -> str:
    """The variable holding ``account``'s key: ``AZURE_STORAGE_KEY_<ACCOUNT>``."""
    return f"{KEY_ENV}_{account.upper()}"


def storage_key(account: str) -> str | None:
    """The key of storage account ``account`` from the environment (see the module's order); None for sign-in."""
    own = os.environ.get(account_key_env(account))
    if own:
        return own
    key = os.environ.get(KEY_ENV)
    named = os.environ.get(ACCOUNT_ENV)
    if key and (not named or named.lower() == account.lower()):
        return key
    return None


def key_hint(account: str) -> str:
    """What to set when the service refuses this account's credentials."""
    return (f"set {account_key_env(account)} to the key of storage account {account} (or {KEY_ENV} with "
            f"{ACCOUNT_ENV}={account}), or sign in (az login) with an identity that has the 'Storage File Data "
            "Privileged Contributor' role on that account")


def storage_suffix() -> str:
    """The storage endpoints' suffix of the cloud in use: ``core.windows.net``, or a sovereign cloud's, by the cloud
    name in ``AZUREML_CURRENT_CLOUD`` (what ``MLClient(cloud=…)`` sets; the names azure-ai-ml knows)."""
    cloud = os.environ.get(CLOUD_ENV) or "AzureCloud"
    for name, suffix in STORAGE_SUFFIXES.items():
        if name.lower() == cloud.lower():
            return suffix
    raise ShareError(f"{CLOUD_ENV} names the cloud `{cloud}`, whose Azure Files endpoint nbbatch does not know (it "
                     f"knows {', '.join(STORAGE_SUFFIXES)}); set {ENDPOINT_ENV} to it, e.g. "
                     "https://{account}.file.<storage suffix>")


def default_endpoint(account: str) -> str:
    """The account's File service URL: ``NBBATCH_AZFILES_ENDPOINT`` (``{account}`` in it is replaced), else the
    cloud's (:func:`storage_suffix`)."""
    override = os.environ.get(ENDPOINT_ENV)
    if override:
        return override.replace("{account}", account)
    return f"https://{account}.file.{storage_suffix()}"


def resolve_credential(account: str, endpoint: str) -> tuple[Any, bool]:
    """(credential, is_token_credential) for ``account``: its key from the environment, else DefaultAzureCredential."""
    key = storage_key(account)
    if key:
        return AzureNamedKeyCredential(account, key), False
    if not endpoint.lower().startswith("https://"):
        raise ShareError(
            f"the Azure Files endpoint {endpoint} is not HTTPS, where Azure AD tokens cannot be used; "
            f"set {account_key_env(account)} (the key of storage account {account}) in the environment"
        )
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError as exc:  # pragma: no cover - azure-identity is part of the extra
        raise ShareError(f"Azure AD sign-in needs azure-identity: pip install 'nbbatch[azure]' ({exc})") from exc
    return DefaultAzureCredential(), True


def _retry_after_s(headers: Any) -> float | None:
    """The wait a response asks for: ``x-ms-retry-after-ms``/``retry-after-ms``, else ``Retry-After`` (seconds or a date)."""
    for name in ("x-ms-retry-after-ms", "retry-after-ms"):
        value = headers.get(name)
        if value:
            try:
                return max(0.0, float(value) / 1000)
            except ValueError:
                pass
    value = headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


class ThrottleRetry(ExponentialRetry):
    """The storage SDK's exponential retry, waiting what ``Retry-After`` asks and at most ``max_wait_s`` in all."""

    def __init__(self, *, max_wait_s: float = MAX_RETRY_WAIT_S, retry_total: int = 6, initial_backoff: int = 1,
                 increment_base: int = 2, random_jitter_range: int = 1, **kwargs: Any) -> None:
        self.max_wait_s = max_wait_s
        super().__init__(initial_backoff=initial_backoff, increment_base=increment_base, retry_total=retry_total,
                         random_jitter_range=random_jitter_range, **kwargs)

    def configure_retries(self, request: Any) -> dict[str, Any]:
        settings = super().configure_retries(request)
        settings.update(waited=0.0, next_wait=0.0)
        return settings

    def increment(self, settings: dict[str, Any], request: Any, response: Any = None, error: Any = None) -> bool:
        """Count the attempt; False (give up) also when the next wait would pass ``max_wait_s`` in all."""
        if not super().increment(settings, request, response, error):
            return False
        wait = _retry_after_s(response.headers) if response is not None else None
        if wait is None:
            wait = super().get_backoff_time(settings)
        if settings["waited"] + wait > self.max_wait_s:
            return False
        settings["waited"] += wait
        settings["next_wait"] = wait
        return True

    def get_backoff_time(self, settings: dict[str, Any]) -> float:
        return float(settings.get("next_wait") or 0.0)

    def send(self, request: Any) -> Any:
        """Send with the SDK's retries; then also retry, with the same backoff and ``max_wait_s``, a 409
        ``SharingViolation`` (an SMB client, e.g. a job's mount of the share, holds the file open for a moment), which
        the SDK treats as final."""
        settings = None
        while True:
            response = super().send(request)
            if response.http_response.headers.get("x-ms-error-code") not in RETRIED_CONFLICTS:
                return response
            settings = settings or self.configure_retries(request)
            if not self.increment(settings, request=request.http_request, response=response.http_response):
                return response
            self.sleep(settings, request.context.transport)


def retry_policy(client_options: dict[str, Any]) -> None:
    """Give ``client_options`` a :class:`ThrottleRetry` (configured by its retry keywords) unless it names a policy."""
    if "retry_policy" not in client_options:
        picked = {k: client_options.pop(k) for k in RETRY_OPTIONS if k in client_options}
        client_options["retry_policy"] = ThrottleRetry(**picked)


def check_account_key(account: str, share: str, key: str) -> None:
    """Raise :class:`ShareError` when the service refuses ``key`` for ``account`` (one request to the share).

    Only a refused key is an error: a missing share, or a service out of reach, is told by what uses it next.
    """
    client = ShareClient(account_url=default_endpoint(account), share_name=share,
                         credential=AzureNamedKeyCredential(account, key), retry_policy=ThrottleRetry(retry_total=2))
    try:
        client.get_share_properties()
    except ClientAuthenticationError as exc:
        raise ShareError(f"storage account {account} refused the key nbbatch found for it "
                         f"({account_key_env(account) if os.environ.get(account_key_env(account)) else KEY_ENV}): "
                         f"it is not that account's key; {key_hint(account)}") from exc
    except AzureError:
        pass
    finally:
        client.close()
