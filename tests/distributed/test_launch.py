"""`slipstream launch`: local torchrun, the Slurm per-node logic run on localhost, sbatch and PyTorchJob files.

The multi-process tests start real torchrun agents (gloo on CPU), each wrapped in a hard timeout.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slipstream.cli import main
from slipstream.distributed.launch import parse_hostlist
from slipstream.errors import UserError

SRC = Path(__file__).resolve().parents[2] / "src"
PROC_TIMEOUT_S = 90
PROBE = ["probe", "--sections", "comm", "--comm-sizes", "1024"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    # Absolute: the children may run in another folder; SLIPSTREAM_CACHE_DIR comes from conftest.
    env.update(PYTHONPATH=str(SRC), OMP_NUM_THREADS="1", **extra)
    return env


def _slipstream(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slipstream", *args], env=_env(**env), cwd=cwd,
                          capture_output=True, text=True, timeout=PROC_TIMEOUT_S)


# ------------------------------------------------------------------ local


@pytest.mark.timeout(120)
def test_local_runs_the_collective_probe_on_two_ranks(tmp_path):
    out = tmp_path / "probe.json"
    r = _slipstream("launch", "local", "--nproc", "2", "--", *PROBE, "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    first = r.stdout.splitlines()[0]
    assert "torch.distributed.run --standalone --nproc-per-node 2" in first and "-m slipstream probe" in first
    assert "all_reduce" in r.stdout
    assert json.loads(out.read_text())["sections"]["comm"]["world_size"] == 2


# A failing command's exit code comes back through `launch local` (2: the override reached train
# untouched, and train refused it): tests/e2e/test_faults.py::test_a_user_error_is_not_retried.


@pytest.mark.parametrize("argv, message", [
    (["launch", "local", "--nproc", "2"], "no command to launch"),
    (["launch", "local", "--nproc", "2", "--"], "no command to launch"),
    (["launch", "local", "--", "rm", "-rf", "/"], "'rm' is not a slipstream command"),
    (["launch", "local", "--", "launch", "local"], "'launch' is not a slipstream command"),
    (["launch", "local", "--nproc", "0", "--", "train"], "--nproc must be >= 1"),
    (["launch", "local", "--max-restarts", "-1", "--", "train"], "--max-restarts must be >= 0"),
    (["launch", "local", "--bogus", "1", "--", "train"], "unknown launch option"),
])
def test_launch_user_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ Slurm


@pytest.mark.parametrize("hostlist, hosts", [
    ("localhost", ["localhost"]),
    ("gpu[01-03,07],login-1,a[1-2]b", ["gpu01", "gpu02", "gpu03", "gpu07", "login-1", "a1b", "a2b"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("node-[001-002],x", ["node-001", "node-002", "x"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("gpu[5]", ["gpu5"]),
])
def test_parse_hostlist(hostlist, hosts):
    assert parse_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-03", "gpu]1", "gpu[3-1]", "gpu[a-b]", "a,,b", "", "gpu[[1]]"])
def test_parse_hostlist_rejects_malformed(bad):
    with pytest.raises(UserError, match="SLURM_JOB_NODELIST"):
        parse_hostlist(bad)


SLURM_OK = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}


@pytest.mark.parametrize("change, message", [
    ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID is not set"),
    ({"SLURM_NNODES": None}, "SLURM_NNODES is not set"),
    ({"SLURM_NODEID": "x"}, "SLURM_NODEID='x'"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 must be < SLURM_NNODES=2"),
    ({"SLURM_JOB_NODELIST": "n[1-"}, "SLURM_JOB_NODELIST"),
])
def test_slurm_node_needs_the_slurm_variables(change, message, monkeypatch, capsys):
    for key, value in {**SLURM_OK, **change}.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    assert main(["launch", "slurm-node", "--gpus-per-node", "1", "--", "train"]) == 2
    err = capsys.readouterr().err
    assert message in err
    if "not set" in message:
        assert "inside an sbatch job" in err


def _srun_argv(script: str) -> list[str]:
    [line] = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    argv = shlex.split(line)
    assert argv[:2] == ["srun", "--kill-on-bad-exit=1"]
    return argv[2:]


def test_sbatch_script_is_valid_bash_with_the_expected_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["launch", "slurm", "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu", "--time", "02:00:00",
            "--account", "proj", "--job-name", "big", "--cpus-per-task", "64", "--mem", "500G",
            "--", "train", "--train.max_steps=3", "--run.dir=/runs/a b"]
    assert main(argv) == 0
    script_path = tmp_path / "big.sbatch"
    assert "sbatch big.sbatch" in capsys.readouterr().out
    script = script_path.read_text()
    subprocess.run(["bash", "-n", str(script_path)], check=True, timeout=30)
    assert script.startswith("#!/bin/bash\n")
    for line in ["--job-name=big", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=64",
                 "--time=02:00:00", "--partition=gpu", "--account=proj", "--mem=500G", "--output=logs/%x-%j.out"]:
        assert f"#SBATCH {line}\n" in script
    for text in ["set -euo pipefail", f"cd {tmp_path.resolve()}", "env | sort", "TORCH_NCCL_ASYNC_ERROR_HANDLING=3",
                 "TORCH_NCCL_DUMP_ON_TIMEOUT=1", "TORCH_NCCL_TRACE_BUFFER_SIZE=", "NCCL_DEBUG=WARN",
                 "# export NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS=8"]:
        assert text in script
    assert (tmp_path / "logs").is_dir()  # Slurm needs it before the job starts
    assert _srun_argv(script) == [
        sys.executable, "-m", "slipstream", "launch", "slurm-node", "--gpus-per-node", "8", "--port", "29500",
        "--max-restarts", "0", "--rdzv-timeout", "300", "--", "train", "--train.max_steps=3", "--run.dir=/runs/a b"]
    # Never silently replaced.
    assert main(argv) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(argv[:2] + ["--force"] + argv[2:]) == 0


@pytest.mark.parametrize("extra, message", [
    (["--nodes", "0"], "--nodes must be >= 1"),
    (["--nodes", "1", "--time", "2 hours"], "is not a Slurm time"),
    (["--nodes", "1", "--job-name", "a;b"], "--job-name"),
])
def test_sbatch_bad_input(extra, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "slurm", "--gpus-per-node", "1", *extra, "--", "train"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_slurm_node_on_localhost_as_two_nodes(tmp_path, monkeypatch):
    """Generate the sbatch script, then run its srun line twice, with the variables Slurm sets per node."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "probe.json"
    assert main(["launch", "slurm", "--nodes", "2", "--gpus-per-node", "1", "--port", str(_free_port()),
                 "--rdzv-timeout", "60", "--", *PROBE, "--out", str(out)]) == 0
    argv = _srun_argv((tmp_path / "slipstream.sbatch").read_text())
    assert argv[0] == sys.executable
    # localhost first, as the rendezvous host, followed by hosts that only appear in the list.
    nodes = [subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env(SLURM_JOB_ID="1234", SLURM_NNODES="2", SLURM_NODEID=str(node),
                                       SLURM_JOB_NODELIST="localhost,gpu[02-03]"))
             for node in (0, 1)]
    try:
        logs = [p.communicate(timeout=PROC_TIMEOUT_S)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    for p, log in zip(nodes, logs):
        assert p.returncode == 0, log
        assert "--rdzv-endpoint localhost:" in log.splitlines()[0]
    assert any("all_reduce" in log for log in logs)  # rank 0's collectives table
    assert json.loads(out.read_text())["sections"]["comm"]["world_size"] == 2


@pytest.mark.timeout(120)
def test_slurm_node_without_peers_fails_instead_of_hanging():
    r = _slipstream("launch", "slurm-node", "--gpus-per-node", "1", "--port", str(_free_port()),
                    "--rdzv-timeout", "1", "--", *PROBE,
                    SLURM_JOB_ID="99", SLURM_NNODES="2", SLURM_NODEID="0", SLURM_JOB_NODELIST="localhost")
    assert r.returncode != 0
    assert "RendezvousTimeoutError" in r.stderr


# ------------------------------------------------------------------ Kubernetes


def _pytorchjob(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "job.yaml"
    assert main(["launch", "k8s", "--name", "lm-1", "--image", "reg/slipstream:gpu", "--out", str(out), *extra,
                 "--", "train", "--train.max_steps=3"]) == 0
    return yaml.safe_load(out.read_text())


def _check_replica(replica: dict, count: int, gpus: int) -> dict:
    assert replica["replicas"] == count and replica["restartPolicy"] == "OnFailure"
    pod = replica["template"]["spec"]
    [container] = pod["containers"]
    assert container["name"] == "pytorch"  # the operator requires this name
    assert container["image"] == "reg/slipstream:gpu"
    assert container["command"] == ["torchrun", "-m", "slipstream", "train", "--train.max_steps=3"]
    assert all(isinstance(e["name"], str) and isinstance(e["value"], str) for e in container["env"])
    limits = container["resources"].get("limits", {})
    assert limits.get("nvidia.com/gpu", 0) == gpus
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert len(volumes) == len(pod["volumes"])
    for mount in container["volumeMounts"]:
        assert mount["name"] in volumes and mount["mountPath"].startswith("/")
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    return container


def test_pytorchjob_manifest_multi_node(tmp_path):
    job = _pytorchjob(tmp_path, "--nodes", "3", "--gpus-per-node", "8", "--cpus", "32", "--memory", "64Gi",
                      "--pvc", "ckpt", "--mount", "/ckpt", "--env", "A=1", "--env", "URL=a=b", "--namespace", "ml",
                      "--max-restarts", "5")
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert job["metadata"] == {"name": "lm-1", "namespace": "ml"}
    spec = job["spec"]
    assert spec["nprocPerNode"] == "8"  # *string in the v1 API
    assert spec["runPolicy"]["backoffLimit"] == 5 and spec["runPolicy"]["cleanPodPolicy"] in ("None", "Running", "All")
    assert set(spec["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    _check_replica(spec["pytorchReplicaSpecs"]["Master"], 1, 8)
    container = _check_replica(spec["pytorchReplicaSpecs"]["Worker"], 2, 8)
    assert container["env"] == [{"name": "A", "value": "1"}, {"name": "URL", "value": "a=b"}]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "cpu": "32", "memory": "64Gi"}
    assert {"name": "checkpoints", "mountPath": "/ckpt"} in container["volumeMounts"]
    [claim] = [v for v in spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"]
               if "persistentVolumeClaim" in v]
    assert claim == {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}}


def test_pytorchjob_single_node_has_no_worker(tmp_path):
    job = _pytorchjob(tmp_path, "--gpus-per-node", "0")
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master"}
    assert job["spec"]["nprocPerNode"] == "1"
    container = _check_replica(job["spec"]["pytorchReplicaSpecs"]["Master"], 1, 0)
    assert "namespace" not in job["metadata"]
    assert [m["name"] for m in container["volumeMounts"]] == ["dshm"]


@pytest.mark.parametrize("extra, message", [
    (["--env", "NOEQUALS"], "--env 'NOEQUALS'"),
    (["--nodes", "0"], "--nodes must be >= 1"),
    (["--mount", "/x"], "--mount needs --pvc"),
    (["--name", "Bad_Name"], "--name"),
])
def test_pytorchjob_bad_input(extra, message, tmp_path, capsys):
    argv = ["launch", "k8s", "--name", "ok", "--image", "img", "--out", str(tmp_path / "j.yaml"), *extra, "--", "train"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "j.yaml").exists()
