"""The progress of a long phase (training, reference scoring, validation, ...): one tqdm bar on stderr with its
count n/N, its rate and the time left, drawn by the main process only. Every stage that loops over a known number of
items draws its bar with `progress`, so each looks the same and `cli.main.report_error` can close any left open."""

from __future__ import annotations

from typing import Optional


def progress(what: str, total: int, enabled: bool = True, *, unit: str = "batch", initial: int = 0,
             leave: Optional[bool] = True):
    """A tqdm bar labelled `what` over `total` units (use it as a context manager, `update` it per unit). `enabled`
    False (another rank than the main one) draws nothing. `leave` None erases it when done if it was drawn under
    another bar (validation under training's), whose own line then reports the result."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=what, unit=unit, disable=not enabled, leave=leave,
                dynamic_ncols=True)
