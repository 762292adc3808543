"""Padding-free batches for the local engine: the datums of a micro-batch back to back in one row,
attention kept inside each, and datums that begin with the same tokens sharing one pass over
those tokens.

A padded micro-batch of datums of lengths ``n_1 .. n_B`` costs ``B * max(n)`` token slots; on
chat data of mixed lengths much of that is padding (8 Dolly chats of <= 256 tokens: 1,119 real
tokens in 1,800 slots).  Here a micro-batch is one row holding its datums back to back: the
decoder, the output head and the log-softmax see real tokens only, and attention costs each
datum its own length, not the row's (:mod:`tinker_local.attention`).  Micro-batches
(:func:`split_microbatches`) bound the row at the engine's budget of token slots.

**Shared prefixes.**  Datums that begin with the same tokens (a DPO pair's prompt before its
chosen and its rejected reply; a GRPO group's prompt before each of its samples; a chat
template's system prompt) form one *unit*: the shared prefix once, then each datum's own
remainder (its *branch*).  A causal model's hidden states of the prefix do not depend on what
follows it, so computing them once and letting every branch attend to them gives each datum
exactly the hidden states it would get alone (to float rounding); the loss's gradients flow into
the prefix from every branch, as they would through separate copies.  :func:`shared_prefix_units`
finds such groups (at least ``MIN_SHARED`` tokens in common) where a cost model makes the layout
cheaper (:func:`layout_cost`: decoder and output head per token slot, attention per query-key
pair: a branch attends to all of its prefix through a mask, which SDPA's kernel cannot skip).

Attention stays inside each datum in one of two ways:

- **segments** (``tinker_local.attention.SEGMENT_ATTENTION``, SDPA on CPU and CUDA): the row's
  :class:`~tinker_local.attention.Segment` list goes to the model's forward; each datum (each
  prefix, each branch with its prefix) gets its own causal attention.  Positions (rotary
  embeddings) restart at 0 at each unit; a branch continues at its prefix's length.
- **restarting positions only** (flash-attention 2, whose varlen kernels take no segments and no
  4D mask): one datum per unit, ``position_ids`` restarting at 0 at each datum, and
  ``transformers`` (5.x, ``masking_utils.find_packed_sequence_indices``) turns positions that
  restart inside a row into its varlen attention.

Each datum then reads its logprobs from the slots of its own positions (``PackedBatch.index``),
shared prefix slots included.  An architecture whose attention ignores the segments or the
restarting positions would mix datums silently, so :func:`packing_supported` checks each base
model once: logits of packed sequences, a shared prefix among them, against each sequence alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import segments_on
from .compute import fp32_head_logits

MIN_SHARED = 8  # fewest tokens in common for datums to share their prefix
MAX_UNIT = 1024  # most tokens in a unit of several datums, unless one datum alone is longer

#: A unit of layout: an item index (one datum), or ``(prefix length, [item indices])`` for datums
#: sharing their first ``prefix length`` tokens.
Unit = int | tuple[int, list[int]]


def unit_items(unit: Unit) -> list[int]:
    """The item indices of ``unit``."""
    return [unit] if isinstance(unit, int) else list(unit[1])


def unit_length(unit: Unit, lengths: list[int]) -> int:
    """Token slots of ``unit``: the prefix once plus every item's remainder."""
    if isinstance(unit, int):
        return lengths[unit]
    p, items = unit
    return p + sum(lengths[i] - p for i in items)


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


@dataclass(frozen=True)
class LayoutCosts:
    """Relative costs of a layout, in units of one token slot's decoder work: ``attention`` per
    query-key pair, ``head`` per token slot (output head and log-softmax).
    :func:`layout_costs` derives them from a model config."""

    attention: float = 1 / (6 * 512)
    head: float = 0.1


def layout_costs(config) -> LayoutCosts:
    """``LayoutCosts`` of a transformers config: a decoder layer's weights ~ 12 h^2 multiply-adds
    per token, attention ~ 2 h per query and key (so ``1 / (6 h)`` of a slot per pair), the head
    ``V h`` per token (``V / (12 h L)`` of a slot); h hidden size, L layers, V vocabulary."""
    cfg = getattr(config, "text_config", None) or config
    h = int(getattr(cfg, "hidden_size", 512) or 512)
    n_layers = int(getattr(cfg, "num_hidden_layers", 12) or 12)
    vocab = int(getattr(cfg, "vocab_size", 32000) or 32000)
    return LayoutCosts(attention=1 / (6 * h), head=vocab / (12 * h * n_layers))


def layout_cost(units: list[Unit], lengths: list[int], costs: LayoutCosts) -> float:
    """Estimated cost of computing ``units``: ``1 + head`` per token slot, plus ``attention`` per
    query-key pair: ``n^2 / 2`` for a datum of n tokens alone (causal: the kernel skips the
    upper triangle), ``p^2 / 2 + sum n_i (p + n_i)`` for a prefix of p tokens and its branches
    of n_i (each branch attends through a mask, computed in full)."""
    total = 0.0
    for u in units:
        slots = unit_length(u, lengths)
        if isinstance(u, int):
            pairs = slots * slots / 2
        else:
            p, items = u
            pairs = p * p / 2 + sum((lengths[i] - p) * lengths[i] for i in items)
        total += slots * (1 + costs.head) + costs.attention * pairs
    return total


def shared_prefix_units(
    tokens: list[list[int]],
    costs: LayoutCosts = LayoutCosts(),
    min_shared: int = MIN_SHARED,
    max_unit: int = MAX_UNIT,
) -> list[Unit]:
    """Group items (token lists) that share at least ``min_shared`` leading tokens into units,
    where that makes the layout cheaper (:func:`layout_cost`).

    Items are sorted by their tokens, where each item's longest common prefix with any other is
    with a neighbour.  For each candidate depth ``t`` (each distinct common-prefix length of
    neighbours, at least ``min_shared``), the runs of neighbours sharing at least ``t`` tokens
    become units (prefix: the run's common prefix; a run is cut where a unit would pass
    ``max(max_unit, its longest item)`` slots); the cheapest candidate wins, no sharing included.
    So a DPO pair shares its prompt, and pairs share only their system prompt when that saves
    more than sharing each pair's whole prompt; a GRPO group shares its prompt.  Returns units
    covering every item once (single items as plain indices), ordered by their first item;
    deterministic for given tokens."""
    n = len(tokens)
    lengths = [len(t) for t in tokens]
    order = sorted(range(n), key=lambda i: tokens[i])
    lcp = [_common(tokens[order[k]], tokens[order[k + 1]]) for k in range(n - 1)]
    best: list[Unit] = list(range(n))
    best_cost = layout_cost(best, lengths, costs)
    for t in sorted({x for x in lcp if x >= min_shared}, reverse=True):
        units: list[Unit] = []
        run, prefix = [order[0]], 0
        for k in range(1, n + 1):
            i = order[k] if k < n else None
            if i is not None and lcp[k - 1] >= t:
                p = min(prefix, lcp[k - 1]) if len(run) > 1 else lcp[k - 1]
                size = p + sum(lengths[j] - p for j in (*run, i))
                if size <= max(max_unit, max(lengths[j] for j in (*run, i))):
                    run.append(i)
                    prefix = p
                    continue
            units.append(run[0] if len(run) == 1 else (prefix, list(run)))
            if i is not None:
                run, prefix = [i], 0
        cost = layout_cost(units, lengths, costs)
        if cost < best_cost:
            best, best_cost = units, cost
    return sorted(best, key=lambda u: min(unit_items(u)))


def split_microbatches(sizes: list[int], budget: int) -> list[list[int]]:
    """Group unit indices (``sizes``: each unit's token slots) into micro-batches, each one row
    of at most ``budget`` slots: units in order, a new micro-batch where the next unit would pass
    the budget (a single unit longer than ``budget`` gets one of its own).  Returns [] for no
    units."""
    out: list[list[int]] = []
    row: list[int] = []
    fill = 0
    for i, n in enumerate(sizes):
        if row and fill + n > budget:
            out.append(row)
            row, fill = [], 0
        row.append(i)
        fill += n
    if row:
        out.append(row)
    return out


@dataclass
class PackedBatch:
    """Model inputs of one packed micro-batch: R rows of W token slots, every one real.  One row
    (R = 1) of every unit back to back; where every unit is a single datum of one length, one
    row per datum (a plain causal batch: no segments, no restarting positions, one attention
    call for all of them).

    Attributes:
        ids: (R, W) int64 token ids.
        position_ids: (1, W) int64, restarting at 0 at each unit (a branch continues its
            prefix); None for a plain causal batch.
        index: (N,) int64 flat slots (into R * W) holding each item's tokens, item after item in
            ``items`` order (N = sum of the item lengths; a shared prefix's slots read by each of
            its items).
        items: item indices in the order of ``index``.
        spans: per entry of ``items``, its ``(start, end)`` in ``index``.
        segments: ``(start, end, prefix slots or None)`` per attention segment of the row in
            order (``tinker_local.attention.segments_on``), or None where restarting positions
            alone keep datums apart (flash-attention 2) or the batch is plain causal.
    """

    ids: torch.Tensor
    position_ids: torch.Tensor | None
    index: torch.Tensor
    items: list[int]
    spans: list[tuple[int, int]]
    segments: list[tuple[int, int, tuple[int, int] | None]] | None


def packed_batch(units: list[Unit], tokens: list[list[int]], *, segments: bool = True) -> PackedBatch:
    """Lay ``units`` (from :func:`shared_prefix_units`, plain item indices for single items) of
    items with token lists ``tokens`` (indexed by item) out, on CPU (see :class:`PackedBatch`).
    ``segments`` False (flash-attention 2): every unit must be a single item, kept apart by
    restarting positions only (ValueError for a shared prefix)."""
    order = [u for u in units if isinstance(u, int)]
    if len(order) == len(units) and len({len(tokens[i]) for i in order}) == 1:
        n = len(tokens[order[0]])
        return PackedBatch(
            torch.tensor([tokens[i] for i in order], dtype=torch.long),
            None,
            torch.arange(len(order) * n),
            order,
            [(k * n, (k + 1) * n) for k in range(len(order))],
            None,
        )
    ids: list[int] = []
    pos: list[int] = []
    spans: list[tuple[int, int, tuple[int, int] | None]] = []
    slots: dict[int, list[int]] = {}  # each item's token slots
    for unit in units:
        at = len(ids)
        if isinstance(unit, int):
            n = len(tokens[unit])
            ids += tokens[unit]
            pos += range(n)
            spans.append((at, at + n, None))
            slots[unit] = list(range(at, at + n))
            continue
        if not segments:
            raise ValueError("shared prefixes need segment attention")
        p, items = unit
        ids += tokens[items[0]][:p]
        pos += range(p)
        spans.append((at, at + p, None))
        for i in items:
            b = len(ids)
            n = len(tokens[i]) - p
            if n:  # an item that is the prefix itself reads the prefix's slots only
                ids += tokens[i][p:]
                pos += range(p, p + n)
                spans.append((b, b + n, (at, at + p)))
            slots[i] = list(range(at, at + p)) + list(range(b, b + n))
    items = [i for u in units for i in unit_items(u)]
    index: list[int] = []
    item_spans: list[tuple[int, int]] = []
    for i in items:
        item_spans.append((len(index), len(index) + len(slots[i])))
        index += slots[i]
    return PackedBatch(
        torch.tensor([ids], dtype=torch.long),
        torch.tensor([pos], dtype=torch.long),
        torch.tensor(index, dtype=torch.long),
        items,
        item_spans,
        spans if segments else None,
    )


def packed_logits(model, pb: PackedBatch, device: torch.device) -> torch.Tensor:
    """fp32 logits (R * W, V) of the batch's slots (the decoder under the ambient autocast).
    With segments, the model also gets an all-ones 2D ``attention_mask`` (every slot is a real
    token): without one, ``transformers`` would read the restarting positions as packed
    sequences and build a (1, 1, W, W) block mask on every forward (0.56 s at 15,827 slots) that
    segment attention never reads; with it, SDPA's mask function sees no padding and builds
    none."""
    ids = pb.ids.to(device)
    kw = {}
    if pb.segments is not None:
        kw = {"segments": segments_on(pb.segments, device), "attention_mask": torch.ones_like(ids)}
    pos = None if pb.position_ids is None else pb.position_ids.to(device)
    logits = fp32_head_logits(model, ids, pos, **kw)
    return logits.reshape(-1, logits.shape[-1])


@torch.no_grad()
def packing_supported(model, vocab_size: int, device: torch.device, *, segments: bool = True) -> bool:
    """True when ``model`` keeps packed sequences apart in the layout the engine will use: fp32
    logits of three sequences packed into one row (with segments: 5 tokens, and two of 5 sharing
    their first 3; without: 5, 3 and 2 tokens) equal those of each sequence alone (within 1e-4
    of the largest logit); False when they differ or the forward fails.  Two branches of one
    prefix tell attention that follows restarting positions but not segments apart from
    segment attention."""
    gen = torch.Generator().manual_seed(0)
    a, prefix, b, c = (torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (5, 3, 2, 2))
    toks = [a, prefix + b, prefix + c] if segments else [a, prefix, c]
    units: list[Unit] = [0, (3, [1, 2])] if segments else [0, 1, 2]
    pb = packed_batch(units, toks, segments=segments)
    try:
        with torch.autocast(device.type, enabled=False):
            logits = packed_logits(model, pb, device)
            packed = logits[pb.index.to(device)]
            alone = torch.cat([fp32_head_logits(model, torch.tensor([toks[i]], device=device))[0] for i in pb.items])
    except (RuntimeError, TypeError, ValueError):
        return False
    scale = float(alone.abs().max()) + 1.0
    return bool(torch.isfinite(packed).all()) and float((packed - alone).abs().max()) <= 1e-4 * scale
