"""Evaluation: the harness, its tasks and data, `bench`, and lm-eval's tasks."""
