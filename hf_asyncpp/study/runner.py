"""Running a study's arms: each a normal training run (train.py) in its own process.

An arm's directory is `<output_dir>/arms/<arm name>`; `arm.json` appears there only after the run
exited cleanly with a final validation loss, and records the arm's settings (its resolved config), so a
rerun skips exactly the finished arms whose settings are unchanged, and its provenance (the commit, the
software versions and the machine it ran on: a grid run in parts may span several of each). `arm.json`
and `metrics.jsonl` are the arm's whole result: a study whose output_dir is kept in version control
carries its finished arms to another machine (stdout.txt and stderr.txt are logs). A crashed arm
leaves `failed.txt` (exit status and the end of its stderr) and the others go on; a rerun retries it.
With `checkpoint_steps`, an arm keeps its latest training checkpoint while it runs and `running.json`
(the settings it runs with, and its process id); a rerun resumes an interrupted arm from that checkpoint
when the settings are still the same (the run continues bitwise) and starts it over otherwise. A
finished arm's checkpoints are deleted. A signal stops the study and its running arms (processes.py);
a rerun while an arm of an earlier study run is still alive (its study killed outright) is refused, as
two processes would write one directory.
Arms run `parallel` at a time. Before anything runs, every arm's config is validated, so a typo fails
the study at once instead of after an hour.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from ..log import get_logger
from ..provenance import NUMERICS, machine, software_versions, source_commit
from .grid import Arm, Study, StudyError
from .processes import ArmProcesses, StudyStopped

__all__ = ["arm_command", "arm_config", "arm_dir", "check_arms", "drop_checkpoints", "finished_record", "progress", "run_arms"]

logger = get_logger(__name__)

DONE, FAILED, RUNNING = "arm.json", "failed.txt", "running.json"


def arm_dir(study: Study, arm: Arm) -> Path:
    return study.output_dir / "arms" / arm.name


def _overrides(study: Study, arm: Arm) -> dict:
    checkpoints = dict(save_steps=study.checkpoint_steps, save_total_limit=1,
                       resume_from_checkpoint="latest") if study.checkpoint_steps else {}
    return {**study.base, **arm.overrides(study.launch), "output_dir": str(arm_dir(study, arm)),
            "save_final": False, "report_to": "none", "threads_per_rank": study.threads_per_arm, **checkpoints}


def _cli(values: dict) -> list[str]:
    args = []
    for key, value in values.items():
        args += [f"--{key}", json.dumps(value) if isinstance(value, list) else str(value)]
    return args


def arm_config(study: Study, arm: Arm):
    """The arm's TrainConfig, as its run reads it (ConfigError on a bad value)."""
    from ..config import load_config

    return load_config(str(study.base_config), _cli(_overrides(study, arm)))


def check_arms(study: Study, arms: list[Arm]) -> None:
    """Validate every arm's config as train.py would (StudyError naming the arm)."""
    from ..config import ConfigError
    from ..config_checks import validate_config

    import torch

    for arm in arms:
        try:
            config = arm_config(study, arm)
            if config.eval_fraction <= 0 and config.eval_dataset is None:
                raise ConfigError("the study compares validation losses: set eval_fraction or eval_dataset in base")
            if study.launch == "emulator" and config.mixed_precision != "no" and torch.cuda.is_available():
                raise ConfigError("emulated arms compute in fp32, a synchronous arm on this GPU in bf16 (mixed_precision "
                                  f"{config.mixed_precision}): set mixed_precision: \"no\" in base, so that the gaps "
                                  "measure the delay alone")
            validate_config(config, arm.depth if study.launch == "pipeline" else 1)
        except ConfigError as err:
            raise StudyError(f"arm {arm.name}: {err}") from None


def arm_command(study: Study, arm: Arm) -> list[str]:
    """The command that runs `arm` into its directory."""
    prefix = [sys.executable, "-m", "hf_asyncpp.run"] if study.launch == "emulator" else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(arm.depth), "-m", "hf_asyncpp.run"]
    return [*prefix, "--config", str(study.base_config), *_cli(_overrides(study, arm))]


def _final_eval(directory: Path, last_step: int) -> dict | None:
    """The arm's evaluation at its last step, None before it (a run stopped after a mid-run evaluation
    exits cleanly too: that evaluation is not the arm's result)."""
    path = directory / "metrics.jsonl"
    if not path.is_file():
        return None
    evals = [r for r in map(json.loads, path.read_text().splitlines()) if "eval_loss" in r]
    return evals[-1] if evals and evals[-1]["step"] == last_step else None


# Where and when an arm writes, not what it computes: a study moved to another directory, or checkpointing
# its arms (a resumed run continues bitwise), keeps its finished arms.
_BOOKKEEPING_KEYS = ("output_dir", "save_steps", "save_total_limit", "resume_from_checkpoint")


def _config_values(config) -> dict:
    values = dataclasses.asdict(config)
    return json.loads(json.dumps({k: v for k, v in values.items() if k not in _BOOKKEEPING_KEYS}))


# Keys only Error Feedback reads that an arm without it leaves out of its settings (ef_lambda, which the
# grid sets to 1.0 in every arm, stays in, as records written before this list hold it).
_READ_BY_EF_ONLY = ("ef_last_update",)


def _read_by_its_run(config) -> dict:
    """The config's values less the keys only another optimizer reads (`soap_*` in an AdamW arm, say) and,
    without Error Feedback, the keys only it reads."""
    from ..optim import OPTIMIZER_NAMES

    others = tuple(f"{name}_" for name in OPTIMIZER_NAMES if name != config.optimizer)
    unread = () if config.ef else _READ_BY_EF_ONLY
    return {k: v for k, v in _config_values(config).items() if not k.startswith(others) and k not in unread}


def _settings(study: Study, arm: Arm) -> dict:
    """What an arm's result depends on: its resolved config (base config and every override; the files'
    comments and layout do not count; nor keys of other optimizers than its own, so that a SOAP setting
    in the study's base reruns the SOAP arms alone; nor, in an arm without Error Feedback, the keys only
    it reads) and how it is launched. A finished arm whose
    settings differ (a value in the study file or base config was edited) is run again."""
    return {"config": _read_by_its_run(arm_config(study, arm)), "launch": study.launch}


def _finished(directory: Path, settings: dict) -> dict | None:
    """The record of the arm in `directory` if it finished with `settings` under this code's numerics
    (provenance.NUMERICS), else None. A key its record lacks (added to the config after it ran) counts
    as that key's default, which keeps the behaviour from before the key."""
    try:
        record = json.loads((directory / DONE).read_text())
    except (OSError, ValueError):
        return None
    if (record.get("provenance") or {}).get("numerics") != NUMERICS:
        return None
    from ..config import TrainConfig

    defaults = _config_values(TrainConfig())
    ran = record.get("settings") or {}
    ran_config = ran.get("config") or {}
    same = ran.get("launch") == settings["launch"] and bool(ran_config) and all(
        ran_config.get(key, defaults.get(key)) == value for key, value in settings["config"].items())
    return record if same else None


def finished_record(study: Study, arm: Arm) -> dict | None:
    """`arm`'s arm.json record if it finished with the settings it would run with now, else None."""
    return _finished(arm_dir(study, arm), _settings(study, arm))


def _pace(records: list[dict], arm: Arm) -> float:
    """The seconds `arm` is expected to take: the median of the (whole) finished arms of its optimizer and
    schedule (PipeDream's per-microbatch updates cost Muon and SOAP more than a step's one), else of its
    optimizer, else of all."""
    for same in (lambda r: (r["arm"]["optimizer"], r["arm"]["schedule"]) == (arm.optimizer, arm.schedule),
                 lambda r: r["arm"]["optimizer"] == arm.optimizer, lambda r: True):
        seconds = [r["seconds"] for r in records if same(r)]
        if seconds:
            return statistics.median(seconds)
    raise ValueError("no finished arm to take the pace from")


def progress(study: Study, arms: list[Arm]) -> str:
    """How far `arms` are: how many finished, how many are left and, once any arm of the study has
    finished, about how long those take at the pace of the finished ones, `parallel` at a time."""
    left = [arm for arm in arms if finished_record(study, arm) is None]
    line = f"{len(arms) - len(left)} of {len(arms)} arms finished"
    records = [json.loads(p.read_text()) for p in sorted((study.output_dir / "arms").glob(f"*/{DONE}"))]
    records = [r for r in records if "seconds" in r and not r.get("resumed_after_step")]  # whole runs only
    if not left or not records:
        return line + (f"; {len(left)} to run" if left else "")
    hours = sum(_pace(records, arm) for arm in left) / study.parallel / 3600
    return line + f"; {len(left)} to run, about {hours:.1f} hours at the finished arms' pace, {study.parallel} at a time"


def _resumable_step(directory: Path, settings: dict) -> int:
    """The step of the arm's latest complete checkpoint when the run that wrote it had `settings` and this
    code's numerics, else 0."""
    from ..checkpoint.checkpoints import list_checkpoints

    try:
        running = json.loads((directory / RUNNING).read_text())
    except (OSError, ValueError):
        return 0
    saved = list_checkpoints(directory)
    if running.get("settings") != settings or running.get("numerics") != NUMERICS or not saved:
        return 0
    return int(saved[-1].name.rsplit("-", 1)[1])


def drop_checkpoints(directory: Path) -> None:
    """Delete the training checkpoints in a run's directory."""
    for path in directory.glob("checkpoint-*"):
        shutil.rmtree(path, ignore_errors=True)


def _alive_process(directory: Path) -> int | None:
    """The id of the process running.json names if it still runs this arm (an argument of its command
    line is the arm's directory, so a reused id does not count), else None."""
    try:
        pid = int(json.loads((directory / RUNNING).read_text())["pid"])
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if str(directory).encode() in command.split(b"\0") else None


def _refuse_alive(study: Study, arms: list[Arm]) -> None:
    for arm in arms:
        pid = _alive_process(arm_dir(study, arm))
        if pid is not None:
            raise StudyError(f"arm {arm.name} is running (process {pid}), started by another run of this study: "
                             "stop that run first (SIGTERM: its arms save a checkpoint, which a rerun resumes), or "
                             f"this arm (kill {pid}) if its study is gone")


def _run_one(study: Study, arm: Arm, processes: ArmProcesses) -> str:
    log = processes.log
    directory = arm_dir(study, arm)
    settings = _settings(study, arm)
    if _finished(directory, settings) is not None:
        return "skipped"
    if processes.stop_signal is not None:
        return "not started"
    if (directory / DONE).is_file():
        log(f"study: {arm.name}: its settings or numerics changed since it ran; running it again")
        (directory / DONE).unlink()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / FAILED).unlink(missing_ok=True)
    resumed_after = _resumable_step(directory, settings)
    if resumed_after:
        log(f"study: {arm.name}: resuming after step {resumed_after}")
    else:
        drop_checkpoints(directory)  # another run's, or none
    provenance = {"numerics": NUMERICS, "commit": source_commit(), "versions": software_versions(), "machine": machine()}
    start = time.time()
    mode = "a" if resumed_after else "w"

    def started(pid: int) -> None:
        (directory / RUNNING).write_text(json.dumps({"settings": settings, "numerics": NUMERICS, "pid": pid}))

    with open(directory / "stdout.txt", mode) as out, open(directory / "stderr.txt", mode) as err:
        status = processes.run(arm_command(study, arm), out, err, started)
    if status is None:
        return "not started"
    final = _final_eval(directory, settings["config"]["max_steps"])
    if processes.stop_signal is not None and final is None:  # its checkpoint and running.json stay
        log(f"study: {arm.name}: stopped; a rerun resumes it from its checkpoint")
        return "stopped"
    if status != 0 or final is None:
        tail = (directory / "stderr.txt").read_text()[-4000:]
        (directory / FAILED).write_text(f"exit status {status}\n{tail}")
        log(f"study: {arm.name}: failed (exit status {status}; see {directory / FAILED})")
        return "failed"
    record = {"arm": arm.__dict__, "mode": arm.mode, "final_eval": final, "seconds": round(time.time() - start, 1),
              "settings": settings, "provenance": provenance}
    if resumed_after:  # `seconds` are then the last part's
        record["resumed_after_step"] = resumed_after
    (directory / DONE).write_text(json.dumps(record, indent=1))
    drop_checkpoints(directory)
    (directory / RUNNING).unlink(missing_ok=True)
    log(f"study: {arm.name}: eval_loss {final['eval_loss']:.4f} ({record['seconds']:.0f}s)")
    return "done"


def run_arms(study: Study, arms: list[Arm], log=logger.info) -> dict[str, str]:
    """Run the arms not finished yet, `study.parallel` at a time; {arm name: done|skipped|failed}.
    The arms' configs are expected to be checked (`check_arms`) already. StudyStopped once a signal
    stopped the study (processes.py) and its running arms have saved their checkpoints."""
    _refuse_alive(study, arms)
    processes = ArmProcesses(log)

    def run(arm: Arm) -> str:
        outcome = _run_one(study, arm, processes)
        if outcome == "done":
            log(f"study: {progress(study, arms)}")
        return outcome

    log(f"study: {progress(study, arms)}")
    with processes.stopping_on_signals(), ThreadPoolExecutor(max_workers=study.parallel) as pool:
        futures = {arm.name: pool.submit(run, arm) for arm in arms}
        # Waiting in slices: a signal the OS hands to a worker thread is handled by the main thread only
        # when it next runs Python code, which a wait without a timeout would put off until an arm ends.
        while wait(list(futures.values()), timeout=1.0).not_done:
            pass
        outcomes = {name: future.result() for name, future in futures.items()}
    if processes.stop_signal is not None:
        counts = {o: sum(v == o for v in outcomes.values()) for o in ("stopped", "not started")}
        raise StudyStopped(f"arms stopped at a checkpoint: {counts['stopped']}, not started: {counts['not started']}")
    return outcomes
