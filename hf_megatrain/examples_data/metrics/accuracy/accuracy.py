"""Accuracy as an `evaluate` module that loads offline.

Same name, inputs and output as the Hub's "accuracy" metric (fraction of predictions equal to references,
optional sample weights, ``normalize``), computed with numpy instead of scikit-learn, so
``evaluate.load(<this folder>)`` works without network access or sklearn.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Accuracy = (number of predictions equal to their reference) / (number of predictions)."
_CITATION = ""
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): ground-truth labels.
    normalize (bool): if False, return the number of correct predictions instead of the fraction. Default True.
    sample_weight (list of float): per-sample weights. Default None.
Returns:
    accuracy (float): the (weighted) fraction, or count, of correct predictions.
Examples:
    >>> accuracy_metric = evaluate.load("accuracy")
    >>> accuracy_metric.compute(references=[0, 1, 2, 0, 1, 2], predictions=[0, 1, 1, 2, 1, 0])
    {'accuracy': 0.5}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int32"),
                                        "references": datasets.Value("int32")}),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        correct = (np.asarray(predictions) == np.asarray(references)).astype(np.float64)
        w = np.ones_like(correct) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        total = float((correct * w).sum())
        return {"accuracy": total / float(w.sum()) if normalize else total}
