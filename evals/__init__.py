"""Evaluation pieces of tileinfer: drift statistics (:mod:`evals.metrics`) and exact-length
prompts built from bundled text (:mod:`evals.prompts`, data in ``evals/data/``)."""
