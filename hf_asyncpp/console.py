"""What a run says on its console, the same from every front end: a start banner, one line per logged
step, one per evaluation (and, from the loop, one per checkpoint saved). Plain lines of at most a few
hundred characters, so a log redirected to a file (a SLURM job's .out) reads and greps line by line;
a progress bar is drawn only on a terminal (loop.py)."""

from __future__ import annotations

__all__ = ["banner", "eval_line", "parameter_counts", "step_line"]


def parameter_counts(model_config) -> tuple[int, float]:
    """(all parameters, those a token is multiplied by: routed experts scaled by top-k / experts, the
    embedding table left out; utilization.active_parameters) of the whole model, built on the meta device."""
    from .models.construct import meta_model
    from .utilization import active_parameters

    model = meta_model(model_config)
    return sum(p.numel() for p in model.parameters()), active_parameters(model.named_parameters(), model_config)


def _count(n: float) -> str:
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def banner(config, model_config, dp_size: int, schedule: str, stages: str, tokenizer=None) -> list[str]:
    """The run before its first step: model, tokenizer, layout, batch, schedule, update."""
    total, active = parameter_counts(model_config)
    source = config.init_from or config.model_config
    vocab = model_config.vocab_size
    if tokenizer is None:
        words = f"vocabulary {vocab}"
    else:
        name, size = config.tokenizer or getattr(tokenizer, "name_or_path", "given"), len(tokenizer)
        padded = f"; the model's vocabulary of {vocab} is padded past it" if size < vocab else ""
        words = f"tokenizer {name} ({size} ids{padded})"
    sequences = config.micro_batch_size * config.n_microbatches * dp_size
    tokens = sequences * config.seq_len
    ef = f", Error Feedback λ {config.ef_lambda:g}" if config.ef else ", no Error Feedback"
    return [
        f"model: {model_config.model_type} from {source}, {_count(total)} parameters ({_count(active)} active per "
        f"token), {words}",
        f"layout: pp {config.pp_size} × dp {dp_size}; {stages}",
        f"batch: {sequences} sequences of {config.seq_len} tokens a step ({tokens:,} tokens: micro_batch_size "
        f"{config.micro_batch_size} × n_microbatches {config.n_microbatches} × dp {dp_size}); {config.max_steps} steps, "
        f"{tokens * config.max_steps:,} tokens",
        f"schedule: {schedule}; optimizer: {config.optimizer}, learning rate {config.learning_rate:g}, momentum "
        f"{config.momentum:g}{ef}",
    ]


def _per_rank(values) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def step_line(record: dict, max_steps: int) -> str:
    """One logged step: loss, learning rate, gradient norm, throughput, each rank's idle share, each
    stage's weight-version age, and utilization where known."""
    parts = [f"step {record['step']}/{max_steps}", f"loss {record['loss']:.4f}", f"lr {record['learning_rate']:.3g}"]
    if record.get("grad_norm") is not None:
        parts.append(f"grad norm {record['grad_norm']:.3g}")
    parts.append(f"{record['train_tokens_per_second']:,.0f} tokens/s")
    if record.get("idle_fraction_per_rank"):
        parts.append(f"idle {_per_rank(record['idle_fraction_per_rank'])}")
    if record.get("weight_version_age_per_stage"):
        parts.append("version age " + "/".join(map(str, record["weight_version_age_per_stage"])))
    if record.get("mfu") is not None:
        parts.append(f"MFU {record['mfu']:.3f}")
    if record.get("max_memory_gib") is not None:
        parts.append(f"peak memory {record['max_memory_gib']:.2f} GiB")
    return " | ".join(parts)


def eval_line(results: dict) -> str:
    """One evaluation: validation loss and perplexity (and the auxiliary loss where there is one)."""
    line = f"step {results['step']}: validation loss {results['eval_loss']:.4f}, perplexity {results['eval_perplexity']:.2f}"
    if results.get("eval_aux_loss"):
        line += f", aux loss {results['eval_aux_loss']:.4f}"
    return line
