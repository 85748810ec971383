"""Sending notifications: tell those a ``notify:`` block names (:class:`~nbbatch.spec.notify.NotifySpec`) how an
experiment or a pipeline ended.

A driver that saw its runs end builds an :class:`Outcome` (an experiment's: :func:`experiment_outcome`) and calls
:func:`send_notifications`: a POST of JSON to the webhook (a Slack-compatible ``text`` line and the outcome's fields)
and an email through SMTP, with the standard library only. The block's ``${env:NAME}`` values are read from the
environment here and nowhere else. Sending never raises and never fails a run: what could not be sent is a warning
line that names where it failed, without the webhook's path, a password or any variable's value.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import re
import smtplib
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from email.message import EmailMessage
from typing import Any

from nbbatch import __version__
from nbbatch.errors import SpecError
from nbbatch.redact import redacted_url
from nbbatch.results.pipeline import best_record, finished, metric_value
from nbbatch.results.status import parameters_text, summary_counts
from nbbatch.spec.notify import (
    ENV_REFERENCE,
    SMTP_URL_VAR,
    NotifySpec,
    SmtpServer,
    expand,
    smtp_server,
    smtp_url,
)
from nbbatch.spec.pipeline import Select
from nbbatch.store.runjson import DONE_STATUSES, RunRecord, Status

WEBHOOK_TIMEOUT_S = 10.0  # each try; a webhook that takes longer is down for our purpose
SMTP_TIMEOUT_S = 15.0
RETRY_AFTER_S = 1.0  # one retry at most, after a connection failure or a 5xx/429 answer
DETAIL_LINES = 5  # failed runs named in a message; the rest are counted
NOT_WAITED = ("notify: sent only when the driver waits, as it alone sees the runs end: use --wait or --detach "
              "(nothing was sent for this submission)")


@dataclass
class Outcome:
    """How an experiment or a pipeline ended, for people: what a notification says."""

    kind: str  # experiment | pipeline
    name: str
    status: str  # succeeded | failed | cancelled
    share: str = ""  # where its results are (the experiment's or pipeline's folder)
    counts: dict[str, int] = field(default_factory=dict)  # runs by status
    lines: list[str] = field(default_factory=list)  # a few lines of detail: failed runs, blocked stages, the best
    started: str | None = None  # ISO-8601, as the records keep them
    ended: str | None = None

    def headline(self) -> str:
        """``experiment digits succeeded (9/9 runs)``; ``… failed (7/9 runs succeeded; 2 failed)``."""
        total = sum(self.counts.values())
        done = sum(n for status, n in self.counts.items() if status in DONE_STATUSES)
        rest = ", ".join(f"{n} {status}" for status, n in self.counts.items() if status not in DONE_STATUSES and n)
        runs = f"{done}/{total} runs" + (f" succeeded; {rest}" if rest else "")
        return f"{self.kind} {self.name} {self.status} ({runs})"

    def text(self) -> str:
        """The message as plain text (Slack's ``text``; the email's body)."""
        return "\n".join([f"nbbatch: {self.headline()}", *(f"• {line}" for line in self.lines),
                          *([f"results: {self.share}"] if self.share else []),
                          *([f"ran {self.started} → {self.ended}"] if self.started and self.ended else [])])

    def payload(self) -> dict[str, Any]:
        """The webhook's JSON body: Slack's ``text`` and every field for other receivers."""
        return {"text": self.text(), **asdict(self), "runs": sum(self.counts.values()), "nbbatch": __version__}


def ending_of(statuses: Iterable[str]) -> str:
    """How a set of final runs ended: ``cancelled`` if any was, else ``failed`` if any failed or timed out, else
    ``succeeded`` (pruned runs ended as their search meant)."""
    seen = set(statuses)
    if Status.CANCELLED in seen:
        return "cancelled"
    return "failed" if seen & {Status.FAILED, Status.TIMED_OUT} else "succeeded"


def best_line(records: Iterable[RunRecord], metric: str, mode: str = "max") -> str | None:
    """``best accuracy 0.97: run pytorch-1a2b (LR=0.01)``, over the records that recorded ``metric``; ``None``
    when none did."""
    best = best_record(list(records), Select(metric, mode))
    if best is None:
        return None
    value = float(best.metrics[metric])
    shown = parameters_text(best.parameters)
    return f"best {metric} {value:.6g}: run {best.run_id}" + (f" ({shown})" if shown else "")


def front_line(records: Iterable[RunRecord], objectives: Sequence[tuple[str, str]]) -> str | None:
    """A search of several objectives (``(metric, mode)`` each): its Pareto front, the finished runs no other is as
    good as in every objective and better in one, ``Pareto front of accuracy (max) and seconds (min), 2 runs: run a
    (accuracy 0.97, seconds 12.3); run b (…)``; None when no run recorded every objective."""
    scored = [(r, [metric_value(r, m) for m, _ in objectives]) for r in records if finished(r)]
    points = [(r, [v if mode == "min" else -v for v, (_, mode) in zip(values, objectives, strict=True)])
              for r, values in scored if None not in values]
    front = [r for r, p in points if not any(all(o <= q for o, q in zip(other, p, strict=True)) and other != p
                                             for _, other in points)]
    if not front:
        return None
    front.sort(key=lambda r: (-1 if objectives[0][1] == "max" else 1) * float(r.metrics[objectives[0][0]]))
    shown = "; ".join(f"run {r.run_id} (" + ", ".join(f"{m} {float(r.metrics[m]):.6g}" for m, _ in objectives) + ")"
                      for r in front[:DETAIL_LINES])
    more = f"; … and {len(front) - DETAIL_LINES} more" if len(front) > DETAIL_LINES else ""
    names = " and ".join(f"{m} ({mode})" for m, mode in objectives)
    return f"Pareto front of {names}, {len(front)} run(s): {shown}{more}"


def experiment_outcome(name: str, share: str, records: list[RunRecord], metric: str | None = None,
                       mode: str = "max", objectives: Sequence[tuple[str, str]] = ()) -> Outcome:
    """The outcome of an experiment whose ``records`` are final: its ending, counts, its failed runs and (with
    ``metric``, a search's) its best run; with several ``objectives`` (a search's ``(metric, mode)`` each), its
    Pareto front instead."""
    counts = summary_counts(records)
    bad = [r for r in records if r.status not in DONE_STATUSES]
    lines = [f"run {r.run_id} {r.status}" + (f": {r.error_summary()}" if r.error else "") for r in bad[:DETAIL_LINES]]
    if len(bad) > DETAIL_LINES:
        lines.append(f"… and {len(bad) - DETAIL_LINES} more runs that did not succeed")
    best = front_line(records, objectives) if len(objectives) > 1 else best_line(records, metric, mode) if metric \
        else None
    starts = [r.started_at for r in records if r.started_at]
    ends = [r.ended_at for r in records if r.ended_at]
    return Outcome("experiment", name, ending_of(r.status for r in records), f"{share.rstrip('/')}/{name}", counts,
                   [*lines, *([best] if best else [])], min(starts, default=None), max(ends, default=None))


def send_notifications(spec: NotifySpec, outcome: Outcome, environ: Mapping[str, str] | None = None) -> list[str]:
    """Tell those ``spec`` names how ``outcome`` ended (when ``spec.on`` wants this ending). Returns a warning for
    each message that could not be sent; never raises, and no warning holds a secret."""
    if not spec.wants(outcome.status):
        return []
    env = dict(environ) if environ is not None else None
    said: list[str] = []
    for channel, wanted, send in (("webhook", spec.webhook, _call_webhook), ("email", spec.email, _send_email)):
        if not wanted:
            continue
        try:
            said.extend(send(spec, outcome, env))
        except Exception as exc:  # noqa: BLE001 - a notification never fails the runs it tells about
            said.append(f"notify: {channel} not sent: {type(exc).__name__}: {exc}")
    secrets = _secrets(spec, env) if said else []
    return [_scrub(line, secrets) for line in said]


def _call_webhook(spec: NotifySpec, outcome: Outcome, environ: Mapping[str, str] | None) -> list[str]:
    assert spec.webhook is not None
    url, missing = expand(spec.webhook, environ)
    where = f"notify: webhook {spec.webhook if ENV_REFERENCE.search(spec.webhook) else redacted_url(url)}"
    if missing:
        return [f"{where} not called: {_unset(missing)}"]
    if not re.match(r"https?://[^/\s]", url):
        return [f"{where} not called: its value is no http(s) URL"]
    request = urllib.request.Request(url, data=json.dumps(outcome.payload()).encode(), method="POST", headers={
        "Content-Type": "application/json", "User-Agent": f"nbbatch/{__version__}"})
    problem = ""
    for attempt in (1, 2):
        try:
            with urllib.request.urlopen(request, timeout=WEBHOOK_TIMEOUT_S) as response:
                response.read(4096)
            return []
        except urllib.error.HTTPError as exc:
            problem = f"it answered HTTP {exc.code} {exc.reason}"
            if exc.code < 500 and exc.code != 429:  # refused (a revoked hook, a bad body): asking again changes nothing
                break
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            problem = str(getattr(exc, "reason", None) or exc) or type(exc).__name__
        if attempt == 1:
            time.sleep(RETRY_AFTER_S)
    return [f"{where} ({redacted_url(url)}) not delivered: {problem}"]


def _send_email(spec: NotifySpec, outcome: Outcome, environ: Mapping[str, str] | None) -> list[str]:
    to = ", ".join(spec.email)
    url, source = smtp_url(spec, environ), "notify.smtp" if spec.smtp else SMTP_URL_VAR
    if url is None:
        return [f"notify: email to {to} not sent: no SMTP server; set notify.smtp "
                f"(smtp://user:${{env:SMTP_PASSWORD}}@host:587) or {SMTP_URL_VAR} in the driver's environment"]
    try:
        server, missing = smtp_server(url, environ)
    except SpecError as exc:
        return [f"notify: email to {to} not sent: the SMTP URL ({source}): {exc}"]
    recipients: list[str] = []
    for written in spec.email:
        value, unset = expand(written, environ)
        recipients.extend(a.strip() for a in value.split(",") if a.strip())
        missing.extend(unset)
    sender, unset = expand(spec.sender, environ) if spec.sender else (_default_sender(server), [])
    missing.extend(unset)
    if missing or server is None:
        return [f"notify: email to {to} not sent: {_unset(missing)}"]
    message = EmailMessage()
    message["Subject"], message["From"], message["To"] = f"nbbatch: {outcome.headline()}", sender, recipients
    message.set_content(outcome.text())
    problem = ""
    for attempt in (1, 2):
        try:
            _deliver(server, message)
            return []
        except (TimeoutError, smtplib.SMTPServerDisconnected, smtplib.SMTPConnectError, ConnectionError) as exc:
            problem = f"{type(exc).__name__}: {exc}"  # the server may be back in a second
        except (smtplib.SMTPException, OSError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
            break
        if attempt == 1:
            time.sleep(RETRY_AFTER_S)
    return [f"notify: email to {to} not sent through {server}: {problem}"]


def _deliver(server: SmtpServer, message: EmailMessage) -> None:
    """Hand ``message`` to ``server``: TLS from the start (smtps) or STARTTLS when offered; a password only over
    TLS, except to this machine."""
    context = ssl.create_default_context()
    smtp: smtplib.SMTP = (smtplib.SMTP_SSL(server.host, server.port, timeout=SMTP_TIMEOUT_S, context=context)
                          if server.implicit_tls else smtplib.SMTP(server.host, server.port, timeout=SMTP_TIMEOUT_S))
    with smtp:
        smtp.ehlo()
        secure = server.implicit_tls
        if not secure and smtp.has_extn("starttls"):
            smtp.starttls(context=context)
            smtp.ehlo()
            secure = True
        if server.user:
            if not secure and not _loopback(server.host):
                raise smtplib.SMTPException("the server offers no STARTTLS and the password is not sent in the "
                                            "clear: use smtps:// (port 465) or a server that offers STARTTLS")
            smtp.login(server.user, server.password or "")
        smtp.send_message(message)


def _default_sender(server: SmtpServer | None) -> str:
    user = server.user if server else None
    return user if user and "@" in user else f"nbbatch@{socket.getfqdn()}"


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _unset(names: list[str]) -> str:
    shown = ", ".join(f"${{env:{n}}}" for n in dict.fromkeys(names))
    return f"{shown} {'is' if len(set(names)) == 1 else 'are'} not set in the driver's environment"


def _secrets(spec: NotifySpec, environ: Mapping[str, str] | None) -> list[str]:
    """What a warning must never show: the expanded webhook URL, every named variable's value, the SMTP password
    (also one in NBBATCH_SMTP_URL)."""
    found = [expand(spec.webhook, environ)[0]] if spec.webhook else []
    found += [expand(f"${{env:{name}}}", environ)[0] for name in spec.variables()]
    url = smtp_url(spec, environ)
    try:
        server = smtp_server(url, environ)[0] if url else None
    except SpecError:
        server = None
    found += [server.password] if server and server.password else []
    return sorted({s for s in found if len(s) >= 4 and "${env:" not in s}, key=len, reverse=True)


def _scrub(line: str, secrets: list[str]) -> str:
    for secret in secrets:
        line = line.replace(secret, "…")
    return line
