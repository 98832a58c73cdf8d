"""The studio (`gpt4all-training studio`): one local web app over the pipeline, from a JSONL file to a model to chat
with. It is a window over the CLI's own commands (each page calls the function its command calls, with the same
options; training runs as the CLI itself, in a subprocess), and every page shows the command line that does what the
page did, so a user can move to scripts.

- Data: upload or pick JSONL, `clean` it with its options (kept and dropped by reason), and `data`'s statistics and
  examples, the trained tokens highlighted where `data --show` writes {+ +}.
- Train: a form built from the config blocks and their docs (what `train --help` lists), presets from
  configs/train/, `plan` and `check`, a run started under `python` or `accelerate launch`, its loss, learning rate,
  gradient norm, tokens/s and memory live from metrics.jsonl, stop (SIGTERM: a checkpoint) and resume.
- Map: `inference` and `build_map` of a run, the map in the page, `curate` from its selection, and training again on
  the curated data.
- Evaluate, chat, export: `eval` on the shipped suite before and after, a chat with any final/ or checkpoint through
  the serving engine (streamed), `export` as HF or GGUF with download links.
- Every model picker offers the packaged models by their short names (model/names.py), so a studio on an empty
  workdir starts from `smollm2`, then the workdir's models/ folders and the runs' final/ and checkpoints.

The front end is plain HTML, CSS and ES modules shipped as package data (static/): no build step, nothing fetched
from the network at run time, and nothing for CI to install. The one chart it needs (a few lines over the steps) is
an SVG drawn by hand, smaller than any charting package would be to vendor.

Modules: app.py (the HTTP side: its guard, its errors and the shell every page shares), pages.py (one router per
page and its request bodies), actions.py (each page's action through the CLI's own command), configs.py (the
form and saved configs), runs.py with supervise.py (runs as subprocesses, their state read from their folders),
jobs.py (long actions in threads), chat.py (the chat panel over the serving engine), workdir.py (paths confined to
the workdir, uploads).
"""
