"""Notifications (``notify:``): a webhook gets the JSON, an SMTP server gets the mail, a failure to send is a warning
and never a failed run, and no secret given as ``${env:NAME}`` lands in a message, a warning, a record or a file.

The receivers are real: an ``http.server`` and an aiosmtpd server on 127.0.0.1 (free ports), in this process.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
from email import message_from_bytes
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult
from support.notebooks import make_notebook
from support.waiting import wait_until
from test_drivers import InstantBackend
from test_drivers import _plan as instant_plan

import nbbatch
from nbbatch.api import submit
from nbbatch.drivers import SubmissionDriver, notify
from nbbatch.drivers.notify import Outcome, experiment_outcome, send_notifications
from nbbatch.errors import SpecError
from nbbatch.plan.runs import plan
from nbbatch.redact import redacted_url
from nbbatch.spec.experiment import Experiment
from nbbatch.spec.notify import NotifySpec, notify_warnings, parse_notify
from nbbatch.store.share import FileShare

pytestmark = pytest.mark.timeout(120)

SMTP_USER = "nbbatch-ci"


# --- the receivers ----------------------------------------------------------------------------------------

class _Hook(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append((self.path, self.headers["Content-Type"], json.loads(body)))  # type: ignore[attr-defined]
        self.send_response(self.server.answer)  # type: ignore[attr-defined]
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def webhook():
    """An HTTP server on 127.0.0.1 that keeps every POST: ``received`` (path, content type, JSON body)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    server.received, server.answer = [], 200  # type: ignore[attr-defined]
    server.secret = f"secret-{secrets.token_hex(8)}"  # type: ignore[attr-defined]
    server.url = f"http://127.0.0.1:{server.server_port}/services/T0/B0/{server.secret}"  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


class _Inbox:
    """aiosmtpd's handler: keeps each mail; checks logins against the planted password."""

    def __init__(self, password: str) -> None:
        self.password, self.mails, self.logins = password, [], []

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's name
        self.mails.append((envelope.mail_from, list(envelope.rcpt_tos), message_from_bytes(envelope.content)))
        return "250 OK"

    def authenticate(self, server, session, envelope, mechanism, auth_data) -> AuthResult:
        self.logins.append(auth_data.login.decode())
        ok = auth_data.login.decode() == SMTP_USER and auth_data.password.decode() == self.password
        return AuthResult(success=ok, handled=False)  # handled=False: aiosmtpd answers 535 to a wrong password


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def smtp():
    """An SMTP server on 127.0.0.1 (aiosmtpd) that takes a login over plain SMTP (loopback) and keeps the mail."""
    inbox = _Inbox(f"pw-{secrets.token_hex(8)}")
    controller = Controller(inbox, hostname="127.0.0.1", port=_free_port(), authenticator=inbox.authenticate,
                            auth_require_tls=False)
    controller.start()
    inbox.port = controller.port
    yield inbox
    controller.stop()


@pytest.fixture
def secrets_in_env(monkeypatch, webhook, smtp):
    """The webhook URL and the SMTP password, only in the environment; the notify block that names them."""
    monkeypatch.setenv("TEST_HOOK_URL", webhook.url)
    monkeypatch.setenv("TEST_SMTP_PASSWORD", smtp.password)
    monkeypatch.delenv("NBBATCH_SMTP_URL", raising=False)
    monkeypatch.setattr(notify, "RETRY_AFTER_S", 0.01)
    return {"webhook": "${env:TEST_HOOK_URL}", "email": ["me@example.com", "team@example.com"],
            "smtp": f"smtp://{SMTP_USER}:${{env:TEST_SMTP_PASSWORD}}@127.0.0.1:{smtp.port}"}


def _closed_port_url(scheme: str) -> str:
    return f"{scheme}://127.0.0.1:{_free_port()}"


def _files_holding(root: Path, *needles: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and any(n.encode() in p.read_bytes() for n in needles)]


# --- sending -----------------------------------------------------------------------------------------------

OUTCOME = Outcome("experiment", "digits", "failed", "/results/digits", {"succeeded": 7, "failed": 2},
                  ["run nb-1 failed: cell 2: ValueError: boom"], "2024-01-01T00:00:00Z", "2024-01-01T00:05:00Z")


def test_the_webhook_gets_slack_text_and_the_fields_and_the_mail_its_subject(secrets_in_env, webhook, smtp):
    spec = parse_notify(secrets_in_env)
    assert spec.webhook == "${env:TEST_HOOK_URL}", "kept unexpanded in the spec"
    assert send_notifications(spec, OUTCOME) == []
    [(path, content_type, body)] = webhook.received
    assert path.endswith(webhook.secret) and content_type == "application/json"
    assert body["text"].startswith("nbbatch: experiment digits failed (7/9 runs succeeded; 2 failed)")
    assert "run nb-1 failed: cell 2: ValueError: boom" in body["text"]
    assert {k: body[k] for k in ("kind", "name", "status", "counts", "share", "runs")} == {
        "kind": "experiment", "name": "digits", "status": "failed", "counts": {"succeeded": 7, "failed": 2},
        "share": "/results/digits", "runs": 9}
    [(sender, recipients, mail)] = smtp.mails
    assert smtp.logins == [SMTP_USER] and recipients == ["me@example.com", "team@example.com"]
    assert mail["Subject"] == "nbbatch: experiment digits failed (7/9 runs succeeded; 2 failed)"
    assert sender == f"nbbatch@{socket.getfqdn()}" and "ValueError: boom" in _body(mail)


def test_on_picks_the_endings_that_notify(webhook):
    spec = parse_notify({"webhook": webhook.url, "on": "failed"})
    send_notifications(spec, Outcome("experiment", "e", "succeeded", counts={"succeeded": 1}))
    assert webhook.received == []
    send_notifications(spec, Outcome("experiment", "e", "failed", counts={"failed": 1}))
    assert len(webhook.received) == 1


def test_what_cannot_be_sent_is_a_warning_that_names_where_and_shows_no_secret(monkeypatch, webhook, smtp):
    monkeypatch.setattr(notify, "RETRY_AFTER_S", 0.01)
    down = f"{_closed_port_url('http')}/services/T0/B0/{webhook.secret}"
    monkeypatch.setenv("TEST_HOOK_URL", down)
    monkeypatch.setenv("TEST_SMTP_PASSWORD", smtp.password)
    spec = parse_notify({"webhook": "${env:TEST_HOOK_URL}", "email": "me@example.com",
                         "smtp": f"smtp://{SMTP_USER}:${{env:TEST_SMTP_PASSWORD}}@127.0.0.1:{_free_port()}"})
    said = send_notifications(spec, OUTCOME)
    assert len(said) == 2, said
    assert said[0].startswith(f"notify: webhook ${{env:TEST_HOOK_URL}} ({redacted_url(down)}) not delivered")
    assert said[1].startswith("notify: email to me@example.com not sent through smtp://127.0.0.1:")
    assert not any(webhook.secret in line or smtp.password in line or "/services/" in line for line in said)

    webhook.answer = 404  # a hook the receiver refuses: said once, not asked again
    spec = parse_notify({"webhook": webhook.url})
    [line] = send_notifications(spec, OUTCOME)
    assert "answered HTTP 404" in line and webhook.secret not in line and len(webhook.received) == 1

    wrong = parse_notify({"email": "me@example.com", "smtp": f"smtp://{SMTP_USER}:${{env:WRONG}}@127.0.0.1:{smtp.port}"})
    monkeypatch.setenv("WRONG", "not-the-password")
    [line] = send_notifications(wrong, OUTCOME)
    assert "SMTPAuthenticationError" in line and "not-the-password" not in line and not smtp.mails


def test_a_variable_not_set_is_a_warning_at_send_time_and_when_planning(project, monkeypatch):
    monkeypatch.delenv("NOT_SET_HOOK", raising=False)
    monkeypatch.delenv("NBBATCH_SMTP_URL", raising=False)
    spec = parse_notify({"webhook": "${env:NOT_SET_HOOK}", "email": "me@example.com"})
    said = send_notifications(spec, OUTCOME)
    assert said == ["notify: webhook ${env:NOT_SET_HOOK} not called: ${env:NOT_SET_HOOK} is not set in the driver's "
                    "environment",
                    "notify: email to me@example.com not sent: no SMTP server; set notify.smtp "
                    "(smtp://user:${env:SMTP_PASSWORD}@host:587) or NBBATCH_SMTP_URL in the driver's environment"]
    make_notebook(project / "nb.ipynb", ["print(A)"])
    experiment = Experiment.from_dict({"experiment": "e", "notebooks": ["nb.ipynb"], "notify": spec.to_dict()},
                                      base_dir=project)
    warnings = plan(experiment, check_kernels=False).warnings
    assert any("${env:NOT_SET_HOOK} is not set here" in w for w in warnings), warnings
    assert any("email cannot be sent: no SMTP server" in w for w in warnings), warnings
    assert notify_warnings(spec, {"NOT_SET_HOOK": "https://hooks.example.com/x", "NBBATCH_SMTP_URL": "smtps://h"}) == []


def test_an_smtp_password_may_hold_what_a_url_cannot(smtp, monkeypatch):
    smtp.password = "p@ss/w:rd#1"
    monkeypatch.setenv("TEST_SMTP_PASSWORD", smtp.password)
    spec = parse_notify({"email": "me@example.com", "from": "lab@example.com",
                         "smtp": f"smtp://{SMTP_USER}:${{env:TEST_SMTP_PASSWORD}}@127.0.0.1:{smtp.port}"})
    assert send_notifications(spec, OUTCOME) == [] and smtp.mails[0][0] == "lab@example.com"


# --- the block -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block, message", [
    ({"webhok": "https://h/x"}, r"unknown key `notify.webhok` \(did you mean `webhook`\?\)"),
    ({"webhook": "ftp://h/x"}, r"`notify.webhook` must be an http\(s\) URL \(got ftp://…\)"),
    ({"webhook": "https://h/${SLACK}"}, r"'\$\{SLACK\}' is not a reference nbbatch reads: write \$\{env:NAME\}"),
    ({"email": "me"}, r"`notify.email`: 'me' is not an email address"),
    ({"email": 3}, r"`notify.email` must be an email address or a non-empty list of them \(got 3\)"),
    ({"email": "a@b.c", "smtp": "smtp://u:hunter2@h:587"}, r"`notify.smtp`: holds a password: .*\$\{env:SMTP_PASSWORD\}"),
    ({"email": "a@b.c", "smtp": "http://h"}, r"an SMTP URL starts with smtp:// or smtps://"),
    ({"email": "a@b.c", "smtp": "smtp://h:port"}, r"its port is not a number"),
    ({"email": "a@b.c", "on": "succeded"}, r"notify.on.*\(did you mean `succeeded`\?\)"),
    ({"email": "a@b.c", "on": []}, r"`notify.on` must be"),
    ({"on": "failed"}, r"`notify` tells no one: give `webhook: URL` and/or `email: ADDRESS`"),
    ("me@example.com", r"`notify` must be a mapping"),
])
def test_each_mistake_in_the_block_is_one_line_naming_the_fix(block, message, tmp_path):
    with pytest.raises(SpecError, match=message) as caught:
        Experiment.from_dict({"experiment": "e", "notebooks": ["nb.ipynb"], "notify": block}, base_dir=tmp_path)
    assert "\n" not in str(caught.value) and "hunter2" not in str(caught.value)


@pytest.mark.parametrize("block, message", [
    ({"email": "a@b.c", "on": []}, r"`stages.train.notify.on` is empty, so nothing would ever notify"),
    ({"webhook": "https://h", "emial": "a@b.c"}, r"unknown key `stages.train.notify.emial` \(did you mean `email`\?\)"),
])
def test_the_block_parses_alone_for_a_pipeline(block, message):
    with pytest.raises(SpecError, match=message):
        parse_notify(block, "stages.train.notify")


def test_an_experiment_built_in_python_takes_a_dict_or_a_spec_and_is_checked():
    spec = Experiment(name="e", notebooks=[], frameworks=["x"], notify={"email": "a@b.c"}, base_dir=Path.cwd())
    assert spec.notify == NotifySpec(email=("a@b.c",))
    with pytest.raises(SpecError, match="tells no one"):
        Experiment(name="e", frameworks=["x"], notify=NotifySpec())


# --- experiments ---------------------------------------------------------------------------------------------

def test_a_driver_that_does_not_wait_says_it_cannot_notify_and_one_that_waits_notifies(project, webhook, monkeypatch):
    monkeypatch.setattr(notify, "RETRY_AFTER_S", 0.01)
    share = FileShare(project / "results")
    result = SubmissionDriver(instant_plan(project, notify={"webhook": webhook.url}), InstantBackend(), share,
                              wait=False, progress=False).submit()
    assert notify.NOT_WAITED in result.warnings and webhook.received == []
    result = SubmissionDriver(instant_plan(project, notify={"webhook": webhook.url}), InstantBackend(), share,
                              progress=False, force=True).submit()
    assert result.ok and webhook.received[0][2]["text"].startswith("nbbatch: experiment e succeeded (3/3 runs)")
    again = SubmissionDriver(instant_plan(project, notify={"webhook": webhook.url}), InstantBackend(), share,
                             progress=False).submit()
    assert again.skipped and len(webhook.received) == 1, "a submission that ran nothing tells nothing"


def test_unreachable_receivers_leave_the_runs_succeeded(project, monkeypatch):
    monkeypatch.setattr(notify, "RETRY_AFTER_S", 0.01)
    block = {"webhook": f"{_closed_port_url('http')}/hook", "email": "me@example.com",
             "smtp": f"{_closed_port_url('smtp')}"}
    result = SubmissionDriver(instant_plan(project, notify=block), InstantBackend(), FileShare(project / "results"),
                              progress=False).submit()
    assert result.ok and all(r.status == "succeeded" for r in result.records)
    assert [w.split(" ", 2)[1] for w in result.warnings if w.startswith("notify:")] == ["webhook", "email"]


def test_the_outcome_of_an_experiment(project):
    result = SubmissionDriver(instant_plan(project), InstantBackend(), FileShare(project / "results"),
                              progress=False).submit()
    records = result.records
    records[0].status, records[1].status = "failed", "cancelled"
    records[2].metrics = {"accuracy": 0.9}
    outcome = experiment_outcome("e", "/share/", records, "accuracy")
    assert outcome.status == "cancelled" and outcome.share == "/share/e"
    assert outcome.lines == ["run r0 failed", "run r1 cancelled", "best accuracy 0.9: run r2 (A=2)"]
    assert outcome.headline() == "experiment e cancelled (1/3 runs succeeded; 1 failed, 1 cancelled)"


def test_the_outcome_of_a_search_of_several_objectives_names_its_pareto_front():
    from nbbatch.store.runjson import RunRecord, Status

    values = [(0.99, 90.0), (0.95, 50.0), (0.95, 60.0), (0.9, 10.0), (0.8, 12.0)]  # r2 and r4 are dominated
    records = [RunRecord(f"r{i}", "e", "nb", "k", status=Status.SUCCEEDED, metrics={"accuracy": a, "seconds": t})
               for i, (a, t) in enumerate(values)]
    outcome = experiment_outcome("e", "/share/", records, "accuracy", "max", [("accuracy", "max"), ("seconds", "min")])
    assert outcome.lines == ["Pareto front of accuracy (max) and seconds (min), 3 run(s): run r0 (accuracy 0.99, "
                             "seconds 90); run r1 (accuracy 0.95, seconds 50); run r3 (accuracy 0.9, seconds 10)"]


WAIT_FOR_RELEASE = "import pathlib, time\nwhile not pathlib.Path('release').exists():\n    time.sleep(0.05)"


@pytest.mark.kernel
@pytest.mark.parametrize("ending, cells", [
    ("succeeded", ["import nbbatch; nbbatch.record(accuracy=0.5 + A / 10)"]),
    ("failed", ["assert A != 2, 'A is 2'"]),
    ("cancelled", [WAIT_FOR_RELEASE]),
])
def test_an_experiment_notifies_both_when_it_ends_and_no_secret_lands_anywhere(project, write_experiment, webhook,
                                                                              smtp, secrets_in_env, ending, cells,
                                                                              capsys):
    make_notebook(project / "nb.ipynb", cells, parameters="A = 1")
    exp = write_experiment(f"experiment: tiny\nnotebooks: [nb.ipynb]\nsweep: {{grid: {{A: [1, 2]}}}}\n"
                           f"notify: {json.dumps(secrets_in_env)}\n")
    if ending == "cancelled":
        box: dict = {}
        thread = threading.Thread(target=lambda: box.setdefault("result", submit(exp, progress=False)))
        thread.start()
        wait_until(lambda: "running" in _statuses("tiny"), 60, "a run of tiny running")
        assert nbbatch.cancel("tiny")
        thread.join(60)
        result = box["result"]
    else:
        result = submit(exp, progress=False)
    assert {r.status for r in result.records} == ({"succeeded", "failed"} if ending == "failed" else {ending})
    assert not [w for w in result.warnings if w.startswith("notify:")], result.warnings
    [(_, _, body)] = webhook.received
    [(_, _, mail)] = smtp.mails
    assert body["status"] == ending and body["name"] == "tiny" and sum(body["counts"].values()) == 2
    assert mail["Subject"].startswith(f"nbbatch: experiment tiny {ending} (")
    if ending == "failed":
        assert "AssertionError: A is 2" in body["text"] and "AssertionError: A is 2" in _body(mail)
    leaks = (webhook.secret, smtp.password)
    assert _files_holding(project, *leaks) == [], "no file nbbatch wrote holds a secret"
    out = capsys.readouterr()
    assert not any(s in out.out + out.err + json.dumps(result.warnings) for s in leaks)


def _statuses(name: str) -> set[str]:
    try:
        return {str(r.status) for r in nbbatch.status(name, refresh=False)}
    except nbbatch.NbbatchError:  # no run record yet
        return set()


def _body(mail: Message) -> str:
    return mail.get_payload(decode=True).decode()


@pytest.mark.kernel
@pytest.mark.timeout(600)
def test_a_pipeline_notifies_once_when_it_ends_naming_its_blocked_stage(project, webhook, smtp, secrets_in_env):
    make_notebook(project / "a.ipynb", ["import nbbatch\nassert A < 2, 'A is 2'\nnbbatch.record(score=A)"],
                  parameters="A = 1")
    make_notebook(project / "b.ipynb", ["print(A)"], parameters="A = 1")
    path = project / "p.yaml"
    path.write_text(json.dumps({
        "pipeline": "chain", "share": "results", "notify": secrets_in_env,
        "stages": {"first": {"notebooks": [{"path": "a.ipynb", "kernel": "python3"}], "sweep": {"grid": {"A": [1, 2]}},
                             "select": {"metric": "score", "mode": "max"}},
                   "then": {"notebooks": [{"path": "b.ipynb", "kernel": "python3"}],
                            "parameters": {"A": "${first.best.parameters.A}"}}}}))
    result = nbbatch.api.submit_pipeline(path, progress=False)
    assert result.state == "failed" and result.stages["then"].state == "blocked"
    assert not [w for w in result.warnings if "notify" in w], result.warnings
    [(_, _, body)] = webhook.received  # one message for the pipeline, none per stage
    [(_, _, mail)] = smtp.mails
    assert body["kind"] == "pipeline" and body["name"] == "chain" and body["status"] == "failed"
    assert any(line.startswith("stage then blocked: stage `first` failed") for line in body["lines"]), body["lines"]
    assert mail["Subject"].startswith("nbbatch: pipeline chain failed (1/2 runs succeeded; 1 failed)")
    assert nbbatch.api.submit_pipeline(path, progress=False).state == "failed"
    assert len(webhook.received) == 2  # the failed run ran again, so the pipeline ended again: told again
