"""A real Slurm cluster on this machine for the tests: munged, slurmctld and two slurmd daemons (node1, node2).

Everything lives in one folder (config, munge key, state, logs) and a short-named runtime folder in the temp dir
(sockets, pid files, the nodes' spool: munged wants every folder above its socket open to all, and Unix socket paths
are short), and the daemons listen on free ports of their own, so a test never meets another Slurm here. The
daemons run in the foreground as children of the test process (``-D``/``--foreground``), with ``SLURM_CONF`` passed
in their environment only: whoever uses the cluster passes ``cluster.env`` (or sets it for the session, as the
``slurm_cluster`` fixture does). ``stop()`` runs at exit too, should the test session end without it.

Choices worth knowing:
- ``MinJobAge=300`` (Slurm's default, what real clusters have): a finished job stays in slurmctld's memory, so
  ``squeue``/``scontrol show job`` still report its final state and exit code for five minutes. There is no
  accounting (``sacct`` does not work), as on many small clusters; ``jobcomp/filetxt`` records each finished job in
  ``<folder>/log/jobcomp.txt``.
- Each node has ``CPUs=2``, a third of this machine's memory (at most 8000 MB) and ``Gres=gpu:2`` backed by two
  character devices made here (like /dev/null), so jobs that ask for GPUs get ``CUDA_VISIBLE_DEVICES``.
  ``SlurmdParameters=config_overrides`` lets the nodes claim that on a smaller machine.
- The daemons listen on loopback only where this host's name resolves to a loopback address (127.0.0.1 here,
  127.0.1.1 on a stock Debian): Slurm's ``NoInAddrAny`` binds to what the host name resolves to, never to a
  chosen address. Elsewhere they listen on every address, and are reached at 127.0.0.1.
"""

from __future__ import annotations

import atexit
import getpass
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from support.processes import gone

NODES = ("node1", "node2")
PROTOTYPE_PORTS = frozenset({16817, 16818, 16821, 16822})  # a hand-made cluster on the dev machine: never meet it
REQUIRED_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel")
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                          "BOOT_FAIL", "DEADLINE"})
STOP_GRACE = 10.0  # seconds a daemon gets to exit after SIGTERM before SIGKILL


def slurm_available() -> str | None:
    """Why a Slurm cluster cannot be started here, or None when it can (root, Debian's slurm and munge)."""
    if os.geteuid() != 0:
        return "starting a Slurm cluster needs root (slurmd runs jobs as their users)"
    missing = [name for name in REQUIRED_BINARIES if shutil.which(name) is None]
    if missing:
        return f"Slurm or munge is not installed ({', '.join(missing)} missing): apt-get install slurmctld slurmd " \
               "slurm-client munge"
    return None


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 right now (bind and release; the kernel's ephemeral range)."""
    sockets, ports = [], []
    try:
        while len(ports) < count:
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probe.bind(("127.0.0.1", 0))
            sockets.append(probe)
            port = probe.getsockname()[1]
            if port not in PROTOTYPE_PORTS:
                ports.append(port)
    finally:
        for probe in sockets:
            probe.close()
    return ports


def _node_memory_mb() -> int:
    """A third of this machine's memory in MB, at most 8000: two nodes fit with room for the rest."""
    total_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1024 * 1024)
    return max(512, min(8000, total_mb // 3))


def _loopback_address(hostname: str) -> str | None:
    """What ``hostname`` resolves to when that is a loopback address (so the daemons can bind to it), else None."""
    try:
        address = socket.gethostbyname(hostname)
    except OSError:
        return None
    return address if address.startswith("127.") else None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class SlurmCluster:
    """A two-node Slurm cluster in ``folder``: ``start()`` it, submit with ``run("sbatch", ...)``, ``stop()`` it."""

    def __init__(self, folder: Path, extra_config: str = "") -> None:
        """``extra_config``: more slurm.conf lines (``"EnforcePartLimits=ALL"``), after the cluster's own settings."""
        self.folder = Path(folder)
        self.extra_config = extra_config
        self.hostname = socket.gethostname().split(".")[0]
        bind_address = _loopback_address(socket.gethostname())
        self.address = bind_address or "127.0.0.1"
        self._communication = "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny\n" if bind_address else ""
        self.conf = self.folder / "slurm.conf"
        self.log_dir = self.folder / "log"
        self.run_dir = Path(tempfile.mkdtemp(prefix="nbslurm-"))  # removed by stop()
        self.run_dir.chmod(0o755)
        atexit.register(self.stop)
        self.jobcomp = self.log_dir / "jobcomp.txt"
        self._daemons: dict[str, subprocess.Popen] = {}  # "munged", "slurmctld", "slurmd-node1", ...
        self._stopped = False
        self.ctld_port, *node_ports = _free_ports(1 + len(NODES))
        self.node_ports = dict(zip(NODES, node_ports, strict=True))

    @property
    def env(self) -> dict[str, str]:
        """The variables that point Slurm's commands at this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def daemon_env(self) -> dict[str, str]:
        """This process's environment with this cluster's SLURM_CONF and no other Slurm's variables."""
        env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
        return env | self.env

    def run(self, *cmd: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command (``run("sbatch", "--wrap", "true")``) against this cluster; text output captured."""
        done = subprocess.run(list(cmd), env=self.daemon_env(), capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def sbatch(self, *args: str) -> str:
        """Submit with ``sbatch --parsable`` and return the job id (``"12"``; an array's is its array job id)."""
        return self.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o``'s fields of one job or array task (``JobState``, ``ExitCode``, ``Reason``...);
        finished jobs stay there for MinJobAge (300 s)."""
        line = self.run("scontrol", "show", "job", "-o", job_id).stdout.splitlines()[0]
        return dict(field.split("=", 1) for field in line.split() if "=" in field)

    def wait_job_done(self, job_id: str, timeout: float = 60.0) -> dict[str, str]:
        """Wait until the job has ended (any final state) and return its ``job()`` fields."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in FINAL_STATES:
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"Slurm job {job_id} not done within {timeout:g} s: {fields}")
            time.sleep(0.1)

    # --- start -----------------------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Write the config, start every daemon and wait until both nodes are idle."""
        for sub in ("log", "state", "dev"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        for node in NODES:
            (self.run_dir / "spool" / node).mkdir(parents=True, exist_ok=True)
        self._write_config()
        self._start_munged()
        self._spawn("slurmctld", ["slurmctld", "-D"])
        for node in NODES:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node])
        self.wait_nodes_idle(timeout)
        return self

    def _write_config(self) -> None:
        folder = self.folder
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for index in range(2):  # GPUs Slurm can hand out: character devices like /dev/null
            device = folder / "dev" / f"nvidia{index}"
            if not device.exists():
                os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        (folder / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName=node[1-{len(NODES)}] Name=gpu File={folder}/dev/nvidia[0-1]\n")
        memory = _node_memory_mb()
        nodes = "\n".join(
            f"NodeName={node} NodeHostname={self.hostname} NodeAddr={self.address} Port={port} CPUs=2 "
            f"RealMemory={memory} Gres=gpu:2 State=UNKNOWN" for node, port in self.node_ports.items())
        node_list = ",".join(NODES)
        self.conf.write_text(f"""\
ClusterName=nbbatchtest
SlurmctldHost={self.hostname}({self.address})
SlurmctldPort={self.ctld_port}
SlurmdPort={self.node_ports[NODES[0]]}
{self._communication}AuthType=auth/munge
AuthInfo=socket={self.run_dir}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={self.run_dir}/spool/%n
SlurmctldPidFile={self.run_dir}/slurmctld.pid
SlurmdPidFile={self.run_dir}/slurmd-%n.pid
SlurmctldLogFile={self.log_dir}/slurmctld.log
SlurmdLogFile={self.log_dir}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=256
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp}
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
GresTypes=gpu
{nodes}
PartitionName=debug Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes={node_list} Default=NO MaxTime=60 State=UP
{self.extra_config}
""")

    def _start_munged(self) -> None:
        run = self.run_dir
        self._spawn("munged", ["munged", "--foreground", f"--socket={run}/munge.socket",
                               f"--key-file={self.folder}/munge.key", f"--pid-file={run}/munged.pid",
                               f"--log-file={self.log_dir}/munged.log", f"--seed-file={run}/munge.seed"])
        deadline = time.monotonic() + 15
        while not (run / "munge.socket").exists():
            if self._daemons["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self._log_tails()}")
            time.sleep(0.05)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        with open(self.log_dir / f"{name}.out", "ab") as output:  # the daemon's own stdout/stderr
            self._daemons[name] = subprocess.Popen(cmd, env=self.daemon_env(), stdin=subprocess.DEVNULL,
                                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True)

    def node_states(self) -> dict[str, tuple[str, str]]:
        """Each node's state (``idle``, ``mixed``, ``down*``...) and reason, as sinfo shows them."""
        done = self.run("sinfo", "-h", "-N", "-o", "%N|%T|%E", check=False, timeout=30)
        states = {}
        for line in done.stdout.splitlines():
            node, state, reason = (line.split("|", 2) + ["", ""])[:3]
            states[node] = (state, reason)
        return states

    def wait_nodes_idle(self, timeout: float = 60.0, nodes: Sequence[str] = NODES) -> None:
        """Wait until ``nodes`` are idle; raise with the node reasons and the daemons' log tails after ``timeout``."""
        deadline = time.monotonic() + timeout
        states: dict[str, tuple[str, str]] = {}
        while time.monotonic() < deadline:
            dead = [name for name, process in self._daemons.items() if process.poll() is not None
                    and (name == "munged" or name == "slurmctld" or name.removeprefix("slurmd-") in nodes)]
            if dead:
                break
            states = self.node_states()
            if all(states.get(node, ("",))[0] == "idle" for node in nodes):
                return
            time.sleep(0.2)
        else:
            dead = []
        shown = ", ".join(f"{node}: {state} ({reason or 'no reason'})" for node, (state, reason) in states.items())
        raise RuntimeError(f"Slurm nodes not idle within {timeout:g} s (dead daemons: {dead or 'none'}; nodes: "
                           f"{shown or 'sinfo answered nothing'}):\n{self._log_tails()}")

    def clear(self, timeout: float = 120.0) -> None:
        """Cancel the jobs an earlier test left (one that returned once its jobs were queued) and wait for idle nodes:
        under pytest-xdist the session's Slurm tests run one after another in one worker, from several files."""
        self._cancel_all_jobs()
        self.wait_nodes_idle(timeout)

    def _log_tails(self) -> str:
        logs = sorted(self.log_dir.glob("*.log")) + sorted(self.log_dir.glob("*.out"))
        return "\n".join(f"--- {path.name}\n{_tail(path)}" for path in logs)

    # --- nodes -----------------------------------------------------------------------------------------------

    def node_pid(self, node: str) -> int:
        """The pid of ``node``'s slurmd, from its pid file."""
        return int((self.run_dir / f"slurmd-{node}.pid").read_text().split()[0])

    def kill_node(self, node: str, steps: bool = True) -> None:
        """SIGKILL ``node``'s slurmd: a node daemon dying mid-run. With ``steps``, its job steps (slurmstepd and the
        jobs' processes) die too, as when the node itself goes; without, they run on and report to slurmctld."""
        pid = self.node_pid(node)
        doomed = {pid} | (set(self._step_pids(node)) if steps else set())
        _kill_pids(doomed)
        process = self._daemons.get(f"slurmd-{node}")
        if process is not None and process.pid == pid:
            process.wait(timeout=STOP_GRACE)

    def restart_node(self, node: str, timeout: float = 180.0) -> None:
        """Start ``node``'s slurmd again (after ``kill_node``) and wait until it has registered and is idle. A slurmd
        that exits at once (on a loaded machine the killed one may still hold its port) is started again."""
        process = self._daemons.get(f"slurmd-{node}")
        if process is not None and process.poll() is None:
            _stop_process(process)
        started_before = self._node_field(node, "SlurmdStartTime")
        # SlurmdStartTime is to the second: a slurmd started again within the second the killed one started in (a
        # node killed just after the cluster started) would look unregistered for good
        time.sleep(1.1)
        self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node])
        deadline = time.monotonic() + timeout
        while self._node_field(node, "SlurmdStartTime") == started_before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"slurmd of {node} did not register again:\n{self._log_tails()}")
            if self._daemons[f"slurmd-{node}"].poll() is not None:
                time.sleep(1.0)
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node])
            time.sleep(0.1)
        self.wait_nodes_idle(max(1.0, deadline - time.monotonic()), nodes=(node,))

    def _node_field(self, node: str, field: str) -> str:
        shown = self.run("scontrol", "show", "node", "-o", node, check=False).stdout
        return next((item.split("=", 1)[1] for item in shown.split() if item.startswith(f"{field}=")), "")

    def _step_pids(self, node: str | None = None) -> list[int]:
        """The job steps (slurmstepd, known by the node log they write to) of ``node`` or of every node, and all
        their processes."""
        import psutil  # the test extra

        logs = {self.log_dir / f"slurmd-{name}.log" for name in ([node] if node else NODES)}
        found: set[int] = set()
        for process in psutil.process_iter(["cmdline"]):
            try:
                if (process.info["cmdline"] or [""])[0].startswith("slurmstepd") \
                        and any(Path(file.path) in logs for file in process.open_files()):
                    found.add(process.pid)
                    found.update(child.pid for child in process.children(recursive=True))
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return sorted(found)

    # --- stop ------------------------------------------------------------------------------------------------

    def pids(self) -> list[int]:
        """Every process of this cluster still alive: the daemons and their children, the job steps and the jobs'
        processes (those left by a killed step too: SLURM_JOB_ID and this cluster's SLURM_CONF)."""
        import psutil  # the test extra

        found = {process.pid for process in self._daemons.values() if process.poll() is None}
        found.update(self._step_pids())
        for process in psutil.process_iter():
            try:
                if process.pid in found:
                    found.update(child.pid for child in process.children(recursive=True))
                elif process.pid != os.getpid() and process.status() != psutil.STATUS_ZOMBIE:
                    environ = process.environ()
                    if environ.get("SLURM_CONF") == str(self.conf) and "SLURM_JOB_ID" in environ:
                        found.add(process.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return sorted(pid for pid in found if not gone(pid))

    def stop(self) -> None:
        """Cancel every job, stop the daemons (SIGTERM, SIGKILL after 10 s) and kill any job step left. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        ctld = self._daemons.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            self._cancel_all_jobs()
        leftovers = set(self.pids())
        for name in sorted(self._daemons, key=lambda name: ("slurmd" not in name, name == "munged")):
            _stop_process(self._daemons[name])  # the nodes first, then slurmctld, munged last
        leftovers.update(self.pids())
        _kill_pids(leftovers)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _cancel_all_jobs(self) -> None:
        self.run("scancel", f"--user={getpass.getuser()}", check=False, timeout=30)
        deadline = time.monotonic() + STOP_GRACE
        while time.monotonic() < deadline:
            active = self.run("squeue", "-h", "-t", "PD,R,CG,S", "-o", "%i", check=False, timeout=30)
            if active.returncode != 0 or not active.stdout.strip():
                return
            time.sleep(0.2)


def _stop_process(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=STOP_GRACE)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=STOP_GRACE)


def _kill_pids(pids: set[int]) -> None:
    """SIGKILL what is left of the cluster (job steps, slurmscriptd), reaping our own children."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE
    while any(not gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
