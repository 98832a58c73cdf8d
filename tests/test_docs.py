"""Every command the README and the docs show runs, on tiny fixtures, so none can rot; and the docs site builds.

What is a shown command (docs/contributing.md says the same to writers):
- each line of a fenced block tagged `sh`: one command (`#` starts a comment; a line ending in `\\` goes on);
- each `$ ` line of a block tagged `console`; the lines below it, up to the next `$ `, are its output, and each must
  be a line of what the command printed, in that order (`...` inside a line stands for any text);
- a block tagged `python`: one script, run with the venv's python;
- a code span in a table cell that starts with a program (`gpt4all-training`, `python`, `accelerate`, ...).
A comment `<!-- docs-test: not-run REASON -->` just before a block, or inside the cell, keeps it from running (a GPU,
several machines, the Hub): each is a skipped test whose reason pytest lists. `<!-- docs-test: exit N -->` expects
exit code N (0 otherwise). Every other fenced block must carry a tag that is not a command language (`yaml`, `text`,
...), so that no command goes untested by accident.

The commands run in the order shown, the README first and then the pages in the site's order, in one scratch
workspace (the repository's scripts and venv linked in, `configs/` copied, the fixture files below), as a user would
run them from the repository root. A command shown twice runs once. `gpt4all-training serve` and `studio` are servers:
each is started and must answer; it stays up while the later commands run (a client script talks to it) and is
stopped with SIGTERM at the end, when it must exit cleanly. What the docs name that would be too big or not here is
replaced, by SUBSTITUTIONS only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from markdown_it import MarkdownIt
from support.launch import free_port
from support.models import build_tiny_llama
from support.paths import DOLLY, OASST, PYTHON, REPO

SITE = yaml.safe_load((REPO / "mkdocs.yml").read_text())
DOCS = REPO / SITE.get("docs_dir", "docs")
# Pages whose commands are records of measurements, not instructions: kept where they are, only linked from the site.
RECORDS = ("BENCHMARKS.md", "RELIABILITY.md")
COMMAND_TAGS = ("sh", "console", "python")
# Fence tags that hold no command. A fence without a tag, or with bash/shell, is refused (see the module doc).
OTHER_TAGS = ("text", "yaml", "json", "jinja")
# How a command starts: a program and a space, or a path or variable in front of one.
PROGRAM = re.compile(r"(gpt4all-training|python|accelerate|torchrun|make|source|bash|vllm) "
                     r"|\.venv/bin/|scripts/|[A-Z_]+=\S+ ")
DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(not-run\s+(?P<reason>.+?)|exit\s+(?P<exit>\d+))\s*-->", re.DOTALL)
SERVERS = re.compile(r"\bgpt4all-training (serve|studio)\b")
TIMEOUT_S = 300
TINY_MODEL = "models/tiny-chat"

# What the docs name -> what the workspace runs instead, applied to every command and to the copied configs/.
# (pattern, replacement, why); `{serve}` and `{studio}` stand for the free ports the servers get.
SUBSTITUTIONS = [
    (r"(?<=[=\s])smollm2(?=\s|$)", TINY_MODEL,
     "SmolLM2-135M (the packaged `smollm2`) trains at seconds a step here: a 2-layer Llama with a ChatML tokenizer"),
    (r"127\.0\.0\.1:8000\b", "127.0.0.1:{serve}", "serve's default port: a free one, whatever else runs here"),
    (r"127\.0\.0\.1:7860\b", "127.0.0.1:{studio}", "studio's default port: the same"),
    (r"(gpt4all-training (serve|studio)\b(?:(?!--port)[^\n#])*?)(?=\s*(?:#|$))", r"\1 --port {\2}",
     "the server on that port"),
]


@dataclass
class Shown:
    """One command (or script) as a page shows it."""
    page: str
    line: int
    kind: str  # sh | console | python | cell
    text: str
    output: list[str] = field(default_factory=list)
    exit: int = 0
    not_run: str | None = None

    @property
    def id(self) -> str:
        first = self.text.strip().splitlines()[0]
        return f"{self.page}:{self.line} {first[:70]}"


def substituted(text: str, ports: dict[str, int] | None = None) -> str:
    """`text` as the workspace runs it; the servers' ports filled in when given."""
    for pattern, replacement, _ in SUBSTITUTIONS:
        text = re.sub(pattern, replacement, text, flags=re.MULTILINE)
    for server, port in (ports or {}).items():
        text = text.replace("{" + server + "}", str(port))
    return text


def navigation() -> list[str]:
    """The site's pages (paths under docs/) in the order of its navigation."""
    def walk(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from walk(value) if isinstance(value, list) else [value]
    return list(walk(SITE["nav"]))


def pages() -> list[Path]:
    """The README, then the site's pages in its navigation order, less the records of measurements."""
    return [REPO / "README.md"] + [DOCS / name for name in navigation() if (DOCS / name).resolve().name not in RECORDS]


def directive(html: str) -> dict:
    match = DIRECTIVE.search(html or "")
    if not match:
        return {}
    return {"not_run": match["reason"].strip()} if match["reason"] else {"exit": int(match["exit"])}


def commands_of_block(lines: list[str], kind: str) -> list[tuple[int, str, list[str]]]:
    """(offset of its first line in the block, command, output lines) for each command of an sh or console block."""
    found = []  # [offset, text, output]
    for offset, line in enumerate(lines):
        going_on = bool(found) and found[-1][1].endswith("\\")
        if going_on:
            found[-1][1] += "\n" + line
        elif kind == "sh":
            text = re.sub(r"(^|\s)#.*$", "", line).rstrip()
            if text:
                found.append([offset, text, []])
        elif line.startswith("$ "):
            found.append([offset, line[2:].rstrip(), []])
        elif found and line.strip():
            found[-1][2].append(line)
    return [(offset, text, output) for offset, text, output in found]


def shown_in(page: Path, source: str | None = None) -> tuple[list[Shown], list[str]]:
    """The commands a page shows, and its fenced blocks that break the convention (as `page:line why`)."""
    name = str(page.relative_to(REPO)) if page.is_relative_to(DOCS) else page.name
    tokens = MarkdownIt("commonmark").enable("table").parse(page.read_text() if source is None else source)
    shown, problems = [], []
    previous = None
    for i, token in enumerate(tokens):
        if token.type == "fence":
            tag = token.info.strip().split(" ")[0]
            line = token.map[0] + 1
            given = directive(previous.content) if previous is not None and previous.type == "html_block" else {}
            if tag not in COMMAND_TAGS:
                if tag not in OTHER_TAGS:
                    problems.append(f"{name}:{line} a fence tagged {tag!r}: use one of {COMMAND_TAGS + OTHER_TAGS}")
                elif tag == "text" and any(PROGRAM.match(row.lstrip()) for row in token.content.splitlines()):
                    problems.append(f"{name}:{line} a command in a {tag!r} block: tag it sh or console")
            elif tag == "python":
                shown.append(Shown(name, line, "python", token.content, **given))
            else:
                for offset, text, output in commands_of_block(token.content.splitlines(), tag):
                    shown.append(Shown(name, line + 1 + offset, tag, text, output, **given))
        elif token.type == "inline" and previous is not None and previous.type in ("td_open", "th_open"):
            given = directive("".join(c.content for c in token.children if c.type == "html_inline"))
            for child in token.children:
                if child.type == "code_inline" and PROGRAM.match(child.content):
                    shown.append(Shown(name, token.map[0] + 1, "cell", child.content, **given))
        previous = token
    return shown, problems


def in_running_order() -> list[Shown]:
    """The README's blocks, the pages in the site's order, then the README's table of stages (which uses what the
    pages made)."""
    readme, *rest = pages()
    shown = shown_in(readme)[0]
    return ([c for c in shown if c.kind != "cell"] + [c for page in rest for c in shown_in(page)[0]]
            + [c for c in shown if c.kind == "cell"])


def all_shown() -> list[Shown]:
    """Every command in running order, each distinct command once (its first showing)."""
    seen, result = set(), []
    for command in in_running_order():
        key = substituted(command.text)
        if key not in seen:
            seen.add(key)
            result.append(command)
    return result


SHOWN = all_shown()


# --- the convention itself, on a made-up page -----------------------------------------------------------------

SAMPLE = """\
```sh
gpt4all-training clean a.jsonl --output-dir data/clean   # a comment
python train.py --config c.yaml \\
    max_steps=2
```

<!-- docs-test: exit 2 -->
```console
$ python train.py --config c.yaml lrr=1
error: lrr: unknown key ...
```

<!-- docs-test: not-run needs 8 GPUs -->
```sh
accelerate launch --config_file x.yaml train.py --config c.yaml
```

| stage | command |
|---|---|
| serve | `gpt4all-training serve --model m` |
| map | `python build_map.py --input i` <!-- docs-test: not-run the Hub --> |

```
python untagged.py
```
"""


def test_the_convention_finds_each_kind_of_command_and_refuses_an_untagged_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(SAMPLE)
    shown, problems = shown_in(page)
    assert [(c.kind, c.text, c.output, c.exit, c.not_run) for c in shown] == [
        ("sh", "gpt4all-training clean a.jsonl --output-dir data/clean", [], 0, None),
        ("sh", "python train.py --config c.yaml \\\n    max_steps=2", [], 0, None),
        ("console", "python train.py --config c.yaml lrr=1", ["error: lrr: unknown key ..."], 2, None),
        ("sh", "accelerate launch --config_file x.yaml train.py --config c.yaml", [], 0, "needs 8 GPUs"),
        ("cell", "gpt4all-training serve --model m", [], 0, None),
        ("cell", "python build_map.py --input i", [], 0, "the Hub"),
    ]
    assert [c.line for c in shown] == [2, 3, 9, 15, 20, 21]
    assert [problem.split(" ", 1)[0].rsplit(":", 1)[1] for problem in problems] == ["23"]
    assert problems[0].endswith(f"a fence tagged '': use one of {COMMAND_TAGS + OTHER_TAGS}")


def test_substitutions_replace_only_what_the_table_names():
    ports = {"serve": 5, "studio": 6}
    assert substituted("gpt4all-training serve --model smollm2", ports) == (
        f"gpt4all-training serve --model {TINY_MODEL} --port 5")
    assert substituted("gpt4all-training studio --workdir studio   # the app", ports) == (
        "gpt4all-training studio --workdir studio --port 6   # the app")
    with_port = "gpt4all-training serve --model m --port 9"
    assert substituted(with_port, ports) == with_port
    assert substituted("python train.py --config configs/train/smollm2_lora.yaml model_name=smollm2") == (
        f"python train.py --config configs/train/smollm2_lora.yaml model_name={TINY_MODEL}")
    assert substituted("output_dir: ckpts/smollm2-lora\nmodel_name: smollm2\n") == (
        f"output_dir: ckpts/smollm2-lora\nmodel_name: {TINY_MODEL}\n")
    assert substituted('OpenAI(base_url="http://127.0.0.1:8000/v1")', ports) == (
        'OpenAI(base_url="http://127.0.0.1:5/v1")')


def test_every_fenced_block_follows_the_convention():
    problems = [problem for page in pages() for problem in shown_in(page)[1]]
    assert not problems, "\n".join(problems)


def code_spans(page: Path) -> list[tuple[int, str]]:
    """(line, text) of every inline code span of a page: its prose and its tables."""
    tokens = MarkdownIt("commonmark").enable("table").parse(page.read_text())
    return [(token.map[0] + 1, child.content) for token in tokens if token.type == "inline"
            for child in token.children if child.type == "code_inline"]


# Where a command of ours starts in a command line, also after a launcher (`accelerate launch ... train.py`).
SUBCOMMAND = re.compile(r"(?:^|\s)(?:gpt4all-training ([a-z_]+)|([a-z_]+)\.py)(?=\s|$)(.*)", re.DOTALL)


@pytest.mark.slow
def test_every_option_a_page_names_exists():
    """The synopses in prose (`gpt4all-training plan --config c.yaml [--gpus 8]`) and the commands shown but not run
    (a GPU, several machines) are checked against the subcommand's parser itself."""
    from gpt4all_training.cli.main import COMMANDS

    lines = [(f"{page.name}:{line} `{span}`", span) for page in pages() for line, span in code_spans(page)
             if PROGRAM.match(span)]
    lines += [(command.id, command.text) for command in in_running_order() if command.kind != "python"]
    wrong, checked = [], 0
    for where, text in lines:
        match = SUBCOMMAND.search(text)
        if not match:
            continue
        name, rest = match[1] or match[2], match[3]
        if name not in COMMANDS:
            wrong.append(f"{where}: no subcommand {name}")
            continue
        parser = argparse.ArgumentParser()
        importlib.import_module(COMMANDS[name][0]).add_arguments(parser)
        known = set(re.findall(r"--[\w-]+", parser.format_help()))
        wrong += [f"{where}: {name} has no {option}"
                  for option in re.findall(r"(?<![\w-])--[\w-]+", rest) if option not in known]
        checked += 1
    assert checked > 40 and not wrong, "\n".join(wrong)


# `key: value` or `key=value` as a page writes a setting (not `==`, not a keyword argument inside a call).
SETTING = re.compile(r"(?<![\w.\-/])([a-z][a-z0-9_]*)(?:=(?!=)|: )")
# Spans in that shape that name no setting: a server-sent event's `data:` line, the override form itself,
# torch.load's argument.
NOT_SETTINGS = {"data", "key", "weights_only"}


def known_keys() -> set[str]:
    """Every key a config of ours takes (training, inference, generation, tokenizer), and every key of the shipped
    accelerate configs (the distributed page names theirs)."""
    from gpt4all_training.config.loader import config_fields
    from gpt4all_training.config.schemas import GenerateConfig, InferenceConfig, TokenizerConfig, TrainConfig

    def keys_of(value) -> set[str]:
        if isinstance(value, dict):
            return set(value) | {key for inner in value.values() for key in keys_of(inner)}
        return set()

    keys = {name for cls in (TrainConfig, InferenceConfig, GenerateConfig, TokenizerConfig)
            for name in config_fields(cls)}
    for path in (REPO / "configs" / "accelerate").glob("*.yaml"):
        keys |= keys_of(yaml.safe_load(path.read_text()))
    return keys


def test_every_config_key_a_page_names_exists():
    """A setting in prose (`packing: true`, `resume=never`) and an override in any shown command, run or not
    (`train.py --config c.yaml lora=true`), names a key the configs take."""
    known = known_keys()
    named = []  # (where, key)
    # A command shown failing (exit 2) names a wrong key on purpose.
    commands = [(c.id, c.text) for c in in_running_order() if c.kind != "python" and c.exit == 0]
    for page in pages():
        for line, span in code_spans(page):
            where = f"{page.name}:{line} `{span}`"
            if PROGRAM.match(span):
                commands.append((where, span))
            elif "(" not in span and "--" not in span:  # not a call's keywords, not another program's options
                named += [(where, m[1]) for m in SETTING.finditer(span) if m[1] not in NOT_SETTINGS]
    for where, text in commands:
        if "--config " in text:
            named += [(where, m[1]) for m in re.finditer(r"(?<=\s)([a-z][a-z0-9_]*)=(?!=)", text)]
    wrong = [f"{where}: no config key {key}" for where, key in named if key not in known]
    assert len(named) > 40 and not wrong, "\n".join(wrong)


def test_the_readme_opens_with_the_two_setup_commands_and_stays_short():
    readme = (REPO / "README.md").read_text()
    visible = re.sub(r"\A<!--.*?-->\n", "", readme, flags=re.DOTALL)  # the block's not-run comment, which shows nowhere
    assert visible.startswith("```sh\nmake demo ") and visible.split("```")[1].count("\n") == 3, readme[:300]
    assert [c.text for c in shown_in(REPO / "README.md")[0][:2]] == ["make demo", "make test"]
    assert len(readme.splitlines()) <= 250


def test_the_site_builds_strict(tmp_path):
    """Every link and every page in the navigation resolves (mkdocs --strict turns warnings into errors)."""
    mkdocs = Path(PYTHON).with_name("mkdocs")
    result = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert on_disk == set(navigation()), "a page on disk that the navigation leaves out, or the reverse"


# --- running them ------------------------------------------------------------------------------------------------

@dataclass
class Workspace:
    root: Path
    env: dict
    ports: dict  # "serve" | "studio" -> the free port it gets
    servers: list = field(default_factory=list)  # [(Shown, Popen)], up until every command has run


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, chat_tokenizer) -> Workspace:
    root = tmp_path_factory.mktemp("docs-workspace")
    for entry in REPO.iterdir():
        if entry.name not in (".git", ".cache", "configs", "ckpts", "data", "site") and not entry.name.startswith("."):
            (root / entry.name).symlink_to(entry)
    (root / ".venv").symlink_to(Path(PYTHON).parents[1])
    for path in (REPO / "configs").rglob("*"):
        if path.is_file():
            target = root / path.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(substituted(path.read_text()))
    # The files the docs name as a user's own: a JSONL file of Dolly records, an OpenAssistant export, a conversation,
    # a training config (the distributed page's run.yaml).
    with open(DOLLY, encoding="utf-8") as f:
        (root / "my_data.jsonl").write_text("".join(line for _, line in zip(range(160), f)))
    with open(OASST, encoding="utf-8") as f:
        (root / "oasst.jsonl").write_text("".join(line for _, line in zip(range(6), f)))
    (root / "chat.json").write_text(json.dumps([{"role": "user", "content": "Name a fish."}]))
    run = yaml.safe_load((root / "configs" / "train" / "finetune_tiny.yaml").read_text())
    (root / "run.yaml").write_text(yaml.safe_dump({**run, "output_dir": "ckpts/run", "max_steps": 2}))
    model = build_tiny_llama(chat_tokenizer, max_positions=2048)
    model.save_pretrained(root / TINY_MODEL)
    chat_tokenizer.save_pretrained(root / TINY_MODEL)
    # As a user's shell: the venv first on PATH, this checkout's package, and no offline switch set by hand (the
    # commands set it themselves when everything they name is local).
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                                            "TRANSFORMERS_OFFLINE", "PYTEST_CURRENT_TEST")}
    env.update(PATH=f"{root / '.venv' / 'bin'}:{env['PATH']}", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    space = Workspace(root, env, {"serve": free_port(), "studio": free_port()})
    yield space
    problems = stop_servers(space)
    assert not problems, "\n".join(problems)


def answering(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def start_server(space: Workspace, command: Shown) -> None:
    text = substituted(command.text, space.ports)
    process = subprocess.Popen(["bash", "-c", f"exec {text}"], cwd=space.root, env=space.env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    space.servers.append((command, process))
    kind = SERVERS.search(command.text)[1]
    probe = f"http://127.0.0.1:{space.ports[kind]}/" + ("health" if kind == "serve" else "api/status")
    deadline = time.monotonic() + TIMEOUT_S
    while not answering(probe):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            output = process.communicate()[0]
            pytest.fail(f"{command.id}: the server did not answer {probe} (exit {process.returncode})\n"
                        f"$ {text}\n{output[-3000:]}")
        time.sleep(0.5)


def stop_servers(space: Workspace) -> list[str]:
    """SIGTERM to each server; what went wrong, as lines."""
    problems = []
    for command, process in space.servers:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            output = process.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output = process.communicate()[0]
            problems.append(f"{command.id}: still running 60 s after SIGTERM\n{output[-2000:]}")
            continue
        if process.returncode not in (0, -signal.SIGTERM):
            problems.append(f"{command.id}: exit {process.returncode} after SIGTERM\n{output[-2000:]}")
    return problems


def printed_as_shown(expected: list[str], actual: str) -> str | None:
    """None when every expected line is a line of `actual`, in order (`...` = any text); else the first missing."""
    lines = [line.rstrip() for line in actual.splitlines()]
    position = 0
    for want in expected:
        pattern = re.compile(".*".join(re.escape(part) for part in want.rstrip().split("...")))
        while position < len(lines) and not pattern.fullmatch(lines[position]):
            position += 1
        if position == len(lines):
            return want
        position += 1
    return None


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("command", SHOWN, ids=[c.id for c in SHOWN])
def test_a_shown_command_runs_as_shown(command: Shown, workspace: Workspace):
    if command.not_run:
        pytest.skip(f"not run: {command.not_run}")
    if command.kind != "python" and SERVERS.search(command.text):
        start_server(workspace, command)
        return
    text = substituted(command.text, workspace.ports)
    if command.kind == "python":
        script = workspace.root / f"snippet-{command.line}.py"
        script.write_text(text)
        argv = [str(workspace.root / ".venv" / "bin" / "python"), str(script)]
    else:
        argv = ["bash", "-c", text]
    started = time.monotonic()
    result = subprocess.run(argv, cwd=workspace.root, env=workspace.env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, timeout=TIMEOUT_S, check=False)
    where = f"$ {text}\n(exit {result.returncode} after {time.monotonic() - started:.1f} s)\n{result.stdout[-4000:]}"
    assert result.returncode == command.exit, where
    missing = printed_as_shown(command.output, result.stdout)
    assert missing is None, f"the docs show {missing!r}, which it did not print\n{where}"
