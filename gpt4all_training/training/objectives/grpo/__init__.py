""""grpo": prompts (data/prompt_records.py), completions sampled from the model being trained, scored by rewards,
and the group-relative clipped policy loss of GRPO with the DAPO and Dr. GRPO corrections (the names, defaults and
formulas are TRL 1.16's GRPOTrainer's). The objective (objective.py) samples each step's rows (rollout.py: decoding,
advantages, the rows), scores them (rewards.py; the kinds built in: builtin_rewards.py) and trains on them with the
policy loss (policy.py, which also adds the log-probabilities the loss compares with).

A step, in `step_batches` (the loop times it as batch_seconds, apart from the update):
1. Sampling. Each process samples `num_generations` completions of each of its own prompts of the step through the
   one decoder (model/decoding.py: batched, a KV cache), from the very module being trained, in eval mode, under
   the step's autocast; where the parameters are sharded (FSDP2, ZeRO-3) the processes decode in lockstep, each
   running a forward wherever another does. Completion j of a prompt draws with its own generator, seeded from (seed,
   step, the prompt's position, j): a resumed run and a run on another number of processes sample the same
   completions. A completion ends at an EOS (or the chat template's end of turn) or at max_completion_length
   (truncated: no EOS; with mask_truncated_completions it takes no part in the loss).
2. Rewards: every reward on every completion of this process; a failure on any process stops all of them.
3. Advantages, per group of a prompt's completions (a group never spans processes): A = r - mean(group), divided
   (scale_rewards "group") by the group's Bessel-corrected std + 1e-4, or ("batch") by the std of the whole step's
   rewards on every process; "none" divides by nothing.
4. The rows: prompt + completion, right-padded, the completion's tokens (its EOS included) trained. With
   num_iterations > 1 the log-probabilities of the weights that sampled (old) are computed once, here; with beta > 0
   so are the reference's (LoRA: the adapter disabled; full fine-tuning: a frozen copy of the initial weights).
These rows are the batches of num_iterations consecutive optimizer steps; a checkpoint between them keeps them
(`state_dict`), so a resume continues with the same rows.

The loss, per completion token t, with the log-probabilities of softmax(logits / temperature) (as TRL's):
ratio = exp(logp - old) (old = logp without gradient when num_iterations is 1: ratio exactly 1),
l = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) + beta ratio (exp(ref - logp) - (ref - logp) - 1),
the KL estimate times the ratio as TRL 1.16 does by default (use_bias_correction_kl, DeepSeek-V3.2): the unbiased
gradient of the reverse KL, also where the ratio's value is 1.
The loop divides the step's summed loss by the step's count over every process, which the loss_type chooses:
"dapo": every completion token of the step; "grpo": each completion's mean over its tokens, then the mean over
completions; "dr_grpo": max_completion_length x completions.
"""
