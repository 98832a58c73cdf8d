"""Packed examples must not attend to each other: a start-up check that the model keeps them apart.

A packed batch (data/batching.py) carries position ids that restart at every example and no attention mask;
transformers' create_causal_mask reads the restarts as sequence boundaries. A model with its own attention code may
ignore them, and would train on context from the neighbouring examples.
"""

from __future__ import annotations

import torch

from gpt4all_training.batch import model_inputs
from gpt4all_training.errors import UserError
from gpt4all_training.model.wrappers import unwrap_model


@torch.no_grad()
def check_isolation(model, tolerance: float = 1e-3) -> float:
    """Refuse packing for a model that attends across packed examples; returns the measured difference.

    `model` may be wrapped (DDP, DeepSpeed, PEFT): it is called like in training, so under ZeRO-3 every rank runs it.

    Two short examples are run packed in one row and the second alone. With isolation its log-probabilities are the
    same up to rounding; attention across the boundary changes them at the first position already.
    """
    # torch types a module's attributes as Tensor | Module
    embeddings = unwrap_model(model).get_input_embeddings()  # type: ignore[operator]
    vocab, device = embeddings.num_embeddings, embeddings.weight.device
    was_training = model.training
    model.eval()
    try:
        first = torch.tensor([3, 1, 4, 1, 5]) % vocab
        second = torch.tensor([9, 2, 6, 5]) % vocab
        packed = torch.cat([first, second])[None].to(device)
        positions = torch.cat([torch.arange(5), torch.arange(4)])[None].to(device)
        inside = model(**model_inputs({"input_ids": packed, "position_ids": positions}))
        alone = model(**model_inputs({"input_ids": second[None].to(device)}))
        inside = inside.logits[0, 5:].float().log_softmax(-1)
        alone = alone.logits[0].float().log_softmax(-1)
    finally:
        model.train(was_training)
    difference = float((inside - alone).abs().max())
    if not difference <= tolerance:
        name = type(unwrap_model(model)).__name__
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", "?")
        raise UserError(f"packing: {name} with attention '{implementation}' lets packed examples attend to each "
                        f"other (log-prob difference {difference:.2e}); set packing: false or use a model built on "
                        f"transformers' create_causal_mask")
    return difference
