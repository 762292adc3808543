"""Fine-tune a model with the Tinker API: a few supervised steps, then one REINFORCE step.

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_train_loop.py BASE_MODEL [STEPS]

Prints one JSON line with what happened.  Uses only the public `tinker` SDK (no project code),
the way a user's own training script would.
"""

import json
import sys

import tinker
from tinker import types

EXAMPLES = [
    ("Question: say hello.", " Answer: hello world"),
    ("Question: count to three.", " Answer: one two three"),
    ("Question: what is 12 + 34?", " Answer: 46"),
]


def make_datum(tokenizer, prompt, completion):
    prompt_tokens = tokenizer.encode(prompt, add_special_tokens=False)
    completion_tokens = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
    tokens = prompt_tokens + completion_tokens
    weights = [0.0] * (len(prompt_tokens) - 1) + [1.0] * len(completion_tokens)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def mean_nll(result, data):
    total, count = 0.0, 0.0
    for output, datum in zip(result.loss_fn_outputs, data, strict=True):
        logprobs = output["logprobs"].tolist()
        weights = datum.loss_fn_inputs["weights"].tolist()
        total -= sum(lp * w for lp, w in zip(logprobs, weights, strict=True))
        count += sum(weights)
    return total / count


def main():
    base_model = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    service = tinker.ServiceClient()
    models = [m.model_name for m in service.get_server_capabilities().supported_models]
    training = service.create_lora_training_client(base_model=base_model, rank=8)
    tokenizer = training.get_tokenizer()
    data = [make_datum(tokenizer, p, c) for p, c in EXAMPLES]

    losses = []
    for _ in range(steps):
        fwd_bwd = training.forward_backward(data, loss_fn="cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(mean_nll(fwd_bwd.result(), data))
        optim.result()

    # RL: sample from the current weights, reward short answers, one importance-sampling step
    sampler = training.save_weights_and_get_sampling_client(name="policy")
    prompt_tokens = tokenizer.encode(EXAMPLES[0][0], add_special_tokens=False)
    samples = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt_tokens), num_samples=4,
        sampling_params=types.SamplingParams(max_tokens=12, temperature=1.0, stop=["\n"]),
    ).result()
    rewards = [1.0 / (1 + len(s.tokens)) for s in samples.sequences]
    baseline = sum(rewards) / len(rewards)
    rl_data = []
    for seq, reward in zip(samples.sequences, rewards, strict=True):
        tokens = prompt_tokens + list(seq.tokens)
        n_prompt = len(prompt_tokens) - 1
        rl_data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": tokens[1:],
                "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                "advantages": [0.0] * n_prompt + [reward - baseline] * len(seq.tokens),
            },
        ))
    rl = training.forward_backward(rl_data, loss_fn="importance_sampling").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    final_loss = mean_nll(training.forward(data, loss_fn="cross_entropy").result(), data)
    checkpoint = training.save_state("final").result().path
    resumed = service.create_training_client_from_state_with_optimizer(checkpoint).result()
    resumed_loss = mean_nll(resumed.forward(data, loss_fn="cross_entropy").result(), data)
    text = sampler.get_tokenizer().decode(samples.sequences[0].tokens)
    runs = tinker.RestClient().list_training_runs().result()
    print(json.dumps({
        "models": models, "losses": losses, "rl_loss": rl.metrics["loss:sum"],
        "sample_lengths": [len(s.tokens) for s in samples.sequences], "sample_text": text,
        "checkpoint": checkpoint, "final_loss": final_loss, "resumed_loss": resumed_loss,
        "runs": [r.training_run_id for r in runs.training_runs],
    }))


if __name__ == "__main__":
    main()
