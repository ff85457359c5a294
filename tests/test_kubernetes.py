"""The Kubernetes manifests in k8s/, without a cluster (none can start here): each loads into the published
API models of its kind, pinned in requirements-dev.txt (kubeflow-training: the training operator's
PyTorchJob, with the kubernetes client's pod template; kubeflow-trainer-api: Kubeflow Trainer v2's TrainJob),
and a broken copy does not; every pod template has the snapshot volume and a sized /dev/shm; and each
job's command, with the variables its controller sets, runs two local "pods" (torchrun processes on 127.0.0.1)
that share a snapshot directory: the PyTorchJob's train until a pod dies, the TrainJob's resume from the
snapshot and finish (one chain: the two commands are the same but for the snapshot). What each controller sets
is read from its source (training-operator v1.9: pkg/controller.v1/pytorch/envvar.go and master.go;
trainer v2.3.0: pkg/runtime/framework/plugins/torch/torch.go and manifests/base/runtimes/torch_distributed.yaml).
"""
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
# No importorskip: without the pinned API packages these checks would silently not run.
from kubeflow.training import ApiClient
from kubeflow.training.utils.utils import FakeResponse
from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob
from pydantic import ValidationError

from conftest import (BIN, REPO, check_no_abort, clean_env, epoch_lines, free_port, kill_launched, load_snapshot,
                      process_state, start, summary)

K8S = REPO / "k8s"
PYTORCHJOB = K8S / "pytorchjob-multinode.yaml"
TRAINJOB = K8S / "trainjob-multinode.yaml"
PVC = K8S / "snapshots-pvc.yaml"
IMAGE = "ddp-examples:latest"  # the Dockerfile's image, as its header builds it
# The torch-distributed runtime's replicated job and training container are both named "node".
TRAINER_NODE = "node"
TRAINER_MASTER_PORT = "29500"  # constants.ContainerTrainerPort; the test pods use a free port instead
SHM_AT_LEAST = 1 << 30  # the container default is 64 MiB; NCCL's buffers and DataLoader workers need more

# Each kind's published model: document -> (model -> document), the SDK's own way in and out.
V1_CLIENT = ApiClient()
MODELS = {
    "PyTorchJob": lambda doc: V1_CLIENT.sanitize_for_serialization(
        V1_CLIENT.deserialize(FakeResponse(doc), "KubeflowOrgV1PyTorchJob")),
    "PersistentVolumeClaim": lambda doc: V1_CLIENT.sanitize_for_serialization(
        V1_CLIENT.deserialize(FakeResponse(doc), "V1PersistentVolumeClaim")),
    "TrainJob": lambda doc: TrainerV1alpha1TrainJob.from_dict(doc).to_dict(),
}


def load(path):
    (doc,) = yaml.safe_load_all(path.read_text())
    return doc


def differences(given, back, where=""):
    """Where a model's round trip differs from the document: keys it dropped (unknown or misspelt: the
    generated models ignore them) or added, and values it converted (the kubeflow-training SDK turns "1"
    into 1 for an int field; the type must match too, since 1 == True)."""
    if isinstance(given, dict) and isinstance(back, dict):
        found = [f"{where}/{key}: {'not in the model' if key in given else 'added by the model'}"
                 for key in sorted(given.keys() ^ back.keys())]
        return found + [d for key in sorted(given.keys() & back.keys()) for d in differences(given[key], back[key],
                                                                                             f"{where}/{key}")]
    if isinstance(given, list) and isinstance(back, list) and len(given) == len(back):
        return [d for i, (a, b) in enumerate(zip(given, back)) for d in differences(a, b, f"{where}[{i}]")]
    if type(given) is not type(back) or given != back:
        return [f"{where}: {given!r} became {back!r}"]
    return []


def model_problems(doc):
    """What the published model of the document's kind does not take as written."""
    if doc.get("kind") not in MODELS:
        return [f"no API model for kind {doc.get('kind')!r}"]
    try:
        back = MODELS[doc["kind"]](doc)
    # pydantic's strict types; the v1 SDK's int("x"), or a list where it iterates over a mapping
    except (ValidationError, ValueError, TypeError, AttributeError) as error:
        return [f"{doc['kind']} refused: {' '.join(str(error).split())[:300]}"]
    return differences(doc, back)


@pytest.mark.parametrize("path", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_manifest_loads_into_its_published_api_model(path):
    assert model_problems(load(path)) == []


# Deliberately broken copies: (file, text in it, replacement, what the check must report).
BROKEN = {
    "trainjob misspelt numProcsPerNode": (TRAINJOB, "numProcPerNode: 2", "numProcsPerNode: 2",
                                          "/spec/trainer/numProcsPerNode: not in the model"),
    "trainjob unknown field": (TRAINJOB, "    numNodes: 2", "    gpusPerNode: 2\n    numNodes: 2",
                               "/spec/trainer/gpusPerNode: not in the model"),
    "trainjob wrong type": (TRAINJOB, "numNodes: 2", 'numNodes: "2"', "TrainJob refused"),
    # A required field missing: the model fills in "" rather than refusing, which the round trip shows.
    "trainjob misspelt deep in the runtime patch": (TRAINJOB, "mountPath: /dev/shm", "mountpath: /dev/shm",
                                                    "/volumeMounts[1]/mountPath: added by the model"),
    "trainjob misspelt sizeLimit": (TRAINJOB, "sizeLimit: 2Gi", "sizelimit: 2Gi", "/emptyDir/sizelimit: not in"),
    "pytorchjob misspelt nprocPerNode": (PYTORCHJOB, 'nprocPerNode: "2"', 'nProcPerNode: "2"',
                                         "/spec/nProcPerNode: not in the model"),
    "pytorchjob unknown field": (PYTORCHJOB, "    backoffLimit: 3", "    backoffLimit: 3\n    maxRestarts: 3",
                                 "/spec/runPolicy/maxRestarts: not in the model"),
    "pytorchjob wrong type": (PYTORCHJOB, "backoffLimit: 3", "backoffLimit: three", "PyTorchJob refused"),
    "pytorchjob number as string": (PYTORCHJOB, "replicas: 1 ", 'replicas: "1" ', "'1' became 1"),
    "pytorchjob misspelt in the pod template": (PYTORCHJOB, "volumeMounts:", "volumeMount:",
                                                "/containers[0]/volumeMount: not in the model"),
    "pvc access modes not a list": (PVC, "accessModes:\n    - ReadWriteMany", "accessModes: ReadWriteMany",
                                    "/spec/accessModes: 'ReadWriteMany' became"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_copy_fails_the_model_check(case):
    path, text, broken, report = BROKEN[case]
    original = path.read_text()
    assert text in original, f"{path.name} no longer has {text!r}: update this case"
    problems = model_problems(yaml.safe_load(original.replace(text, broken, 1)))
    assert any(report in problem for problem in problems), problems


def named(items, name, where):
    found = [item for item in items if item["name"] == name]
    assert len(found) == 1, f"{where}: no {name!r} among {[item['name'] for item in items]}"
    return found[0]


def pod_templates(doc):
    """(name, pod spec, training container) of every pod the job runs. The controller puts its variables
    into the container named "pytorch" (PyTorchJob) or "node" (TrainJob). A TrainJob's pods are the
    runtime's; what the manifest adds comes through its runtime patch of the "node" replicated job."""
    if doc["kind"] == "PyTorchJob":
        for replica_type, replica in doc["spec"]["pytorchReplicaSpecs"].items():
            spec = replica["template"]["spec"]
            yield replica_type, spec, named(spec["containers"], "pytorch", replica_type)
    else:
        (patch,) = doc["spec"]["runtimePatches"]
        job = named(patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"], TRAINER_NODE, "runtimePatches")
        spec = job["template"]["spec"]["template"]["spec"]
        yield TRAINER_NODE, spec, named(spec["containers"], TRAINER_NODE, "runtimePatches")


def commands(doc):
    """The training command of every pod template."""
    if doc["kind"] == "PyTorchJob":
        return [container["command"] for _, _, container in pod_templates(doc)]
    return [doc["spec"]["trainer"]["command"]]


def flag(command, name):
    values = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{name}=")]
    assert len(values) == 1, f"--{name}=... once in {command}"
    return values[0]


def test_the_two_jobs_run_the_same_training():
    pytorchjob, trainjob = load(PYTORCHJOB), load(TRAINJOB)
    replicas = pytorchjob["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    assert trainjob["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                              "name": "torch-distributed"}
    trainer = trainjob["spec"]["trainer"]
    assert trainer["numNodes"] == 1 + replicas["Worker"]["replicas"]
    # Unset, the Trainer passes "auto": the GPU count, or on CPU-only nodes the CPU request.
    assert trainer["numProcPerNode"] == int(pytorchjob["spec"]["nprocPerNode"])
    assert trainer["image"] == IMAGE and all(c["image"] == IMAGE for _, _, c in pod_templates(pytorchjob))
    runs = [command for doc in (pytorchjob, trainjob) for command in commands(doc)]
    for command in runs:
        assert command[0] == "torchrun" and "multinode.py" in command
        assert [a for a in command if "snapshot_path" not in a] == [a for a in runs[0] if "snapshot_path" not in a]
    # One file each: a job that found the other's finished snapshot would have nothing to do.
    assert flag(commands(pytorchjob)[0], "snapshot_path") != flag(commands(trainjob)[0], "snapshot_path")


DECIMAL_EXPONENTS = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def quantity(text):
    """A Kubernetes resource quantity ("2Gi", "500M", "1e3", "1.5") as an exact number."""
    match = re.fullmatch(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:([KMGTPE]i)|([numkMGTPE]?)|[eE]([+-]?\d+))",
                         str(text))
    assert match, f"not a quantity: {text!r}"
    number, binary, decimal, exponent = match.groups()
    if binary:
        return Fraction(number) * 1024 ** ("KMGTPE".index(binary[0]) + 1)
    return Fraction(number) * Fraction(10) ** (int(exponent) if exponent else DECIMAL_EXPONENTS[decimal])


def test_quantity():
    assert quantity("2Gi") == 2 << 30 and quantity("64Mi") == 64 << 20 and quantity("1.5Gi") == 3 << 29
    assert quantity("500M") == 500 * 10 ** 6 and quantity("1e3") == 1000 and quantity("100m") == Fraction(1, 10)
    assert quantity(2) == 2


@pytest.mark.parametrize("path", [PYTORCHJOB, TRAINJOB], ids=lambda p: p.name)
def test_every_pod_mounts_the_shared_snapshot_volume_and_a_sized_dev_shm(path):
    doc, claim = load(path), load(PVC)
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # pods on different nodes mount it at once
    templates = list(pod_templates(doc))
    assert len(templates) == (2 if doc["kind"] == "PyTorchJob" else 1)
    snapshots = {flag(command, "snapshot_path") for command in commands(doc)}
    for name, spec, container in templates:
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        shm = mounts["/dev/shm"]["emptyDir"]
        assert shm["medium"] == "Memory", name
        assert quantity(shm["sizeLimit"]) >= SHM_AT_LEAST, f"{name}: /dev/shm of {shm['sizeLimit']}"
        for snapshot in snapshots:
            volume = next(v for m, v in mounts.items() if snapshot.startswith(m.rstrip("/") + "/"))
            assert volume.get("persistentVolumeClaim") == {"claimName": claim["metadata"]["name"]}, name


# What each controller puts into the training container (the sources in this module's docstring).
def pytorchjob_pods(doc, port="23456"):
    """(pod, container command, variables) for each pod: the training operator names the Master's service
    <job>-master-0 and numbers the nodes Master 0, Worker i+1; WORLD_SIZE counts processes, RANK the node."""
    spec = doc["spec"]
    nnodes = sum(r["replicas"] for r in spec["pytorchReplicaSpecs"].values())
    pods = []
    for replica_type, replica in spec["pytorchReplicaSpecs"].items():
        for index in range(replica["replicas"]):
            rank = index + (replica_type == "Worker")
            command = named(replica["template"]["spec"]["containers"], "pytorch", replica_type)["command"]
            pods.append((f"{replica_type.lower()}-{index}", command, {
                "PYTHONUNBUFFERED": "1", "MASTER_PORT": port, "PET_MASTER_PORT": port,
                "MASTER_ADDR": "127.0.0.1", "PET_MASTER_ADDR": "127.0.0.1",  # <job>-master-0 in the cluster
                "WORLD_SIZE": nnodes * int(spec["nprocPerNode"]), "RANK": rank, "PET_NODE_RANK": rank,
                "PET_NPROC_PER_NODE": spec["nprocPerNode"], "PET_NNODES": nnodes}))
    return pods


def trainjob_master(doc):
    name = doc["metadata"]["name"]
    return f"{name}-{TRAINER_NODE}-0-0.{name}"  # node 0's pod in the JobSet's headless service


def trainjob_pods(doc, port=TRAINER_MASTER_PORT):
    """(pod, container command, variables) for each pod: the Trainer numbers the pods by their Job
    completion index and points all of them at node 0 by its DNS name."""
    trainer = doc["spec"]["trainer"]
    extra = {e["name"]: e["value"] for e in trainer.get("env", [])}
    return [(f"node-0-{rank}", trainer["command"], {
        **extra, "PET_NNODES": trainer["numNodes"], "PET_NPROC_PER_NODE": trainer.get("numProcPerNode", "auto"),
        "PET_NODE_RANK": rank, "PET_MASTER_ADDR": trainjob_master(doc), "PET_MASTER_PORT": port})
        for rank in range(trainer["numNodes"])]


def expand(command, variables):
    """Kubernetes' expansion of a container's command: $(VAR) becomes the container's variable VAR, $$ a $.
    A variable the controller does not set would reach torchrun as written: the test stops there instead."""
    def one(match):
        if match[0] == "$$":
            return "$"
        assert match[1] in variables, f"the command uses $({match[1]}), which the controller does not set"
        return str(variables[match[1]])
    return [re.sub(r"\$\$|\$\((\w+)\)", one, argument) for argument in command]


def with_flags(command, **values):
    """The command with these flags' values replaced: a shorter run, the snapshot in the test's folder."""
    for name in values:
        flag(command, name)  # each is there once
    return [next((f"--{n}={v}" for n, v in values.items() if a.startswith(f"--{n}=")), a) for a in command]


POD_VARIABLE = "DDP_EXAMPLES_TEST_POD"
# Every pod resolves names from the files below only, so a name the test has not added fails at once,
# whatever DNS this machine has.
LATE_NAME = 'mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/nsswitch.conf && shift 2 && exec "$@"'


def why_no_mount_namespace():
    if os.geteuid() != 0:
        return "not root"
    try:
        result = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    except OSError as error:
        return f"no unshare: {error}"
    if result.returncode != 0:
        return f"unshare --mount exited {result.returncode}: {result.stderr.strip()}"
    return None


WHY_NO_MOUNT_NAMESPACE = why_no_mount_namespace()


class Pod:
    """A pod's training container: the command, with the controller's variables, started in the repository
    (the image's working directory); its output is read as it comes. With `hosts`, in a mount namespace
    of its own whose /etc/hosts is that file, as a pod sees the cluster's DNS."""

    def __init__(self, name, command, variables, hosts=None):
        self.name, self.marker = name, uuid.uuid4().hex
        argv = [BIN / command[0], *command[1:]]
        if hosts is not None:
            argv = ["unshare", "--mount", "sh", "-c", LATE_NAME, "pod", hosts, hosts.parent / "nsswitch.conf", *argv]
        self.process = start(argv, REPO, {**clean_env(), **{k: str(v) for k, v in variables.items()},
                                          POD_VARIABLE: self.marker})
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self):
        return "".join(self.lines)

    def wait_for(self, pattern, timeout):
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output, re.MULTILINE):
            if not self.reader.is_alive() or time.monotonic() > deadline:
                kill_launched()
                pytest.fail(f"pod {self.name}: no {pattern!r} " +
                            ("before it exited" if not self.reader.is_alive() else f"within {timeout}s") +
                            f":\n{self.output[-3000:]}")
            time.sleep(0.05)

    def processes(self):
        """The pids of the container's processes: torchrun and every worker it started."""
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and f"{POD_VARIABLE}={self.marker}".encode() in \
                        (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # it ended meanwhile
                pass
        return found

    def wait_until_stopped(self, timeout):
        """Until one of the container's processes has stopped itself (DDP_EXAMPLES_PROBE_STOP_AT)."""
        deadline = time.monotonic() + timeout
        while not any(process_state(pid) == "T" for pid in self.processes()):
            if not self.reader.is_alive() or time.monotonic() > deadline:
                kill_launched()
                pytest.fail(f"pod {self.name}: no process stopped at its step " +
                            ("before it exited" if not self.reader.is_alive() else f"within {timeout}s") +
                            f":\n{self.output[-3000:]}")
            time.sleep(0.05)

    def kill(self):
        """The container dies at once (an OOM kill, a lost node): torchrun and every worker it started."""
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def finish(self, timeout):
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_launched()
            pytest.fail(f"pod {self.name} still running after {timeout}s:\n{self.output[-3000:]}")
        self.reader.join(10)
        check_no_abort(self.output, f"pod {self.name}")
        return self.output


EPOCHS, SAVE_EVERY = 6, 2  # the manifests' 50 and 10, shortened
STEPS_PER_EPOCH = 16  # 2048 samples, 4 ranks, the default batch of 32
# The worker pod's first rank stops itself after this step (the probe's DDP_EXAMPLES_PROBE_STOP_AT), and the pod
# dies there: mid-way through the epoch after the first snapshot, so the master's ranks, which cannot take a step
# without it, end with exactly that snapshot saved. (Waiting from outside for the master's first "Snapshot saved"
# raced the job, which trains an epoch in a fraction of a second and could save the next one first.)
SAVED_AT_DEATH = SAVE_EVERY
STOP_STEP = SAVED_AT_DEATH * STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2


# What c10d prints each time the master's address does not resolve (torch 2.13); then it tries again.
UNRESOLVED = r"network addresses of \({name}, \d+\) cannot be retrieved"


@pytest.mark.slow
def test_pytorchjob_pods_train_and_trainjob_pods_resume_from_the_snapshot_volume(tmp_path):
    """One chain for both manifests, whose commands are the same but for the snapshot's name
    (test_the_two_jobs_run_the_same_training): what differs is the variables each controller sets, and each
    set runs two pods here. The PyTorchJob's pods train; after the first snapshot the worker pod dies and the
    master pod's ranks stop on their own. The TrainJob's pods then start on the same volume (new pods, as a
    restart makes them) and resume at the snapshot's epoch: before node 0's name resolves (the Trainer adds
    no init container that waits for it), it starts to resolve only after a pod has tried and failed, and
    both pods must wait, join and finish."""
    pytorchjob, trainjob = load(PYTORCHJOB), load(TRAINJOB)
    snapshot = tmp_path / "snapshots" / "multinode.pt"  # the ReadWriteMany volume every pod mounts
    port = str(free_port())
    shorter = {"total_epochs": EPOCHS, "save_every": SAVE_EVERY, "snapshot_path": snapshot}
    first, second = [[(name, with_flags(expand(command, variables), **shorter), variables)
                      for name, command, variables in pods(doc, port)]
                     for pods, doc in ((pytorchjob_pods, pytorchjob), (trainjob_pods, trainjob))]
    assert len(first) == len(second) == 2

    nproc = int(first[0][2]["PET_NPROC_PER_NODE"])
    # Only the first pair of pods carries the probe: the worker pod's first rank stops itself after STOP_STEP.
    # The TrainJob's pods run as the manifest has them.
    probe = {"DDP_EXAMPLES_PROBE_SAMPLES": tmp_path / "probe",
             "DDP_EXAMPLES_PROBE_STOP_AT": f"{int(first[1][2]['PET_NODE_RANK']) * nproc}:0:{STOP_STEP}"}
    (tmp_path / "probe").mkdir()
    master, worker = [Pod(name, command, {**variables, **probe}) for name, command, variables in first]
    worker.wait_until_stopped(timeout=180)
    worker.kill()
    output = master.finish(timeout=60)
    assert master.process.returncode != 0, output[-2000:]
    # Rank 0 finished the epochs before the stop, and no more: their lines, and the first snapshot's, are there.
    assert [(line.epoch, line.steps) for line in epoch_lines(output)] == \
        [(epoch, STEPS_PER_EPOCH) for epoch in range(SAVED_AT_DEATH)], output[-2000:]
    assert f"Epoch {SAVED_AT_DEATH - 1} | Snapshot saved" in output, output[-2000:]
    saved = load_snapshot(snapshot)["epochs_run"]
    assert saved == SAVED_AT_DEATH, "the pods were meant to die in the epoch after the first snapshot"

    if WHY_NO_MOUNT_NAMESPACE:
        pytest.skip(f"the PyTorchJob's pods passed; the TrainJob's, whose node 0 name resolves late, need a "
                    f"mount namespace: {WHY_NO_MOUNT_NAMESPACE}")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    (tmp_path / "nsswitch.conf").write_text("hosts: files\n")
    restarted = [Pod(name, command, variables, hosts) for name, command, variables in second]
    restarted[1].wait_for(UNRESOLVED.format(name=re.escape(trainjob_master(trainjob))), timeout=60)
    with hosts.open("a") as f:  # appended in place: the pods' bind mounts hold this inode
        f.write(f"127.0.0.1 {trainjob_master(trainjob)}\n")
    outputs = [pod.finish(timeout=180) for pod in restarted]
    for pod, output in zip(restarted, outputs):
        assert pod.process.returncode == 0, f"pod {pod.name}:\n{output[-3000:]}"
    assert f"Resuming from {snapshot} at epoch {saved}" in outputs[0], outputs[0][-3000:]
    assert [line.epoch for line in epoch_lines(outputs[0])] == list(range(saved, EPOCHS))
    result = summary(outputs[0])
    assert (result.world_size, result.backend) == (2 * int(second[0][2]["PET_NPROC_PER_NODE"]), "gloo")
    assert load_snapshot(snapshot)["epochs_run"] == EPOCHS
