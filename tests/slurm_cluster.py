"""A real SLURM cluster for the tests: munged, slurmctld and three slurmds (node1 to node3) on 127.0.0.1.

Everything lives under one directory of the cluster's own (configuration, state, spool, logs), but for
munge's key and socket in a directory of their own under /tmp; nothing in /etc is read or written: the
daemons get `-f` and munged its paths, the clients SLURM_CONF. Slurm
22.05's daemons and srun listen on every address, so the cluster runs in a network namespace of its
own whose only interface is loopback: the daemons', the clients' and the jobs' traffic all stays on
127.0.0.1 of that namespace. The namespace has no name: a holder process keeps it until the daemons
are in, and it goes with the last process inside it.

Nothing outlives the tests: stop() (the fixture's teardown, which runs on failure too) cancels the jobs,
stops the daemons and kills what is left of the jobs. Should pytest itself be killed, the daemons die
with it (PR_SET_PDEATHSIG), and the job steps they started end with their jobs, which are bounded by
their scripts' --timeout and a few seconds of training.

    with SlurmCluster(directory) as cluster:
        cluster.run(["sbatch", "--wait", ...], cwd=..., env=cluster.env(...), timeout=...)
"""
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import BIN, PROBE, clean_env, free_port

# Debian's packages (bookworm: Slurm 22.05). libpmix-dev: Slurm's PMIx plugin opens libpmix.so, a name
# only the -dev package installs. libopenmpi3: the cluster's own MPI, built with the same PMIx as Slurm
# (the Open MPI wheel of requirements.txt does not work under srun --mpi=pmix, see test_slurm.py).
# iproute2: ip, for the loopback of the cluster's network namespace (not in Debian's minimal images).
PACKAGES = "slurm-wlm munge libpmix-dev libopenmpi3 iproute2"
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "squeue", "scontrol", "scancel",
            "nsenter", "ip")
# Jobs take two nodes; the third is the spare that a job requeued after a node's death runs on, as on a
# cluster with nodes to spare. (A dead node restarted at once, within a second of the requeue, left the
# requeued job, which keeps its id, waiting for its job step until the time limit: "Requested nodes are
# busy", twice in two tries.)
NODES = ("node1", "node2", "node3")


def unavailable():
    """Why no cluster can run here, or None."""
    if os.geteuid() != 0:
        return "a SLURM cluster of the tests' own needs root (slurmd starts jobs as their owner)"
    absent = [name for name in PROGRAMS if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed: apt-get install {PACKAGES} (.ci/run does)"
    if not list(Path("/usr/lib").glob("*/pmix2/lib/libpmix.so")):
        return f"libpmix.so, which Slurm's PMIx plugin loads, is not installed: apt-get install {PACKAGES}"
    if site_libmpi() is None:
        return f"Debian's Open MPI (libmpi.so.40) is not installed: apt-get install {PACKAGES}"
    return None


def site_libmpi():
    """The cluster's MPI library: Debian's Open MPI, built against the PMIx that Slurm serves."""
    found = sorted(Path("/usr/lib").glob("*/libmpi.so.40"))
    return found[0] if found else None


class SlurmCluster:
    def __init__(self, root):
        self.root = Path(root)
        self.holder = None  # the process that holds the network namespace open
        self.netns = None  # its path, /proc/<holder>/ns/net
        self.conf = self.root / "slurm.conf"
        self.munge = None
        self.daemons = {}

    def __enter__(self):
        try:
            self._write_config()
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def _write_config(self):
        r = self.root
        for sub in ("state", "log", *(f"{kind}-{node}" for kind in ("etc", "spool", "pmix") for node in NODES)):
            (r / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses a socket that not everyone can reach ("Socket is inaccessible"): every directory
        # above it must be searchable by all, which the tests' own temporary directories are not.
        self.munge = Path(tempfile.mkdtemp(prefix="ddp-munge-"))
        self.munge.chmod(0o711)
        key = self.munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        lines = [
            "ClusterName=ddptest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge}/munge.socket",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool-%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            # No cgroups needed: processes are tracked through /proc, tasks are not bound to cores.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            # A request no node can satisfy fails at submission instead of pending forever.
            "EnforcePartLimits=ALL",
            # A node that stops answering is declared down, and its jobs requeued, after about
            # SlurmdTimeout + 2 x MessageTimeout (measured: 27 s at 5 and 10, 17 s at 5 and 5).
            "SlurmdTimeout=5",
            "MessageTimeout=5",
            # A node that comes back (slurmd restarted) returns to service by itself.
            "ReturnToService=2",
            # sbatch --wait polls every 2 s when finished jobs are kept 5 s or less, and backs off to 32 s
            # otherwise (at 300 s, the default).
            "MinJobAge=5",
            # A step that is ended (srun --kill-on-bad-exit, scancel, a down node) gets SIGTERM, then SIGKILL this
            # many seconds later (30 by default): submitit's tasks ignore SIGTERM ("Bypassing signal SIGTERM"), so a
            # rank left waiting for a failed peer lived out all of them.
            "KillWait=2",
        ]
        for node in NODES:
            lines.append(f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} "
                         f"CPUs={os.cpu_count()}")
        lines.append(f"PartitionName=test Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        text = "\n".join(lines) + "\n"
        self.conf.write_text(text)
        # Each slurmd reads its own copy, beside which lies its own mpi.conf: two PMIx servers of one job
        # step on one host would otherwise create the same client directory ("File exists").
        for node in NODES:
            (r / f"etc-{node}" / "slurm.conf").write_text(text)
            (r / f"etc-{node}" / "mpi.conf").write_text(f"PMIxCliTmpDirBase={r}/pmix-{node}\n")

    def _netns_argv(self, argv):
        # nsenter without --pid execs the program in place: a daemon is pytest's own child.
        return ["nsenter", f"--net={self.netns}", *map(str, argv)]

    def _daemon(self, name, argv):
        with open(self.root / "log" / f"{name}.stderr", "ab") as log:
            self.daemons[name] = subprocess.Popen(self._netns_argv(argv), cwd=self.root, stdin=subprocess.DEVNULL,
                                                  stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    def _start(self):
        self.holder = subprocess.Popen(["unshare", "--net", "sleep", "infinity"], stdin=subprocess.DEVNULL,
                                       preexec_fn=_die_with_parent)
        host_netns = os.readlink("/proc/self/ns/net")
        self.netns = f"/proc/{self.holder.pid}/ns/net"
        # Until unshare has made the namespace, the holder's is still the host's.
        self.wait_for(lambda: _readlink(self.netns) not in (None, host_netns) or self.holder.poll() is not None, 30,
                      "a network namespace")
        if self.holder.poll() is not None:
            raise RuntimeError(f"unshare --net exited {self.holder.returncode}: no network namespace for the cluster")
        # Besides 127.0.0.1, a second loopback address: with none but 127.0.0.1, glibc's AI_ADDRCONFIG
        # finds no IPv4 at all, and the daemons cannot resolve the address they listen on.
        for argv in (["link", "set", "lo", "up"], ["addr", "add", "127.0.0.2/32", "dev", "lo"]):
            subprocess.run(self._netns_argv(["ip", *argv]), check=True, capture_output=True, timeout=30)
        m = self.munge
        self._daemon("munged", ["munged", "--foreground", f"--socket={m}/munge.socket", f"--key-file={m}/munge.key",
                                f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed",
                                f"--log-file={self.root}/log/munged.log"])
        self.wait_for(lambda: (m / "munge.socket").exists(), 30, "munged's socket")
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        for node in NODES:
            self.start_node(node)
        self.wait_for(lambda: self.node_states() == {node: "idle" for node in NODES}, 60, "every node idle")

    def start_node(self, node):
        self._daemon(node, ["slurmd", "-D", "-N", node, "-f", self.root / f"etc-{node}" / "slurm.conf"])

    def env(self, base):
        return {**base, "SLURM_CONF": str(self.conf)}

    def run(self, argv, cwd, env, timeout, check=True):
        """A client command (sbatch, squeue, ...) in the cluster's network."""
        result = subprocess.run(self._netns_argv(argv), cwd=cwd, env=self.env(env), capture_output=True, text=True,
                                timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, argv))} exited {result.returncode}\n{result.stdout}\n"
                                 f"{result.stderr}\nlogs in {self.root / 'log'}")
        return result

    def popen(self, argv, cwd, env, **kwargs):
        return subprocess.Popen(self._netns_argv(argv), cwd=cwd, env=self.env(env), **kwargs)

    def node_states(self):
        out = self.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], cwd=self.root, env=os.environ,
                       timeout=30, check=False).stdout
        return dict(line.split() for line in out.splitlines())

    def job(self, job_id):
        """scontrol's fields of a job, e.g. JobState, Restarts."""
        out = self.run(["scontrol", "show", "job", "--oneliner", job_id], cwd=self.root, env=os.environ,
                       timeout=30).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait_for(self, condition, timeout, what):
        deadline = time.monotonic() + timeout
        while not condition():
            dead = [name for name, daemon in self.daemons.items() if daemon.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"timed out after {timeout}s"
                raise TimeoutError(f"SLURM cluster: waiting for {what}: {why}; logs in {self.root / 'log'}")
            time.sleep(0.2)

    def processes(self, node=None):
        """Every process of the cluster's jobs (batch scripts, srun, slurmstepd, tasks), or of one node's:
        slurmd hands its own SLURM_CONF to the job steps it starts, and sbatch the submitter's to the job."""
        wanted = str(self.root / f"etc-{node}" / "slurm.conf") if node else f"{self.root}{os.sep}"
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            conf = next((item[len(b"SLURM_CONF="):].decode() for item in environ
                         if item.startswith(b"SLURM_CONF=")), "")
            if conf.startswith(wanted):
                found.append(int(entry.name))
        return found

    def kill_node(self, node):
        """The node dies: its slurmd and every process of its job steps, at once (SIGKILL)."""
        daemon = self.daemons.pop(node)
        daemon.kill()
        for pid in self.processes(node):
            _kill(pid)
        daemon.wait(30)

    def stop(self):
        """Cancel every job, stop the daemons, and kill whatever of the jobs is left."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--user=root"], cwd=self.root, env=os.environ, timeout=30, check=False)
            try:
                self.wait_for(lambda: not self.processes(), 60, "end of the cancelled jobs")
            except TimeoutError:
                pass  # killed below
        for name in list(self.daemons):
            daemon = self.daemons.pop(name)
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(30)
        for pid in self.processes():
            _kill(pid)
        if self.holder:
            self.holder.kill()
            self.holder.wait(30)
        if self.munge:
            shutil.rmtree(self.munge, ignore_errors=True)


def _die_with_parent():
    """In a daemon, before it starts: SIGKILL when pytest goes, however it goes."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def _readlink(path):
    try:
        return os.readlink(path)
    except OSError:
        return None


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---- what the tests that submit to the cluster share (test_slurm.py, test_submitit.py) ----

WHY_NOT = unavailable()  # why this machine cannot run the cluster, or None


@pytest.fixture(scope="module", name="cluster")
def slurm_cluster(tmp_path_factory):
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running
    assert not running.processes(), "processes of the cluster's jobs outlived it"


def job_env(**extra):
    """The submitter's environment, which sbatch hands to the job: the tests' probes (tests/support) load in
    every Python process of the job, which checks the teardown and counts each rank's collectives."""
    return clean_env(PATH=f"{BIN}:{os.environ['PATH']}", PYTHONPATH=PROBE, DDP_EXAMPLES_PROBE_COLLECTIVES=1, **extra)


def launched_on(cluster, job_id):
    """The nodes whose slurmd started a task of the job's srun (the last, for a requeued job)."""
    return [node for node in NODES
            if f"launch task StepId={job_id}.0 " in (cluster.root / "log" / f"slurmd-{node}.log").read_text()]
