"""gpt4all-training: prompt/response data in, a fine-tuned causal language model out."""

__version__ = "0.1.0"
