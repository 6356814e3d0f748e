"""The training side.

losses.py       PPO/DAPO/GSPO/CISPO policy loss, KL (k1-k3), entropy, aggregation modes (plain tensor functions)
advantages.py   GRPO, DAPO, GSPO, CISPO, RLOO, REINFORCE++ advantages
off_policy.py   rollout-vs-training mismatch metrics, TIS / MIS importance weights, the corrected loss
model/          HF <-> Megatron model families: build a GPTModel from config.json, load and export weights
batch.py        rollout samples and their micro-batches (padded, or packed by a token budget)
logprobs.py     per-token logprob and entropy over a (tensor-parallel) vocabulary, a few positions at a time
actor.py        MegatronActor: logprobs, reference logprobs, train step, sleep and wake
offload.py      the training state's device memory handed back and taken again (sleep/wake): memory saver or host copies
process_groups.py  process groups destroyed on sleep and rebuilt on wake
checkpoint.py   dist_checkpointing save/load, export to an HF directory
"""
