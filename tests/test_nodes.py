"""Many nodes: the repository's Slurm script and PyTorchJob run the same training loop as a notebook does.

Both are run here on one machine, two torchrun agents standing for two nodes: scripts/slurm.sbatch with stand-ins
for srun and scontrol (c10d rendezvous, 2 nodes x 2 ranks), and scripts/pytorchjob.yaml's command with the
environment Kubeflow's operator gives each pod (static rendezvous). Every rank's records land in one run directory
and read back as one Run, equal to the same config launched from a notebook."""
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import labkit
from labkit import Fault, RunConfig, load_run
from labkit.rundir import RunDir
from labkit.tricks.monitor import read_tensorboard

ROOT = Path(__file__).resolve().parent.parent

FAKE_SRUN = """#!/bin/bash
# srun with --ntasks-per-node=1, on one machine: the command once per node, each told its node id; the first failure
# is the exit status.
while [[ $1 == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" > "$NODE_LOGS/node$node.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
# scontrol show hostnames: the allocation's nodes, the head first. A long list (a large allocation) is what made
# `head -n 1` under pipefail fail the job with SIGPIPE, once in a while with two names and every time with these.
FAKE_SCONTROL = "#!/bin/bash\necho 127.0.0.1\nfor i in $(seq 20000); do echo node$i; done\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(cmd: list[str], env: dict[str, str], timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run cmd in a process group of its own; on timeout the whole group (agents and ranks) is killed."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[0]} did not finish in {timeout} s:\n{out[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the agents left behind
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def node_logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(folder.glob("node*.log")))


def test_the_slurm_script_runs_two_nodes_into_one_run_that_matches_a_notebook_launch(tmp_path, no_leftovers):
    # digits, not the default tinylm: each fresh torchrun rank would import transformers' GPT-2 (about 4 s of CPU
    # each, 16 s for four ranks on two cores); the slurm script, the rendezvous and the records are what is tested.
    config = RunConfig(task="digits", world_size=4, global_batch=32, steps=4, tensorboard=True, save_final=False)
    config.save(tmp_path / "config.json")
    shims, logs, run_dir = tmp_path / "bin", tmp_path / "logs", tmp_path / "shared" / "job"
    shims.mkdir(), logs.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "NODE_LOGS": str(logs), "PYTHON": sys.executable,
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "NPROC_PER_NODE": "2",
           "RDZV_PORT": str(free_port()), "RUN_DIR": str(run_dir), "TMPDIR": str(tmp_path)}
    done = run_group(["bash", str(ROOT / "scripts" / "slurm.sbatch"), str(tmp_path / "config.json")], env, 240)
    assert done.returncode == 0, done.stdout[-2000:] + node_logs(logs)

    run = load_run(run_dir)
    assert run.world_size == 4 and run.config.world_size == 4 and run.finished
    assert {r: sorted(g) for r, g in run.df.groupby("rank")["step"]} == {r: [0, 1, 2, 3] for r in range(4)}
    assert run.steps()["samples_seen"].tolist() == [32, 64, 96, 128]  # 4 ranks x 8 samples per step
    layout = run.meta["ranks"]
    assert run.meta["nodes"] == 2 and [r["rank"] for r in layout] == [0, 1, 2, 3]
    assert all(r["rank"] == 2 * r["node"] + r["local_rank"] for r in layout), layout  # contiguous per node
    assert {r["node"] for r in layout} == {0, 1} and {r["local_rank"] for r in layout} == {0, 1}
    assert sorted(read_tensorboard(run)["rank"].unique()) == [0, 1, 2, 3]  # each rank wrote its own events
    assert RunDir(run_dir).missing_records(4) == []

    notebook = labkit.launch(config, runs_root=tmp_path / "runs", echo=False, progress=False)
    np.testing.assert_allclose(run.df["loss"], notebook.df["loss"], rtol=1e-6)  # both sorted by (step, rank)


def pytorchjob_pod_env(job: dict, pod_rank: int, port: int, nproc: str) -> dict[str, str]:
    """What Kubeflow's training operator (1.7+) puts in each pod's environment, with the master's address
    (its pod's service name on a cluster) on loopback, plus the container's own env from the job."""
    pods = sum(spec["replicas"] for spec in job["spec"]["pytorchReplicaSpecs"].values())
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    return {**env, "MASTER_ADDR": "127.0.0.1", "PET_MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(pods * int(nproc)), "RANK": str(pod_rank),
            "PET_NODE_RANK": str(pod_rank), "PET_NNODES": str(pods), "PET_NPROC_PER_NODE": nproc,
            "PYTHONUNBUFFERED": "1"}


def test_the_pytorchjob_command_under_the_operators_environment_writes_one_run(tmp_path, no_leftovers):
    job = yaml.safe_load((ROOT / "scripts" / "pytorchjob.yaml").read_text())
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["template"] == specs["Worker"]["template"]  # one pod template (a YAML anchor)
    container = specs["Master"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and container["workingDir"] == "/labkit"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    command = container["command"]
    config_path, run_dir = command[command.index("run") + 1], command[command.index("--run-dir") + 1]
    assert Path(config_path).parent.as_posix() in mounts and Path(run_dir).parent.as_posix() in mounts

    # digits: no transformers import in the fresh ranks (see the slurm test)
    RunConfig(task="digits", world_size=2, global_batch=16, steps=3, tensorboard=False).save(tmp_path / "config.json")
    local = {config_path: str(tmp_path / "config.json"), run_dir: str(tmp_path / "runs" / "job"),
             ".venv/bin/python": sys.executable}
    cmd = [local.get(part, part) for part in command]
    port = free_port()  # nprocPerNode 1 here (the file asks for 8 GPUs): two pods, one rank each
    agents = [subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path),
                                                  **pytorchjob_pod_env(job, pod, port, "1")},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
              for pod in range(2)]
    try:
        outputs = [a.communicate(timeout=180)[0] for a in agents]
    finally:
        for agent in agents:
            try:
                os.killpg(agent.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            agent.wait()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    run = load_run(local[run_dir])
    assert run.finished and run.meta["nodes"] == 2 and sorted(run.df["rank"].unique()) == [0, 1]
    assert [r["node"] for r in run.meta["ranks"]] == [0, 1]  # the pod's PET_NODE_RANK became torchrun's node rank


def test_a_rank_that_fails_under_torchrun_leaves_a_report_labkit_show_reads(tmp_path, capsys, no_leftovers):
    # digits: no transformers import in the fresh ranks (see the slurm test)
    config = RunConfig(task="digits", world_size=2, steps=5, tensorboard=False,
                       faults=(Fault(kind="raise", rank=1, step=2),))
    config.save(tmp_path / "config.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "labkit", "run", str(tmp_path / "config.json"), "--run-dir", str(tmp_path / "job")]
    done = run_group(cmd, {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}, 180)
    assert done.returncode != 0
    # torchrun's own summary names the root cause with its traceback (labkit writes TORCHELASTIC_ERROR_FILE, as
    # torchelastic's @record would): before, it said "error_file: <N/A>" and "To enable traceback see: ..."
    cause = done.stdout.split("Root Cause (first observed failure):", 1)[-1]
    assert "rank      : 1" in cause and "InjectedFault" in cause and "To enable traceback" not in cause, done.stdout
    run = load_run(tmp_path / "job")
    assert not run.finished and run.failure().startswith("rank 1 raised at step 2: InjectedFault"), run.failure()
    # labkit show's main in this process, as tests/test_cli.py runs it where a real process adds nothing: a second
    # interpreter would import torch again only to print (the entry point as a command: test_cli, test_package).
    from labkit.cli import main
    assert main(["show", str(tmp_path / "job")]) == 0
    assert "rank 1 raised at step 2" in capsys.readouterr().out


def test_ranks_whose_records_are_elsewhere_are_named(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.jsonl").write_text("")
    assert RunDir(tmp_path).missing_records(4) == [2, 3] and RunDir(tmp_path).missing_records(2) == []


def test_a_failure_caused_by_a_peer_is_stamped_after_the_peers_own():
    """torchrun's Root Cause is the earliest whole second, ties to rank 0: the rank whose peer closed the connection
    rounds up, the rank that raised rounds down, so the cause wins even within one second."""
    from labkit.run.torchrun import error_second
    consequence = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    assert error_second(ValueError("injected"), 100.4) == 100 < error_second(consequence, 100.6) == 101
    assert error_second(consequence, 100.0) == 100   # an exact second stays itself
