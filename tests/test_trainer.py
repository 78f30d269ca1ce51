"""AsyncPPTrainer: a transformers.Trainer on the pipeline, launched as a user's script under torchrun.

- The Trainer and train.py (its main on two ranks of the suite's pool) run one engine: the same config
  and data give the same per-step losses and validation losses (pp 2, PipeDream-2BW + Error Feedback,
  AdamW, clipping, warm-up, linear decay).
- A Trainer run saves at save_steps; `train(resume_from_checkpoint=...)` in a new launch continues with
  identical losses and keeps the log history; `push_to_hub` reaches the loopback Hub with the export
  and a card that says what was done.
- A callback's stop ends an asynchronous pipeline one step later, drained (its next minibatch was
  already in flight); report_to tensorboard reaches transformers' TensorBoardCallback.
- Epoch strategies log, evaluate and save at the steps that end epochs; best_metric and
  best_model_checkpoint are set as Trainer sets them, so EarlyStoppingCallback stops a run and
  save_strategy "best" saves after improving evaluations; push_to_hub pushes at every save, to
  hub_revision, and push_to_hub(revision=) to its branch.
- Bad input is one ConfigError before any process group starts, with nothing written.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml

from tests.hub_server import LoopbackHub
from tests.test_engine import save_model_dir, small_model_config

SEQ, MBS, M, STEPS = 16, 2, 4, 6
TOKEN = "hf_loopbackTrainerToken"
# The same run in both front ends' words (TrainingArguments names ↔ TrainConfig keys).
TRAINER_SETTINGS = dict(schedule="pipedream-2bw", pp_size=2, n_microbatches=M, optimizer="adamw", ef=True,
                        per_device_train_batch_size=MBS, learning_rate=3e-3, adam_beta2=0.95, weight_decay=0.01,
                        max_grad_norm=0.5, lr_scheduler_type="linear", warmup_steps=1, max_steps=STEPS,
                        logging_steps=1, eval_strategy="steps", eval_steps=3, save_steps=3, seed=11,
                        report_to="none")
SCRIPT_SETTINGS = dict(schedule="pipedream-2bw", pp_size=2, n_microbatches=M, optimizer="adamw", ef="true",
                       micro_batch_size=MBS, learning_rate=3e-3, beta2=0.95, momentum=0.9, weight_decay=0.01,
                       max_grad_norm=0.5, lr_scheduler_type="linear", warmup_steps=1, max_steps=STEPS,
                       logging_steps=1, eval_steps=3, seed=11, seq_len=SEQ, report_to="none")


def _env(**extra):
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", **extra}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    config = small_model_config("tiny-qwen3-moe")
    config.vocab_size = 8192  # the built-in tokenizer's size
    save_model_dir(config, root / "model")
    rows = torch.randint(0, 8192, (80, SEQ), generator=torch.Generator().manual_seed(0)).tolist()
    (root / "train.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows[:64]))
    (root / "eval.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows[64:]))
    return root


def _trainer_run(corpus, out, *extra, env=None, **settings):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "tests/trainer_script.py", str(out), str(corpus / "model"),
               str(corpus / "train.jsonl"), str(corpus / "eval.jsonl"), *extra]
    for key, value in {**TRAINER_SETTINGS, **settings}.items():
        command += [f"--{key}", json.dumps(value)]
    done = subprocess.run(command, capture_output=True, text=True, env=env or _env(), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "log_history.json").read_text())


def _losses(history, key="loss"):
    return {r["step"]: r[key] for r in history if key in r}


@pytest.mark.multirank
def test_the_trainer_and_train_py_share_one_engine_and_a_trainer_run_resumes_and_pushes(corpus, tmp_path):
    with LoopbackHub() as hub:
        hub_env = _env(HF_ENDPOINT=hub.endpoint, HF_HUB_OFFLINE="0", HF_TOKEN=TOKEN)
        straight = _trainer_run(corpus, tmp_path / "trainer", "--push", env=hub_env,
                                hub_model_id="team/tiny-async")["log_history"]
    # train.py on the same config and data: its main on two ranks of the suite's pool
    from tests.ranks import train_py

    arguments = ["--model_config", str(corpus / "model"), "--dataset", str(corpus / "train.jsonl"), "--eval_dataset",
                 str(corpus / "eval.jsonl"), "--output_dir", str(tmp_path / "script")]
    for key, value in SCRIPT_SETTINGS.items():
        arguments += [f"--{key}", str(value)]
    ran = train_py(2, arguments, tmp_path / "script-logs")
    assert [code for code, _ in ran] == [0, 0], ran[0][1][-3000:]
    records = [json.loads(line) for line in (tmp_path / "script" / "metrics.jsonl").read_text().splitlines()]
    script_losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    script_evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}

    trainer_losses = _losses(straight)
    assert sorted(trainer_losses) == list(range(1, STEPS + 1))
    assert trainer_losses == script_losses  # one engine, the same arithmetic: equal to the bit
    assert _losses(straight, "eval_loss") == script_evals == pytest.approx({3: script_evals[3], 6: script_evals[6]})
    assert all("aux_loss" in r and "grad_norm" in r and "learning_rate" in r for r in straight if "loss" in r)

    # Saved at save_steps (3 and 6), with the Trainer's own state as transformers.Trainer writes it;
    # resumed in a new launch from step 3: identical losses after it.
    from transformers import TrainerState

    saved = TrainerState.load_from_json(str(tmp_path / "trainer" / "checkpoint-3" / "trainer_state.json"))
    assert (saved.global_step, saved.max_steps, saved.train_batch_size, saved.epoch) == (3, STEPS, MBS * M, 3 / 8)
    assert _losses(saved.log_history) == {k: v for k, v in trainer_losses.items() if k <= 3}
    assert list(_losses(saved.log_history, "eval_loss")) == [3] and "TrainerControl" in saved.stateful_callbacks
    resumed = _trainer_run(corpus, tmp_path / "trainer", "--resume", str(tmp_path / "trainer" / "checkpoint-3"))
    assert resumed["global_step"] == STEPS
    assert _losses(resumed["log_history"]) == trainer_losses  # steps 1-3 from the checkpoint, 4-6 recomputed

    # The push: the export and a card that describes pretraining with this schedule and optimizer.
    files = hub.received["team/tiny-async"]
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= set(files)
    card = files["README.md"].decode()
    metadata = yaml.safe_load(card.split("---")[1])
    assert "hf_asyncpp" in json.dumps(metadata)
    assert "pipedream-2bw" in card.lower() and "adamw" in card.lower()
    assert "fine-tuned" not in card.lower()
    assert "train_dataset given to AsyncPPTrainer" in card and "shakespeare" not in card.lower()
    assert TOKEN not in card


@pytest.fixture(scope="module")
def stopped_run(corpus, tmp_path_factory):
    """A 2BW run whose callback stops training after step 2, reporting to tensorboard and counting
    input tokens (one launch that two specifications below read)."""
    out = tmp_path_factory.mktemp("stopped")
    history = _trainer_run(corpus, out, "--stop_after", "2", eval_strategy="no", save_steps=0,
                           report_to="tensorboard", include_num_input_tokens_seen=True)
    return out, history


@pytest.mark.multirank
def test_a_callbacks_stop_ends_an_asynchronous_pipeline_one_drained_step_later(stopped_run):
    from transformers import AutoModelForCausalLM

    out, history = stopped_run
    assert history["global_step"] == 3  # minibatch 3 was in flight when the callback stopped training
    losses = _losses(history["log_history"])
    assert sorted(losses) == [1, 2, 3]
    # report_to tensorboard reaches transformers' TensorBoardCallback with the logged losses.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [run] = (out / "runs").iterdir()
    events = EventAccumulator(str(run)).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (step, pytest.approx(loss, rel=1e-6)) for step, loss in sorted(losses.items())]
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.multirank
def test_epoch_events_best_metric_early_stopping_and_a_push_at_every_save(corpus, tmp_path):
    """64 train rows at 3 × 4 rows a step (pp 2, dp 1): an epoch is 5⅓ steps, so epochs end at the steps
    that read their last block, 6 and 11 (and 16). Logging, evaluation and saving follow the epochs; an
    EarlyStoppingCallback whose threshold no change reaches stops at the second evaluation (step 11),
    which PipeDream-2BW drains at step 12, the last epoch event (eval_on_start's evaluation counts for
    neither). best_metric is the lowest eval_loss,
    best_model_checkpoint its checkpoint; every save pushes to hub_revision, push_to_hub(revision=) to its own."""
    out = tmp_path / "epochs"
    with LoopbackHub() as hub:
        env = _env(HF_ENDPOINT=hub.endpoint, HF_HUB_OFFLINE="0", HF_TOKEN=TOKEN)
        result = _trainer_run(corpus, out, "--push", "--push_revision", "release", "--early_stopping_threshold", "10",
                              env=env, per_device_train_batch_size=3, max_steps=-1, num_train_epochs=3,
                              logging_strategy="epoch", eval_strategy="epoch", save_strategy="epoch",
                              eval_on_start=True, metric_for_best_model="loss", push_to_hub=True, hub_strategy="every_save",
                              hub_revision="dev", hub_model_id="team/epochs")
    history = result["log_history"]
    assert result["global_step"] == 12
    assert sorted(_losses(history)) == [6, 11, 12]
    assert [r["epoch"] for r in history if "loss" in r] == pytest.approx([6 * 12 / 64, 11 * 12 / 64, 12 * 12 / 64])
    evals = _losses(history, "eval_loss")
    assert sorted(evals) == [0, 6, 11, 12]  # 0: eval_on_start; 12: the evaluation that ends every run
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-11", "checkpoint-12", "checkpoint-6"]
    best_step = min((s for s in evals if s), key=evals.get)  # eval_on_start's is no candidate, as in Trainer
    assert result["best_metric"] == evals[best_step] and result["best_global_step"] == best_step
    assert result["best_model_checkpoint"] == str(out / f"checkpoint-{best_step}")
    progress = [("team/epochs", "dev", f"Training in progress, epoch {e}") for e in (1, 2, 2)]
    assert hub.commits == [*progress, ("team/epochs", "dev", "Model save"), ("team/epochs", "release", "End of training")]
    assert {"config.json", "model.safetensors", "README.md"} <= set(hub.received["team/epochs"])


def _train_saving_the_best(rank, world_size, corpus, out):
    """A rank target: a one-rank Trainer run with save_strategy "best", evaluating every step."""
    from datasets import load_dataset
    from transformers import AutoConfig

    from hf_asyncpp import AsyncPPTrainer, AsyncPPTrainingArguments
    from hf_asyncpp.models import build_model
    from hf_asyncpp.parallel.mesh import shutdown_parallel

    args = AsyncPPTrainingArguments(
        output_dir=str(out), schedule="1f1b", pp_size=1, n_microbatches=2, per_device_train_batch_size=2,
        learning_rate=0.05, max_steps=8, logging_steps=1, eval_strategy="steps", eval_steps=1, save_strategy="best",
        metric_for_best_model="loss", report_to="none", seed=5)
    trainer = AsyncPPTrainer(model=build_model(AutoConfig.from_pretrained(corpus / "model"), 5), args=args,
                             train_dataset=load_dataset("json", data_files=str(corpus / "train.jsonl"), split="train"),
                             eval_dataset=load_dataset("json", data_files=str(corpus / "eval.jsonl"), split="train"))
    trainer.train()
    shutdown_parallel()
    state = trainer.state
    return state.log_history, state.best_global_step, state.best_model_checkpoint


@pytest.mark.multirank
def test_save_strategy_best_saves_after_the_evaluations_that_improve_the_metric(corpus, tmp_path):
    """Trainer's rule: a checkpoint follows each evaluation during training whose eval_loss is below
    every earlier one; the run (random tokens, a large learning rate) has evaluations that do not."""
    from tests.ranks import run_ranks

    [(history, best_step, best_checkpoint)] = run_ranks(1, _train_saving_the_best, corpus, tmp_path / "best")
    evals = _losses(history, "eval_loss")
    assert sorted(evals) == list(range(1, 9))  # 8: the evaluation that ends the run, after the last step
    improving = [s for s in range(1, 8) if evals[s] < min([evals[t] for t in range(1, s)], default=math.inf)]
    assert 1 < len(improving) < 7, evals  # the test's premise: some evaluations improve, some do not
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "best").glob("checkpoint-*"))
    assert saved == improving
    assert best_step == min(evals, key=evals.get)
    assert best_checkpoint == (str(tmp_path / "best" / f"checkpoint-{best_step}") if best_step in saved else None)


def _train_and_card(rank, world_size, corpus, out, model_source):
    """A rank target: a one-rank Trainer run of a model built as `model_source` says, saving at step 2;
    returns the export's card and the card `hf-asyncpp export` writes for the checkpoint."""
    from datasets import load_dataset
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_asyncpp import AsyncPPTrainer, AsyncPPTrainingArguments
    from hf_asyncpp.hub import checkpoint_model_card
    from hf_asyncpp.models import build_model
    from hf_asyncpp.parallel.mesh import shutdown_parallel

    if model_source == "from_pretrained":
        model = AutoModelForCausalLM.from_pretrained(str(corpus / "weights"))
    else:  # a config read from the same directory: its name_or_path is that directory too
        model = build_model(AutoConfig.from_pretrained(str(corpus / "weights")), 5)
    args = AsyncPPTrainingArguments(
        output_dir=str(out), schedule="1f1b", pp_size=1, n_microbatches=2, per_device_train_batch_size=2,
        max_steps=2, save_steps=2, report_to="none", seed=5)
    trainer = AsyncPPTrainer(model=model, args=args,
                             train_dataset=load_dataset("json", data_files=str(corpus / "train.jsonl"), split="train"))
    trainer.train()
    trainer.save_model()
    shutdown_parallel()
    state = json.loads((out / "checkpoint-2" / "pipeline_state.json").read_text())
    return (out / "final" / "README.md").read_text(), checkpoint_model_card(state, model.config, "exported")


@pytest.mark.multirank
@pytest.mark.parametrize("model_source", ["from_pretrained", "from_config"])
def test_the_card_says_which_weights_the_given_model_started_from(corpus, tmp_path, model_source):
    """A model from_pretrained loaded is trained from those weights (as transformers' own cards say);
    a model built from a config is pretrained from scratch, though the config came from the same
    directory. The checkpoint's card says the same."""
    from transformers import AutoModelForCausalLM

    from tests.ranks import run_ranks

    weights = corpus / "weights"
    if not weights.is_dir():
        config = small_model_config("tiny-qwen3-moe")
        config.vocab_size = 8192  # the corpus's token ids
        AutoModelForCausalLM.from_config(config).save_pretrained(weights)
    [cards] = run_ranks(1, _train_and_card, corpus, tmp_path / "run", model_source)
    for card in cards:
        if model_source == "from_pretrained":
            assert f"from the weights of the local model directory `{weights}`" in card
            assert "from scratch" not in card and "base_model" not in card.split("---")[1]
        else:
            assert "pretrained from scratch with hf_asyncpp" in card and "from the weights" not in card


def test_only_weights_transformers_loaded_count_as_where_a_model_started(tmp_path):
    """Pins transformers' private mark of loaded parameters (`_is_hf_initialized`), which
    `_loaded_from` reads: from_pretrained sets it on every parameter, from_config on none."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_asyncpp.trainer import _loaded_from

    AutoModelForCausalLM.from_config(small_model_config("tiny-qwen3-moe")).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert all(getattr(p, "_is_hf_initialized", False) for p in loaded.parameters())
    assert _loaded_from(loaded) == str(tmp_path)
    built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tmp_path)))
    assert built.name_or_path == str(tmp_path) and _loaded_from(built) is None


# --- bad input: one ConfigError, no process group, nothing written ---------------------------------

def _dataset(rows):
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": rows.tolist()})


def _model(**overrides):
    from transformers import AutoModelForCausalLM

    config = small_model_config("tiny-qwen3-moe")
    for key, value in overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_config(config)


def _args(out, **overrides):
    from hf_asyncpp import AsyncPPTrainingArguments

    return AsyncPPTrainingArguments(output_dir=str(out), **{**dict(pp_size=1, max_steps=2, report_to="none",
                                                                   per_device_train_batch_size=MBS), **overrides})


def _rows(n=32, length=SEQ, high=100):
    return torch.randint(0, high, (n, length), generator=torch.Generator().manual_seed(1))


BAD_ARGUMENTS = {
    "unknown pipeline key": (dict(pipeline_config={"muon_lr_scal": "original"}), "unknown config key"),
    "wrong type": (dict(pp_size="two"), "'pp_size' expects int, got 'two'"),
    "negative learning rate": (dict(learning_rate=-1e-3), "learning_rate must be positive"),
    "unknown schedule": (dict(schedule="pipedream-3bw"), "pipedream-3bw"),
    "accumulation and microbatches disagree": (dict(gradient_accumulation_steps=4, n_microbatches=2),
                                               "n_microbatches \\(2\\) and gradient_accumulation_steps \\(4\\)"),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_bad_training_arguments_fail_before_any_process_group(case, tmp_path):
    import torch.distributed as dist

    from hf_asyncpp import ConfigError

    overrides, message = BAD_ARGUMENTS[case]
    with pytest.raises(ConfigError, match=message):
        _args(tmp_path / "out", **overrides)
    assert not dist.is_initialized() and not (tmp_path / "out").exists()


def test_an_unknown_argument_names_itself(tmp_path):
    from hf_asyncpp import AsyncPPTrainer

    with pytest.raises(TypeError, match="pipline_size"):
        _args(tmp_path / "out", pipline_size=2)
    with pytest.raises(TypeError, match="warmup"):
        AsyncPPTrainer(model=_model(), args=_args(tmp_path / "out"), train_dataset=_dataset(_rows()), warmup=3)
    assert not (tmp_path / "out").exists()


def _bad_trainers(tmp_path):
    from transformers import AutoTokenizer

    from hf_asyncpp.data import BUILTIN_TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(str(BUILTIN_TOKENIZER_DIR))  # 8192 tokens
    out = tmp_path / "out"
    return {
        "missing dataset": (dict(model=_model(), args=_args(out), train_dataset=None), "needs a train_dataset"),
        "tokenizer larger than the model's vocabulary": (
            dict(model=_model(vocab_size=1000), args=_args(out), train_dataset=_dataset(_rows()),
                 processing_class=tokenizer), "the tokenizer has 8192 tokens but the model's vocab_size is 1000"),
        "token ids beyond the vocabulary": (
            dict(model=_model(vocab_size=1000), args=_args(out), train_dataset=_dataset(_rows(high=5000))),
            "outside the model's vocabulary of 1000 ids"),
        "rows longer than the model's positions": (
            dict(model=_model(max_position_embeddings=8), args=_args(out), train_dataset=_dataset(_rows())),
            "seq_len 16 exceeds the model's max_position_embeddings"),
        "evaluation without an evaluation set": (
            dict(model=_model(), args=_args(out, eval_strategy="steps", eval_steps=1), train_dataset=_dataset(_rows())),
            "no eval_dataset"),
        "epochs of a stream": (
            dict(model=_model(), args=_args(out, logging_strategy="epoch"),
                 train_dataset=_dataset(_rows()).to_iterable_dataset()),
            "logging_strategy 'epoch' needs epochs, but a streamed train_dataset has no length"),
    }


@pytest.mark.parametrize("case", ["missing dataset", "tokenizer larger than the model's vocabulary",
                                  "token ids beyond the vocabulary", "rows longer than the model's positions",
                                  "evaluation without an evaluation set", "epochs of a stream"])
def test_a_bad_trainer_fails_with_one_message_before_any_process_group(case, tmp_path):
    import torch.distributed as dist

    from hf_asyncpp import AsyncPPTrainer, ConfigError

    kwargs, message = _bad_trainers(tmp_path)[case]
    with pytest.raises(ConfigError, match=message):
        AsyncPPTrainer(**kwargs)
    assert not dist.is_initialized() and not (tmp_path / "out").exists()


def test_training_arguments_map_onto_the_pipeline_config(tmp_path):
    """Trainer fields keep their meaning: microbatch size, optimizer hyperparameters, schedule, seed,
    limits; momentum defaults to adam_beta1; pipeline_config reaches any other key."""
    args = _args(tmp_path / "out", schedule="pipedream-2bw", pp_size=2, n_microbatches=8, optimizer="muon",
                 per_device_train_batch_size=3, learning_rate=0.02, adam_beta1=0.85, adam_beta2=0.97,
                 weight_decay=0.1, max_grad_norm=0.7, lr_scheduler_type="cosine", max_steps=50, seed=5, ef=True,
                 ef_lambda=0.5, save_total_limit=2, pipeline_config={"muon_lr_scale": "match_rms_adamw"})
    config = args.pipeline
    # One process (no launcher), as train.py: the asynchronous schedule is emulated at the asked depth.
    assert (config.schedule, config.pp_size, config.emulate_pp_size) == ("pipedream-2bw", 1, 2)
    assert (config.n_microbatches, config.optimizer) == (8, "muon")
    assert (config.micro_batch_size, config.learning_rate, config.momentum, config.beta2) == (3, 0.02, 0.85, 0.97)
    assert (config.weight_decay, config.max_grad_norm, config.lr_scheduler_type) == (0.1, 0.7, "cosine")
    assert (config.max_steps, config.seed, config.ef, config.ef_lambda, config.save_total_limit) == (50, 5, True, 0.5, 2)
    assert config.muon_lr_scale == "match_rms_adamw" and config.report_to == []
    assert _args(tmp_path / "out", momentum=0.95).pipeline.momentum == 0.95
    assert _args(tmp_path / "out", warmup_steps=0.1).get_warmup_steps(50) == 5
    assert not args.place_model_on_device  # the pipeline places only this rank's stages
    assert _args(tmp_path / "out", gradient_checkpointing=True).pipeline.activation_checkpointing == "full"
    from transformers import TrainingArguments

    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__:  # its name from transformers 5.24 on
        assert _args(tmp_path / "out", activation_checkpointing=True).pipeline.activation_checkpointing == "full"
    assert _args(tmp_path / "out", pipeline_config={"activation_checkpointing": "selective"}).pipeline.activation_checkpointing == "selective"
    assert _args(tmp_path / "out", torch_compile=True).pipeline.compile_layers and not args.pipeline.compile_layers


@pytest.mark.multirank
def test_a_sigterm_to_one_process_checkpoints_every_process_and_train_exits_0(corpus, tmp_path):
    """Rank 1 is signalled after step 2, so its flag travels in step 3's statistics, which every process
    reads at the end of step 4: all save checkpoint-4 and exit 0 from train() without running on to the
    export; resuming finishes the run."""
    out = tmp_path / "preempted"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "tests/trainer_script.py", str(out), str(corpus / "model"),
               str(corpus / "train.jsonl"), str(corpus / "eval.jsonl"), "--sigterm_at", "2"]
    for key, value in {**TRAINER_SETTINGS, "eval_strategy": "no", "save_steps": 0}.items():
        command += [f"--{key}", json.dumps(value)]
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[hf_asyncpp] stopped after step 4 on SIGTERM" in done.stderr  # the hf_asyncpp logger
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-4"]
    assert not (out / "final").exists() and not (out / "log_history.json").exists()

    resumed = _trainer_run(corpus, out, "--resume", "True", eval_strategy="no", save_steps=0)
    assert resumed["global_step"] == STEPS and sorted(_losses(resumed["log_history"])) == list(range(1, STEPS + 1))


# The step record's numbers under transformers' names (Trainer's own where it has one), and what the run
# measured of its devices (on a CPU: TFLOP/s and the largest peak RSS; MFU has no peak there), in both outputs.
HF_NAMED_KEYS = {"step", "epoch", "loss", "aux_loss", "learning_rate", "grad_norm", "num_input_tokens_seen",
                 "train_tokens_per_second", "step_time_s", "train_tflops_per_device", "max_memory_gib"}


@pytest.mark.multirank
def test_log_history_and_metrics_jsonl_of_a_run_share_their_keys_and_values(stopped_run):
    # num_input_tokens_seen reaches log_history only when asked for (the run asks), as in Trainer
    out, history = stopped_run[0], stopped_run[1]["log_history"]
    logged = [entry for entry in history if "loss" in entry and "train_runtime" not in entry]
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [entry["step"] for entry in logged] == [record["step"] for record in records] == [1, 2, 3]
    for entry, record in zip(logged, records):
        assert set(record) == HF_NAMED_KEYS | {"idle_fraction_per_rank", "weight_version_age_per_stage",
                                               "skipped_updates_per_stage", "schedule", "mfu",
                                               "peak_rss_gib_per_rank"}  # lists and None in the file only
        # each list's entries as scalars of their own: idle_fraction_per_rank → idle_fraction_rank_0, …
        flattened = {f"{name}_{unit}_{i}": value for key, values in record.items() if isinstance(values, list)
                     for name, unit in [key.rsplit("_per_", 1)] for i, value in enumerate(values)}
        assert set(entry) == HF_NAMED_KEYS | set(flattened)
        assert {key: entry[key] for key in flattened} == flattened
        assert {key: entry[key] for key in HF_NAMED_KEYS} == {key: record[key] for key in HF_NAMED_KEYS}
    steps_per_epoch = 64 / (MBS * M)  # 64 training rows, one dp rank
    assert [record["epoch"] for record in records] == [step / steps_per_epoch for step in (1, 2, 3)]
    assert [record["num_input_tokens_seen"] for record in records] == [step * MBS * M * SEQ for step in (1, 2, 3)]
