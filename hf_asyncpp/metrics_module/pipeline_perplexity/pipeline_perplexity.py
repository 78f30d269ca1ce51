"""Pipeline perplexity: an `evaluate` metric over per-batch mean losses and their token counts.

Load it by path, offline: `evaluate.load(hf_asyncpp.evaluation.PERPLEXITY_METRIC_PATH)`. The
arithmetic is `hf_asyncpp.evaluation.validation_summary`, the same that a run's validation reports.
"""

import datasets
import evaluate

from hf_asyncpp.evaluation import validation_summary

__all__ = ["PipelinePerplexity"]

_DESCRIPTION = """
Validation loss and perplexity of a causal LM from batch results: `losses` are per-batch mean
token losses, `tokens` the tokens each batch scored. eval_loss is their token-weighted mean and
eval_perplexity its exp.
"""

_KWARGS_DESCRIPTION = """
Args:
    losses (`list` of `float`): the mean token loss of each batch.
    tokens (`list` of `int`): the number of tokens each batch's loss averages over.
Returns:
    eval_loss (`float`): sum(losses[i] * tokens[i]) / sum(tokens).
    eval_perplexity (`float`): exp(eval_loss).
Examples:
    >>> metric = evaluate.load(PERPLEXITY_METRIC_PATH)
    >>> metric.compute(losses=[2.0, 3.0], tokens=[100, 300])["eval_loss"]
    2.75
"""

_CITATION = ""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class PipelinePerplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"losses": datasets.Value("float64"), "tokens": datasets.Value("int64")}),
        )

    def _compute(self, losses, tokens):
        return validation_summary(losses, tokens)
