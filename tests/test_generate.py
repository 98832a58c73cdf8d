"""Generation: the sampling order on hand-made logits, and the KV-cache loop on the tiny GPT-J checked against a
plain argmax loop that recomputes the whole sequence every step."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from support.files import write_jsonl
from support.models import build_tiny_gptj
from support.paths import PYTHON, REPO
from gpt4all_training.data.prompts import encode_prompts, format_prompt
from gpt4all_training.generation.generate import generate_texts
from gpt4all_training.model.decoding import (Sampling, Sequence, cut_at_stop, decode_all, eos_token_ids, next_tokens,
                                             process_logits)

PROMPTS = ["Which is a species of fish? Tope or Rope", "Why can camels survive for long without water?",
           "Name three primary colours."]


def kept(scores: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isfinite(scores[0])).flatten().tolist()


def no_seen(logits: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(logits, dtype=torch.bool)


def draw(logits: torch.Tensor, seen: torch.Tensor, sampling: Sampling, generator=None) -> torch.Tensor:
    """Every row of `logits` under one sampling and one generator."""
    return next_tokens(logits, seen, [sampling] * len(logits), [generator] * len(logits))


def generate_ids(model, tokenizer, prompt_ids: list[list[int]], eos_ids: set[int], max_new_tokens: int,
                 sampling: Sampling) -> list[list[int]]:
    """The ids the decoder generates after each prompt, all in one batch."""
    sequences = [Sequence(ids, max_new_tokens, sampling) for ids in prompt_ids]
    return [s.ids for s in decode_all(model, tokenizer, sequences, eos_ids, batch_size=len(sequences))]


# ---------------------------------------------------------------- the pure sampling function

def test_temperature_is_applied_before_top_p():
    # probabilities 0.6, 0.3, 0.1 and top_p 0.8: the nucleus depends on the temperature-scaled distribution.
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    seen = no_seen(logits)
    assert kept(process_logits(logits, seen, Sampling(temperature=1.0, top_p=0.8))) == [0, 1]
    # T=0.25 gives p^4 normalised = (0.940, 0.059, 0.001): the top token alone carries 0.8.
    assert kept(process_logits(logits, seen, Sampling(temperature=0.25, top_p=0.8))) == [0]
    # T=4 gives p^0.25 normalised = (0.403, 0.339, 0.258): the first two carry only 0.742, so all three stay.
    assert kept(process_logits(logits, seen, Sampling(temperature=4.0, top_p=0.8))) == [0, 1, 2]


def test_top_p_sees_the_distribution_top_k_left():
    # 0.4, 0.3, 0.2, 0.1; top_k=2 renormalises to (0.571, 0.429), so top_p=0.5 keeps one token.
    # (top-p on the full distribution would have kept two.)
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    scores = process_logits(logits, no_seen(logits), Sampling(temperature=1.0, top_k=2, top_p=0.5))
    assert kept(scores) == [0]
    assert kept(process_logits(logits, no_seen(logits), Sampling(temperature=1.0, top_p=0.5))) == [0, 1]


def test_repetition_penalty_comes_before_top_k():
    logits = torch.tensor([[3.0, 2.9, 1.0, -1.0]])
    seen = torch.tensor([[True, False, False, True]])
    scores = process_logits(logits, seen, Sampling(temperature=1.0, top_k=1, repetition_penalty=2.0))
    assert kept(scores) == [1]  # token 0 fell to 1.5 before the top-1 cut
    unfiltered = process_logits(logits, seen, Sampling(temperature=0.5, repetition_penalty=2.0))
    # positive logits are divided, negative multiplied (CTRL), then everything is divided by the temperature
    assert torch.allclose(unfiltered, torch.tensor([[3.0, 5.8, 2.0, -4.0]]))


def test_greedy_is_the_argmax_after_the_penalty():
    logits = torch.tensor([[3.0, 2.9, 1.0], [0.0, 1.0, 2.0]])
    seen = torch.tensor([[True, False, False], [False, False, False]])
    assert draw(logits, seen, Sampling(temperature=0.0)).tolist() == [0, 2]
    assert draw(logits, seen, Sampling(temperature=0.0, repetition_penalty=1.5)).tolist() == [1, 2]


def test_defaults_leave_logits_unchanged():
    logits = torch.randn(2, 50)
    assert torch.equal(process_logits(logits, no_seen(logits), Sampling(temperature=1.0)), logits)


def test_draws_follow_the_filtered_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    generator = torch.Generator().manual_seed(0)
    draws = draw(logits, no_seen(logits), Sampling(temperature=1.0, top_k=2), generator)
    counts = torch.bincount(draws, minlength=4).tolist()
    assert counts[2] == counts[3] == 0
    # kept mass renormalised: 0.625 / 0.375; 4000 draws put the share within about 0.024 (3 sigma)
    assert abs(counts[0] / 4000 - 0.625) < 0.03


def test_cut_at_stop_takes_the_earliest():
    assert cut_at_stop("abc###def\nUser:", ["User:", "###"]) == ("abc", True)
    assert cut_at_stop("abc", ["x"]) == ("abc", False)


# ---------------------------------------------------------------- the loop on a real model

@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_gptj(tokenizer, seed=3).eval()


def argmax_loop(model, ids: list[int], steps: int) -> list[int]:
    """Greedy decoding the slow, obvious way: the whole sequence every step, no cache, no padding."""
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


def test_greedy_cached_loop_matches_argmax_loop(model, tokenizer):
    # The prompt ids are the training format: format_prompt's text, tokenised as plain training does it.
    ids = tokenizer(format_prompt(PROMPTS[0], tokenizer, "plain"))["input_ids"]
    assert encode_prompts([PROMPTS[0]], tokenizer, "plain") == [ids]
    expected = argmax_loop(model, ids, 16)
    got = generate_ids(model, tokenizer, [ids], set(), 16, Sampling(temperature=0.0))
    assert got == [expected]


def test_left_padded_batch_matches_single_prompts(model, tokenizer):
    prompt_ids = encode_prompts(PROMPTS, tokenizer, "plain")
    assert len({len(ids) for ids in prompt_ids}) == 3  # really padded
    batched = generate_ids(model, tokenizer, prompt_ids, set(), 12, Sampling())
    single = [generate_ids(model, tokenizer, [ids], set(), 12, Sampling())[0] for ids in prompt_ids]
    assert batched == single


def test_greedy_stops_at_the_first_eos(model, tokenizer):
    ids = encode_prompts([PROMPTS[1]], tokenizer, "plain")[0]
    sequence = argmax_loop(model, ids, 20)
    # Call the first token the model emits that it has not emitted before (after two tokens) "EOS".
    k = next(i for i in range(2, 20) if sequence[i] not in sequence[:i])
    first = generate_ids(model, tokenizer, [ids], {sequence[k]}, 20, Sampling())
    again = generate_ids(model, tokenizer, [ids], {sequence[k]}, 20, Sampling())
    assert first == again == [sequence[:k]]


def test_generate_texts_ends_at_the_tokenizer_eos(tokenizer):
    model = build_tiny_gptj(tokenizer, seed=3).eval()
    eos = tokenizer.eos_token_id
    assert eos_token_ids(model, tokenizer) == {eos}
    with torch.no_grad():
        model.lm_head.bias[eos] += 100.0  # EOS is now every step's argmax
    prompt_ids = encode_prompts(PROMPTS, tokenizer, "plain")
    assert generate_ids(model, tokenizer, prompt_ids, {eos}, 10, Sampling()) == [[], [], []]
    assert generate_texts(model, tokenizer, PROMPTS, "plain", 10) == ["", "", ""]


def test_seeded_sampling_is_reproducible(model, tokenizer):
    settings = dict(temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=16)
    first = generate_texts(model, tokenizer, PROMPTS, "plain", seed=7, **settings)
    assert generate_texts(model, tokenizer, PROMPTS, "plain", seed=7, **settings) == first
    assert generate_texts(model, tokenizer, PROMPTS, "plain", seed=8, **settings) != first
    assert all(first)


def test_stop_string_cuts_the_text(model, tokenizer):
    full = generate_texts(model, tokenizer, [PROMPTS[2]], "plain", 30)[0]
    stop = full[6:10]
    assert stop.strip()
    cut = generate_texts(model, tokenizer, [PROMPTS[2]], "plain", 30, stop=[stop])[0]
    assert cut == full[:full.find(stop)]


def test_no_tokens_are_added_to_the_tokenizer(model, tokenizer):
    before = (len(tokenizer), dict(tokenizer.special_tokens_map))
    generate_texts(model, tokenizer, PROMPTS, "auto", 4, temperature=0.7, top_p=0.9)
    assert (len(tokenizer), dict(tokenizer.special_tokens_map)) == before


def test_logits_past_the_tokenizer_are_never_chosen(tokenizer):
    model = build_tiny_gptj(tokenizer, seed=3).eval()
    model.resize_token_embeddings(len(tokenizer) + 8)  # embedding rows the tokenizer has no token for
    with torch.no_grad():
        model.lm_head.bias[len(tokenizer) + 2] += 100.0  # an untrained padding row that wins every argmax
    ids = encode_prompts([PROMPTS[0]], tokenizer, "plain")
    out = generate_ids(model, tokenizer, ids, set(), 5, Sampling())
    assert len(out[0]) == 5 and max(out[0]) < len(tokenizer)


# ---------------------------------------------------------------- command line

@pytest.mark.integration
@pytest.mark.slow
def test_cli_prompts_file_gives_jsonl_equal_to_the_function(tiny_model_dir, tokenizer, tmp_path):
    prompts_file = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    result = subprocess.run([PYTHON, str(REPO / "generate.py"), "--config", str(REPO / "configs/generate/tiny.yaml"),
                             "--prompts-file", str(prompts_file), f"model_name={tiny_model_dir}",
                             "max_new_tokens=8"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    from gpt4all_training.model.loading import load_model

    expected = generate_texts(load_model(str(tiny_model_dir)).eval(), tokenizer, PROMPTS, "auto", 8)
    assert rows == [{"prompt": p, "response": r} for p, r in zip(PROMPTS, expected)]


def test_cli_bad_prompts_file_is_one_line(tiny_model_dir, tmp_path, capsys):
    from gpt4all_training.cli.main import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt"}\n')
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompts-file", str(bad), f"model_name={tiny_model_dir}"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: prompts_file {bad}:2: expected an object with a string 'prompt'\n"


def test_config_rejects_out_of_range_sampling():
    from gpt4all_training.config.loader import load_config
    from gpt4all_training.errors import UserError
    from gpt4all_training.config.blocks import validate
    from gpt4all_training.config.schemas import GenerateConfig

    with pytest.raises(UserError, match=r"^top_p: must be in \(0, 1\], got 1.5$"):
        load_config(None, ["model_name=m", "top_p=1.5"], cls=GenerateConfig, check=validate)
    with pytest.raises(UserError, match="temperature"):
        load_config(None, ["model_name=m", "temperature=-1"], cls=GenerateConfig, check=validate)
    assert math.isclose(load_config(None, ["model_name=m", "temperature=0"], cls=GenerateConfig,
                                    check=validate).temperature, 0.0)
