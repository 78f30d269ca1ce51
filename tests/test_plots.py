"""Loss curves from metrics.jsonl (hf_asyncpp.plots and `hf-asyncpp plot`).

A run directory's metrics.jsonl holds training records (`loss`, `aux_loss`, `num_input_tokens_seen`, ...) and
evaluation records (`eval_loss`, ...); a resumed run rewrites the steps after its checkpoint, so the
last record of a step is the one that counts. Every figure must be a real PNG that matplotlib reads
back; a missing run must fail with its path named and leave nothing written.
"""

from __future__ import annotations

import json

import pytest

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TOKENS_PER_STEP = 1024


def _train(step: int, loss: float, aux_loss: float = 0.01) -> dict:
    return {"step": step, "loss": loss, "aux_loss": aux_loss, "learning_rate": 1e-3, "grad_norm": 1.0,
            "num_input_tokens_seen": step * TOKENS_PER_STEP, "idle_fraction_per_rank": [0.1, 0.2], "schedule": "1f1b"}


def _eval(step: int, loss: float) -> dict:
    return {"step": step, "eval_loss": loss, "eval_perplexity": 2.718 ** loss, "eval_aux_loss": 0.01,
            "eval_tokens": 4096}


def _write_run(run_dir, records) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))


def _resumed_run(run_dir) -> None:
    """Steps 1-4 with an evaluation at 2 and 4, then a resume from step 2 that re-ran steps 3 and 4."""
    _write_run(run_dir, [_train(1, 5.0), _train(2, 4.5), _eval(2, 4.8), _train(3, 9.9), _train(4, 9.9),
                         _eval(4, 9.9), _train(3, 4.0), _train(4, 3.5), _eval(4, 3.9)])


def _assert_png(path) -> None:
    import matplotlib.pyplot as plt

    assert path.is_file()
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = plt.imread(path)
    assert image.ndim == 3 and image.shape[0] > 0 and image.shape[1] > 0


def test_read_metrics_keeps_the_last_record_of_each_step_sorted_by_step(tmp_path):
    from hf_asyncpp.plots import read_metrics

    _resumed_run(tmp_path)
    train, evals = read_metrics(tmp_path)
    assert [(record["step"], record["loss"]) for record in train] == [(1, 5.0), (2, 4.5), (3, 4.0), (4, 3.5)]
    assert [(record["step"], record["eval_loss"]) for record in evals] == [(2, 4.8), (4, 3.9)]


def test_read_metrics_names_the_missing_or_broken_file(tmp_path):
    from hf_asyncpp.plots import read_metrics

    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path / "never_ran")
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_train(1, 5.0)) + "\n{truncated\n")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'metrics.jsonl'}:2 is not JSON"):
        read_metrics(tmp_path)


def test_write_loss_curves_writes_a_png_into_the_run_directory(tmp_path):
    from hf_asyncpp.plots import write_loss_curves

    run_dir = tmp_path / "tiny-moe-2bw"
    _resumed_run(run_dir)
    path = write_loss_curves(run_dir)
    assert path == run_dir / "loss_curves.png"
    _assert_png(path)


def test_the_aux_loss_panel_appears_only_when_the_model_has_an_aux_loss(tmp_path):
    import matplotlib.pyplot as plt

    from hf_asyncpp.plots import write_loss_curves

    with_aux, without_aux = tmp_path / "moe", tmp_path / "dense"
    _write_run(with_aux, [_train(step, 5.0 - step, aux_loss=0.02) for step in (1, 2, 3)])
    _write_run(without_aux, [_train(step, 5.0 - step, aux_loss=0.0) for step in (1, 2, 3)])
    # Same width, and the second panel makes the figure taller.
    moe_height = plt.imread(write_loss_curves(with_aux)).shape[0]
    dense_height = plt.imread(write_loss_curves(without_aux)).shape[0]
    assert moe_height > dense_height


def test_compare_runs_overlays_runs_with_the_same_name_against_tokens(tmp_path):
    from hf_asyncpp.plots import compare_runs

    _resumed_run(tmp_path / "sweep_a" / "run")
    _resumed_run(tmp_path / "sweep_b" / "run")
    path = compare_runs([tmp_path / "sweep_a" / "run", tmp_path / "sweep_b" / "run"], tmp_path / "out" / "cmp.png",
                        x="tokens")
    assert path == tmp_path / "out" / "cmp.png"
    _assert_png(path)


def test_run_labels_add_the_parent_directory_only_to_shared_names(tmp_path):
    from hf_asyncpp.plots import _run_labels

    labels = _run_labels([tmp_path / "a" / "run", tmp_path / "b" / "run", tmp_path / "b" / "other"])
    assert labels == ["a/run", "b/run", "other"]


def test_an_unknown_x_axis_is_refused(tmp_path):
    from hf_asyncpp.plots import compare_runs

    _resumed_run(tmp_path / "run")
    with pytest.raises(ValueError, match="x must be one of step, tokens"):
        compare_runs([tmp_path / "run"], tmp_path / "cmp.png", x="time")
    assert not (tmp_path / "cmp.png").exists()


def test_cli_plot_of_one_run_writes_its_loss_curves(tmp_path, capsys):
    from hf_asyncpp.cli import main

    _resumed_run(tmp_path / "run")
    assert main(["plot", str(tmp_path / "run")]) == 0
    _assert_png(tmp_path / "run" / "loss_curves.png")
    assert capsys.readouterr().out.strip() == str(tmp_path / "run" / "loss_curves.png")


def test_cli_plot_of_two_runs_writes_the_comparison_in_the_current_directory(tmp_path, monkeypatch, capsys):
    from hf_asyncpp.cli import main

    _resumed_run(tmp_path / "run_a")
    _resumed_run(tmp_path / "run_b")
    monkeypatch.chdir(tmp_path)
    assert main(["plot", "run_a", "run_b", "--x", "tokens"]) == 0
    _assert_png(tmp_path / "loss_comparison.png")
    assert capsys.readouterr().out.strip() == "loss_comparison.png"


def test_cli_plot_of_a_missing_run_fails_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from hf_asyncpp.cli import main

    _resumed_run(tmp_path / "run_a")
    monkeypatch.chdir(tmp_path)
    files_before = sorted(tmp_path.rglob("*"))
    assert main(["plot", "run_a", "no_such_run"]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and "no_such_run" in captured.err
    assert captured.out == ""
    assert sorted(tmp_path.rglob("*")) == files_before
