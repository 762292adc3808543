"""Segment attention: the engine's attention for padding-free rows on SDPA.

A packed row (``tinker_local.packing``) holds several datums back to back, with no padding; each
*segment* of the row is a run of query slots that attends causally to its own keys, and, for the
branch of a shared prefix, to every slot of that prefix first.  ``sdpa_segments`` is registered
as a ``transformers`` attention implementation (``AttentionInterface``): called with a
``segments`` keyword (a list of :class:`Segment`, passed through the model's forward), it runs
one ``scaled_dot_product_attention`` per segment on that segment's queries and keys and
concatenates the outputs; called without one (sampling, a padded batch, another caller), it is
``transformers``' own SDPA attention with its usual mask, so a model loaded with it behaves as
with ``"sdpa"`` everywhere else.

Why per segment instead of one (R, 1, W, W) block mask over the row: SDPA's CPU flash kernel
skips key blocks above the diagonal only with ``is_causal``, never by reading a mask, so a mask
makes every query attend over the whole row's width.  On SmolLM2-135M (8 chats, 951 slots, their
system prompt shared) the masked attention took 1.24 s of a 4.4 s ``forward_backward``
(``torch.profiler``, 2 threads), the per-segment one 0.43 s.  The row's decoder work then follows
its real tokens, however long the row: one row per micro-batch (see ``packing``).

Numerics: each segment's queries see exactly the keys they would see alone (a shared prefix's
keys are its own, computed once), with the same SDPA kernel, so logits equal those of each datum
alone to float rounding (checked per base model by ``packing.packing_supported``).  A layer with
a sliding window (``sliding_window`` passed by the model) also limits each query to the last
``sliding_window`` positions of its segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SEGMENT_ATTENTION = "sdpa_segments"  # contains "sdpa": transformers applies SDPA's support checks


@dataclass(frozen=True)
class Segment:
    """Query slots ``[start, end)`` of a packed row, attending causally to the same slots.

    Attributes:
        start, end: the segment's slots in the row (0-based, end exclusive).
        prefix: ``(start, end)`` slots of a shared prefix that every query of the segment also
            attends to, in full and before its own keys (a branch of ``packing``'s shared-prefix
            unit), or None.
        mask: for a segment with a prefix, the (1, 1, end - start, prefix length + end - start)
            boolean mask (True: may attend) on the compute device; None otherwise (``is_causal``).
    """

    start: int
    end: int
    prefix: tuple[int, int] | None = None
    mask: torch.Tensor | None = None


def segments_on(spans: list[tuple[int, int, tuple[int, int] | None]], device: torch.device) -> list[Segment]:
    """:class:`Segment` list of ``spans`` ``(start, end, prefix or None)``, with each prefixed
    segment's mask built once on ``device`` (shared by every layer of a forward)."""
    out = []
    for start, end, prefix in spans:
        mask = None
        if prefix is not None:
            n, p = end - start, prefix[1] - prefix[0]
            mask = torch.ones((1, 1, n, p + n), dtype=torch.bool, device=device).tril(diagonal=p)
        out.append(Segment(start, end, prefix, mask))
    return out


def _window(mask: torch.Tensor | None, n: int, p: int, window: int, device: torch.device) -> torch.Tensor:
    """``mask`` (or plain causal over ``n`` queries and ``p + n`` keys) limited to keys fewer
    than ``window`` positions before each query (query i sits at position p + i, key j at j)."""
    q = torch.arange(p, p + n, device=device).unsqueeze(-1)
    k = torch.arange(p + n, device=device).unsqueeze(0)
    band = ((k <= q) & (q - k < window))[None, None]
    return band if mask is None else mask & band


def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    segments: list[Segment] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``transformers`` attention function (``AttentionInterface``): query (B, H, T, D), key and
    value (B, H_kv, T, D) -> ((B, T, H, D), None).  With ``segments`` (B = 1; every slot of the
    row in exactly one segment, in row order; a prefix is the segment of its own that starts at
    ``prefix[0]`` and ends at ``prefix[1]``), ``attention_mask`` is not read; without, this is
    ``transformers.integrations.sdpa_attention.sdpa_attention_forward``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if segments is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    window = kwargs.get("sliding_window")
    groups = _groups(segments)
    sizes = [segments[g[-1]].end - segments[g[0]].start for g in groups]
    # one split per tensor (its backward is one concatenation) rather than a slice per segment,
    # whose backward would write a zero tensor of the whole row for every segment
    qs, ks, vs = ((t,) if len(sizes) == 1 else t.split(sizes, dim=2) for t in (query, key, value))
    at = {segments[g[0]].start: i for i, g in enumerate(groups)}
    outs = []
    for i, g in enumerate(groups):
        q, k, v, seg = qs[i], ks[i], vs[i], segments[g[0]]
        B, H, _, D = q.shape
        if len(g) > 1:  # equal datums side by side: one batched call, (B * len(g), H, n, D) views
            q, k, v = (t.unflatten(2, (len(g), -1)).transpose(1, 2).flatten(0, 1) for t in (q, k, v))
        mask = seg.mask
        if seg.prefix is not None:
            j = at[seg.prefix[0]]  # the prefix is a segment (and a group) of its own, before its branches
            k, v = torch.cat([ks[j], k], dim=2), torch.cat([vs[j], v], dim=2)
        n, p = q.shape[2], k.shape[2] - q.shape[2]
        if window and p + n > window:
            mask = _window(mask, n, p, int(window), query.device)
        out, _ = sdpa_attention_forward(
            module, q, k, v, mask, dropout=dropout, scaling=scaling, is_causal=mask is None
        )  # (B * len(g), n, H, D)
        outs.append(out.reshape(B, -1, *out.shape[2:]))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], None


def _groups(segments: list[Segment]) -> list[list[int]]:
    """Indices of ``segments`` in runs attended by one SDPA call: adjacent segments of equal
    length with no prefix that are no other segment's prefix together, every other alone."""
    prefixes = {seg.prefix[0] for seg in segments if seg.prefix is not None}
    groups: list[list[int]] = []
    for i, seg in enumerate(segments):
        plain = seg.prefix is None and seg.start not in prefixes
        if groups and plain:
            last = segments[groups[-1][-1]]
            if (
                last.prefix is None
                and last.start not in prefixes
                and last.end - last.start == seg.end - seg.start
                and last.end == seg.start
            ):
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def register_segment_attention() -> None:
    """Register :data:`SEGMENT_ATTENTION` with ``transformers`` (attention and mask functions;
    the mask is SDPA's, for calls without segments).  Idempotent."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
    AttentionMaskInterface.register(SEGMENT_ATTENTION, sdpa_mask)
