"""One training run on this rank, whichever front end started it.

`TrainingLoop` owns what happens around the engine's steps: the data position (resume continues at
the next unseen block; a stream from the position its checkpoint saved), logging records,
evaluation, checkpoints, an early stop, the metrics file, trackers, the loss-curve PNG, the HF export
and the model card. A front end decides only *when*:
`LoopHooks` is train.py's answer (the config's logging_steps / eval_steps / save_steps), and
`AsyncPPTrainer` answers through transformers' callbacks. So train.py and the Trainer run the same
steps on the same rows and log the same losses.

Checkpoints are written in the background while the next steps run (checkpoint/saving.py): the
front end hears of one (`on_save`) once it is complete, at the next save, a stop or the end.

A SIGTERM (preemption) ends the run at the step boundary where every rank learns of it (resilience.py),
and so does the job's time limit once only a save still fits before it (resilience.TimeLimit): all
ranks save a checkpoint there and `run()` returns with `terminated_at` set; nothing else follows (no
final evaluation or export), and the same command with `resume_from_checkpoint: latest` continues.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .console import step_line
from .log import get_logger
from .profiling import profiled_step
from .resilience import LocalFailure, PeerLostError, RunFailure
from .run_summary import IdleTally, idle_summary
from .utilization import FIELDS as UTILIZATION_FIELDS
from .utilization import Utilization

__all__ = ["MEASURED_KEYS", "LoopHooks", "StepDecision", "TrainingLoop", "load_main_process_first", "step_record"]

logger = get_logger(__name__)


@dataclass
class StepDecision:
    """What follows a step: log it, evaluate, save a checkpoint, stop training."""

    log: bool = False
    evaluate: bool = False
    save: bool = False
    stop: bool = False


class LoopHooks:
    """The script front end's decisions (the config's *_steps keys) and its `TrainerState`, which a
    checkpoint carries as trainer_state.json (logged records and evaluations in its log_history)."""

    def __init__(self, config):
        from transformers import TrainerState

        self.config = config
        self.state = TrainerState(max_steps=config.max_steps, logging_steps=config.logging_steps,
                                  eval_steps=config.eval_steps, save_steps=config.save_steps,
                                  train_batch_size=config.rows_per_step)

    def on_step_begin(self, step: int) -> None:
        pass

    def after_step(self, result, last_step: int) -> StepDecision:
        """`result.step` steps are done out of `last_step` (metrics.StepResult)."""
        c, step = self.config, result.step
        return StepDecision(
            log=step % c.logging_steps == 0 or step == last_step,
            evaluate=bool(c.eval_steps) and step % c.eval_steps == 0,
            save=bool(c.save_steps) and step % c.save_steps == 0,
        )

    def trainer_state(self, loop: "TrainingLoop", step: int):
        """The front end's `transformers.TrainerState` after `step` steps, for a checkpoint."""
        state = self.state
        state.global_step, state.max_steps, state.num_input_tokens_seen = step, loop.end_step, loop.tokens_seen
        state.epoch = loop.data.epoch(step)
        state.num_train_epochs = math.ceil(loop.data.epoch(loop.end_step))
        return state

    def resumed_from(self, checkpoint: Path) -> None:
        """A checkpoint was loaded: continue its TrainerState (log history included)."""
        from transformers import TrainerState

        from .checkpoint.checkpoints import TRAINER_STATE

        self.state = TrainerState.load_from_json(str(checkpoint / TRAINER_STATE))

    def on_log(self, record: dict) -> None:
        self.state.log_history.append(dict(record))

    def on_evaluate(self, results: dict) -> None:
        self.state.log_history.append(dict(results))

    def on_save(self, path: Path) -> None:
        pass


# What a step record says of how fast and in how much memory the machine ran, not of what the run
# computed: reruns of the same numerics differ there (a reproduction compares the rest).
MEASURED_KEYS = ("train_tokens_per_second", "step_time_s", "idle_fraction_per_rank", *UTILIZATION_FIELDS)


def step_record(result, tokens_seen: int, epoch: float, tokens_per_second: float, schedule: str,
                utilization=None) -> dict:
    """The logged record of one step (metrics.jsonl, trackers, the Trainer's log_history), under the
    names transformers' Trainer logs where it has one: `learning_rate`, `epoch`, `num_input_tokens_seen`
    (all dp ranks), `train_tokens_per_second` (this session's tokens over its wall time so far); with
    `utilization` (utilization.Utilization), achieved TFLOP/s per device, MFU and memory per rank."""
    return {
        "step": result.step,
        "epoch": epoch,
        "loss": result.loss,
        "aux_loss": result.aux_loss,
        "learning_rate": result.lr,
        "grad_norm": result.grad_norm,
        "num_input_tokens_seen": tokens_seen,
        "train_tokens_per_second": tokens_per_second,
        "step_time_s": result.step_time_s,
        "idle_fraction_per_rank": result.idle_fraction_per_rank,
        "weight_version_age_per_stage": result.weight_version_age_per_stage,
        "skipped_updates_per_stage": result.skipped_updates_per_stage,
        "schedule": schedule,
        **(utilization.fields(result, tokens_per_second) if utilization is not None else {}),
    }


def load_main_process_first(layout, load):
    """`load()` on rank 0 first, then on the others, which read the datasets cache rank 0 filled
    instead of racing to write it. A failure on any rank (a bad file, rows that do not fit) ends
    every rank with the same RunFailure, before training: the others would otherwise wait for the
    failed rank and report a lost peer."""
    import torch.distributed as dist

    from .data.errors import DataError
    from .resilience import RunFailure

    outcome: dict = {}

    def attempt() -> None:
        try:
            outcome["value"] = load()
        except Exception as err:  # noqa: BLE001 — whatever it is, every rank must learn of it
            outcome["error"] = str(err) if isinstance(err, DataError) else (
                f"loading the data failed on rank {layout.rank}: {type(err).__name__}: {err}")

    if layout.is_main:
        attempt()
    first = [outcome.get("error")]
    dist.broadcast_object_list(first, group=layout.io_group, group_src=0)
    if first[0] is None and not layout.is_main:
        attempt()
    errors = [None] * layout.world_size
    dist.all_gather_object(errors, outcome.get("error"), group=layout.io_group)
    message = first[0] or next((e for e in errors if e), None)
    if message:
        raise RunFailure(message)
    return outcome["value"]


class TrainingLoop:
    """Steps `engine` over `data` (data/run_data.py: TrainingData) from a fresh start or a checkpoint."""

    def __init__(self, config, model_config, layout, engine, data, tokenizer, hooks: LoopHooks | None = None,
                 report_to: list[str] | None = None, progress_bar: bool = True):
        """`report_to` overrides config.report_to (a front end with its own trackers passes []);
        `progress_bar`: the loop's tqdm bar on the main process."""
        self.config, self.model_config, self.layout = config, model_config, layout
        self.engine, self.data, self.tokenizer = engine, data, tokenizer
        self.hooks = hooks or LoopHooks(config)
        self.report_to = config.report_to if report_to is None else report_to
        # Drawn on a terminal only: redirected (a job's log file), a bar is one line of carriage returns.
        self.progress_bar = progress_bar and layout.is_main and sys.stderr.isatty()
        self._progress = None
        self.start_step, self.tokens_seen = 0, 0
        self.checkpoint_state: dict = {}  # what the checkpoint resumed from holds (pipeline_state.json)
        self.last_record: dict = {}
        self.last_eval: dict | None = None  # the latest evaluation (kept in checkpoints, for their card)
        self.final_eval: dict | None = None
        self.end_step = config.max_steps
        self.terminated_at: int | None = None  # the step after which a SIGTERM ended the run
        self.data_description: str | None = None  # the card's data section, when not config.dataset's
        self.started_from: str | None = None  # where a front end's model was loaded from, for the card
        self.writer = self.reporters = None  # opened at the first record (main process)
        self.idle = IdleTally()  # this launch's steps, for the closing lines
        self.utilization = Utilization(model_config, config.seq_len, layout.world_size, layout.device,
                                       config.peak_tflops)
        from .checkpoint.saving import CheckpointWriter
        from .resilience import TimeLimit

        self.checkpoints = CheckpointWriter(layout, background=config.checkpoint_async)
        self.time_limit = TimeLimit.from_environment() if config.save_before_time_limit and self._stops_cleanly() else None
        self._state_bytes: int | None = None  # this rank's checkpoint size, for the time limit before a save is timed
        self._time_limit_asked = False  # this rank asked for the stop, the job's end being near
        self._said_saved: Path | None = None  # the checkpoint whose line was printed last

    def resume(self, resume_from: str) -> None:
        """Load a checkpoint (a directory, or "latest" in output_dir): the next step is the one after it.
        "latest" with no checkpoint yet starts from step 0."""
        from .checkpoint.checkpoints import find_checkpoint, load_checkpoint, read_data_positions

        path = find_checkpoint(resume_from, self.config.output_dir)
        if path is None:
            logger.info(f"no checkpoint in {self.config.output_dir} yet: starting from step 0")
            return
        self.checkpoint_state = load_checkpoint(self.engine, self.layout, path)
        self.start_step, self.tokens_seen = self.checkpoint_state["step"], self.checkpoint_state["tokens_seen"]
        self.engine.guard.load_state_dict(self.checkpoint_state.get("nonfinite", {}))
        self.last_record = self.checkpoint_state.get("last_record") or {}
        self.last_eval = self.checkpoint_state.get("last_eval")
        self.engine.resume_after(self.start_step)
        self.hooks.resumed_from(path)
        # A stream continues from its saved position; every rank learns if rank 0's is refused.
        positions = read_data_positions(path)
        replayed = load_main_process_first(self.layout, lambda: self.data.sampler.resume(self.start_step, positions))
        if replayed and self.layout.is_main:
            logger.warning(replayed)
        logger.info(f"resumed from {path} after step {self.start_step}")

    # --- the run -------------------------------------------------------------------------------

    def run(self) -> dict:
        """Train from the start (or checkpoint) to max_steps or an earlier stop; evaluate at the end
        when there is an evaluation set; say what the pipeline left idle and the validation loss.
        Returns the last logged record."""
        from tqdm.auto import tqdm

        from .console import banner

        engine = self.engine
        if self.layout.is_main:
            for line in banner(self.config, self.model_config, self.layout.dp_size, engine.spec.name,
                               engine.plan.describe(), self.tokenizer):
                logger.info(line)
        progress = tqdm(total=self.end_step, initial=self.start_step, disable=not self.progress_bar,
                        desc="train", unit="step")
        self._progress = progress
        try:
            with self._termination_handled():
                self._steps(self.start_step, progress)
        except BaseException as err:
            if isinstance(err, RunFailure) and not isinstance(err, (LocalFailure, PeerLostError)):
                with contextlib.suppress(RunFailure):  # raised together: the save in flight can end
                    self.settle_checkpoint()
            else:  # a lost peer (often still a bare gloo error here) or this rank's own failure
                self.checkpoints.abandon(self.config.comm_timeout_s + 5)
            raise
        self.settle_checkpoint()
        engine.finish(wait_for_sends=self.terminated_at is None)
        progress.close()
        if self.terminated_at is None and self.data.held_out is not None:
            self.final_eval = self.evaluate(self.end_step)
            self.hooks.on_evaluate(self.final_eval)
        if self.terminated_at is None:
            for line in self._closing_lines():
                logger.info(line)
        self.close()
        return self.last_record

    def _closing_lines(self) -> list[str]:
        """The run's last words (a collective on a pipeline): each pipeline rank's idle share beside the
        same run with a flush added or taken away (run_summary.py), then the final validation loss."""
        lines = []
        if self.layout.pp_size > 1 and self.idle.steps:
            compute_s, step_time_s = self.idle.per_step_by_pipeline_rank(self.layout)
            lines += idle_summary(self.engine.spec, self.config.n_microbatches, self.idle.steps, compute_s, step_time_s)
        if self.final_eval is not None:
            lines.append(f"validation loss {self.final_eval['eval_loss']:.4f}, "
                         f"perplexity {self.final_eval['eval_perplexity']:.2f}")
        return lines

    def _stops_cleanly(self) -> bool:
        """Whether a step boundary can be checkpointed (not WPipe on a pipeline: ScheduleSpec.step_boundary)."""
        return self.engine.spec.step_boundary(self.config.pp_size, self.config.n_microbatches).clean

    def _termination_handled(self):
        """SIGTERM handled at a step boundary where the run can be checkpointed; otherwise the signal
        keeps its default effect."""
        return self.engine.termination.installed() if self._stops_cleanly() else contextlib.nullcontext()

    def _watch_time_limit(self, step_time_s: float) -> None:
        """Ask for the stop once a save would no longer fit before the job's end (resilience.TimeLimit)."""
        measured = self.checkpoints.last.total_s if self.checkpoints.last else self.checkpoint_state.get("save_seconds")
        if measured is None and self._state_bytes is None:
            from .checkpoint.saving import state_bytes
            from .checkpoint.training_state import training_state

            self._state_bytes = state_bytes(training_state(self.engine, self.layout.rank))
        save_s = self.time_limit.save_estimate_s(measured, self._state_bytes or 0)
        if self.time_limit.due(step_time_s, save_s) and not self._time_limit_asked:
            self._time_limit_asked = True
            self.engine.termination.request(self.time_limit.reason(save_s))

    def _rows(self, step: int):
        """Step `step`'s rows on this rank. A streamed dataset is checked as it is read: a bad row found
        mid-run is said by the ranks that read it (the others stop as for a lost peer)."""
        from .data.errors import DataError
        from .resilience import LocalFailure

        try:
            return self.data.sampler.rows(step)
        except DataError as err:
            raise LocalFailure(str(err)) from err

    def _steps(self, step: int, progress) -> None:
        engine = self.engine
        session_start, session_tokens = time.perf_counter(), self.tokens_seen  # for train_tokens_per_second
        while step < self.end_step:
            self.hooks.on_step_begin(step)
            next_rows = self._rows(step + 1) if engine.forwards_ahead and step + 1 < self.end_step else None
            with profiled_step(step + 1, self.config.profile_steps, self.config.output_dir, self.layout.rank,
                               self.layout.device.type == "cuda") as trace:
                result = engine.train_step(self._rows(step), next_rows)
            if trace is not None and self.layout.is_main:
                logger.info(f"step {step + 1} profiled: {trace.parent}/step{step + 1}_rank*.json (Chrome trace)")
            step = result.step
            if (written := self.checkpoints.written()) is not None:
                self._say_saved(written)
            if self.time_limit is not None:
                self._watch_time_limit(result.step_time_s)
            self.tokens_seen += result.tokens
            self.idle.add(result)
            progress.update(1)
            decision = self.hooks.after_step(result, self.end_step)
            if decision.log:  # every rank: the values come from one all-reduce
                tokens_per_second = (self.tokens_seen - session_tokens) / (time.perf_counter() - session_start)
                self.last_record = step_record(result, self.tokens_seen, self.data.epoch(step), tokens_per_second,
                                               engine.spec.name, self.utilization)
                if self.layout.is_main:
                    self._say(step_line(self.last_record, self.end_step))
                    self._publish(self.last_record)
                self.hooks.on_log(self.last_record)
            if decision.evaluate and self.data.held_out is not None and step < self.end_step:  # the end evaluates anyway
                self.hooks.on_evaluate(self.evaluate(step))
            if decision.save or (result.termination_requested and step < self.end_step):
                self.save(step)
            if result.termination_requested and step < self.end_step:
                self.settle_checkpoint()
                self.terminated_at = step
                cause = "the job's time limit" if self._time_limit_asked else "SIGTERM"
                logger.info(f"stopped after step {step} on {cause}; checkpoint-{step} is saved: run the same "
                            "command with resume_from_checkpoint: latest to continue")
                break
            if decision.stop and step < self.end_step:
                self.end_step = engine.stop_after(step)
                progress.total = self.end_step

    def _say(self, line: str) -> None:
        """A console line (main process), above the progress bar where one is drawn."""
        if self._progress is not None and not self._progress.disable:
            self._progress.write(f"[hf_asyncpp] {line}")
        else:
            logger.info(line)

    def _publish(self, record: dict) -> None:
        if self.writer is None:
            from .metrics import MetricsWriter
            from .reporting import Reporters

            out = Path(self.config.output_dir)
            self.writer = MetricsWriter(out, self.start_step if self.checkpoint_state else None)
            self.reporters = Reporters(self.report_to, out / "runs", out.name, dataclasses.asdict(self.config),
                                       run_ids=self.checkpoint_state.get("tracker_run_ids"))
        try:
            self.writer.write(record)
        except OSError as err:  # e.g. output_dir became read-only: say so instead of a traceback
            from .resilience import LocalFailure

            raise LocalFailure(f"writing {self.writer.path} failed ({err}); complete checkpoints are kept") from err
        self.reporters.log(record, record["step"])

    def evaluate(self, step: int) -> dict:
        """Validation loss, aux loss and perplexity of the held-out blocks now (collective)."""
        from .evaluation import evaluate

        from .console import eval_line

        results = {"step": step, **evaluate(self.engine, self.data.held_out, self.config.rows_per_step,
                                             self.layout.dp_rank, self.layout.dp_size)}
        if self.layout.is_main:
            self._say(eval_line(results))
            self._publish(results)
        self.last_eval = results
        return results

    def save(self, step: int) -> Path:
        """Start a training checkpoint after `step` steps (collective): the engine's state, the front
        end's TrainerState, the model's config and tokenizer, and what the run's card is made of. It is
        complete, and the front end told (on_save), by `settle_checkpoint`: at once unless
        checkpoint_async, otherwise at the next save, a stop or the end."""
        self.settle_checkpoint()
        last = self.checkpoints.last
        run_state = {"tokens_seen": self.tokens_seen, "config": dataclasses.asdict(self.config),
                     "nonfinite": self.engine.guard.state_dict(), "last_record": self.last_record,
                     "last_eval": self.last_eval, "data_description": self.data_description,
                     "started_from": self.started_from,
                     # the latest save's time, for the time-limit stop of the launch that resumes this one
                     "save_seconds": last.total_s if last else self.checkpoint_state.get("save_seconds"),
                     # the trackers' runs (W&B), which the launch that resumes this one continues
                     "tracker_run_ids": (self.reporters.run_ids() if self.reporters is not None
                                         else self.checkpoint_state.get("tracker_run_ids"))}
        trainer_state = dataclasses.asdict(self.hooks.trainer_state(self, step))
        from .checkpoint.hf_export import export_dtype, size_limit

        hf_weights = ((export_dtype(self.config.export_dtype), size_limit(self.config.max_shard_size))
                      if self.config.checkpoint_hf_weights else None)
        path = self.checkpoints.save(self.engine, self.config.output_dir, step, run_state,
                                     self.config.save_total_limit, trainer_state, self.model_config, self.tokenizer,
                                     data_position=self.data.sampler.position(step), hf_weights=hf_weights)
        if not self.checkpoints.background:
            self.settle_checkpoint()
        return path

    def settle_checkpoint(self) -> None:
        """Wait for the checkpoint being written (collective); once it is complete, say how long it took
        and tell the front end (on_save). A failed write raises its CheckpointError here, on every rank."""
        done = self.checkpoints.wait()
        if done is None:
            return
        self._say_saved(done)
        self.hooks.on_save(done)

    def _say_saved(self, path: Path) -> None:
        """The checkpoint line, once per checkpoint (main process): when its write is seen complete
        between steps, or at the latest when the run waits for it."""
        if not self.layout.is_main or path == self._said_saved:
            return
        self._said_saved, timing = path, self.checkpoints.last
        self._say(f"saved {path} ({timing.bytes / 2**30:.2f} GiB; training waited {timing.staging_s:.1f} s, "
                  f"writing took {timing.writing_s:.1f} s)")

    def close(self) -> None:
        """Close the metrics file and trackers and draw the loss curves (main process)."""
        if self.writer is None:
            return
        self.writer.close()
        self.reporters.close()
        self.writer = None
        try:
            from .plots import write_loss_curves

            write_loss_curves(self.config.output_dir)
        except (ValueError, OSError) as err:  # e.g. no step was logged: nothing to draw
            logger.warning(f"no loss curves: {err}")

    # --- what the run leaves ---------------------------------------------------------------------

    def model_card(self, repo_id: str | None) -> str:
        from .hub import run_model_card

        return run_model_card(self.config, self.model_config, (self.layout.pp_size, self.layout.dp_size),
                              self.engine.spec, self.last_record, self.final_eval, self.data_description, repo_id,
                              started_from=self.started_from)

    def export(self, out_dir: str | Path, repo_id: str | None = None) -> Path:
        """The HF model (safetensors, config, tokenizer, model card) in `out_dir` (collective)."""
        from .checkpoint import export_dtype, export_hf_model

        self.settle_checkpoint()
        card = self.model_card(repo_id) if self.layout.is_main else None
        out = export_hf_model(self.engine.stage_state_dict(), self.layout, self.model_config, self.tokenizer,
                              Path(out_dir), self.config.max_shard_size, card, export_dtype(self.config.export_dtype))
        logger.info(f"saved {out}")
        return out
