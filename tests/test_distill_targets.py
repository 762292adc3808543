"""Distillation targets against independent computations on fixed sequences: which tokens the
teacher reads (its own rendering, also with another renderer than the student's: the cookbook's
#796), the reverse-KL advantages, the top-K soft targets, the reverse-KL custom loss, prompt
records and the teacher's view."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from prefect_tinker.recipes.data_reading import SourceSpec
from prefect_tinker.recipes.data_sources import DatasetFormatError
from prefect_tinker.recipes.distill.align import align_completion, end_marker, gather_teacher, split_reply
from prefect_tinker.recipes.distill.prompts import DEMO_TEMPLATE, PromptRecord, TeacherView, freeze, load_prompts
from prefect_tinker.recipes.distill.targets import ReverseKLLoss, discounted_future_sum, kl_advantages, soft_targets
from prefect_tinker.recipes.renderers import get_renderer
from tests import renderer_tokenizers

MSGS = [{"role": "user", "content": "What is 7 plus 5?"}]


@pytest.fixture(scope="module")
def tok():
    return renderer_tokenizers.tiny()


def _reply(renderer, text: str) -> tuple[list[int], list[int]]:
    """(generation prompt, the reply tokens the renderer trains: body and end marker)."""
    prompt = renderer.build_generation_prompt(MSGS).to_ints()
    full, w = renderer.build_supervised_example(
        MSGS + [{"role": "assistant", "content": text}], "last_assistant_message"
    )
    full = full.to_ints()
    assert full[: len(prompt)] == prompt
    last = max(i for i, x in enumerate(w) if x > 0)
    return prompt, full[len(prompt): last + 1]


def test_split_reply_and_end_markers(tok):
    chatml, colon = get_renderer("chatml", tok), get_renderer("role_colon", tok)
    _, reply = _reply(chatml, "12 apples")
    body, end = split_reply(chatml, reply)
    assert end == end_marker(chatml) == [tok.convert_tokens_to_ids("<|im_end|>")] and body == reply[:-1]
    assert split_reply(chatml, body) == (body, [])  # truncated: no marker
    _, reply = _reply(colon, "12 apples")
    body, end = split_reply(colon, reply)
    assert body + end == reply and "\n\nUser:" in tok.decode(end) and "\n\nUser:" not in tok.decode(body)
    assert "12 apples" in tok.decode(body)
    assert tok.decode(end_marker(colon)) == "\n\nUser:"


def test_same_renderer_reuses_every_completion_token(tok):
    chatml = get_renderer("chatml", tok)
    prompt, reply = _reply(chatml, "7 plus 5 is 12.")
    view = TeacherView(system_prompt="You are a careful teacher.")
    record = PromptRecord(freeze(MSGS), "12", "x:1")
    t_prompt = chatml.build_generation_prompt(view.messages(record)).to_ints()
    al = align_completion(
        len(prompt), reply, t_prompt, student_renderer=chatml, teacher_renderer=chatml, same_format=True
    )
    assert al.teacher_tokens == t_prompt + reply
    assert "careful teacher" in tok.decode(al.teacher_tokens) and "careful teacher" not in tok.decode(prompt)
    # target i of the student predicts (prompt + reply)[i + 1]; the teacher's target j predicts teacher_tokens[j + 1]
    student = prompt + reply
    for s, (t,) in al.pairs:
        assert student[s + 1] == al.teacher_tokens[t + 1]
    assert [s for s, _ in al.pairs] == list(range(len(prompt) - 1, len(student) - 1))


@pytest.mark.parametrize("student_name, teacher_name", [("role_colon", "chatml"), ("chatml", "role_colon")])
def test_teacher_reads_its_own_format_not_the_students(tok, student_name, teacher_name):
    """The cookbook's #796: a chat teacher must not score the student's role_colon text. The
    teacher's sequence is its own generation prompt, the student's reply body, its own end marker."""
    student, teacher = get_renderer(student_name, tok), get_renderer(teacher_name, tok)
    prompt, reply = _reply(student, "7 plus 5 is 12.")
    t_prompt = teacher.build_generation_prompt(MSGS).to_ints()
    al = align_completion(len(prompt), reply, t_prompt, student_renderer=student, teacher_renderer=teacher,
                          same_format=False)
    body, end = split_reply(student, reply)
    assert al.teacher_tokens == t_prompt + body + end_marker(teacher)
    text = tok.decode(al.teacher_tokens)
    if teacher_name == "chatml":
        assert text.startswith("<|im_start|>user\n") and "User:" not in text and text.endswith("<|im_end|>")
    else:
        assert text.startswith("User: What is 7 plus 5?\n\nAssistant:") and "<|im" not in text
        assert text.endswith("\n\nUser:")
    # body tokens one to one; the student's first end token <-> the teacher's whole end marker
    n = len(t_prompt) - 1
    expected = [(len(prompt) - 1 + k, (n + k,)) for k in range(len(body))]
    expected.append((len(prompt) - 1 + len(body), tuple(n + len(body) + j for j in range(len(end_marker(teacher))))))
    assert al.pairs == expected

    # teacher logprobs gathered onto the student's targets: an independent loop over a fixed array
    lp = -np.arange(1, len(al.teacher_tokens), dtype=np.float64) / 10
    values, mask = gather_teacher(al, lp, len(prompt + reply) - 1)
    for s in range(len(prompt + reply) - 1):
        k = s - (len(prompt) - 1)
        if 0 <= k < len(body):
            assert values[s] == pytest.approx(lp[n + k]) and mask[s] == 1
        elif k == len(body):
            assert values[s] == pytest.approx(sum(lp[n + len(body) + j] for j in range(len(end_marker(teacher)))))
        else:
            assert mask[s] == 0 and values[s] == 0


def test_kl_advantages_match_a_direct_computation():
    rng = np.random.default_rng(3)
    n = 12
    student, teacher = -rng.random(n) * 3, -rng.random(n) * 3
    mask = np.array([0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 0], dtype=np.float64)
    adv, kl = kl_advantages(student, teacher, mask, coef=0.7)
    for t in range(n):
        assert kl[t] == pytest.approx(mask[t] * (student[t] - teacher[t]))
        assert adv[t] == pytest.approx(-0.7 * mask[t] * (student[t] - teacher[t]))
    gamma = 0.9
    adv_d, _ = kl_advantages(student, teacher, mask, coef=0.7, discount=gamma)
    for t in range(n):
        future = sum(gamma ** (s - t) * -0.7 * mask[s] * (student[s] - teacher[s]) for s in range(t, n))
        assert adv_d[t] == pytest.approx(mask[t] * future)
    assert discounted_future_sum(np.array([1.0, 2.0, 3.0]), 0.5).tolist() == [1 + 1 + 0.75, 2 + 1.5, 3]


def test_soft_targets_renormalise_drop_and_pad():
    ids = np.array([[5, 9, 2000, -1], [7, 3, 1, 0], [4, 4, 4, 4]], dtype=np.int64)
    lps = np.array([[-0.5, -1.5, -2.0, -np.inf], [-0.1, -3.0, -4.0, -5.0], [-1, -1, -1, -1]], dtype=np.float64)
    st = soft_targets(ids, lps, [(2, 0), (4, 1)], n_targets=6, k=4, vocab_size=1000)
    z = math.exp(-0.5) + math.exp(-1.5)  # id 2000 is outside the vocabulary, slot 3 is empty
    assert st.target_tokens[2].tolist() == [5, 9, 0, 0]
    assert st.weights[2].tolist() == pytest.approx([math.exp(-0.5) / z, math.exp(-1.5) / z, 0, 0], rel=1e-6)
    z2 = sum(math.exp(x) for x in (-0.1, -3.0, -4.0, -5.0))
    assert st.weights[4].tolist() == pytest.approx([math.exp(x) / z2 for x in (-0.1, -3.0, -4.0, -5.0)], rel=1e-6)
    assert st.target_tokens[4].tolist() == [7, 3, 1, 0]
    assert np.abs(st.weights[[0, 1, 3, 5]]).sum() == 0 and st.positions == 2 and st.dropped == 1
    h = -sum(p * math.log(p) for p in st.weights[2][:2]) - sum(p * math.log(p) for p in st.weights[4])
    assert st.entropy_sum == pytest.approx(h, rel=1e-5)
    with pytest.raises(ValueError, match="outside"):
        soft_targets(ids, lps, [(6, 0)], n_targets=6, k=4, vocab_size=1000)


def test_reverse_kl_loss_value_and_gradient_match_an_independent_computation():
    import tinker

    rng = np.random.default_rng(0)
    n, k = 5, 4
    q = np.zeros((n, k), dtype=np.float32)
    q[1, :3] = rng.dirichlet(np.ones(3))
    q[3, :] = rng.dirichlet(np.ones(4))
    datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(list(range(n))), loss_fn_inputs={
        "target_tokens": tinker.TensorData.from_numpy(rng.integers(0, 50, size=(n, k)).astype(np.int64)),
        "weights": tinker.TensorData.from_numpy(q)})
    lp = torch.tensor(-rng.random((n, k)) * 4, dtype=torch.float32, requires_grad=True)
    loss, metrics = ReverseKLLoss()([datum], [lp])
    loss.backward()
    # independent: per position, p~ over the valid slots by explicit exp/sum, KL(p~ || q)
    lp_ref = lp.detach().double().clone().requires_grad_(True)
    total = 0
    for i in range(n):
        valid = [j for j in range(k) if q[i, j] > 0]
        if not valid:
            continue
        z = sum(torch.exp(lp_ref[i, j]) for j in valid)
        total = total + sum(
            torch.exp(lp_ref[i, j]) / z * (torch.log(torch.exp(lp_ref[i, j]) / z) - math.log(float(q[i, j])))
            for j in valid
        )
    total.backward()
    assert float(loss.detach()) == pytest.approx(float(total.detach()), rel=1e-9)
    assert metrics["kl:sum"] == pytest.approx(float(total.detach()))
    assert metrics["positions:sum"] == 2
    assert lp.grad.double().numpy() == pytest.approx(lp_ref.grad.numpy(), abs=1e-6)
    # the cookbook's REINFORCE form p~ * sg[log p~ - log q] has the same gradient
    lp2 = lp.detach().clone().requires_grad_(True)
    s = 0
    for i in (1, 3):
        valid = torch.tensor(q[i] > 0)
        logp = torch.log_softmax(torch.where(valid, lp2[i], torch.tensor(-float("inf"))), -1)[valid]
        s = s + (logp.exp() * (logp - torch.log(torch.tensor(q[i][q[i] > 0]))).detach()).sum()
    s.backward()
    assert lp.grad.numpy() == pytest.approx(lp2.grad.numpy(), abs=1e-5)


def test_prompt_records_and_teacher_view(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"messages": [{"role": "user", "content": "Q1 {answer}"}, {"role": "assistant", "content": "A1"}]},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q2"}]},
            {"text": "a raw sentence"}]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n")
    recs = load_prompts(SourceSpec(path=str(path)))
    assert [r.message_list()[-1]["content"] for r in recs] == ["Q1 {answer}", "Q2"]
    assert [r.answer for r in recs] == ["A1", None] and recs[0].id.endswith("p.jsonl:1")
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps(rows[2]) + "\n")
    (r,) = load_prompts(SourceSpec(path=str(raw), format="prompt"), source=2)
    assert r.message_list() == [{"role": "user", "content": "a raw sentence"}] and r.source == 2

    sdft = TeacherView(prompt_template=DEMO_TEMPLATE)
    msgs = sdft.messages(recs[0])
    assert msgs[-1]["content"].startswith("Q1 {answer}\n\nThis is an example") and "\nA1\n" in msgs[-1]["content"]
    with pytest.raises(ValueError, match="no answer"):
        sdft.messages(recs[1])
    lit = TeacherView(system_prompt="Label it.", prompt_template="Text: {prompt} -> {label}")
    assert lit.messages(recs[1]) == [{"role": "system", "content": "Label it.\n\nbe brief"},
                                     {"role": "user", "content": "Text: Q2 -> {label}"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    with pytest.raises(DatasetFormatError, match=r"bad\.jsonl:1: .*must end with a user message"):
        load_prompts(SourceSpec(path=str(bad)))


def test_teacher_logprobs_of_its_own_rendering_through_the_server(local_credentials):
    """The scored sequence through the SDK and the local server: the teacher-logprobs task's
    numbers on the aligned positions equal an fp32 transformers forward of the teacher's own
    rendering (chatml) -- and differ from scoring the student's role_colon text (#796)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from prefect_tinker.tasks.teacher import teacher_logprobs, weights_tokenizer

    tok = weights_tokenizer(local_credentials, "base:tiny")
    student, teacher = get_renderer("role_colon", tok), get_renderer("chatml", tok)
    prompt, reply = _reply(student, "7 plus 5 is 12.")
    t_prompt = teacher.build_generation_prompt(MSGS).to_ints()
    al = align_completion(
        len(prompt), reply, t_prompt, student_renderer=student, teacher_renderer=teacher, same_format=False
    )
    (lp,) = teacher_logprobs.fn(local_credentials, "base:tiny", [al.teacher_tokens])
    values, mask = gather_teacher(al, lp, len(prompt + reply) - 1)

    model = AutoModelForCausalLM.from_pretrained(
        str(Path(local_credentials.local_root) / "models" / "tiny"), dtype=torch.float32
    )

    def logprobs(seq):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].double(), -1)
        return [float(logp[i, seq[i + 1]]) for i in range(len(seq) - 1)]

    body, _ = split_reply(student, reply)
    own = t_prompt + body + [tok.convert_tokens_to_ids("<|im_end|>")]  # written out by hand
    ref = logprobs(own)
    n = len(t_prompt) - 1
    for k in range(len(body) + 1):
        assert values[len(prompt) - 1 + k] == pytest.approx(ref[n + k], abs=2e-4)
    assert mask.sum() == len(body) + 1
    wrong = logprobs(prompt + reply)  # the student's rendering, as the cookbook's #796 scored it
    biased = [wrong[len(prompt) - 1 + k] for k in range(len(body))]
    assert max(abs(b - values[len(prompt) - 1 + k]) for k, b in enumerate(biased)) > 1e-3
