"""Peak RSS after each phase of our training run: `python bench/memory_phases.py [smollm2|smollm2-full] [dtype]`.

Wraps `loop.train`'s phases (the objective's build_model, prepare, every train_step, finish_run, save_final) and prints
the process's current and peak RSS before and after each, for a packed run of 3 steps (fp32 unless `dtype` says
bfloat16) with the model's bench settings: where in a run the peak memory is taken.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def rss() -> str:
    current = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return f"rss {current:,.0f} MiB, peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB"


def traced(module, name: str) -> None:
    inner = getattr(module, name)

    def wrapped(*args, **kwargs):
        print(f"before {name}: {rss()}", flush=True)
        out = inner(*args, **kwargs)
        print(f"after  {name}: {rss()}", flush=True)
        return out

    setattr(module, name, wrapped)


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    harness.setup_environment()
    import gpt4all_training.training.final as final
    import gpt4all_training.training.loop as loop
    from gpt4all_training.config.loader import load_config
    from gpt4all_training.training.objectives.sft import FineTuning

    traced(FineTuning, "build_model")
    for name in ("prepare", "train_step", "finish_run"):
        traced(loop, name)
    traced(final, "save_final")
    harness.MODELS[kind]["dtype"] = sys.argv[2] if len(sys.argv) > 2 else "float32"
    out = harness.WORK / "runs" / "memory-phases"
    shutil.rmtree(out, ignore_errors=True)
    overrides = harness.ours_overrides(kind, harness.model_dir(kind), harness.clean_data(), out, 3)
    loop.train(load_config(None, [*overrides, "packing=true"]))
    print(f"end: {rss()}")


if __name__ == "__main__":
    main()
