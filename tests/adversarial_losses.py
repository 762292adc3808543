"""Custom losses (SDK ``create_custom_loss`` / ``trace_loss`` signature: ``logprobs`` of shape (T,) ->
(scalar loss, metrics)) whose graphs grow past any sane bound: the attacks that ``tinker_local.loss_limits``
must refuse, shared by the engine-level and the shared-server tests."""

from __future__ import annotations

import torch


def pow_chain(logprobs):
    """A Python int raised to 1024 forty times: a constant far past 63 bits, whatever the data."""
    n = logprobs.shape[0]
    for _ in range(40):
        n = n ** 1024
    return logprobs.sum() + n, {}


def cat_chain(logprobs):
    """``torch.cat`` doubling the input forty times: 2**40 * T elements."""
    x = logprobs
    for _ in range(40):
        x = torch.cat([x, x])
    return x.sum(), {}


def outer(logprobs):
    """The outer product of the input with itself: T**2 elements, over the bound only for long data."""
    return (logprobs[:, None] * logprobs[None, :]).sum(), {}
