"""Padding-free batches for the local engine: several datums per row, attention kept inside each.

A padded micro-batch of datums of lengths ``n_1 .. n_B`` costs ``B * max(n)`` token slots; on
chat data of mixed lengths much of that is padding (8 Dolly chats of <= 256 tokens: 1,165 real
tokens in 2,048 slots).  Here the datums of a micro-batch are laid out in rows of width ``W``
(the longest datum): first-fit decreasing puts each datum, longest first, into the first row
with room, so ``R`` rows hold them in ``R * W`` slots (1,280 for that batch).  The width stays
the longest datum, not the sum of all, because attention costs ``W`` per token and row: one
row of every token would cost more attention than the padding it saves.

Attention stays inside each datum through its positions: ``position_ids`` restart at 0 at each
datum, and ``transformers`` (5.x, ``masking_utils.find_packed_sequence_indices``) turns positions
that restart inside a row, with no attention mask given, into a block-diagonal causal mask (a 4D
boolean mask for SDPA on CPU and CUDA; the varlen kernels with flash-attention 2).  Rotary
embeddings see each datum's own positions, so every token's hidden state equals the padded
batch's (fp32: to float rounding, ~1e-6).  Slots after a row's last datum hold token 0 at
positions continuing that datum's: causal attention keeps them out of every real token, and a
row holding one datum needs no mask at all.  Only real positions go through the output head
(``tinker_local.compute.fp32_head_logits(keep=...)``), so head and log-softmax cost follow real
tokens too.

An architecture whose attention ignores restarting positions would mix datums silently, so
:func:`packing_supported` checks each base model once: logits of two sequences packed into one
row against each sequence alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compute import fp32_head_logits


def pack_microbatches(lengths: list[int], budget: int) -> list[list[list[int]]]:
    """Group item indices into micro-batches of rows: each micro-batch is a list of rows, each row
    a list of item indices whose lengths sum to at most the micro-batch's width (its longest item).
    Items are placed longest first, each into the first row with room (first-fit decreasing); a
    new row opens while ``rows * width <= budget`` token slots, else a new micro-batch starts (a
    single item longer than ``budget`` gets one of its own).  Returns [] for no items."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[list[int]]] = []
    rows: list[list[int]] = []
    fill: list[int] = []
    width = 0
    for i in order:
        n = lengths[i]
        r = next((j for j, f in enumerate(fill) if f + n <= width), None)
        if r is not None:
            rows[r].append(i)
            fill[r] += n
            continue
        if rows and (len(rows) + 1) * width > budget:
            out.append(rows)
            rows, fill = [], []
        if not rows:
            width = n  # the longest item of this micro-batch (items come longest first)
        rows.append([i])
        fill.append(n)
    if rows:
        out.append(rows)
    return out


@dataclass
class PackedBatch:
    """Model inputs of one packed micro-batch.

    Attributes:
        ids: (R, W) int64 token ids (0 in the slots after a row's last item).
        position_ids: (R, W) int64, restarting at 0 at each item.
        keep: (N,) int64 flat indices into the R * W slots of the real tokens, item after item in
            ``items`` order (N = sum of the item lengths).
        items: item indices in the order of ``keep``.
        spans: per entry of ``items``, its ``(start, end)`` in ``keep``.
    """

    ids: torch.Tensor
    position_ids: torch.Tensor
    keep: torch.Tensor
    items: list[int]
    spans: list[tuple[int, int]]


def packed_batch(rows: list[list[int]], tokens: list[list[int]]) -> PackedBatch:
    """Lay out ``rows`` (from :func:`pack_microbatches`) of items with token lists ``tokens``
    (indexed by item) on CPU; width: the longest row's length."""
    width = max(sum(len(tokens[i]) for i in row) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    keep, items, spans = [], [], []
    total = 0
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n = len(tokens[i])
            ids[r, at : at + n] = torch.as_tensor(tokens[i], dtype=torch.long)
            pos[r, at : at + n] = torch.arange(n)
            keep.append(torch.arange(r * width + at, r * width + at + n))
            items.append(i)
            spans.append((total, total + n))
            total += n
            at += n
        if at < width:  # the tail continues the last item's positions: no extra mask block
            last = len(tokens[row[-1]])
            pos[r, at:] = torch.arange(last, last + width - at)
    return PackedBatch(ids, pos, torch.cat(keep), items, spans)


@torch.no_grad()
def packing_supported(model, vocab_size: int, device: torch.device) -> bool:
    """True when ``model`` keeps packed sequences apart: the fp32 logits of two sequences (5 and 3
    tokens) packed into one row with restarting ``position_ids`` equal those of each sequence
    alone (within 1e-4 of the largest logit); False when they differ or the forward fails."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, vocab_size, (5,), generator=gen).tolist()
    b = torch.randint(0, vocab_size, (3,), generator=gen).tolist()
    pb = packed_batch([[0, 1]], [a, b])
    try:
        with torch.autocast(device.type, enabled=False):
            packed = fp32_head_logits(model, pb.ids.to(device), pb.position_ids.to(device), pb.keep.to(device))
            alone = torch.cat([fp32_head_logits(model, torch.tensor([s], device=device))[0] for s in (a, b)])
    except (RuntimeError, TypeError, ValueError):
        return False
    scale = float(alone.abs().max()) + 1.0
    return bool(torch.isfinite(packed).all()) and float((packed - alone).abs().max()) <= 1e-4 * scale
