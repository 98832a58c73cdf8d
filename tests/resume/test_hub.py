"""push_to_hub against a real local HTTP server: a failing Hub costs one warning, never the run; a working one
receives final/ byte for byte; the token is sent to the Hub and nowhere else."""

from __future__ import annotations

import secrets
import subprocess

import pytest
from support.launch import explain
from support.paths import PYTHON, REPO

from gpt4all_training.tracking.hub import push_folder

from .harness import HubServer, hub_env, run_train

PUSH = ["push_to_hub=true", "save_name=someone/tiny-gptj", "max_steps=3"]


def files_under(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.integration
@pytest.mark.slow
def test_failing_hub_warns_once_and_training_finishes_without_leaking_the_token(resume_config, tmp_path):
    token = "hf_" + secrets.token_hex(16)
    out = tmp_path / "run"
    with HubServer(fail_with=500) as hub:
        result = run_train(resume_config, out, *PUSH, env=hub_env(hub, token))
    assert result.returncode == 0, explain(result)
    assert (out / "final" / "model.safetensors").is_file() and (out / "report.html").is_file()
    warnings = [line for line in result.stderr.splitlines() if "warning: push_to_hub" in line]
    assert len(warnings) == 1, result.stderr
    assert (f"pushing {out / 'final'} to someone/tiny-gptj failed after 3 attempt(s) "
            f"(Server error '500 Internal Server Error'") in warnings[0]
    # Three attempts, each stopped at repo creation, each authenticated with the token from HF_TOKEN.
    assert [(r["method"], r["path"]) for r in hub.requests] == [("POST", "/api/repos/create")] * 3
    assert all(r["headers"]["authorization"] == f"Bearer {token}" for r in hub.requests)
    assert token not in result.stdout + result.stderr
    assert not [name for name, data in files_under(out).items() if token.encode() in data]


@pytest.mark.integration
@pytest.mark.slow
def test_working_hub_receives_final_byte_for_byte(resume_config, tmp_path):
    out, store = tmp_path / "run", tmp_path / "hub-store"
    with HubServer(store=store) as hub:
        result = run_train(resume_config, out, *PUSH, env=hub_env(hub, "hf_" + secrets.token_hex(16)))
    assert result.returncode == 0, explain(result)
    assert f"pushed {out / 'final'} to {hub.url}/someone/tiny-gptj/commit/{'1' * 40}" in result.stdout
    assert "warning" not in result.stderr.lower()
    assert [r["path"].split("?")[0] for r in hub.requests] == [
        "/api/repos/create", "/api/models/someone/tiny-gptj/preupload/main",
        "/api/models/someone/tiny-gptj/commit/main"]
    uploaded = files_under(store)
    assert uploaded == files_under(out / "final")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(uploaded)


@pytest.mark.integration
def test_refused_token_is_not_retried(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    token = "hf_" + secrets.token_hex(16)
    code = ("import sys; from gpt4all_training.tracking.hub import push_folder; "
            "sys.exit(push_folder(sys.argv[1], 'someone/tiny', first_delay=0) is not None)")
    with HubServer(fail_with=401) as hub:
        result = subprocess.run([PYTHON, "-c", code, str(tmp_path / "final")], cwd=REPO, capture_output=True,
                                text=True, timeout=60, env={**hub_env(hub, token), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    # 401: another try would fail the same way (huggingface_hub itself follows up with one GET of the repo).
    assert [(r["method"], r["path"]) for r in hub.requests if r["method"] == "POST"] == [("POST", "/api/repos/create")]
    assert "failed after 1 attempt(s)" in result.stderr and token not in result.stderr


def test_offline_mode_skips_the_push_with_one_warning(tmp_path, capsys):
    # The test session runs with HF_HUB_OFFLINE=1 (see tests/conftest.py): nothing may reach the network.
    assert push_folder(tmp_path, "someone/tiny") is None
    err = capsys.readouterr().err
    assert err.count("warning: push_to_hub: not pushing") == 1 and "HF_HUB_OFFLINE" in err
