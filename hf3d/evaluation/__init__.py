"""Downstream evaluation at the training mesh: multiple-choice tasks scored by the log-likelihood of each
choice (the cloze formulation), with no export (hf3d/evaluation/evaluator.py)."""
