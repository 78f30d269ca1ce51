"""`AsyncPPTrainer`: a transformers.Trainer whose training loop is the pipeline's.

    trainer = AsyncPPTrainer(model=model, args=AsyncPPTrainingArguments(...), train_dataset=train,
                             eval_dataset=valid, processing_class=tokenizer)
    trainer.train()            # or train(resume_from_checkpoint=True)
    trainer.push_to_hub()

Every process of the launch (accelerate launch / torchrun) builds the same model and Trainer; the
Trainer cuts the model into this rank's stages and drives the same `TrainingLoop` and
`PipelineEngine` as train.py. What Trainer users rely on maps onto it: the callbacks decide when to
log, evaluate and save (DefaultFlowCallback with "steps", "epoch" or "best", and any `TrainerControl`
a user callback sets, including EarlyStoppingCallback's stop); epoch events fire at the step that ends
an epoch; state.best_metric and best_model_checkpoint are set as Trainer sets them; log_history holds
the numbers of metrics.jsonl's records under the same names (the train and aux loss as means since the
last log, as Trainer logs its loss), and eval_loss / eval_perplexity; `report_to`
reaches the usual integration callbacks; checkpoints are the pipeline's (sharded, every rank) in
output_dir/checkpoint-<step>, with the Trainer's state in trainer_state.json (log history, best
metric, callbacks' states; `TrainerState.load_from_json` reads it); `save_model` writes the HF export
(output_dir/final unless told otherwise), pushed as Trainer pushes (push_to_hub, hub_strategy end /
every_save, hub_revision), and the card describes what was really done (pretraining from
scratch, or training from the weights `from_pretrained` loaded the model from; the optimizer, the
schedule). Gradient clipping is by the global norm over all stages
and dp ranks (update/held.py), or each asynchronous stage's own with the pipeline config's
`grad_clip_scope: stage`.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import time
from pathlib import Path

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput

from .config import ConfigError
from .config_checks import check_model_fits, check_settings, check_step_boundaries, resolve_schedule
from .loop import LoopHooks, StepDecision, TrainingLoop
from .trainer_args import AsyncPPTrainingArguments

__all__ = ["AsyncPPTrainer", "AsyncPPTrainingArguments"]

# Trainer arguments that have no meaning here: the pipeline computes the LM loss itself, builds its
# optimizer from the arguments and feeds packed token blocks without a collator.
_UNSUPPORTED = ("data_collator", "model_init", "compute_loss_func", "compute_metrics", "optimizers",
                "optimizer_cls_and_kwargs", "preprocess_logits_for_metrics")


def _loaded_from(model) -> str | None:
    """Where `from_pretrained` loaded the model's weights from (its name_or_path), or None for a model
    built from a config. name_or_path alone cannot tell (a config read from a directory or Hub id names
    it too): transformers marks each parameter it loads with `_is_hf_initialized`
    (tests/test_trainer.py pins that)."""
    loaded = any(getattr(p, "_is_hf_initialized", False) for p in model.parameters())
    return (model.name_or_path or None) if loaded else None


def _rows_length(dataset) -> int | None:
    """seq_len of a dataset that holds input_ids rows (None for text)."""
    import torch

    if isinstance(dataset, torch.Tensor):
        return int(dataset.shape[1])
    features = getattr(dataset, "column_names", None) or []
    if "input_ids" not in features:
        return None
    first = next(iter(dataset))["input_ids"]
    return len(first)


def _describe(train_dataset, eval_dataset) -> str:
    """The model card's data section for datasets handed to the Trainer."""
    def one(dataset) -> str:
        info = getattr(dataset, "info", None)
        name = getattr(info, "dataset_name", None) or getattr(info, "builder_name", None) or type(dataset).__name__
        size = f"{len(dataset)} rows" if hasattr(dataset, "__len__") else "streamed"
        columns = getattr(dataset, "column_names", None)
        return f"`{name}` ({size}" + (f"; columns: {', '.join(columns)})" if columns else ")")

    text = f"Pretraining data: the train_dataset given to AsyncPPTrainer, {one(train_dataset)}."
    if eval_dataset is not None:
        text += f" Validation: {one(eval_dataset)}, held out."
    return text


def _mean(values: list[float], finite_only: bool) -> float:
    """The logged mean; `finite_only` (logging_nan_inf_filter) leaves out non-finite values, as Trainer
    does, unless none is finite."""
    kept = [v for v in values if math.isfinite(v)] if finite_only else values
    return sum(kept or values) / len(kept or values)


class _TrainerHooks(LoopHooks):
    """The loop's decisions and events, answered by the Trainer's callbacks and state.

    An epoch is the train blocks once over (`rows_per_epoch`), at `rows_per_step` rows a step on all dp
    ranks together (data/samplers.py: a step may straddle two epochs; it ends the first). Epoch events
    fire at the step that reads an epoch's last block, and at the run's last step, as Trainer fires
    them when an epoch's batches or max_steps run out. The loop reads a StepDecision's `save` and
    `stop` after the step's evaluation, so an evaluation can still decide them (save_strategy "best",
    an EarlyStoppingCallback)."""

    def __init__(self, trainer: "AsyncPPTrainer", rows_per_epoch: int | None, rows_per_step: int):
        self.trainer = trainer
        self.rows_per_epoch, self.rows_per_step = rows_per_epoch, rows_per_step
        self.since_last_log: list = []  # StepResults not yet in a logged mean
        self.decision: StepDecision | None = None  # the decision of the step in progress

    def ends_epoch(self, steps_done: int) -> bool:
        if not self.rows_per_epoch or steps_done == 0:
            return False
        rows, per_epoch = self.rows_per_step, self.rows_per_epoch
        return steps_done * rows // per_epoch > (steps_done - 1) * rows // per_epoch  # epochs completed grew

    def on_step_begin(self, step: int) -> None:
        t = self.trainer
        if step == t.loop.start_step or self.ends_epoch(step):
            t.control = t.callback_handler.on_epoch_begin(t.args, t.state, t.control)
        t.control = t.callback_handler.on_step_begin(t.args, t.state, t.control)

    def after_step(self, result, last_step: int) -> StepDecision:
        t = self.trainer
        self.since_last_log.append(result)
        t.state.global_step = result.step
        t.state.epoch = t.loop.data.epoch(result.step)
        t.state.num_input_tokens_seen = t.loop.tokens_seen
        t.control = t.callback_handler.on_step_end(t.args, t.state, t.control)
        if self.ends_epoch(result.step) or result.step == last_step:
            t.control = t.callback_handler.on_epoch_end(t.args, t.state, t.control)
        c = t.control
        self.decision = StepDecision(log=c.should_log, evaluate=c.should_evaluate, save=c.should_save,
                                     stop=c.should_training_stop)
        c.should_log = c.should_evaluate = c.should_save = False
        return self.decision

    def on_log(self, record: dict) -> None:
        """The record's numbers under the same names (metrics.py: numeric_scalars), the losses as their
        mean since the last log, as Trainer logs its loss."""
        from .metrics import numeric_scalars

        window, self.since_last_log = self.since_last_log, []
        args, finite_only = self.trainer.args, self.trainer.args.logging_nan_inf_filter
        logs = {**numeric_scalars(record), "loss": _mean([r.loss for r in window], finite_only),
                "aux_loss": _mean([r.aux_loss for r in window], finite_only)}
        if args.include_num_input_tokens_seen in ("no", False):  # as Trainer: logged only when asked for
            logs.pop("num_input_tokens_seen", None)
        self.trainer.log(logs)

    def on_evaluate(self, results: dict) -> None:
        """Log, the callbacks' on_evaluate, then the best metric (Trainer's order: EarlyStoppingCallback
        compares with the best before this evaluation)."""
        t = self.trainer
        metrics = {k: v for k, v in results.items() if k.startswith("eval_")}
        t.log(metrics)
        t.control = t.callback_handler.on_evaluate(t.args, t.state, t.control, metrics=metrics)
        is_new_best = t._determine_best_metric(metrics, None)  # transformers' own rule
        self._note_best_checkpoint()
        if self.decision is not None:
            if t.args.save_strategy == "best":
                self.decision.save = is_new_best
            self.decision.stop = self.decision.stop or t.control.should_training_stop

    def _note_best_checkpoint(self) -> None:
        """state.best_model_checkpoint: checkpoint-<best_global_step>, once it exists (Trainer's rule)."""
        state = self.trainer.state
        if state.best_global_step:
            best = Path(self.trainer.args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}"
            if best.is_dir():
                state.best_model_checkpoint = str(best)

    def on_save(self, path: Path) -> None:
        t = self.trainer
        self._note_best_checkpoint()
        if t.args.push_to_hub and t.args.hub_strategy == "every_save":
            progress = f"step {t.state.global_step}" if t.args.save_strategy == "steps" else f"epoch {int(t.state.epoch)}"
            try:
                t.push_to_hub(commit_message=f"Training in progress, {progress}")
            except Exception as err:  # noqa: BLE001 — an upload failing mid-run must not end it on rank 0 alone
                print(f"[hf_asyncpp] warning: pushing {PREFIX_CHECKPOINT_DIR}-{t.state.global_step}'s export failed "
                      f"({type(err).__name__}: {err}); training continues", file=sys.stderr)
        t.control = t.callback_handler.on_save(t.args, t.state, t.control)

    def trainer_state(self, loop, step: int):
        """The Trainer's own state, with its callbacks' (EarlyStoppingCallback's patience, TrainerControl)
        as Trainer saves them."""
        from transformers import TrainerState
        from transformers.trainer_callback import ExportableState

        t = self.trainer
        exportable = [cb for cb in t.callback_handler.callbacks + [t.control] if isinstance(cb, ExportableState)]
        t.state.stateful_callbacks = TrainerState(stateful_callbacks=exportable).stateful_callbacks
        return t.state

    def resumed_from(self, checkpoint: Path) -> None:
        """The checkpoint's TrainerState replaces the Trainer's, and its callbacks' states are restored,
        as Trainer does when it resumes."""
        from transformers import TrainerState

        from .checkpoint.checkpoints import TRAINER_STATE

        t = self.trainer
        state = TrainerState.load_from_json(str(checkpoint / TRAINER_STATE))
        state.is_world_process_zero, state.is_local_process_zero = t.state.is_world_process_zero, t.state.is_local_process_zero
        t.state = state
        t._load_callback_state()


class AsyncPPTrainer(Trainer):
    def __init__(self, model=None, args: AsyncPPTrainingArguments | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, callbacks=None, **unsupported):
        given = sorted(k for k, v in unsupported.items() if k in _UNSUPPORTED and v not in (None, (None, None)))
        if given:
            raise ConfigError(f"AsyncPPTrainer does not take {', '.join(given)}: the pipeline computes the LM loss "
                              "(+ aux loss), builds its optimizer from args.optimizer and packs token blocks itself")
        unknown = sorted(set(unsupported) - set(_UNSUPPORTED))
        if unknown:
            raise TypeError(f"AsyncPPTrainer got unexpected argument(s): {', '.join(unknown)}")
        if not isinstance(args, AsyncPPTrainingArguments):
            raise ConfigError("AsyncPPTrainer needs args=AsyncPPTrainingArguments(...) (TrainingArguments plus the "
                              "pipeline's schedule, pp_size, n_microbatches, optimizer, momentum, ef, ef_lambda)")
        if model is None:
            raise ConfigError("AsyncPPTrainer needs a model (an HF causal LM; every process builds the same one)")
        if train_dataset is None:
            raise ConfigError("AsyncPPTrainer needs a train_dataset (token rows or text to pack)")
        if args.eval_strategy != "no" and eval_dataset is None:
            raise ConfigError(f"eval_strategy is '{args.eval_strategy.value}' but there is no eval_dataset: "
                              "pass eval_dataset or set eval_strategy to 'no'")
        if args.eval_on_start and eval_dataset is None:
            raise ConfigError("eval_on_start is set but there is no eval_dataset: pass eval_dataset")
        started_from = _loaded_from(model)  # before anything moves or cuts the model
        config = self._config_for(args, model.config, train_dataset, eval_dataset, processing_class)
        data = self._prepare_data(args, config, model, train_dataset, eval_dataset, processing_class)
        super().__init__(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, callbacks=callbacks)
        # The launch's ranks, not accelerate's view (which on CPU may not see the launch as distributed).
        self.state.is_world_process_zero = self.is_world_process_zero()
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.loop = self._start_pipeline(config, model, data, processing_class)
        self.loop.data_description = _describe(train_dataset, eval_dataset)
        self.loop.started_from = started_from
        self._trained = False

    def is_world_process_zero(self) -> bool:
        return os.environ.get("RANK", "0") == "0"

    def is_local_process_zero(self) -> bool:
        return os.environ.get("LOCAL_RANK", "0") == "0"

    # --- construction ---------------------------------------------------------------------------

    @staticmethod
    def _config_for(args, model_config, train_dataset, eval_dataset, tokenizer):
        """The TrainConfig of this run, checked against the model and the tokenizer (ConfigError)."""
        from .models import UnsupportedModelError, family_for

        rows_length = _rows_length(train_dataset)
        if rows_length is None and tokenizer is None:
            raise ConfigError("train_dataset holds text: pass processing_class=<tokenizer> (or tokenized input_ids rows)")
        if rows_length is None and args.seq_len is None:
            raise ConfigError("train_dataset holds text: set seq_len in AsyncPPTrainingArguments (the block length)")
        if rows_length is not None and args.seq_len not in (None, rows_length):
            raise ConfigError(f"seq_len is {args.seq_len} but train_dataset's input_ids rows hold {rows_length} tokens")
        config = args.to_train_config(seq_len=args.seq_len or rows_length)
        try:
            family_for(model_config)
        except UnsupportedModelError as err:
            raise ConfigError(str(err)) from None
        if tokenizer is not None and len(tokenizer) > model_config.vocab_size:
            raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                              f"{model_config.vocab_size}")
        check_model_fits(config, model_config)
        if args.save_strategy != "no":
            check_step_boundaries(config, "training checkpoints")
        if args.eval_strategy != "no" or args.eval_on_start:
            check_step_boundaries(config, f"evaluations during training (eval_strategy '{args.eval_strategy.value}'"
                                          f"{', eval_on_start' if args.eval_on_start else ''}; the final one works)")
        return config

    def _prepare_data(self, args, config, model, train_dataset, eval_dataset, tokenizer):
        """This dp rank's packed data, checked against the model's vocabulary; max_steps and warm-up
        from it when the arguments give epochs (everything before the Trainer writes anything)."""
        from .data import TrainingData
        from .parallel.launch import read_launch
        from .parallel.mesh import mesh_coordinates

        launch = read_launch()
        _, dp_rank, dp_size = mesh_coordinates(launch.rank, launch.world_size, config.pp_size)
        try:
            data = TrainingData.from_datasets(train_dataset, eval_dataset, tokenizer, config, dp_rank, dp_size,
                                              model.config.vocab_size)
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(str(err)) from None
        self.steps_per_epoch = data.steps_per_epoch  # infinite for a streamed train set
        finite = not math.isinf(self.steps_per_epoch)
        self.rows_per_epoch = round(self.steps_per_epoch * config.rows_per_step * dp_size) if finite else None
        epochal = [k for k in ("logging_strategy", "eval_strategy", "save_strategy") if getattr(args, k) == "epoch"]
        if not finite and epochal:
            raise ConfigError(f"{', '.join(epochal)} 'epoch' needs epochs, but a streamed train_dataset has no length: "
                              "use 'steps'")
        if args.max_steps <= 0:
            if not finite:
                raise ConfigError("a streamed train_dataset has no length: set max_steps")
            config.num_train_epochs = args.num_train_epochs
            resolve_schedule(config, self.steps_per_epoch)
        config.warmup_steps = args.get_warmup_steps(config.max_steps)
        check_settings(config, launch.world_size)
        return data

    def _start_pipeline(self, config, model, data, tokenizer) -> TrainingLoop:
        """The process groups (if the launch has none yet), this rank's stages, the loop."""
        from .engine import PipelineEngine
        from .parallel.launch import read_launch
        from .parallel.mesh import init_parallel

        layout = init_parallel(read_launch(), config.pp_size, config.comm_timeout_s)
        engine = PipelineEngine(config, model.config, layout, model=model)
        atexit.register(self._shutdown)
        hooks = _TrainerHooks(self, self.rows_per_epoch, config.rows_per_step * layout.dp_size)
        return TrainingLoop(config, model.config, layout, engine, data, tokenizer, hooks=hooks, report_to=[],
                            progress_bar=False)

    def _shutdown(self) -> None:
        """Tear the process group down at exit after a completed run (gloo can abort otherwise); after a
        failure it is left to the process's end, since a barrier could wait for a dead peer."""
        from .parallel.mesh import shutdown_parallel

        if self._trained:
            shutdown_parallel()

    # --- training -------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None,
              **kwargs) -> TrainOutput:
        """Run the pipeline to max_steps (or a callback's stop). `resume_from_checkpoint`: True for the
        newest complete checkpoint in output_dir, or a checkpoint directory. A SIGTERM makes every
        process save a checkpoint at the next step boundary and exit with status 0 (SystemExit)."""
        from .checkpoint.checkpoints import CheckpointError, find_checkpoint, verify_checkpoint
        from .resilience import lost_peers_reported

        if self._trained:
            raise RuntimeError("this AsyncPPTrainer has trained already; build a new one to train again")
        loop, args = self.loop, self.args
        if resume_from_checkpoint:
            where = "latest" if resume_from_checkpoint is True else str(resume_from_checkpoint)
            try:
                found = find_checkpoint(where, args.output_dir)
                if found is None:  # as Trainer does: True asks for a checkpoint that must exist
                    raise CheckpointError(f"resume_from_checkpoint=True, but {args.output_dir} holds no complete checkpoint")
                verify_checkpoint(found)
            except (CheckpointError, OSError, ValueError) as err:
                raise ConfigError(str(err)) from None
            loop.resume(where)  # the checkpoint's TrainerState becomes self.state (_TrainerHooks.resumed_from)
        state = self.state
        state.max_steps = loop.end_step
        state.compute_steps(args, loop.end_step)
        state.global_step = loop.start_step
        state.train_batch_size = loop.config.rows_per_step
        state.num_train_epochs = math.ceil(loop.end_step / self.steps_per_epoch) if self.steps_per_epoch < math.inf else 0
        self.control = self.callback_handler.on_train_begin(args, state, self.control)
        start = time.time()
        with lost_peers_reported(loop.layout.rank, loop.config.comm_timeout_s):  # as train.py reports it
            if args.eval_on_start:
                self.evaluate()
            loop.run()
        self._trained = True
        if loop.terminated_at is not None:  # SIGTERM: the checkpoint is saved; the process ends as asked
            raise SystemExit(0)
        losses = [r["loss"] for r in state.log_history if "loss" in r]
        train_loss = sum(losses) / len(losses) if losses else float("nan")
        runtime = time.time() - start
        metrics = {"train_runtime": round(runtime, 4), "train_loss": train_loss,
                   "train_tokens_per_second": round(loop.tokens_seen / runtime, 3) if runtime else 0.0}
        self.log(metrics)
        self.control = self.callback_handler.on_train_end(args, state, self.control)
        return TrainOutput(state.global_step, train_loss, metrics)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Validation loss, aux loss and perplexity of the eval_dataset given at construction, through
        the pipeline (collective: call on every process)."""
        if eval_dataset is not None:
            raise ValueError("AsyncPPTrainer evaluates the eval_dataset it was built with (its blocks are packed "
                             "and split over dp ranks once); build a new trainer for another one")
        if self.loop.data.held_out is None:
            raise ValueError("there is no eval_dataset to evaluate: pass one to AsyncPPTrainer")
        results = self.loop.evaluate(self.state.global_step)
        metrics = {f"{metric_key_prefix}_{k[len('eval_'):]}": v for k, v in results.items() if k.startswith("eval_")}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    # --- what the run leaves ----------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The HF export (safetensors, config, tokenizer, model card) in `output_dir`, by default
        output_dir/final (collective: call on every process). The directory is replaced whole."""
        out = Path(output_dir) if output_dir else Path(self.args.output_dir) / "final"
        if out.resolve() == Path(self.args.output_dir).resolve():
            raise ValueError(f"save_model would replace {out}, which holds the run's checkpoints; "
                             "export into a subdirectory (default: final/)")
        self.loop.export(out, self.args.hub_model_id)
        if self.args.push_to_hub and not _internal_call:  # as Trainer.save_model
            self.callback_handler.on_push_begin(self.args, self.state, self.control)
            self._upload(out, "Model save")

    def create_model_card(self, model_name: str | None = None, **kwargs) -> None:
        """The card of the export in output_dir/final (the loop's, not Trainer's fine-tuning draft)."""
        if self.is_world_process_zero():
            final = Path(self.args.output_dir) / "final"
            final.mkdir(parents=True, exist_ok=True)
            (final / "README.md").write_text(self.loop.model_card(self.args.hub_model_id or model_name))

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    **kwargs) -> str | None:
        """Export to output_dir/final and upload it to args.hub_model_id, on the branch `revision`
        (default: args.hub_revision, else main; created if missing). Collective; the commit URL on the
        main process, None elsewhere."""
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        out = Path(self.args.output_dir) / "final"
        self.save_model(str(out), _internal_call=True)
        return self._upload(out, commit_message or "End of training", token, revision, private)

    def _upload(self, folder: Path, commit_message: str, token: str | None = None, revision: str | None = None,
                private: bool | None = None) -> str | None:
        """The export in `folder` to the Hub from the main process (the commit URL; None elsewhere)."""
        from .hub import push_to_hub

        if not self.is_world_process_zero():
            return None
        repo_id = self.args.hub_model_id or Path(self.args.output_dir).name
        return push_to_hub(folder, repo_id, token=token or self.args.hub_token,
                           private=bool(private if private is not None else self.args.hub_private_repo),
                           commit_message=commit_message,
                           revision=revision if revision is not None else self.args.hub_revision)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Nothing at construction: push_to_hub creates the repository when it uploads."""
        self.hub_model_id = self.args.hub_model_id
