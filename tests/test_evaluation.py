"""Validation through train.py: the held-out blocks' loss equals the exported model's own loss on them.

train.py (one process: tiny_moe.yaml's PipeDream-2BW with Muon and Error Feedback, emulated) holds out
the last 20% of a jsonl dataset's rows, evaluates every step and at the end; the final validation loss
must equal the mean LM loss that plain transformers computes with the exported weights on the same
held-out rows, batch by batch (fp32, 1e-5), the run's closing line must say it, and the model card's
model-index must carry it. The shipped `evaluate` metric computes the same summary offline.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import yaml

from hf_asyncpp.evaluation import PERPLEXITY_METRIC_PATH, validation_summary
from tests.test_engine import save_model_dir, small_model_config
from tests.test_run import _env

SEQ, MBS, M, ROWS = 16, 2, 2, 40


def _model_and_rows(tmp_path):
    """A tiny Qwen3-MoE (with the built-in tokenizer beside it) and ROWS random rows as data.jsonl."""
    config = small_model_config("tiny-qwen3-moe")
    config.vocab_size = 8192
    save_model_dir(config, tmp_path / "model")
    rows = torch.randint(0, 8192, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows.tolist()))
    return config, rows


def _train(tmp_path, out, *extra):
    """train.py for two steps on one process."""
    command = [sys.executable, "training_scripts/train.py", "--config", "training_scripts/configs/tiny_moe.yaml",
               "--model_config", str(tmp_path / "model"), "--dataset", str(tmp_path / "data.jsonl"),
               "--seq_len", str(SEQ), "--micro_batch_size", str(MBS), "--n_microbatches", str(M),
               "--max_steps", "2", "--output_dir", str(out), *extra]
    return subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=300)


@pytest.mark.launch
def test_the_validation_loss_is_the_exported_models_loss_on_the_held_out_rows(tmp_path):
    from transformers import AutoModelForCausalLM

    config, rows = _model_and_rows(tmp_path)
    out = tmp_path / "run"
    done = _train(tmp_path, out, "--eval_fraction", "0.2", "--eval_steps", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2]
    final = evals[-1]

    model = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    held_out = rows[-8:]  # 20% of 40 rows, the last ones
    batch_losses = []
    with torch.no_grad():
        for batch in held_out.chunk(2):  # two evaluation batches of MBS × M rows
            lm = [(o.loss - config.router_aux_loss_coef * o.aux_loss).item()
                  for o in (model(input_ids=mb, labels=mb) for mb in batch.chunk(M))]
            batch_losses.append(sum(lm) / M)
    expected = sum(batch_losses) / 2
    assert abs(final["eval_loss"] - expected) < 1e-5, (final, expected)
    # exp carries the loss's 1e-5 into a relative 1e-5 (an absolute one grows with the perplexity, ~8000 here)
    assert final["eval_perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    # The run's closing line (after training, before the export): the final validation loss.
    closing = f"[hf_asyncpp] validation loss {final['eval_loss']:.4f}, perplexity {final['eval_perplexity']:.2f}\n"
    assert closing + f"[hf_asyncpp] saved {out / 'final'}\n" in done.stderr, done.stderr[-2000:]
    card = (out / "final" / "README.md").read_text()
    metrics = yaml.safe_load(card.split("---")[1])["model-index"][0]["results"][0]["metrics"]
    assert {m["type"]: m["value"] for m in metrics}["loss"] == round(final["eval_loss"], 4)


def test_the_shipped_evaluate_metric_loads_offline_and_computes_the_token_weighted_summary(tmp_path, monkeypatch):
    import evaluate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    losses, tokens = [2.0, 3.5, 1.25], [64, 192, 32]
    loss = (2.0 * 64 + 3.5 * 192 + 1.25 * 32) / (64 + 192 + 32)  # 2.917, not the plain mean 2.25
    metric = evaluate.load(PERPLEXITY_METRIC_PATH, cache_dir=str(tmp_path))
    metric.add_batch(losses=losses[:2], tokens=tokens[:2])
    metric.add(losses=losses[2], tokens=tokens[2])
    result = metric.compute()
    assert result == validation_summary(losses, tokens)
    assert abs(result["eval_loss"] - loss) < 1e-12 and abs(result["eval_perplexity"] - math.exp(loss)) < 1e-9


@pytest.mark.launch
def test_a_held_out_set_smaller_than_one_evaluation_batch_is_refused_before_the_first_step(tmp_path):
    """5% of 40 rows is 2 blocks, fewer than one evaluation batch of 2 × 2: said when the data is read,
    not at the first evaluation after steps were spent."""
    _model_and_rows(tmp_path)
    out = tmp_path / "run"
    done = _train(tmp_path, out, "--eval_fraction", "0.05")
    assert done.returncode == 1
    assert ("error: the held-out split has 2 blocks, fewer than one evaluation batch (4: micro_batch_size × "
            "n_microbatches × dp); raise eval_fraction") in done.stderr
    assert not (out / "metrics.jsonl").exists()  # no step was spent
