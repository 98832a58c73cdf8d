"""The studio end to end in a real headless Chromium (tests/support/browser.py), one browser session for the whole
path on a tiny Llama: log in with the API key, upload a ShareGPT file, clean it (the dropped counts by reason), see
the trained tokens highlighted as `data --show` marks them, a config the CLI refuses (its line in the page), `plan`
and `check`, a 20-step run whose loss chart updates live, stop it (a checkpoint), resume it, kill the studio while the
run goes on and start it again (the run is still listed, and finishes), chat with final/ and with a checkpoint (streamed
answers), export a GGUF and download it, build the map (its command line reads back as the config it ran), curate
from a search selection and train again on the result, and evaluate before and after.

Every stage's screenshot is kept in .cache/artefacts/studio/ and checked for what it must show (elements in the
page, and colours in the image: the highlighted tokens, the loss line, the map). With STUDIO_DOCS_IMAGES=1 the
screenshots of the six pages are also written to docs/images/, where the README shows them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shlex
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from PIL import Image
from support.browser import Browser, BrowserError, chromium_path
from support.models import CHAT_TEMPLATE
from support.outputs import assert_steps_monotone
from support.paths import CACHE, REPO
from support.studio import CONVERSATIONS, DROPPED, TOPICS, make_workdir, start_studio, stop_studio

from gpt4all_training.cli.main import build_parser
from gpt4all_training.config.loader import load_config
from gpt4all_training.config.schemas import InferenceConfig
from gpt4all_training.data.sft import load_data, show_example
from gpt4all_training.generation.generate import generate_replies
from gpt4all_training.model.loading import load_model, load_tokenizer
from gpt4all_training.model.trained import open_model

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
    config = load_config(PRESET, [f"model_name={workdir / 'models' / 'tiny'}",
                                  f"dataset_path={workdir / 'data' / 'chat-clean'}"])
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


@pytest.mark.integration
@pytest.mark.slow
def test_the_whole_path_in_a_browser(browser, chat_tokenizer, tmp_path):
    shutil.rmtree(ARTEFACTS, ignore_errors=True)
    ARTEFACTS.mkdir(parents=True)
    workdir = make_workdir(tmp_path / "workdir", chat_tokenizer)
    key = secrets.token_hex(16)
    log = tmp_path / "studio.log"
    studio = start_studio(workdir, log, key)
    run_folder = workdir / "runs" / "tiny-chat"
    try:
        # ---------------------------------------------------------------- data: upload, clean, examples
        open_page(browser, studio.url, "data", key)
        document = browser.page("DOM.getDocument")["root"]["nodeId"]
        file_input = browser.page("DOM.querySelector", nodeId=document, selector="#upload-file")["nodeId"]
        browser.page("DOM.setFileInputFiles", nodeId=file_input, files=[str(workdir / "upload" / "chat.jsonl")])
        browser.wait_for("document.getElementById('upload-name').value === 'data/chat.jsonl'", 30)
        click(browser, "upload-button")
        wait(browser, "document.getElementById('upload-result').textContent !== ''", 60, "data")
        assert text(browser, "upload-result") == f"data/chat.jsonl: {CONVERSATIONS + 3} records, " \
                                                 f"{(workdir / 'upload' / 'chat.jsonl').stat().st_size} bytes"
        browser.wait_for("document.getElementById('clean-output').value === 'data/chat-clean'", 30)
        assert js(browser, "document.getElementById('clean-inputs').value") == "data/chat.jsonl"
        click(browser, "clean-button")
        wait(browser, "document.querySelectorAll('#clean-report tr.drop-reason').length > 0", 60, "data")
        dropped = js(browser, """Object.fromEntries([...document.querySelectorAll('#clean-report tr.drop-reason')]
                                 .map(r => [r.dataset.reason, Number(r.querySelector('.count').textContent)]))""")
        assert dropped == DROPPED
        assert js(browser, "document.querySelector('#clean-report td.kept').textContent") == str(CONVERSATIONS)
        assert text(browser, "data-command") == "gpt4all-training clean data/chat.jsonl --output-dir data/chat-clean"
        click(browser, "data-button")
        wait(browser, "document.querySelectorAll('pre.example').length === 3", 120, "data")
        assert shown_examples(browser) == expected_examples(workdir, 3)
        assert js(browser, "document.querySelectorAll('pre.example mark.trained').length") >= 3
        assert text(browser, "data-command").startswith(f"gpt4all-training data --config {PRESET} "
                                                        f"model_name=models/tiny dataset_path=data/chat-clean")
        assert pixels(screenshot(browser, "1-data", docs="data"), HIGHLIGHT) > 500
        no_page_errors(browser)

        # ---------------------------------------------------------------- a refused config, plan, check
        go(browser, "train")
        fill_training_form(browser, "tiny-chat", model_name="models/tiny", dataset_path="data/chat-clean", lr=-1, **RUN)
        assert js(browser, "document.getElementById('field-output_dir').value") == "runs/tiny-chat"
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
        studio = start_studio(workdir, log, key, port=int(studio.url.rsplit(":", 1)[1]))
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
        set_value(browser, "eval-before", "models/tiny")
        set_value(browser, "eval-after", "runs/tiny-chat/final")
        set_value(browser, "eval-limit", "4")
        js(browser, "document.querySelectorAll('#eval-tasks input').forEach(i => "
                    "{ i.checked = i.value === 'gpt4all_arithmetic_choice'; })")
        click(browser, "eval-button")
        wait(browser, "document.querySelectorAll('#eval-table tr[data-task]').length > 0", 240, "evaluate")
        before, after = (json.loads((workdir / "eval" / "compare" / label / "results.json").read_text())
                         ["results"]["gpt4all_arithmetic_choice"]["acc,none"] for label in ("before", "after"))
        row = js(browser, """[...document.querySelector('#eval-table tr[data-metric="acc"]').children]
                             .map(td => td.textContent)""")
        assert row[:2] == ["gpt4all_arithmetic_choice", "acc"]
        assert [float(row[2]), float(row[3])] == [before, after]
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
