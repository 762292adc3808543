"""The tinker_local side of ``vs_trl.py``: one training step of each part through the unmodified
Tinker SDK (a ``TrainingClient`` of the server).

- SFT: ``forward_backward`` (cross_entropy) + ``optim_step``;
- DPO: the reference log-probabilities from one ``forward`` of the initial weights, then
  ``forward_backward_custom`` with ``prefect_tinker.recipes.preference.DPOLoss`` + ``optim_step``;
- GRPO: ``save_weights_and_get_sampling_client`` + ``sample`` + ``forward_backward``
  (importance_sampling) + ``optim_step``.

Each ``server_*`` returns ``step() -> float`` (the step's loss; GRPO: its mean reward).
"""

from __future__ import annotations

import numpy as np

from vs_trl_data import BETAS, DPO_BETA, LR, group_advantages, reward


def server_sft(tc, chats):
    from tinker import types

    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": np.asarray(s[1:], np.int64), "weights": np.ones(len(s) - 1, np.float32)},
        )
        for s in chats
    ]
    adam = types.AdamParams(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1])
    tokens = sum(len(s) - 1 for s in chats)

    def step() -> float:
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(adam)
        loss = fb.result().metrics["loss:sum"] / tokens
        opt.result()
        return loss

    return step


def server_dpo(tc, pairs):
    from tinker import types

    from prefect_tinker.recipes.preference import DPOLoss

    data = []
    for p in pairs:
        for side in ("chosen_ids", "rejected_ids"):
            seq = p["prompt_ids"] + p[side]
            w = np.zeros(len(seq) - 1, np.float32)
            w[len(p["prompt_ids"]) - 1 :] = 1.0  # the reply's tokens
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(seq[:-1]),
                    loss_fn_inputs={"target_tokens": np.asarray(seq[1:], np.int64), "weights": w},
                )
            )
    fwd = tc.forward(data, "cross_entropy").result()  # the initial weights: the reference
    ref = [
        float((o["logprobs"].to_numpy() * d.loss_fn_inputs["weights"].to_numpy()).sum())
        for o, d in zip(fwd.loss_fn_outputs, data, strict=True)
    ]
    loss = DPOLoss(ref, beta=DPO_BETA)
    adam = types.AdamParams(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1])

    def step() -> float:
        fb = tc.forward_backward_custom(data, loss)
        opt = tc.optim_step(adam)
        out = fb.result().metrics["dpo_loss:mean"]
        opt.result()
        return out

    return step


def server_grpo(tc, tok, prompts, group: int, reply_tokens: int):
    from tinker import types

    inputs = [
        types.ModelInput.from_ints(
            list(tok.apply_chat_template(p, tokenize=True, add_generation_prompt=True)["input_ids"])
        )
        for p in prompts
    ]
    params = types.SamplingParams(max_tokens=reply_tokens, temperature=1.0, stop=[])
    adam = types.AdamParams(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1])
    counter = iter(range(10**6))

    def step() -> float:
        k = next(counter)
        sc = tc.save_weights_and_get_sampling_client(f"grpo-{k}")
        futs = [sc.sample(inp, group, params) for inp in inputs]
        seqs = [(inp, s) for inp, f in zip(inputs, futs, strict=True) for s in f.result().sequences]
        rewards = [reward(tok.decode(s.tokens)) for _, s in seqs]
        adv = group_advantages(rewards, group)
        data = []
        for (inp, s), a in zip(seqs, adv, strict=True):
            ids = inp.to_ints() + list(s.tokens)
            n = len(ids) - 1
            plen = inp.length - 1
            q = np.zeros(n, np.float32)
            q[plen:] = s.logprobs
            advs = np.zeros(n, np.float32)
            advs[plen:] = a
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64), "logprobs": q, "advantages": advs},
                )
            )
        fb = tc.forward_backward(data, "importance_sampling")
        opt = tc.optim_step(adam)
        fb.result()
        opt.result()
        return float(np.mean(rewards))

    return step
