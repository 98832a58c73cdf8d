"""The studio end to end in a real headless Chromium (tests/support/browser.py), one browser session for the whole
path, from a workdir with nothing in it, on the packaged model `smollm2` (a tiny Llama stands in for SmolLM2 here:
support/studio.py: packaged_substitute): log in with the API key, upload a ShareGPT file, clean it (the dropped counts
by reason), see the trained tokens highlighted as `data --show` marks them, a config the CLI refuses (its line in the
page), `plan` and `check`, a 200-step run whose loss chart and step counter update live, stop it (a checkpoint),
resume it, kill the studio while the run goes on and start it again (the run is still listed, and finishes), chat
with final/ and with a checkpoint (streamed answers), export a GGUF and download it, build the map (its command line
reads back as the config it ran), curate from a search selection and train again on the result, and evaluate before
(`smollm2`) and after, each score with its interval.

A shorter test drives a run's panel with metrics rows written by hand (the step counter against the chart), loads a
saved config back into the form, and reads every model picker.

Every stage's screenshot is kept in .cache/artefacts/studio/ and checked for what it must show (elements in the
page, and colours in the image: the highlighted tokens, the loss line, the map). With STUDIO_DOCS_IMAGES=1 the
screenshots of the six pages are also written to docs/images/, where the README shows them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import yaml
from PIL import Image
from support.browser import Browser, BrowserError, chromium_path
from support.files import write_jsonl
from support.models import CHAT_TEMPLATE
from support.outputs import assert_steps_monotone
from support.paths import CACHE, REPO
from support.studio import (CONVERSATIONS, DROPPED, TOPICS, sharegpt_rows, smollm2_stand_in, start_studio,
                            stop_studio)

from gpt4all_training.cli.main import build_parser
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import InferenceConfig
from gpt4all_training.data.sft import load_data, show_example
from gpt4all_training.evaluation.results import comparison_of, interval_of
from gpt4all_training.generation.generate import generate_replies
from gpt4all_training.model.loading import load_model, load_tokenizer
from gpt4all_training.model.trained import open_model
from gpt4all_training.studio.runs import Launch

ARTEFACTS = CACHE / "artefacts" / "studio"
DOCS_IMAGES = REPO / "docs" / "images"
PRESET = REPO / "configs" / "train" / "chat_tiny.yaml"
# 20 optimizer steps of 4 micro-batches: long enough (about 0.25 s a step on 2 cores) to be stopped by a click after
# the second row, short enough for CI.
# Long enough that the stop lands mid-run: the tiny model trains about 20 steps a second once its process is up, and a
# stop that arrives during the last step lets the run finish instead (a race a 20-step run lost in CI).
RUN = {"max_steps": 200, "gradient_accumulation_steps": 4, "save_every": 5}
QUESTION = TOPICS[2][0]
HIGHLIGHT = (199, 240, 207)  # mark.trained's background
LOSS_LINE = (31, 119, 180)
MAP_BACKGROUND = (17, 17, 17)
EXPECTED_CONSOLE = "the server responded with a status of 400"  # the refused config's request, on purpose


def js(browser: Browser, expression: str):
    return browser.evaluate(expression)


def set_value(browser: Browser, element_id: str, value) -> None:
    js(browser, f"(e => {{ e.value = {json.dumps(value)}; e.dispatchEvent(new Event('change', {{bubbles: true}})); }})"
                f"(document.getElementById({json.dumps(element_id)}))")


def click(browser: Browser, element_id: str) -> None:
    js(browser, f"document.getElementById({json.dumps(element_id)}).click()")


def text(browser: Browser, element_id: str) -> str:
    return js(browser, f"document.getElementById({json.dumps(element_id)}).textContent")


def no_page_errors(browser: Browser) -> None:
    assert [e for e in browser.errors if EXPECTED_CONSOLE not in e] == []


def pixels(path: Path, colour: tuple[int, int, int]) -> int:
    image = np.asarray(Image.open(path).convert("RGB")).astype(np.int16)
    return int((np.abs(image - np.asarray(colour)).sum(axis=-1) <= 6).sum())


def screenshot(browser: Browser, name: str, scroll_to: str | None = None, docs: str | None = None) -> Path:
    """The viewport (scrolled to `scroll_to`) as ARTEFACTS/NAME.png, and as docs/images/studio-DOCS.png when asked."""
    if scroll_to:
        js(browser, f"document.getElementById({json.dumps(scroll_to)}).scrollIntoView()")
    else:
        js(browser, "window.scrollTo(0, 0)")
    browser.next_frame()
    path = browser.screenshot(ARTEFACTS / f"{name}.png")
    if docs and os.environ.get("STUDIO_DOCS_IMAGES") == "1":
        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, DOCS_IMAGES / f"studio-{docs}.png")
    return path


def open_page(browser: Browser, url: str, page: str, key: str) -> None:
    """Load the page at #PAGE, logging in when the studio asks for its key."""
    browser.open(url + "/", f"#{page}")
    browser.wait_for("document.getElementById('login').open || document.body.dataset.ready !== undefined", 120)
    if js(browser, "document.getElementById('login').open"):
        assert browser.errors == ["Failed to load resource: the server responded with a status of 401 (Unauthorized)"]
        browser.errors.clear()  # the page's first request, refused until it has the key: as it should be
        set_value(browser, "login-key", key)
        click(browser, "login-button")
    browser.wait_for(f"document.body.dataset.ready === {json.dumps(page)}", 120)


def wait(browser: Browser, expression: str, timeout: float, page: str) -> None:
    """browser.wait_for, failing with the page's error line (what the studio said went wrong)."""
    try:
        browser.wait_for(expression, timeout)
    except BrowserError:
        raise AssertionError(f"{expression}: still false; the page says {text(browser, f'{page}-error')!r}") from None


def go(browser: Browser, page: str) -> None:
    js(browser, f"location.hash = '#{page}'")
    browser.wait_for(f"document.body.dataset.ready === {json.dumps(page)}", 120)


def expected_examples(workdir: Path, count: int) -> list[str]:
    """The first examples as `data --show` prints them (with its {+ +} marks), from the CLI's own functions."""
    config = load_config(PRESET, ["model_name=smollm2", f"dataset_path={workdir / 'data' / 'chat-clean'}"])
    tokenizer = load_tokenizer(config.model_name)
    (train, _), _ = load_data(config, tokenizer)
    return [show_example(row, tokenizer) for row in train.select(range(count))]


def shown_examples(browser: Browser) -> list[str]:
    """The page's examples with each highlighted run put back between {+ +}."""
    return js(browser, """[...document.querySelectorAll('pre.example')].map(pre => [...pre.childNodes].map(
        node => node.nodeName === 'MARK' ? '{+' + node.textContent + '+}' : node.textContent).join(''))""")


def fill_training_form(browser: Browser, name: str, **values) -> None:
    set_value(browser, "train-name", name)
    for key, value in values.items():
        set_value(browser, f"field-{key}", str(value))


def options(browser: Browser, element_id: str) -> list[str]:
    return js(browser, f"[...document.getElementById({json.dumps(element_id)}).options].map(o => o.value)")


def bounds_shown(cell: str) -> list[float | None]:
    """[low, high] of an interval cell, `[0.04559, 0.6994]` (`-` for a bound the page has none of)."""
    match = re.fullmatch(r"\[(\S+), (\S+)\]", cell)
    assert match, cell
    return [None if bound == "-" else float(bound) for bound in match.groups()]


def close_to_shown(value: float | None) -> object:
    """`value` as the page shows it, to 4 significant digits (chart.js formatNumber)."""
    return None if value is None or not np.isfinite(value) else pytest.approx(value, rel=1e-3, abs=1e-12)


def running_supervisor(run_folder: Path) -> psutil.Process:
    record = json.loads((run_folder / "studio.json").read_text())
    return psutil.Process(record["pid"])


@pytest.fixture(scope="module")
def browser():
    executable = chromium_path()
    if executable is None:
        pytest.skip("chromium is not installed and scripts/ensure_chromium.sh could not install it")
    with Browser(executable, width=1280, height=900) as b:
        yield b


def metrics_row(step: int) -> str:
    return json.dumps({"step": step, "loss": 3.0 - step / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0,
                       "peak_rss_mb": 500.0}) + "\n"


@pytest.mark.integration
@pytest.mark.slow
def test_the_run_panel_counts_the_steps_its_chart_draws_and_a_saved_config_loads_under_its_name(browser, tmp_path):
    """A running run (its supervisor a live process, as the studio records it) whose metrics rows are written here,
    after the page opened it: the step counter said "0 of 5" beside a chart of 2 points (it was set when the run's
    state changed, and no state changes while rows come in). A config saved from the form, loaded again, shows its
    own name and output_dir (the form kept the name typed before and pointed output_dir at it). Every model picker
    offers the packaged models besides the workdir's."""
    workdir = tmp_path / "workdir"
    (workdir / "configs").mkdir(parents=True)
    (workdir / "configs" / "live.yaml").write_text(yaml.safe_dump({
        "model_name": "smollm2", "dataset_path": "data/chat", "output_dir": "runs/live", "max_steps": 5}))
    run = workdir / "runs" / "live"
    (run / "step_1").mkdir(parents=True)
    (run / "step_1" / "COMPLETE").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    supervisor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (run / "studio.json").write_text(json.dumps({
        "pid": supervisor.pid, "create_time": psutil.Process(supervisor.pid).create_time(),
        "command": "gpt4all-training train --config configs/live.yaml", "config": "configs/live.yaml",
        "launch": dataclasses.asdict(Launch("configs/live.yaml"))}))
    studio = start_studio(workdir, tmp_path / "studio.log")
    try:
        open_page(browser, studio.url, "train", "")
        wait(browser, "document.getElementById('run-state').textContent === 'running'", 60, "train")
        assert text(browser, "run-step") == "0 of 5"
        with open(run / "metrics.jsonl", "a") as metrics:
            for step in (1, 2):
                metrics.write(metrics_row(step))
                metrics.flush()
                browser.wait_for(f"document.getElementById('chart-loss').dataset.points === '{step}'", 30)
                assert text(browser, "run-step") == f"{step} of 5"

        js(browser, "document.getElementById('train-preset').value = 'configs/live.yaml'")
        click(browser, "train-load-preset")
        wait(browser, "document.getElementById('train-name').value === 'live'", 30, "train")
        assert [js(browser, f"document.getElementById('field-{key}').value")
                for key in ("output_dir", "model_name", "max_steps")] == ["runs/live", "smollm2", "5"]

        # Every picker: the packaged model first, then the workdir's (here the run's checkpoint).
        offered = ["smollm2", "runs/live/step_1"]
        assert js(browser, "document.getElementById('field-model_name').getAttribute('list')") == "model-choices"
        assert js(browser, "[...document.getElementById('model-choices').options].map(o => o.value)") == offered
        assert js(browser, "document.querySelector('#model-choices option').textContent") == (
            "smollm2: SmolLM2-135M-Instruct (GGUF Q4_1), packaged")
        for page, pickers in (("data", {"data-model": offered}), ("map", {"map-model": offered[::-1]}),
                              ("evaluate", {"eval-before": ["", *offered], "eval-after": offered}),
                              ("chat", {"chat-model": offered}), ("export", {"export-source": offered})):
            go(browser, page)
            assert {element: options(browser, element) for element in pickers} == pickers, page
        assert js(browser, "document.getElementById('export-to').value") == "exports/smollm2-gguf"
        no_page_errors(browser)
    finally:
        stop_studio(studio)
        supervisor.kill()
        supervisor.wait()


@pytest.mark.integration
@pytest.mark.slow
def test_the_whole_path_in_a_browser(browser, chat_tokenizer, tmp_path, tmp_path_factory, monkeypatch):
    shutil.rmtree(ARTEFACTS, ignore_errors=True)
    ARTEFACTS.mkdir(parents=True)
    packages = smollm2_stand_in(tmp_path_factory, chat_tokenizer)
    monkeypatch.syspath_prepend(str(packages))  # this process's expectations read `smollm2` as the studio does
    upload = tmp_path / "chat.jsonl"  # the user's file, outside the workdir
    write_jsonl(upload, sharegpt_rows())
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    key = secrets.token_hex(16)
    log = tmp_path / "studio.log"
    studio = start_studio(workdir, log, key, packages=packages)
    run_folder = workdir / "runs" / "tiny-chat"
    try:
        # ---------------------------------------------------------------- data: upload, clean, examples
        open_page(browser, studio.url, "data", key)
        document = browser.page("DOM.getDocument")["root"]["nodeId"]
        file_input = browser.page("DOM.querySelector", nodeId=document, selector="#upload-file")["nodeId"]
        browser.page("DOM.setFileInputFiles", nodeId=file_input, files=[str(upload)])
        browser.wait_for("document.getElementById('upload-name').value === 'data/chat.jsonl'", 30)
        click(browser, "upload-button")
        wait(browser, "document.getElementById('upload-result').textContent !== ''", 60, "data")
        assert text(browser, "upload-result") == f"data/chat.jsonl: {CONVERSATIONS + 3} records, " \
                                                 f"{upload.stat().st_size} bytes"
        browser.wait_for("document.getElementById('clean-output').value === 'data/chat-clean'", 30)
        assert js(browser, "document.getElementById('clean-inputs').value") == "data/chat.jsonl"
        click(browser, "clean-button")
        wait(browser, "document.querySelectorAll('#clean-report tr.drop-reason').length > 0", 60, "data")
        dropped = js(browser, """Object.fromEntries([...document.querySelectorAll('#clean-report tr.drop-reason')]
                                 .map(r => [r.dataset.reason, Number(r.querySelector('.count').textContent)]))""")
        assert dropped == DROPPED
        assert js(browser, "document.querySelector('#clean-report td.kept').textContent") == str(CONVERSATIONS)
        assert text(browser, "data-command") == "gpt4all-training clean data/chat.jsonl --output-dir data/chat-clean"
        # The packaged model, the one model of an empty workdir, is what the page tokenises with unless told.
        assert options(browser, "data-model") == ["smollm2"]
        assert js(browser, "document.getElementById('data-model').value") == "smollm2"
        click(browser, "data-button")
        wait(browser, "document.querySelectorAll('pre.example').length === 3", 120, "data")
        assert shown_examples(browser) == expected_examples(workdir, 3)
        assert js(browser, "document.querySelectorAll('pre.example mark.trained').length") >= 3
        assert text(browser, "data-command").startswith(f"gpt4all-training data --config {PRESET} "
                                                        f"model_name=smollm2 dataset_path=data/chat-clean")
        assert pixels(screenshot(browser, "1-data", docs="data"), HIGHLIGHT) > 500
        no_page_errors(browser)

        # ---------------------------------------------------------------- a refused config, plan, check
        go(browser, "train")
        fill_training_form(browser, "tiny-chat", dataset_path="data/chat-clean", lr=-1, **RUN)
        assert js(browser, "document.getElementById('field-model_name').value") == "smollm2"  # the preset's
        assert js(browser, "document.getElementById('field-output_dir').value") == "runs/tiny-chat"
        assert text(browser, "warning-rewards").startswith("A module named here is Python code: the run imports")
        click(browser, "train-plan")
        wait(browser, "document.getElementById('train-error').textContent !== ''", 60, "train")
        assert text(browser, "train-error") == "error: lr: must be > 0, got -1.0"  # the CLI's line
        screenshot(browser, "2-train-refused", scroll_to="train-error")
        set_value(browser, "field-lr", "0.003")
        click(browser, "train-plan")
        wait(browser, "document.getElementById('train-output').textContent.includes('in total')", 120, "train")
        assert f"{RUN['max_steps']} optimiser steps in total" in text(browser, "train-output")
        assert text(browser, "train-error") == ""
        assert text(browser, "train-command") == "gpt4all-training plan --config configs/tiny-chat.yaml"
        click(browser, "train-check")
        wait(browser, "document.getElementById('train-output').textContent.includes('passed')", 180, "train")
        assert text(browser, "train-output").endswith("all checks passed")
        assert text(browser, "train-command") == "gpt4all-training check --config configs/tiny-chat.yaml"

        # ---------------------------------------------------------------- a run: live curves, stop, one at a time
        click(browser, "train-start")
        wait(browser, "document.getElementById('run-state').textContent === 'running'", 60, "train")
        assert text(browser, "train-command") == "gpt4all-training train --config configs/tiny-chat.yaml"
        browser.wait_for("Number(document.getElementById('chart-loss').dataset.points) >= 1", 180)
        first = int(js(browser, "document.getElementById('chart-loss').dataset.points"))
        browser.wait_for(f"Number(document.getElementById('chart-loss').dataset.points) > {first}", 60)
        # The step counter and the chart, read in one go, agree while the rows come in (every step logs a row).
        points, step = js(browser, "[document.getElementById('chart-loss').dataset.points, "
                                   "document.getElementById('run-step').textContent]")
        assert step == f"{points} of {RUN['max_steps']}"
        click(browser, "run-stop")
        assert studio.request("POST", "/api/runs", {"config": "configs/tiny-chat.yaml"}) == (
            409, {"error": "error: run tiny-chat: already running; stop it first"})
        values = studio.request("GET", "/api/presets?name=configs/tiny-chat.yaml")[1]["values"]
        status, saved = studio.request("POST", "/api/configs", {"name": "other",
                                                                "values": {**values, "output_dir": "runs/other"}})
        assert status == 200, saved
        assert studio.request("POST", "/api/runs", {"config": "configs/other.yaml"}) == (409, {
            "error": "error: run tiny-chat is running on all devices: one run at a time per device; stop it, choose "
                     "other devices, or allow concurrent runs"})
        wait(browser, "document.getElementById('run-state').textContent === 'stopped'", 180, "train")
        stopped_at = int(text(browser, "run-step").split()[0])
        assert 2 <= stopped_at < RUN["max_steps"]
        assert (run_folder / f"step_{stopped_at}" / "COMPLETE").is_file()  # the checkpoint SIGTERM wrote
        assert not (run_folder / "final").exists()
        assert js(browser, "document.getElementById('run-resume').disabled") is False
        points = int(js(browser, "document.getElementById('chart-loss').dataset.points"))
        assert points == stopped_at
        assert pixels(screenshot(browser, "3-train-stopped", scroll_to="run-panel"), LOSS_LINE) > 40

        # ---------------------------------------------------------------- resume; the studio killed and restarted
        click(browser, "run-resume")
        wait(browser, "document.getElementById('run-state').textContent === 'running'", 60, "train")
        supervisor = running_supervisor(run_folder)
        studio.process.send_signal(signal.SIGKILL)
        studio.process.wait(timeout=30)
        assert supervisor.is_running() and supervisor.status() != psutil.STATUS_ZOMBIE  # the run goes on
        studio = start_studio(workdir, log, key, port=int(studio.url.rsplit(":", 1)[1]), packages=packages)
        status, listed = studio.request("GET", "/api/runs")
        assert status == 200 and [(r["name"], r["state"] in ("running", "finished")) for r in listed["runs"]] == [
            ("tiny-chat", True)]
        open_page(browser, studio.url, "train", key)  # a new studio: the page logs in again
        wait(browser, "document.getElementById('run-name').textContent === 'tiny-chat'", 60, "train")
        wait(browser, "document.getElementById('run-state').textContent === 'finished'", 240, "train")
        assert_steps_monotone(run_folder, RUN["max_steps"])  # resumed at its checkpoint: every step once, in order
        browser.wait_for(f"Number(document.getElementById('chart-loss').dataset.points) === {RUN['max_steps']}", 30)
        assert [js(browser, f"document.getElementById('{chart}').dataset.points")  # every step's row, resumed too
                for chart in ("chart-lr", "chart-grad", "chart-tps", "chart-memory")] == [str(RUN["max_steps"])] * 4
        assert text(browser, "run-step") == f"{RUN['max_steps']} of {RUN['max_steps']}"
        wait(browser, "document.querySelector('tr[data-run=\"tiny-chat\"]').dataset.state === 'finished'", 30, "train")
        assert pixels(screenshot(browser, "4-train-finished", scroll_to="run-panel", docs="train"), LOSS_LINE) > 40
        no_page_errors(browser)

        # ---------------------------------------------------------------- chat with final/, streamed
        go(browser, "chat")
        set_value(browser, "chat-model", "runs/tiny-chat/final")
        set_value(browser, "chat-input", QUESTION)
        click(browser, "chat-send")
        wait(browser, "document.querySelector('.message.assistant')?.dataset.state === 'done'", 120, "chat")
        model = load_model(str(run_folder / "final")).eval()
        expected = generate_replies(model, load_tokenizer(str(run_folder / "final")),
                                    [[{"role": "user", "content": QUESTION}]], 64)[0]
        reply = js(browser, "document.querySelector('.message.assistant .content').textContent")
        assert reply == expected and reply
        assert int(js(browser, "document.querySelector('.message.assistant').dataset.chunks")) > 1  # streamed
        assert text(browser, "chat-command").startswith("gpt4all-training serve --model runs/tiny-chat/final")
        screenshot(browser, "5-chat", docs="chat")
        # ... and with a checkpoint, step_N/ (its weights in model/, its tokenizer the one its config names)
        checkpoint = js(browser, "[...document.getElementById('chat-model').options].map(o => o.value)"
                                 ".filter(v => v.startsWith('runs/tiny-chat/step_')).pop()")
        set_value(browser, "chat-model", checkpoint)  # a new conversation
        set_value(browser, "chat-input", QUESTION)
        click(browser, "chat-send")
        wait(browser, "document.querySelectorAll('.message.assistant').length === 1 && "
                      "document.querySelector('.message.assistant').dataset.state === 'done'", 120, "chat")
        with contextlib.chdir(workdir):  # the checkpoint's config names its tokenizer relative to the workdir
            model, tokenizer = open_model(checkpoint, torch.float32, torch.device("cpu"))
        expected = generate_replies(model, tokenizer, [[{"role": "user", "content": QUESTION}]], 64)[0]
        assert js(browser, "document.querySelector('.message.assistant .content').textContent") == expected
        assert int(js(browser, "document.querySelector('.message.assistant').dataset.chunks")) > 1
        assert text(browser, "chat-command").startswith(f"gpt4all-training serve --model {checkpoint}")

        # ---------------------------------------------------------------- export a GGUF and download it
        go(browser, "export")
        set_value(browser, "export-source", "runs/tiny-chat/final")
        assert js(browser, "document.getElementById('export-to').value") == "exports/tiny-chat-final-gguf"
        click(browser, "export-button")
        wait(browser, "document.querySelectorAll('#export-files a.download').length > 0", 180, "export")
        gguf = "exports/tiny-chat-final-gguf/tiny-chat-final-gguf-Q8_0.gguf"
        assert text(browser, "export-command") == ("gpt4all-training export --from runs/tiny-chat/final --to "
                                                   "exports/tiny-chat-final-gguf --format gguf")
        downloads = tmp_path / "downloads"
        downloads.mkdir()
        browser.downloads_to(downloads)
        js(browser, f"document.querySelector('#export-files a[href^=\"/files/{gguf}\"]').click()")
        deadline = time.monotonic() + 60
        while not (downloads / Path(gguf).name).is_file():
            assert time.monotonic() < deadline, sorted(p.name for p in downloads.iterdir())
            time.sleep(0.2)
        time.sleep(0.5)  # the browser renames the file when it is complete; let it flush
        assert (downloads / Path(gguf).name).read_bytes() == (workdir / gguf).read_bytes()
        import gguf as gguf_library

        fields = gguf_library.GGUFReader(str(downloads / Path(gguf).name)).fields
        assert fields["tokenizer.chat_template"].contents() == CHAT_TEMPLATE
        screenshot(browser, "6-export", docs="export")

        # ---------------------------------------------------------------- the map, curation, retraining
        go(browser, "map")
        set_value(browser, "map-run", "tiny-chat")
        set_value(browser, "map-model", "runs/tiny-chat/final")
        set_value(browser, "map-layout", "pca")
        click(browser, "map-build")
        wait(browser, "document.getElementById('map-frame').contentDocument?.getElementById('point-count')"
                      f"?.textContent === '{CONVERSATIONS}'", 240, "map")
        # The map's commands are the ones a user could type: the inference line reads back as the config it ran.
        typed = shlex.split(text(browser, "map-command").splitlines()[0])[1:]
        arguments = build_parser(typed[0]).parse_args(typed)
        with contextlib.chdir(workdir):
            shown = dataclasses.asdict(load_config(arguments.config, arguments.overrides, cls=InferenceConfig))
        assert shown == json.loads((workdir / "maps" / "tiny-chat" / "inference.json").read_text())["config"]
        js(browser, """(d => { const s = d.getElementById('search'); s.value = 'planet';
                                s.dispatchEvent(new Event('input', {bubbles: true})); })
                       (document.getElementById('map-frame').contentDocument)""")
        wait(browser, "document.getElementById('map-frame').contentDocument.getElementById('match-count')"
                      f".textContent === '{CONVERSATIONS // len(TOPICS)}'", 30, "map")  # each way of asking it
        click(browser, "curate-button")
        wait(browser, "document.getElementById('curate-result').textContent !== ''", 120, "map")
        kept = CONVERSATIONS - CONVERSATIONS // len(TOPICS)
        assert text(browser, "curate-result") == (f"read {CONVERSATIONS}, kept {kept}, dropped excluded "
                                                  f"{CONVERSATIONS - kept}: data/tiny-chat-curated/curated_clean.jsonl")
        curated = [json.loads(line) for line in (workdir / "data" / "tiny-chat-curated" / "curated_clean.jsonl")
                   .read_text().splitlines()]
        assert "planet" not in json.dumps(curated) and len(curated) == kept
        assert text(browser, "map-command") == ("gpt4all-training curate --input maps/tiny-chat --output "
                                                "data/tiny-chat-curated --exclude-ids maps/tiny-chat/selection.json")
        assert pixels(screenshot(browser, "7-map", docs="map"), MAP_BACKGROUND) > 20_000
        # Training again on the curated data: the run's own config over the curated folder, as a new run.
        click(browser, "curate-train")
        browser.wait_for("document.body.dataset.ready === 'train'", 60)
        assert js(browser, "document.getElementById('field-dataset_path').value") == "data/tiny-chat-curated"
        assert js(browser, "document.getElementById('field-output_dir').value") == "runs/tiny-chat-curated"
        assert js(browser, "document.getElementById('field-save_every').value") == str(RUN["save_every"])
        set_value(browser, "field-max_steps", "2")
        click(browser, "train-start")
        wait(browser, "document.getElementById('run-name').textContent === 'tiny-chat-curated' && "
                      "document.getElementById('run-state').textContent === 'finished'", 180, "train")
        assert text(browser, "train-command") == "gpt4all-training train --config configs/tiny-chat-curated.yaml"
        retrained = load_config(workdir / "runs" / "tiny-chat-curated" / "final" / "config.yaml", check=None)
        assert (retrained.dataset_path, retrained.max_steps, retrained.lr) == ("data/tiny-chat-curated", 2, 3e-3)
        assert_steps_monotone(workdir / "runs" / "tiny-chat-curated", 2)

        # ---------------------------------------------------------------- evaluate before and after
        go(browser, "evaluate")
        assert options(browser, "eval-before")[:2] == ["", "smollm2"]
        set_value(browser, "eval-before", "smollm2")
        set_value(browser, "eval-after", "runs/tiny-chat/final")
        set_value(browser, "eval-limit", "4")
        js(browser, "document.querySelectorAll('#eval-tasks input').forEach(i => "
                    "{ i.checked = i.value === 'gpt4all_arithmetic_choice'; })")
        click(browser, "eval-button")
        wait(browser, "document.querySelectorAll('#eval-table tr[data-task]').length > 0", 240, "evaluate")
        task, metric = "gpt4all_arithmetic_choice", "acc,none"
        before, after = (json.loads((workdir / "eval" / "compare" / label / "results.json").read_text())
                         for label in ("before", "after"))
        row = js(browser, """[...document.querySelector('#eval-table tr[data-metric="acc"]').children]
                             .map(td => td.textContent)""")
        # task, metric, then each model's score and 95% interval, then after - before, its interval and verdict
        assert row[:2] == [task, "acc"] and len(row) == 9
        for value, cell, results in ((row[2], row[3], before), (row[4], row[5], after)):
            interval = interval_of(results, task, metric)
            assert float(value) == results["results"][task][metric] == interval.value
            assert bounds_shown(cell) == [close_to_shown(interval.low), close_to_shown(interval.high)]
        paired = comparison_of(before, after, task, metric)
        assert float(row[6]) == pytest.approx(paired.difference, rel=1e-3, abs=1e-12)
        assert bounds_shown(row[7]) == [close_to_shown(paired.low), close_to_shown(paired.high)]
        assert row[8] == paired.verdict
        assert text(browser, "evaluate-command").splitlines()[1].endswith("--compare eval/compare/before/results.json")
        screenshot(browser, "8-evaluate", docs="evaluate")
        no_page_errors(browser)

        # ---------------------------------------------------------------- no secret anywhere
        assert key not in js(browser, "document.documentElement.outerHTML")
        for path in [log, *workdir.rglob("*.log"), *workdir.rglob("*.json"), *workdir.rglob("*.yaml")]:
            assert key not in path.read_text(errors="replace"), path
    finally:
        stop_studio(studio)
        if (run_folder / "studio.json").is_file() and not (run_folder / "studio_exit.json").is_file():
            try:  # a failed assertion left the run going: stop it (it writes a checkpoint and exits)
                supervisor = running_supervisor(run_folder)
                supervisor.send_signal(signal.SIGTERM)
                supervisor.wait(timeout=60)
            except psutil.NoSuchProcess:
                pass
