"""Benchmark scores from lm-evaluation-harness on a model this project loads (`gpt4all-training eval`)."""
