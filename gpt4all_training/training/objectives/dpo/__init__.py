""""dpo": preference tuning on prompt/chosen/rejected pairs (data/pairs.py): the objective (objective.py), the
DPO, IPO and SimPO losses and the rewards they log (loss.py), and the reference they are measured from
(reference.py).

A micro-batch holds B pairs as 2B rows, chosen answers first (data/pairs.py). Each row's log-probability is the sum
over its answer's trained tokens (the masks sft uses), from loss.sequence_logps, which never builds the full logits.
With the policy's log-probabilities pi and the reference's ref, per pair (the names and conventions are TRL's):
- sigmoid (DPO): d = beta x ((pi_c - ref_c) - (pi_r - ref_r)); loss = -(1 - e) log sigmoid(d) - e log sigmoid(-d),
  with e the label smoothing (conservative DPO);
- ipo: d = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r over the answers' token counts n; loss = (d - 1/(2 beta))^2;
- simpo (no reference): d = beta x (pi_c / n_c - pi_r / n_r) - gamma; loss as sigmoid's;
and with `sft_weight` w, any of them plus w x (-pi_c / n_c), the chosen answer's mean NLL per token (RPO).
The rewards are beta x (pi - ref) per answer (simpo: beta x pi / n). The loop divides the step's summed loss by its
global count of pairs, so every pair weighs the same whatever the batch, accumulation and processes, as TRL's mean.

The reference is chosen once: LoRA's is the base model with the adapter disabled; full fine-tuning's is either
precomputed (one no-grad pass of the initial weights over every pair before step 1, cached with the tokenized data)
or a frozen copy of the initial weights; simpo has none.
"""
