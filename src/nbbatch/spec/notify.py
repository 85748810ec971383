"""Notifications (``notify:``): whom to tell when an experiment or a pipeline ends, and how.

The block names a webhook (an http(s) URL that gets a JSON POST) and/or email recipients (sent through an SMTP
server: ``smtp:``, else ``NBBATCH_SMTP_URL``), and which endings notify (``on:``). Secrets are written as
``${env:NAME}``: the spec keeps them unexpanded, so nothing written from it (a manifest, a record, a message) holds
them; :func:`expand` reads them from the environment only when a message is sent
(:func:`nbbatch.drivers.notify.send_notifications`). :func:`notify_warnings` checks early (``nbbatch plan``,
``submit``) what sending will need: every variable set, an SMTP server for email. A password written into the
file itself is refused, as every credential in an experiment file is (docs/security.md).
"""

from __future__ import annotations

import os
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from nbbatch.errors import SpecError, did_you_mean
from nbbatch.spec.schema import experiment_schema
from nbbatch.spec.schema import keys as schema_keys

KEYS = schema_keys("notify")  # webhook, email, smtp, from, on
ENDINGS: tuple[str, ...] = tuple(experiment_schema()["$defs"]["ending"]["enum"])  # succeeded, failed, cancelled
SMTP_URL_VAR = "NBBATCH_SMTP_URL"  # the SMTP server when the block names none
SMTP_PORTS = {"smtp": 25, "smtps": 465}  # smtps: TLS from the start; smtp: STARTTLS when the server offers it
ENV_REFERENCE = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
_DOLLAR = re.compile(r"\$\{[^}]*\}?|\$[A-Za-z_][A-Za-z0-9_]*")  # what looks meant as a reference: ${…}, $NAME
_ADDRESS = re.compile(r"[^@\s<>,;()\[\]\"]+@[^@\s<>,;()\[\]\"]+")
_MARK = "nbbatchref{}x"  # stands for a reference while a URL is split (letters and digits: valid in every part)


@dataclass(frozen=True)
class NotifySpec:
    """A ``notify:`` block, as written: values may hold ``${env:NAME}`` (expanded only when sending)."""

    webhook: str | None = None
    email: tuple[str, ...] = ()
    smtp: str | None = None  # None: NBBATCH_SMTP_URL in the sender's environment
    sender: str | None = None  # the file's `from:`; None: the SMTP user if an address, else nbbatch@<host>
    on: tuple[str, ...] = ENDINGS

    def wants(self, ending: str) -> bool:
        """Whether an experiment or pipeline that ended so (succeeded, failed, cancelled) is told."""
        return ending in self.on

    def variables(self) -> list[str]:
        """The environment variables its values name (``${env:NAME}``), in order, once each."""
        texts = [self.webhook, *self.email, self.smtp, self.sender]
        return list(dict.fromkeys(n for t in texts if t for n in ENV_REFERENCE.findall(t)))

    def to_dict(self) -> dict[str, Any]:
        """The block as a file writes it (references unexpanded: nothing secret)."""
        data: dict[str, Any] = {"webhook": self.webhook, "email": list(self.email), "smtp": self.smtp,
                                "from": self.sender, "on": list(self.on)}
        return {k: v for k, v in data.items() if v not in (None, [])}


@dataclass(frozen=True)
class SmtpServer:
    """Where email goes, from an SMTP URL: ``implicit_tls`` for smtps:// (else STARTTLS when offered)."""

    host: str
    port: int
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    implicit_tls: bool = False

    def __str__(self) -> str:  # for messages: never the user or the password
        return f"{'smtps' if self.implicit_tls else 'smtp'}://{self.host}:{self.port}"


def parse_notify(value: Any, where: str = "notify") -> NotifySpec | None:
    """The ``notify:`` block checked whole (``None``: no block), or :class:`SpecError` naming the first mistake and
    its fix. ``where`` names the block in messages (``notify``, ``stages.train.notify``)."""
    if value is None:
        return None
    if isinstance(value, NotifySpec):
        value = value.to_dict()
    if not isinstance(value, Mapping):
        raise SpecError(f"`{where}` must be a mapping: {{webhook: URL, email: ADDRESS, smtp: URL, on: [...]}} "
                        f"(got {reprlib.repr(value)})")
    for key in value:
        if key not in KEYS:
            raise SpecError(f"unknown key `{where}.{key}`{did_you_mean(str(key), KEYS)}; known: {', '.join(KEYS)}")
    webhook, smtp, sender = (_text(value.get(k), f"{where}.{k}") for k in ("webhook", "smtp", "from"))
    email = _texts(value.get("email"), f"{where}.email")
    if webhook is None and not email:
        raise SpecError(f"`{where}` tells no one: give `webhook: URL` and/or `email: ADDRESS`")
    if webhook is not None:
        _check_webhook(webhook, f"{where}.webhook")
    for address in email:
        _check_address(address, f"{where}.email")
    if sender is not None:
        _check_address(sender, f"{where}.from")
    if smtp is not None:
        problem = smtp_problem(smtp, in_file=True)
        if problem:
            raise SpecError(f"`{where}.smtp`: {problem}")
    return NotifySpec(webhook, email, smtp, sender, _endings(value.get("on", ENDINGS), f"{where}.on"))


def expand(text: str, environ: Mapping[str, str] | None = None) -> tuple[str, list[str]]:
    """``text`` with each ``${env:NAME}`` replaced by the variable's value (``environ``: default the process's),
    and the names of those not set (left as written)."""
    env = os.environ if environ is None else environ
    missing: list[str] = []

    def value(match: re.Match[str]) -> str:
        if match.group(1) in env:
            return env[match.group(1)]
        missing.append(match.group(1))
        return match.group(0)

    return ENV_REFERENCE.sub(value, text), missing


def smtp_url(spec: NotifySpec, environ: Mapping[str, str] | None = None) -> str | None:
    """The SMTP URL email goes through: the block's ``smtp:``, else ``NBBATCH_SMTP_URL``, else ``None``."""
    env = os.environ if environ is None else environ
    return spec.smtp or env.get(SMTP_URL_VAR) or None


def smtp_server(url: str, environ: Mapping[str, str] | None = None) -> tuple[SmtpServer | None, list[str]]:
    """The server an SMTP URL names, each part's ``${env:NAME}`` expanded on its own (a password may hold ``@`` or
    ``/``), and the variables not set (``None`` when the whole URL is one); :class:`SpecError` when the URL is
    malformed (see :func:`smtp_problem`)."""
    if ENV_REFERENCE.fullmatch(url):  # the whole URL in a variable (as NBBATCH_SMTP_URL holds it)
        url, missing = expand(url, environ)
        if missing:
            return None, missing
    problem = smtp_problem(url)
    if problem:
        raise SpecError(problem)
    references: dict[str, str] = {}

    def mark(match: re.Match[str]) -> str:
        references[_MARK.format(len(references))] = match.group(0)
        return _MARK.format(len(references) - 1)

    parts = urlsplit(ENV_REFERENCE.sub(mark, url))
    missing: list[str] = []

    def part(text: str | None) -> str | None:
        if text is None:
            return None
        text = unquote(text)
        for key, reference in references.items():
            text = text.replace(key, reference)
        expanded, unset = expand(text, environ)
        missing.extend(unset)
        return expanded

    host = part(parts.hostname) or ""
    port = parts.port or SMTP_PORTS[parts.scheme]
    return SmtpServer(host, port, part(parts.username), part(parts.password), parts.scheme == "smtps"), missing


def smtp_problem(url: str, in_file: bool = False) -> str | None:
    """Why ``url`` is no SMTP URL nbbatch can use (a sentence naming the fix), or ``None``. ``in_file``: the URL is
    written in an experiment file, which may name its password only as ``${env:NAME}``."""
    example = "smtp://user:${env:SMTP_PASSWORD}@host:587 or smtps://user:${env:SMTP_PASSWORD}@host:465"
    if ENV_REFERENCE.fullmatch(url):
        return None  # the whole URL in a variable: checked when it is read
    masked = ENV_REFERENCE.sub(lambda m: _MARK.format(0), url)
    try:
        parts = urlsplit(masked)
        parts.port  # noqa: B018 - raises ValueError for a port that is no number
    except ValueError:
        return f"not an SMTP URL, or its port is not a number: write {example}"
    if parts.scheme not in SMTP_PORTS or not parts.hostname:
        return f"an SMTP URL starts with smtp:// or smtps:// and names a host: write {example}"
    if parts.path.strip("/") or parts.query or parts.fragment:
        return f"an SMTP URL is only [user[:password]@]host[:port]: write {example}"
    if in_file and parts.password and parts.password != _MARK.format(0):
        return ("holds a password: an experiment file holds no credential (docs/security.md); put it in an "
                "environment variable and write smtp://user:${env:SMTP_PASSWORD}@host:587")
    return None


def notify_warnings(spec: NotifySpec | None, environ: Mapping[str, str] | None = None) -> list[str]:
    """What would keep a notification from being sent, as this environment stands (``nbbatch plan``, ``submit``):
    variables not set, email without an SMTP server, a variable whose value is no URL or address. Warnings, not
    errors: the driver that sends may run elsewhere (a detached job), with its own environment."""
    if spec is None:
        return []
    env = os.environ if environ is None else environ
    unset = [f"${{env:{name}}}" for name in spec.variables() if name not in env]
    said = [f"notify: {', '.join(unset)} {'is' if len(unset) == 1 else 'are'} not set here: what needs "
            f"{'it' if len(unset) == 1 else 'them'} cannot be sent unless the driver's environment sets "
            f"{'it' if len(unset) == 1 else 'them'}"] if unset else []
    if spec.webhook and not said:
        webhook, _ = expand(spec.webhook, env)
        if not re.match(r"https?://[^/\s]", webhook):
            said.append(f"notify.webhook: {spec.webhook} holds no http(s) URL; the webhook cannot be called")
    url = smtp_url(spec, env) if spec.email else None
    if spec.email and url is None:
        said.append(f"notify: email cannot be sent: no SMTP server; set notify.smtp "
                    f"(smtp://user:${{env:SMTP_PASSWORD}}@host:587) or {SMTP_URL_VAR}")
    elif url is not None and not said:
        problem = smtp_problem(expand(url, env)[0] if ENV_REFERENCE.fullmatch(url) else url)
        if problem:
            said.append(f"notify: the SMTP URL ({'notify.smtp' if spec.smtp else SMTP_URL_VAR}): {problem}")
    return said


def _text(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise SpecError(f"`{where}` must be text (got {reprlib.repr(value)})")
    for written in _DOLLAR.findall(value):
        if not ENV_REFERENCE.fullmatch(written):
            raise SpecError(f"`{where}`: {reprlib.repr(written)} is not a reference nbbatch reads: write "
                            "${env:NAME} for an environment variable's value")
    return value.strip()


def _texts(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        return (_text(value, where) or "",)
    return tuple(_text(item, f"{where}[{i}]") or "" for i, item in enumerate(value))


def _check_webhook(url: str, where: str) -> None:
    if url.startswith("${env:"):
        return  # its scheme is the variable's: checked when it is read (notify_warnings)
    if not re.match(r"https?://[^/\s]", ENV_REFERENCE.sub("x", url)):
        shown = url.split("://", 1)[0] + "://…" if "://" in url else reprlib.repr(url)
        raise SpecError(f"`{where}` must be an http(s) URL (got {shown}); a Slack incoming webhook is "
                        "https://hooks.slack.com/services/…: write it as ${env:SLACK_WEBHOOK_URL}")


def _check_address(address: str, where: str) -> None:
    if not ENV_REFERENCE.fullmatch(address) and not _ADDRESS.fullmatch(ENV_REFERENCE.sub("x", address)):
        raise SpecError(f"`{where}`: {reprlib.repr(address)} is not an email address: write name@example.com")


def _endings(value: Any, where: str) -> tuple[str, ...]:
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise SpecError(f"`{where}` is empty, so nothing would ever notify: name some of {', '.join(ENDINGS)}, or "
                        "drop the notify block")
    for item in items:
        if item not in ENDINGS:
            raise SpecError(f"`{where}`: unknown ending {reprlib.repr(item)}{did_you_mean(str(item), ENDINGS)}; "
                            f"use {', '.join(ENDINGS)}")
    return tuple(dict.fromkeys(items))
