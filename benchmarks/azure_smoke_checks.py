"""The probes of ``make azure-smoke`` and their thresholds: what the live driver (``azure_smoke.py``) observed in, out.

Offline and free of Azure: the probe notebook's cells, the experiments, the cost estimate, and :func:`evaluate`, which
turns what was observed (:class:`Observations`) into one row per question with a verdict (``pass``, ``FAIL``, or
``skip`` where the service gave no occasion to ask). :func:`exit_code` is 1 when any row failed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ONE_NODE, NAMES, TWO_NODES = "azure-probe", "azure-probe-names", "azure-probe-2node"
ONE_NODE_CLUSTER, TWO_NODE_CLUSTER = "nbbatch-probe", "nbbatch-probe2"
WAITING_FILE, MARKER_FILE, NODE1_FILE, BIG_FILE = "probe-waiting", "driver-marker", "from-node-1", "big.bin"
INPUT_FILE, INPUT_TEXT = "probe.txt", "read through a read-only mount: é ü 中"
PLAIN_INPUT, ODD_FOLDER = "smoke-input", "smoke probe é ü"  # the second: a space and non-ASCII characters
LOG_LINE = "nbbatch-smoke log line at "
BIG_FILE_BYTES = 2 << 30
BIG_BLOCK = 64 << 20
LIMIT_PROBE_S = 300  # the time limit of the raw job queued behind the one-node run (what limits.timeout counts)
HOLD_S = LIMIT_PROBE_S + 600  # the one-node run keeps its node at least this long: the limit probe queues longer
MARKER_WITHIN_S = 60.0  # the job sees the driver's cancel marker within this (the mount's attribute cache: 5 s)
LOG_WITHIN_S = 30.0  # a line the run logs is on the share within this, while the run goes
NODE_WITHIN_S = 60.0  # a file one node writes to the share is seen on the other within this
CANCEL_WITHIN_S = 300.0  # a running job the driver cancelled is Canceled within this
# list prices, pay-as-you-go, US regions, US$ per node-hour (docs/azure.md "GPU VM sizes"): an order of magnitude
PRICE_PER_HOUR = {"Standard_NC4as_T4_v3": 0.53, "Standard_NC8as_T4_v3": 0.75, "Standard_NC16as_T4_v3": 1.2,
                  "Standard_NC64as_T4_v3": 4.35, "Standard_NC24ads_A100_v4": 3.67}
VCPUS = {"Standard_NC4as_T4_v3": 4, "Standard_NC8as_T4_v3": 8, "Standard_NC16as_T4_v3": 16,
         "Standard_NC64as_T4_v3": 64, "Standard_NC24ads_A100_v4": 24}
# node-minutes, first run (image build, node allocation, the holds below, scale-down idle 5 min): one node, then two
PHASE_NODE_MINUTES = ((1, 45), (2, 20))

PROBE_PARAMETERS = ("MARKER_WAIT_S = 900\nNODE_WAIT_S = 600\nLOG_WAIT_S = 0\nHOLD_S = 0\nBIG_FILE_BYTES = 0\n"
                    "PROBE_INPUT = ''")
# The probe notebook's cells. `import torch` makes it a PyTorch notebook (its image and kernel) where the project
# has that framework; elsewhere (the tests) it runs in the notebook's own kernel. Only names, numbers and yes/no are
# recorded, never a variable's value.
PROBE_CELLS = [
    """\
import errno, getpass, os, shutil, subprocess, time
from pathlib import Path
import nbbatch
from nbbatch.artifacts import output_dir
try:
    import torch  # noqa: F401  (only so that the notebook is recognised as a PyTorch one)
except ImportError:
    pass
started = time.time()
out = output_dir()
rank = int(os.environ.get("NBBATCH_RANK", "0"))
world = int(os.environ.get("NBBATCH_WORLD_SIZE", "1"))""",
    """\
def attempt(step):
    try:
        return step()
    except OSError as exc:
        return f"error: {errno.errorcode.get(exc.errno, exc.errno)} {exc.strerror}"

def rename_over():
    (out / "a.tmp").write_bytes(b"new"); (out / "a").write_bytes(b"old")
    os.rename(out / "a.tmp", out / "a")
    return "replaces an existing file" if (out / "a").read_bytes() == b"new" else "kept the old file"

def exclusive():
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
    os.close(os.open(out / "excl", flags))
    try:
        os.close(os.open(out / "excl", flags))
    except FileExistsError:
        return "second create refused (EEXIST)"
    return "second create succeeded: O_EXCL not honoured"

def pwrite():
    fd = os.open(out / "pw", os.O_CREAT | os.O_RDWR | os.O_TRUNC)
    try:
        os.pwrite(fd, b"0123456789", 0); os.pwrite(fd, b"AB", 4)
        return "in place" if os.pread(fd, 10, 0) == b"0123AB6789" else f"wrong bytes {os.pread(fd, 10, 0)!r}"
    finally:
        os.close(fd)

def uv():
    found = shutil.which("uv")
    if not found:
        return "not on PATH"
    done = subprocess.run([found, "--version"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[:200]}"

if rank == 0:
    nbbatch.record(rename=attempt(rename_over), o_excl=attempt(exclusive), pwrite=attempt(pwrite), uv=attempt(uv),
                   user=getpass.getuser(), uid=os.getuid(), home=os.environ.get("HOME", "(unset)"),
                   mlflow_uri_in_kernel="MLFLOW_TRACKING_URI" in os.environ,
                   run_token_in_kernel="AZUREML_RUN_TOKEN" in os.environ)""",
    """\
def read_only(folder):
    try:
        (folder / "written-by-the-job").write_text("x")
    except OSError as exc:
        return f"refused: {errno.errorcode.get(exc.errno, exc.errno)}"
    return "written: the input mount is not read-only"

if rank == 0 and PROBE_INPUT:
    nbbatch.record(input_text=attempt(lambda: (Path(PROBE_INPUT) / "probe.txt").read_text(encoding="utf-8")),
                   input_write=read_only(Path(PROBE_INPUT)))""",
    """\
if rank == 0 and LOG_WAIT_S:
    print(f"nbbatch-smoke log line at {time.time():.3f}", flush=True)  # the driver times its arrival on the share
    time.sleep(LOG_WAIT_S)""",
    """\
def wait_for(path, limit):
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if path.exists():
            return round(time.monotonic() - start, 1)
        time.sleep(2)
    return -1.0

if world > 1:
    if rank == 1:
        (out / "from-node-1").write_text("written on node 1")
    elif rank == 0:
        nbbatch.record(node1_file_on_node0_s=wait_for(out / "from-node-1", NODE_WAIT_S))
elif rank == 0 and MARKER_WAIT_S:
    (out / "probe-waiting").write_text("waiting for the driver's marker")
    nbbatch.record(driver_marker_s=wait_for(out / "driver-marker", MARKER_WAIT_S))""",
    """\
if rank == 0:
    time.sleep(max(0.0, HOLD_S - (time.time() - started)))  # the limit probe waits behind this run
if rank == 0 and BIG_FILE_BYTES:  # the run's last act: a large output the runner must see flushed before it ends
    began, block = time.monotonic(), 64 << 20
    with open(out / "big.bin", "wb") as handle:
        for index, start in enumerate(range(0, BIG_FILE_BYTES, block)):
            handle.write(bytes([index % 251]) * min(block, BIG_FILE_BYTES - start))
    nbbatch.record(big_file_write_s=round(time.monotonic() - began, 1))""",
]


def big_file_tail(size: int, count: int) -> bytes:
    """The last ``count`` bytes of the probe's big file of ``size`` bytes (64 MiB blocks, block i all ``i % 251``)."""
    tail = bytearray()
    for offset in range(size - count, size):
        tail.append((offset // BIG_BLOCK) % 251)
    return bytes(tail)


def smoke_experiments(share: str, vm_size: str, notebook: str) -> dict[str, dict[str, Any]]:
    """The three experiments (as experiment-file dicts): two on a one-node cluster, one on a two-node cluster.

    ``share`` is ``azfiles://account/share/folder``: the one-node runs use it and an input beside it; the names run a
    folder of it with a space and non-ASCII characters (its share and its input); the 2-node MPI run the share's root.
    """
    backend = {"name": "azureml", "vm_size": vm_size, "min_nodes": 0, "idle_time_before_scale_down": 300}
    one_node = {**backend, "compute": ONE_NODE_CLUSTER, "max_nodes": 1}
    root = "/".join(share.split("/")[:4])
    return {
        ONE_NODE: {"experiment": ONE_NODE, "notebooks": [notebook], "resources": {"gpus": 1}, "tracking": "mlflow",
                   "timeout": {"run": 2700}, "share": share, "inputs": {"PROBE_INPUT": f"{share}/{PLAIN_INPUT}"},
                   "parameters": {"LOG_WAIT_S": 120, "HOLD_S": HOLD_S, "BIG_FILE_BYTES": BIG_FILE_BYTES},
                   "backend": one_node},
        NAMES: {"experiment": NAMES, "notebooks": [notebook], "resources": {"gpus": 1}, "timeout": {"run": 1800},
                "share": f"{share}/{ODD_FOLDER}", "inputs": {"PROBE_INPUT": f"{share}/{ODD_FOLDER}/{PLAIN_INPUT}"},
                "parameters": {"MARKER_WAIT_S": 0}, "backend": one_node},
        TWO_NODES: {"experiment": TWO_NODES, "notebooks": [notebook], "distribution": {"type": "mpi"},
                    "resources": {"nodes": 2, "processes_per_node": 1, "gpus_per_node": 1},
                    "timeout": {"run": 2700}, "share": root,
                    "backend": {**backend, "compute": TWO_NODE_CLUSTER, "max_nodes": 2}},
    }


def cost_estimate(vm_size: str) -> str:
    """What the smoke test bills, in one paragraph (printed before anything is created)."""
    node_minutes = sum(nodes * minutes for nodes, minutes in PHASE_NODE_MINUTES)
    price = PRICE_PER_HOUR.get(vm_size)
    money = (f"about US${node_minutes / 60 * price:.2f} at US${price:.2f} per node-hour (pay-as-you-go list price, "
             "US regions; check yours)" if price else "price unknown for this size (see the Azure pricing calculator)")
    peak = max(nodes for nodes, _ in PHASE_NODE_MINUTES)
    vcpus = f"{peak * VCPUS[vm_size]} vCPUs" if vm_size in VCPUS else f"{peak} nodes' vCPUs"
    return (f"azure-smoke cost estimate: about {node_minutes} node-minutes of {vm_size} on the probes' clusters, "
            f"{money}, plus `make azure-smoke`'s own one-node run (~15 min) and a little storage. The one-node "
            f"and two-node clusters run one after the other, so at most {peak} nodes ({vcpus} of the VM family's "
            "quota) at once; a default T4 quota may hold fewer: check it first (docs/azure.md, GPU quota)")


@dataclass
class Observations:
    """What the live driver saw: the runs' records by experiment, and what it measured itself."""

    records: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)  # experiment -> why nbbatch refused to submit it
    log_delay_s: float | None = None  # a logged line's arrival on the share, seen while the run went
    big_file: str | None = None  # "ok", or what was wrong with the big file on the share
    limit_probe: str | None = None  # the raw job's last status (Completed, Failed, Canceled …)
    limit_probe_queued_s: float | None = None  # how long it waited before it was seen to start or end
    setup_s: float | None = None  # the one-node job: from its creation to its runner's start (queue, image build)
    cancel: Mapping[str, str] = field(default_factory=dict)  # running | finalizing | finished -> the answer


@dataclass(frozen=True)
class Row:
    question: str
    answer: str
    threshold: str
    verdict: str  # pass | FAIL | skip


def _metric(obs: Observations, experiment: str, name: str) -> tuple[Any, str | None]:
    """``(value, None)``, or ``(None, why there is none)``."""
    if experiment in obs.refused:
        return None, f"refused by nbbatch before submitting: {obs.refused[experiment]}"
    runs = obs.records.get(experiment) or []
    if not runs:
        return None, "no answer: the run never started"
    record = runs[0]
    value = (record.metrics or {}).get(name)
    if value is None:
        return None, f"no answer ({record.error.summary() if record.error else record.status})"
    return value, None


Verdict = tuple[str, bool | None]  # (answer, passed; None: skipped)


def _equals(experiment: str, name: str, wanted: Any) -> Callable[[Observations], Verdict]:
    def check(obs: Observations) -> Verdict:
        value, why = _metric(obs, experiment, name)
        return (why, False) if why else (_shown(value), value == wanted)
    return check


def _within(experiment: str, name: str, limit: float) -> Callable[[Observations], Verdict]:
    def check(obs: Observations) -> Verdict:
        value, why = _metric(obs, experiment, name)
        if why:
            return why, False
        return ("not seen" if value < 0 else f"after {value:g} s"), 0 <= value <= limit
    return check


def _succeeded(experiment: str, then: str, wanted: Any = None) -> Callable[[Observations], Verdict]:
    """The run succeeded and recorded ``then`` (equal to ``wanted`` unless None); skipped when nbbatch refused the
    experiment offline (a name its rules refuse never reaches Azure ML: nothing to ask live)."""
    def check(obs: Observations) -> Verdict:
        value, why = _metric(obs, experiment, then)
        if experiment in obs.refused:
            return why or "", None
        runs = obs.records.get(experiment) or []
        status = str(runs[0].status) if runs else "never started"
        ok = status == "succeeded" and why is None and (wanted is None or value == wanted)
        return (f"run {status}" + (f", {why}" if why else f", {then}: {_shown(value)}")), ok
    return check


def _shown(value: Any) -> str:
    return "yes" if value is True else "no" if value is False else str(value)


def _starts(experiment: str, name: str, wanted: str) -> Callable[[Observations], Verdict]:
    def check(obs: Observations) -> Verdict:
        value, why = _metric(obs, experiment, name)
        return (why, False) if why else (_shown(value), str(value).startswith(wanted))
    return check


def _log_delay(obs: Observations) -> Verdict:
    if obs.log_delay_s is None:
        return "not seen on the share while the run went (only at its end, or never)", False
    return f"after {obs.log_delay_s:.0f} s", obs.log_delay_s <= LOG_WITHIN_S


def _big_file(obs: Observations) -> Verdict:
    if obs.big_file is None:
        return "not checked: the one-node run never ended", False
    return obs.big_file, obs.big_file == "ok"


def _user(obs: Observations) -> Verdict:
    uid, why = _metric(obs, ONE_NODE, "uid")
    if why:
        return why, False
    user = (obs.records[ONE_NODE][0].metrics or {}).get("user")
    if uid == 0:
        return f"{user} (uid 0)", True
    proven = [check(obs)[1] for _, _, check in CHECKS[:3]] + [_succeeded(TWO_NODES, "node1_file_on_node0_s")(obs)[1]]
    return f"{user} (uid {uid}): " + ("the mount and MPI work as this user" if all(proven) else
                                     "not root, and the mount or MPI failed"), all(proven)


def _limit(obs: Observations) -> Verdict:
    status, queued = obs.limit_probe, obs.limit_probe_queued_s
    if status is None:
        return "not measured: the probe job was never created or never ended", False
    waited = f"queued {queued:.0f} s" if queued is not None else "queue time unknown"
    if status == "Completed":
        if queued is None or queued <= LIMIT_PROBE_S:
            return f"completed, but {waited}, not past its {LIMIT_PROBE_S} s limit: inconclusive", None
        return f"the running time only: completed after being {waited}, past its {LIMIT_PROBE_S} s limit", True
    return f"queueing too: the job ended {status} ({waited}, limit {LIMIT_PROBE_S} s); see the next row", True


def _setup_margin(margin_s: float) -> Callable[[Observations], Verdict]:
    def check(obs: Observations) -> Verdict:
        if obs.setup_s is None:
            return "not measured: the one-node run never started", False
        return f"{obs.setup_s:.0f} s from the job's creation to its runner's start", obs.setup_s <= margin_s
    return check


def _cancel(state: str, wanted: str) -> Callable[[Observations], Verdict]:
    def check(obs: Observations) -> Verdict:
        answer = obs.cancel.get(state)
        if answer is None:
            return f"not asked: no job was seen {state}", None if state == "finalizing" else False
        return answer, answer.startswith(wanted)
    return check


def _preemption(obs: Observations) -> Verdict:
    lost = [f"{r.run_id} attempt {e.attempt}" for rs in obs.records.values() for r in rs
            for e in r.attempt_log if e.status == "lost"]
    if not lost:
        return "not observed (it cannot be provoked from here)", None
    return f"observed: {', '.join(lost)} lost", True


# (question, threshold, check): in the order the table shows them
CHECKS: list[tuple[str, str, Callable[[Observations], Verdict]]] = [
    ("rename over an existing file on the rw_mount", "replaces it", _equals(ONE_NODE, "rename", "replaces an existing file")),
    ("O_CREAT|O_EXCL on the rw_mount", "EEXIST", _equals(ONE_NODE, "o_excl", "second create refused (EEXIST)")),
    ("pwrite at an offset on the rw_mount", "in place", _equals(ONE_NODE, "pwrite", "in place")),
    ("the driver's cancel marker seen in the job", f"<= {MARKER_WITHIN_S:g} s",
     _within(ONE_NODE, "driver_marker_s", MARKER_WITHIN_S)),
    ("a logged line on the share while the run goes", f"<= {LOG_WITHIN_S:g} s", _log_delay),
    ("a 2 GiB output written at the run's end", "whole on the share", _big_file),
    ("a read-only input mount", "write refused", _starts(ONE_NODE, "input_write", "refused")),
    ("the share's root mounted (paths/./), 2-node MPI job", "succeeded", _succeeded(TWO_NODES, "node1_file_on_node0_s")),
    ("a file written on node 1 seen on node 0", f"<= {NODE_WITHIN_S:g} s",
     _within(TWO_NODES, "node1_file_on_node0_s", NODE_WITHIN_S)),
    (f"a folder named `{ODD_FOLDER}` (share and input)", "succeeded, input read", _succeeded(NAMES, "input_text", INPUT_TEXT)),
    ("the job's user", "root, or mount and MPI work", _user),
    ("`uv --version` in the built image", "runs", _starts(ONE_NODE, "uv", "uv ")),
    ("MLflow's URI reaches a kernel with `tracking: mlflow`", "yes", _equals(ONE_NODE, "mlflow_uri_in_kernel", True)),
    ("the run token reaches a kernel with `tracking: mlflow`", "yes", _equals(ONE_NODE, "run_token_in_kernel", True)),
    ("the run token reaches a kernel without `tracking:`", "no", _equals(TWO_NODES, "run_token_in_kernel", False)),
    ("what limits.timeout counts", "measured", _limit),
    ("cancelling a running job", "accepted", _cancel("running", "accepted")),
    ("cancelling a finalizing job", "refused (jobs.ENDED)", _cancel("finalizing", "refused")),
    ("cancelling a finished job", "refused (jobs.ENDED)", _cancel("finished", "refused")),
    ("a low-priority preemption", "informative", _preemption),
]


def evaluate(obs: Observations, margin_s: float) -> list[Row]:
    """One row per question: the live answer, its threshold and the verdict (``margin_s``: the job time limit's
    room for queueing and an image build, ``rules.QUEUE_AND_BUILD_SLACK_S``)."""
    checks = [*CHECKS]
    at = next(i for i, (question, _, _) in enumerate(checks) if question == "what limits.timeout counts") + 1
    checks.insert(at, ("queue and image build before the run started", f"<= {margin_s:g} s (the limit's margin)",
                       _setup_margin(margin_s)))
    rows = []
    for question, threshold, check in checks:
        answer, passed = check(obs)
        rows.append(Row(question, answer, threshold, "skip" if passed is None else "pass" if passed else "FAIL"))
    return rows


def exit_code(rows: Sequence[Row]) -> int:
    """1 when any row failed, else 0 (a skipped row is no failure: the service gave no occasion to ask)."""
    return 1 if any(row.verdict == "FAIL" for row in rows) else 0


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a table, with a last line counting the verdicts."""
    widths = [max(len(getattr(r, f)) for r in [Row("question", "live answer", "threshold", "verdict"), *rows])
              for f in ("verdict", "question", "threshold")]
    head = ["verdict".ljust(widths[0]), "question".ljust(widths[1]), "threshold".ljust(widths[2]), "live answer"]
    lines = [" | ".join(head), "-+-".join("-" * w for w in [*widths, 40])]
    lines += [" | ".join([r.verdict.ljust(widths[0]), r.question.ljust(widths[1]), r.threshold.ljust(widths[2]),
                          r.answer]) for r in rows]
    counts = {v: sum(r.verdict == v for r in rows) for v in ("pass", "FAIL", "skip")}
    lines.append(f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped")
    return "\n".join(lines)
