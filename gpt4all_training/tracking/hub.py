"""Publishing final/ to the Hugging Face Hub after a successful run. A push that fails never stops training.

The token comes from the standard places (the `HF_TOKEN` environment variable or `hf auth login`); it is never
passed around, printed or written, and every message here hides it and any other secret (`config.secrets`). Only
the main process pushes, and only once final/ is written.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

from gpt4all_training.config.secrets import scrub, secret_values


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def hidden(text: str, token: str | None) -> str:
    """`text` with every secret hidden: the environment's, token-shaped text (a token pasted into the repo id), and
    the token huggingface_hub found (`hf auth login` keeps it in a file, not in the environment)."""
    return scrub(text, sorted({*secret_values(), *([token] if token else [])}, key=len, reverse=True))


def worth_retrying(exc: Exception) -> bool:
    """Network trouble and 5xx/429 answers may pass; a refused token or a bad repo id will not."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return status is None or status >= 500 or status == 429


def push_folder(folder: str | Path, repo_id: str, attempts: int = 3, first_delay: float = 1.0,
                log: Callable[[str], Any] = print, warn: Callable[[str], Any] = warn) -> str | None:
    """Upload `folder` to the model repo `repo_id` (created if missing), retrying with exponential backoff.

    Returns the commit URL, or None after logging one warning when every attempt failed.
    """
    from huggingface_hub import HfApi, constants, get_token

    token = get_token()  # only to keep it out of messages; huggingface_hub finds it by itself
    if constants.HF_HUB_OFFLINE:
        warn(hidden(f"push_to_hub: not pushing {folder} to {repo_id} because HF_HUB_OFFLINE is set; "
                    f"push it later with `hf upload {repo_id} {folder}`", token))
        return None
    api = HfApi()
    reason = ""
    for attempt in range(1, attempts + 1):
        try:
            api.create_repo(repo_id, exist_ok=True)
            commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id,
                                       commit_message="Upload fine-tuned model (gpt4all-training)")
        except Exception as exc:  # any failure means "not pushed", never "stop the run"
            reason = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
            if attempt == attempts or not worth_retrying(exc):
                break
            time.sleep(first_delay * 2 ** (attempt - 1))
        else:
            log(hidden(f"pushed {folder} to {commit.commit_url}", token))
            return commit.commit_url
    warn(hidden(f"push_to_hub: pushing {folder} to {repo_id} failed after {attempt} attempt(s) ({reason}); the "
                f"model is safe in {folder}; push it later with `hf upload {repo_id} {folder}`", token))
    return None
