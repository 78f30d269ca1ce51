"""A user's Trainer script, as tests launch it under torchrun: build the model and datasets, train
with AsyncPPTrainer, optionally resume and push. Writes log_history.json in output_dir (main process).

    torchrun --nproc_per_node 2 tests/trainer_script.py OUT MODEL_DIR TRAIN.jsonl EVAL.jsonl [--key value ...]
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str]) -> int:
    from datasets import load_dataset
    from transformers import AutoConfig, AutoTokenizer

    from hf_asyncpp import AsyncPPTrainer, AsyncPPTrainingArguments
    from hf_asyncpp.models import build_model
    from hf_asyncpp.data import BUILTIN_TOKENIZER_DIR

    parser = argparse.ArgumentParser()
    for name in ("output_dir", "model_dir", "train", "eval"):
        parser.add_argument(name)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--push", action="store_true")
    parser.add_argument("--push_revision", default=None, help="the branch trainer.push_to_hub(revision=...) names")
    parser.add_argument("--early_stopping_threshold", type=float, default=None,
                        help="an EarlyStoppingCallback (patience 1) with this threshold")
    parser.add_argument("--stop_after", type=int, default=0)
    parser.add_argument("--sigterm_at", type=int, default=0, help="rank 1 receives SIGTERM after this step")
    known, rest = parser.parse_known_args(argv)
    settings = {rest[i].lstrip("-"): json.loads(rest[i + 1]) for i in range(0, len(rest), 2)}

    # The weights train.py starts from with this seed, so the two runs can be compared to the bit (a
    # script that seeds nothing still trains one model: the replicas take the first one's weights).
    model = build_model(AutoConfig.from_pretrained(known.model_dir), settings.get("seed", 42))
    train = load_dataset("json", data_files=known.train, split="train")
    evaluation = load_dataset("json", data_files=known.eval, split="train")
    args = AsyncPPTrainingArguments(output_dir=known.output_dir, **settings)
    callbacks = []
    if known.stop_after:
        from transformers import TrainerCallback

        class StopAt(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == known.stop_after:
                    control.should_training_stop = True

        callbacks.append(StopAt())
    if known.early_stopping_threshold is not None:
        from transformers import EarlyStoppingCallback

        callbacks.append(EarlyStoppingCallback(early_stopping_patience=1,
                                               early_stopping_threshold=known.early_stopping_threshold))
    if known.sigterm_at:
        import os
        import signal

        from transformers import TrainerCallback

        class Preempt(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == known.sigterm_at and os.environ.get("RANK") == "1":
                    os.kill(os.getpid(), signal.SIGTERM)

        callbacks.append(Preempt())
    tokenizer = AutoTokenizer.from_pretrained(str(BUILTIN_TOKENIZER_DIR))
    trainer = AsyncPPTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                             processing_class=tokenizer, callbacks=callbacks)
    output = trainer.train(resume_from_checkpoint=True if known.resume == "True" else known.resume)
    trainer.save_model()  # pushes too when args.push_to_hub
    if known.push:
        print("pushed:", trainer.push_to_hub(revision=known.push_revision))
    if trainer.is_world_process_zero():
        state = trainer.state
        with open(f"{known.output_dir}/log_history.json", "w") as f:
            json.dump({"log_history": state.log_history, "global_step": output.global_step, "epoch": state.epoch,
                       "best_metric": state.best_metric, "best_global_step": state.best_global_step,
                       "best_model_checkpoint": state.best_model_checkpoint}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
