"""The one decoder (model/decoding.py) on tiny real models: greedy rows against the argmax chain of full forwards
without a cache, seeded rows against themselves in other batches, stop strings, log-probabilities against a fresh
forward, a LoRA model in training, and the harness's generate_until against transformers' generate."""

from __future__ import annotations

import pytest
import torch
from support.models import build_tiny_gptj, build_tiny_llama

from gpt4all_training.data.prompts import encode_prompts
from gpt4all_training.evaluation.harness import decoding_hflm, generate_sampling
from gpt4all_training.model.decoding import Decoder, Sampling, Sequence, decode_all
from gpt4all_training.model.lora import apply_lora

PROMPTS = ["Which is a species of fish? Tope or Rope", "Why can camels survive for long without water?",
           "Name three primary colours.", "Hi", "Write a haiku about the sea and the wind in the harbour at night."]
HOT = Sampling(temperature=1.0, top_k=40)


def build_tiny_mistral(tokenizer):
    """A 2-layer Mistral whose attention sees 4 positions back: a sliding-window cache, which rows cannot join."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return MistralForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_gptj(tokenizer, seed=3).eval()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    ids = encode_prompts(PROMPTS, tokenizer, "plain")
    assert len({len(p) for p in ids}) == len(ids)  # every row padded differently
    return ids


def argmax_chain(model, ids: list[int], steps: int) -> list[int]:
    """Greedy decoding the slow, obvious way: the whole sequence every step, no cache, no padding."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def decoded(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
            seeds=None, eos=(), batch_size=None, logprobs=False) -> list[Sequence]:
    sequences = [Sequence(ids, max_new_tokens, sampling, None if seeds is None else seeds[i])
                 for i, ids in enumerate(prompts)]
    return decode_all(model, tokenizer, sequences, set(eos), batch_size or len(sequences), logprobs)


@pytest.mark.parametrize("build", [build_tiny_gptj, build_tiny_llama, build_tiny_mistral])
def test_greedy_rows_are_the_argmax_chain_whatever_the_batch(build, tokenizer, prompt_ids):
    model = build(tokenizer).eval()
    expected = [argmax_chain(model, ids, 10) for ids in prompt_ids]
    # Two rows at a time: a row that ends makes room for the next, which joins the running batch (or, under a
    # sliding-window cache, waits for it to empty).
    for batch_size in (len(prompt_ids), 2):
        assert [s.ids for s in decoded(model, tokenizer, prompt_ids, 10, batch_size=batch_size)] == expected
    lengths = [4, 10, 6, 8, 3]  # rows leave at different steps
    sequences = [Sequence(ids, n) for ids, n in zip(prompt_ids, lengths)]
    decode_all(model, tokenizer, sequences, set(), batch_size=3)
    assert [s.ids for s in sequences] == [e[:n] for e, n in zip(expected, lengths)]
    assert [s.finish_reason for s in sequences] == ["length"] * len(sequences)


def test_a_seeded_row_draws_the_same_tokens_in_any_batch(model, tokenizer, prompt_ids):
    alone = decoded(model, tokenizer, prompt_ids[1:2], 12, HOT, seeds=[5])[0].ids
    assert alone != decoded(model, tokenizer, prompt_ids[1:2], 12, HOT, seeds=[6])[0].ids
    # Among other sampled and greedy rows, with other settings and lengths, in batches that rows join and leave.
    others = [Sequence(prompt_ids[0], 3, Sampling(temperature=0.7, top_p=0.9), 1), Sequence(prompt_ids[2], 12),
              Sequence(prompt_ids[4], 5, HOT, 9)]
    target = Sequence(prompt_ids[1], 12, HOT, 5)
    decode_all(model, tokenizer, [*others, target], set(), batch_size=2)
    assert target.ids == alone
    # Driven a step at a time, joining a batch already four tokens in.
    decoder = Decoder(model, tokenizer, set())
    late = Sequence(prompt_ids[1], 12, HOT, 5)
    with torch.no_grad():
        decoder.prefill([Sequence(prompt_ids[3], 20, HOT, 2), Sequence(prompt_ids[4], 20)])
        for step in range(16):
            if step == 4:
                decoder.prefill([late])
            decoder.choose()
            decoder.step([i for i, s in enumerate(decoder.sequences) if not s.finished])
    assert late.ids == alone and late.finish_reason == "length"


def forward_rows(model) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    """The rows of every forward of `model` from now on (a list it fills), and the hook's handle."""
    rows: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                             with_kwargs=True)
    return rows, handle


def test_a_group_prefills_its_prompt_once_and_samples_as_its_rows_do_alone(model, tokenizer, prompt_ids):
    """Four samples of one prompt beside another prompt: the prefill runs 2 rows, not 5, and every row draws the
    tokens it draws alone, with the same log-probabilities."""
    seeds = [11, 12, 13, 14, 15]
    prompts = [prompt_ids[1]] * 4 + [prompt_ids[4]]
    rows, handle = forward_rows(model)
    try:
        grouped = decoded(model, tokenizer, prompts, 8, HOT, seeds=seeds, logprobs=True)
    finally:
        handle.remove()
    assert rows[0] == 2 and rows[1] == 5  # the prefill of the 2 distinct prompts, then the 5 rows one token on
    assert len({tuple(s.ids) for s in grouped[:4]}) == 4  # each sample its own
    for prompt, seed, sequence in zip(prompts, seeds, grouped):
        [alone] = decoded(model, tokenizer, [prompt], 8, HOT, seeds=[seed], logprobs=True)
        assert sequence.ids == alone.ids
        assert torch.allclose(torch.tensor(sequence.logprobs), torch.tensor(alone.logprobs), atol=1e-6)


def test_in_lockstep_a_process_runs_a_forward_wherever_another_does_and_decodes_the_same(model, tokenizer,
                                                                                         prompt_ids):
    """lockstep ORs this process's flags (rows to step, rows to join) with another process's, which steps rows for
    12 turns and joins rows at turns 0 and 3: this process, whose 3 rows (2 at a time) end sooner, runs one forward
    for each agreed step and each agreed join, and its rows decode exactly what they decode alone."""
    prompts = prompt_ids[:3]
    plain = decoded(model, tokenizer, prompts, 4, HOT, seeds=[1, 2, 3], batch_size=2, logprobs=True)
    agreed: list[list[bool]] = []

    def lockstep(flags: list[bool]) -> list[bool]:
        turn = len(agreed)
        agreed.append([flags[0] or turn < 12, flags[1] or turn in (0, 3)])
        return agreed[-1]

    sequences = [Sequence(ids, 4, HOT, seed) for ids, seed in zip(prompts, [1, 2, 3])]
    rows, handle = forward_rows(model)
    try:
        decode_all(model, tokenizer, sequences, set(), 2, logprobs=True, lockstep=lockstep)
    finally:
        handle.remove()
    assert len(agreed) == 13 and agreed[-1] == [False, False]  # the other process's 12 turns, then the end
    assert len(rows) == sum(steps + joins for steps, joins in agreed) == 12 + 3  # joins: its 2 and this one's 2nd
    assert rows.count(1) > 3  # one-row idle forwards where this process had nothing to run
    assert [(s.ids, s.logprobs) for s in sequences] == [(s.ids, s.logprobs) for s in plain]


def test_a_stop_string_ends_the_row_and_cuts_its_text(model, tokenizer, prompt_ids):
    [full] = decoded(model, tokenizer, prompt_ids[2:3], 30)
    assert full.text == tokenizer.decode(full.ids, skip_special_tokens=True)
    stop = full.text[8:11]
    assert stop.strip() and full.text.find(stop) == 8
    [cut] = decode_all(model, tokenizer, [Sequence(prompt_ids[2], 30, stop=("never", stop))], set(), 1)
    assert (cut.text, cut.finish_reason) == (full.text[:8], "stop")
    # It ends at the token that completed the stop string: one token fewer and the text has none.
    assert cut.ids == full.ids[:len(cut.ids)] and stop not in tokenizer.decode(cut.ids[:-1])
    assert stop in tokenizer.decode(cut.ids)


def fresh_logprobs(model, prompt: list[int], drawn: list[int]) -> torch.Tensor:
    """log-softmax of one forward over prompt + drawn, without a cache, at each drawn token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + drawn])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(drawn)[:, None])[:, 0]


def test_log_probs_are_those_of_a_fresh_forward_and_cost_nothing_when_off(model, tokenizer, prompt_ids):
    sequences = decoded(model, tokenizer, prompt_ids, 8, HOT, seeds=range(5), batch_size=3, logprobs=True)
    for prompt, sequence in zip(prompt_ids, sequences):
        assert len(sequence.logprobs) == len(sequence.ids) == 8
        assert torch.allclose(torch.tensor(sequence.logprobs), fresh_logprobs(model, prompt, sequence.ids),
                              atol=1e-5)
    assert all(not s.logprobs for s in decoded(model, tokenizer, prompt_ids, 8, HOT, seeds=range(5)))
    # A row that ends at an EOS has its log-probability last.
    chain = argmax_chain(model, prompt_ids[0], 6)
    [ended] = decoded(model, tokenizer, prompt_ids[:1], 20, eos={chain[5]}, logprobs=True)
    assert (ended.ids, ended.eos_id, ended.finish_reason) == (chain[:5], chain[5], "stop")
    assert torch.allclose(torch.tensor(ended.logprobs), fresh_logprobs(model, prompt_ids[0], chain), atol=1e-5)


def test_a_lora_model_in_training_samples_from_its_current_weights_and_stays_in_training(tokenizer, prompt_ids):
    model = apply_lora(build_tiny_gptj(tokenizer, seed=3), r=4, alpha=8, dropout=0.5, target_modules=None,
                       gradient_checkpointing=False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    for update in range(2):  # generate, update the adapter, generate again: no stale weights
        model.train()
        sequences = decoded(model, tokenizer, prompt_ids, 6, HOT, seeds=range(5), logprobs=True)
        assert model.training and all(m.training for m in model.modules())
        model.eval()
        for prompt, sequence in zip(prompt_ids, sequences):  # dropout was off and the adapter on
            assert torch.allclose(torch.tensor(sequence.logprobs), fresh_logprobs(model, prompt, sequence.ids),
                                  atol=1e-5)
        with model.disable_adapter():
            base = fresh_logprobs(model, prompt_ids[0], sequences[0].ids)
        assert torch.allclose(torch.tensor(sequences[0].logprobs), base, atol=1e-5) == (update == 0)  # B is 0
        model.train()
        batch = torch.tensor([prompt_ids[0] + sequences[0].ids])
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


# ---------------------------------------------------------------- the harness's generate_until

def test_a_task_s_generation_settings_mean_what_they_mean_to_transformers_generate():
    from transformers import GenerationConfig

    model_defaults = GenerationConfig(top_k=50, top_p=0.95)
    assert generate_sampling({"do_sample": False, "temperature": 0.0}, model_defaults) == Sampling()
    assert generate_sampling({"do_sample": True, "temperature": 0.7}, model_defaults) == Sampling(0.7, 0.95, 50)
    assert generate_sampling({"do_sample": True, "top_k": 0}, GenerationConfig()) == Sampling(1.0)
    assert generate_sampling({"do_sample": False, "num_beams": 4}, model_defaults) is None  # left to generate


def harness_texts(lm, contexts: list[str], settings: dict) -> list[str]:
    from lm_eval.api.instance import Instance

    requests = [Instance("generate_until", {}, (context, dict(settings)), i) for i, context in enumerate(contexts)]
    return lm.generate_until(requests, disable_tqdm=True)


@pytest.mark.parametrize("settings, batch_size", [
    ({"until": ["\n"], "do_sample": False, "max_gen_toks": 16}, 3),
    ({"until": ["e", "."], "do_sample": False, "max_gen_toks": 12}, 3),  # rows stop at different steps
    ({"until": ["\n"], "do_sample": True, "temperature": 0.8, "top_k": 30, "max_gen_toks": 8}, 1),
])
def test_generate_until_gives_the_text_of_transformers_generate(model, tokenizer, settings, batch_size):
    from lm_eval.models.huggingface import HFLM

    contexts = [f"Question: {p}\nAnswer:" for p in PROMPTS]
    theirs = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    torch.manual_seed(1234)  # the harness's torch seed, which a sampled task draws from
    expected = harness_texts(theirs, contexts, settings)
    ours = decoding_hflm()(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    model.generate = None  # transformers' generate must not run
    try:
        torch.manual_seed(1234)
        assert harness_texts(ours, contexts, settings) == expected
    finally:
        del model.generate
    assert len(set(expected)) >= 3  # the rows differ: the comparison is not between empty texts
