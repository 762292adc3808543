"""``tinker_local.compute.target_logprobs``: the engine's logprobs of target tokens and their
one-pass backward, against the same quantities computed by autograd from ``log_softmax`` and a
gather (rows read more than once, as a shared prefix does, several targets per position, and
bf16 logits)."""

from __future__ import annotations

import pytest
import torch

from tinker_local.compute import target_logprobs


def _autograd_reference(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)[rows.unsqueeze(-1), targets]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 3])
def test_logprobs_and_logit_gradients_equal_autograd(dtype, k):
    gen = torch.Generator().manual_seed(k)
    U, V = 37, 301
    base = (torch.randn(U, V, generator=gen) * 3).to(dtype)
    rows = torch.cat([torch.arange(U), torch.tensor([0, 0, 5, 36, 5])])  # rows read twice and three times
    targets = torch.randint(0, V, (rows.shape[0], k), generator=gen)
    weights = torch.randn(rows.shape[0], k, generator=gen)

    mine, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    lp = target_logprobs(mine, rows, targets)
    lp_ref = _autograd_reference(ref, rows, targets)
    assert lp.dtype == torch.float32 and lp.shape == (rows.shape[0], k)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=0)

    (lp * weights).sum().backward()
    (lp_ref * weights).sum().backward()
    assert mine.grad is not None and ref.grad is not None and mine.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(mine.grad.float(), ref.grad.float(), rtol=tol, atol=tol)
    # the gradient of each row sums to zero (softmax rows sum to 1)
    sums = ref.grad.float().sum(-1)
    torch.testing.assert_close(mine.grad.float().sum(-1), sums, rtol=0, atol=1e-5 if dtype == torch.float32 else 0.1)


def test_rows_none_reads_row_n_and_a_second_backward_is_refused():
    logits = torch.randn(4, 9, requires_grad=True)
    targets = torch.tensor([[1], [8], [0], [3]])
    lp = target_logprobs(logits, None, targets)
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, targets), rtol=0, atol=0)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError):  # the backward overwrote what it saved: differentiable once
        lp.sum().backward()
