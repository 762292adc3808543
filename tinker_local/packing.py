"""Padding-free batches for the local engine: several datums per row, attention kept inside each,
and datums that begin with the same tokens sharing one pass over those tokens.

A padded micro-batch of datums of lengths ``n_1 .. n_B`` costs ``B * max(n)`` token slots; on
chat data of mixed lengths much of that is padding (8 Dolly chats of <= 256 tokens: 1,165 real
tokens in 2,048 slots).  Here the datums of a micro-batch are laid out in rows of width ``W``
(the longest unit, see below): first-fit decreasing puts each unit, longest first, into the first
row with room, so ``R`` rows hold them in ``R * W`` slots (1,280 for that batch).  The width stays
the longest unit, not the sum of all, because attention costs ``W`` per token and row: one row
of every token would cost more attention than the padding it saves.

**Shared prefixes.**  Datums that begin with the same tokens (a DPO pair's prompt before its
chosen and its rejected reply; a GRPO group's prompt before each of its samples) form one
*unit*: the shared prefix once, then each datum's own remainder (its *branch*).  A causal
model's hidden states of the prefix do not depend on what follows it, so computing them once and
letting every branch attend to them gives each datum exactly the hidden states it would get
alone (to float rounding); the loss's gradients flow into the prefix from every branch, as they
would through separate copies.  :func:`shared_prefix_units` finds such groups (at least
``MIN_SHARED`` tokens in common) where they make the layout cheaper by a simple cost model
(:func:`layout_cost`: every slot of a row costs decoder work and attention over the row's width,
every computed token the output head), since a unit also widens the rows it sits in: a chat
template's system prompt, common to every datum, is not worth a row holding all of them.

Attention stays inside each datum in one of two ways:

- **explicit mask** (SDPA / eager attention, the default): a boolean (R, 1, W, W) mask, True
  where a slot may attend: causal, inside its own unit, and inside its own branch or the unit's
  prefix.  Positions (rotary embeddings) restart at 0 at each unit; a branch continues at the
  prefix's length.  Needed for shared prefixes.
- **restarting positions only** (flash-attention 2, whose kernels take no 4D mask): one datum
  per unit, ``position_ids`` restarting at 0 at each datum, and ``transformers`` (5.x,
  ``masking_utils.find_packed_sequence_indices``) turns positions that restart inside a row into
  its varlen / block-diagonal attention.

Rows holding one single-datum unit each need neither (plain causal attention; the tail of a short
row, token 0 at continuing positions, is never seen by a real token).  With a mask, a row's tail
attends only to itself, so no query row is fully masked (which would give NaN activations, and
NaN times a zero gradient is NaN in the weights' gradients).  Only real token slots go through
the output head (``tinker_local.compute.fp32_head_logits(keep=...)``), each once, so head and
log-softmax cost follow the tokens computed; each datum then reads its logprobs from the rows of
its own positions (``PackedBatch.index``), shared prefix rows included.

An architecture whose attention ignores the mask or the restarting positions would mix datums
silently, so :func:`packing_supported` checks each base model once: logits of packed sequences,
a shared prefix among them, against each sequence alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    """Relative costs of a layout (in units of one token slot's decoder work): ``attention`` per
    slot and key (a slot of a row of width W attends over W keys: the explicit mask keeps the
    kernel from skipping masked keys), ``head`` per computed token (output head and log-softmax).
    :func:`layout_costs` derives them from a model config."""

    attention: float = 1 / (6 * 512)
    head: float = 0.1


def layout_costs(config) -> LayoutCosts:
    """``LayoutCosts`` of a transformers config: a decoder layer's weights ~ 12 h^2 multiply-adds
    per token, attention ~ 2 h per token and key (so ``1 / (6 h)`` of a slot per key), the head
    ``V h`` per token (``V / (12 h L)`` of a slot); h hidden size, L layers, V vocabulary."""
    cfg = getattr(config, "text_config", None) or config
    h = int(getattr(cfg, "hidden_size", 512) or 512)
    n_layers = int(getattr(cfg, "num_hidden_layers", 12) or 12)
    vocab = int(getattr(cfg, "vocab_size", 32000) or 32000)
    return LayoutCosts(attention=1 / (6 * h), head=vocab / (12 * h * n_layers))


def layout_cost(units: list[Unit], lengths: list[int], budget: int, costs: LayoutCosts) -> float:
    """Estimated cost of laying ``units`` out: per micro-batch of R rows of width W (from
    :func:`pack_microbatches`), ``R W (1 + attention W)``, plus ``head`` per computed token."""
    sizes = [unit_length(u, lengths) for u in units]
    total = costs.head * sum(sizes)
    for rows in pack_microbatches(sizes, budget):
        width = max(sizes[u] for row in rows for u in row)
        total += len(rows) * width * (1 + costs.attention * width)
    return total


def shared_prefix_units(
    tokens: list[list[int]],
    budget: int,
    costs: LayoutCosts = LayoutCosts(),
    min_shared: int = MIN_SHARED,
    max_unit: int = MAX_UNIT,
) -> list[Unit]:
    """Group items (token lists) that share at least ``min_shared`` leading tokens into units,
    where that makes the layout cheaper (:func:`layout_cost` with micro-batches of ``budget``
    slots).

    Items are sorted by their tokens, where each item's longest common prefix with any other is
    with a neighbour.  For each candidate depth ``t`` (each distinct common-prefix length of
    neighbours, at least ``min_shared``), the runs of neighbours sharing at least ``t`` tokens
    become units (prefix: the run's common prefix; a run is cut where a unit would pass
    ``max(max_unit, its longest item)`` slots); the cheapest candidate wins, no sharing included.
    So a DPO pair shares its prompt but pairs do not share the chat template's system prompt
    with each other when that would widen every row more than it saves; a GRPO group shares its
    prompt.  Returns units covering every item once (single items as plain indices), ordered by
    their first item; deterministic for given tokens."""
    n = len(tokens)
    lengths = [len(t) for t in tokens]
    order = sorted(range(n), key=lambda i: tokens[i])
    lcp = [_common(tokens[order[k]], tokens[order[k + 1]]) for k in range(n - 1)]
    best: list[Unit] = list(range(n))
    best_cost = layout_cost(best, lengths, budget, costs)
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
        cost = layout_cost(units, lengths, budget, costs)
        if cost < best_cost:
            best, best_cost = units, cost
    return sorted(best, key=lambda u: min(unit_items(u)))


def pack_microbatches(lengths: list[int], budget: int) -> list[list[list[int]]]:
    """Group unit indices (``lengths``: each unit's token slots) into micro-batches of rows: each
    micro-batch is a list of rows, each row a list of unit indices whose lengths sum to at most
    the micro-batch's width (its longest unit).  Units are placed longest first, each into the
    first row with room (first-fit decreasing); a new row opens while ``rows * width <= budget``
    token slots, else a new micro-batch starts (a single unit longer than ``budget`` gets one of
    its own).  Returns [] for no units."""
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
            width = n  # the longest unit of this micro-batch (units come longest first)
        rows.append([i])
        fill.append(n)
    if rows:
        out.append(rows)
    return out


@dataclass
class PackedBatch:
    """Model inputs of one packed micro-batch.

    Attributes:
        ids: (R, W) int64 token ids (0 in the slots after a row's last unit).
        position_ids: (R, W) int64, restarting at 0 at each unit (a branch continues its prefix).
        keep: (U,) int64 flat indices into the R * W slots of every real token slot, ascending
            (a shared prefix's slots once).
        index: (N,) int64 rows of ``keep`` holding each item's tokens, item after item in
            ``items`` order (N = sum of the item lengths).
        items: item indices in the order of ``index``.
        spans: per entry of ``items``, its ``(start, end)`` in ``index``.
        mask: (R, 1, W, W) bool attention mask (True: may attend), or None where the rows need
            none (one datum per row) or the positions alone keep datums apart.
        restarts: whether positions restart inside a row (``position_ids`` must be passed).
    """

    ids: torch.Tensor
    position_ids: torch.Tensor
    keep: torch.Tensor
    index: torch.Tensor
    items: list[int]
    spans: list[tuple[int, int]]
    mask: torch.Tensor | None
    restarts: bool


def packed_batch(rows: list[list[Unit]], tokens: list[list[int]], *, explicit_mask: bool = True) -> PackedBatch:
    """Lay out ``rows`` of units (from :func:`pack_microbatches` over :func:`shared_prefix_units`;
    plain item indices for single items) of items with token lists ``tokens`` (indexed by item)
    on CPU; width: the longest row's length.  ``explicit_mask`` False (flash-attention 2): every
    unit must be a single item, and rows holding several are kept apart by restarting positions
    only (ValueError for a shared prefix)."""
    lengths = [len(t) for t in tokens]
    width = max(sum(unit_length(u, lengths) for u in row) for row in rows)
    R = len(rows)
    ids = torch.zeros((R, width), dtype=torch.long)
    pos = torch.zeros((R, width), dtype=torch.long)
    seg = torch.full((R, width), -1, dtype=torch.long)  # unit number within the row (-1: tail)
    branch = torch.zeros((R, width), dtype=torch.long)  # 0: a single item or a prefix; i: branch i
    slots: list[list[int]] = [[] for _ in tokens]  # flat slot index of each item's tokens
    shared = any(not isinstance(u, int) for row in rows for u in row)
    if shared and not explicit_mask:
        raise ValueError("shared prefixes need an explicit attention mask")
    for r, row in enumerate(rows):
        at = 0
        for s, unit in enumerate(row):
            base = r * width
            if isinstance(unit, int):
                n = lengths[unit]
                ids[r, at : at + n] = torch.as_tensor(tokens[unit], dtype=torch.long)
                pos[r, at : at + n] = torch.arange(n)
                seg[r, at : at + n] = s
                slots[unit] = list(range(base + at, base + at + n))
                at += n
                continue
            p, items = unit
            ids[r, at : at + p] = torch.as_tensor(tokens[items[0]][:p], dtype=torch.long)
            pos[r, at : at + p] = torch.arange(p)
            seg[r, at : at + p] = s
            prefix_slots = list(range(base + at, base + at + p))
            at += p
            for b, i in enumerate(items, start=1):
                n = lengths[i] - p
                ids[r, at : at + n] = torch.as_tensor(tokens[i][p:], dtype=torch.long)
                pos[r, at : at + n] = torch.arange(p, p + n)
                seg[r, at : at + n] = s
                branch[r, at : at + n] = b
                slots[i] = prefix_slots + list(range(base + at, base + at + n))
                at += n
        if at < width:  # the tail continues the last positions: no extra block without a mask
            last = int(pos[r, at - 1]) + 1
            pos[r, at:] = torch.arange(last, last + width - at)
    several = any(len(row) > 1 for row in rows)
    mask = None
    if explicit_mask and (several or shared):
        seg = torch.where(seg < 0, torch.full_like(seg, width), seg)  # the tail: a unit of its own
        causal = torch.ones((width, width), dtype=torch.bool).tril()
        same_unit = seg[:, :, None] == seg[:, None, :]
        same_branch = (branch[:, :, None] == branch[:, None, :]) | (branch[:, None, :] == 0)
        mask = (causal & same_unit & same_branch).unsqueeze(1)
    items = [i for row in rows for u in row for i in unit_items(u)]
    flat = sorted({x for i in items for x in slots[i]})
    row_of = {x: k for k, x in enumerate(flat)}
    index: list[int] = []
    spans: list[tuple[int, int]] = []
    total = 0
    for i in items:
        index.extend(row_of[x] for x in slots[i])
        spans.append((total, total + lengths[i]))
        total += lengths[i]
    return PackedBatch(
        ids,
        pos,
        torch.tensor(flat, dtype=torch.long),
        torch.tensor(index, dtype=torch.long),
        items,
        spans,
        mask,
        several,
    )


def packed_logits(model, pb: PackedBatch, device: torch.device) -> torch.Tensor:
    """fp32 logits (U, V) of the real token slots ``pb.keep`` (the decoder under the ambient
    autocast).  Position ids and the mask are passed only where the layout needs them, so a
    batch of one datum per row runs exactly as a plain causal batch."""
    pos = pb.position_ids.to(device) if pb.restarts or pb.mask is not None else None
    mask = pb.mask.to(device) if pb.mask is not None else None
    n = pb.ids.numel()
    keep = None if len(pb.keep) == n else pb.keep.to(device)
    logits = fp32_head_logits(model, pb.ids.to(device), pos, keep, attention_mask=mask)
    return logits.reshape(-1, logits.shape[-1]) if keep is None else logits


@torch.no_grad()
def packing_supported(model, vocab_size: int, device: torch.device, *, explicit_mask: bool = True) -> bool:
    """True when ``model`` keeps packed sequences apart in the layout the engine will use: fp32
    logits of three sequences (5 tokens; 3 + 2 sharing the first 3 with an explicit mask, else
    3 and 2) packed into one row equal those of each sequence alone (within 1e-4 of the largest
    logit); False when they differ or the forward fails."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, vocab_size, (5,), generator=gen).tolist()
    b = torch.randint(0, vocab_size, (3,), generator=gen).tolist()
    c = b + torch.randint(0, vocab_size, (2,), generator=gen).tolist() if explicit_mask else b[:2]
    toks = [a, b, c]
    row: list[Unit] = [0, (3, [1, 2])] if explicit_mask else [0, 1, 2]
    pb = packed_batch([row], toks, explicit_mask=explicit_mask)
    try:
        with torch.autocast(device.type, enabled=False):
            logits = packed_logits(model, pb, device)
            packed = logits[pb.index.to(device)]
            alone = torch.cat([fp32_head_logits(model, torch.tensor([toks[i]], device=device))[0] for i in pb.items])
    except (RuntimeError, TypeError, ValueError):
        return False
    scale = float(alone.abs().max()) + 1.0
    return bool(torch.isfinite(packed).all()) and float((packed - alone).abs().max()) <= 1e-4 * scale
