"""Supervised dataset builder: sources -> interleaved conversations -> split -> epochs of datum batches.

:class:`SupervisedDataset` ties the pieces together; each is usable alone:

- :func:`interleave` mixes several sources with sampling weights (seeded), stopping when the first
  source runs out (``first_exhausted``: proportions follow the weights) or when every source has
  been seen once, restarting the shorter ones (``all_exhausted``: oversampling) -- the two
  strategies of ``datasets.interleave_datasets`` -- or drawing until every item of every source
  came exactly once (``each_once``: weights set the mixing order only);
- :func:`shuffle_buffer` shuffles a stream through a bounded buffer (streamed sources);
- :func:`epoch_permutation` is the order of epoch ``e``: a fresh seeded permutation per epoch;
- :func:`batch_at` is the example indices of the batch at a training step (a pure function of
  the step, so a resumed run sees the same batches);
- :func:`render_example` renders one conversation and applies ``max_length`` (truncate, skip or
  error), keeping tokens and weights aligned;
- :func:`batch_datums` cuts datums into batches.

Inputs are shifted against targets by :func:`prefect_tinker.recipes.datasets.datum_from_example`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import numpy as np
import tinker

from prefect_tinker.recipes.data_reading import OnError, SkipStats, SourceSpec, iter_conversations
from prefect_tinker.recipes.data_sources import Conversation, DatasetFormatError
from prefect_tinker.recipes.datasets import datum_from_example, split_conversations
from prefect_tinker.recipes.media import MediaError, safe_cut
from prefect_tinker.recipes.renderers.base import Renderer, RendererError

__all__ = [
    "ExampleTooLongError",
    "OnTooLong",
    "SupervisedDataset",
    "batch_at",
    "batch_datums",
    "epoch_permutation",
    "interleave",
    "render_example",
    "shuffle_buffer",
]

T = TypeVar("T")
OnTooLong = Literal["truncate", "truncate_keep", "skip", "error"]
Stopping = Literal["first_exhausted", "all_exhausted", "each_once"]


def interleave(
    sources: Sequence[Iterable[T] | Callable[[], Iterable[T]]],
    weights: Sequence[float] | None = None,
    *,
    seed: int = 0,
    stopping: Stopping = "first_exhausted",
) -> Iterator[T]:
    """Items drawn from ``sources`` at random with probability proportional to ``weights``.

    Args:
        sources: lists, iterables, or zero-argument callables returning a fresh iterable (needed to
            restart a source under ``all_exhausted``; a plain iterator cannot restart).
        weights: positive weights, one per source (default: equal).
        seed: seed of the draws (same seed, same order).
        stopping: ``"first_exhausted"``, ``"all_exhausted"`` or ``"each_once"`` (see the module
            docstring).

    Raises:
        ValueError: weights of the wrong length or not positive, unknown ``stopping``.
    """
    n = len(sources)
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or not (w > 0).all():
        raise ValueError(f"need one positive weight per source ({n}), got {list(w)}")
    if stopping not in ("first_exhausted", "all_exhausted", "each_once"):
        raise ValueError(f"stopping must be 'first_exhausted', 'all_exhausted' or 'each_once', got {stopping!r}")

    def fresh(i: int) -> Iterator[T] | None:
        src = sources[i]
        if callable(src):
            return iter(src())
        if isinstance(src, Iterator):
            return src if not done[i] else None
        return iter(src)

    done = [False] * n
    its = [fresh(i) for i in range(n)]
    rng = np.random.default_rng(seed)
    p = w / w.sum()
    while True:
        i = int(rng.choice(n, p=p))
        it = its[i]
        item = next(it, _END) if it is not None else _END
        if item is _END:
            done[i] = True
            if stopping == "first_exhausted" or all(done):
                return
            it = its[i] = fresh(i) if stopping == "all_exhausted" else None
            item = next(it, _END) if it is not None else _END
            if item is _END:  # empty or not restartable: drop it from the draw
                p[i] = 0.0
                if p.sum() == 0:
                    return
                p = p / p.sum()
                continue
        yield item


_END: Any = object()


def shuffle_buffer(items: Iterable[T], buffer_size: int, seed: int = 0) -> Iterator[T]:
    """Shuffle a stream through a buffer of ``buffer_size`` items (``buffer_size <= 1``: no shuffle).

    Each incoming item replaces a random buffered one, which is emitted; the rest drain in random
    order.  Memory is O(buffer_size); a buffer as large as the stream is a full shuffle.
    """
    if buffer_size <= 1:
        yield from items
        return
    rng = np.random.default_rng(seed)
    buf: list[T] = []
    for item in items:
        if len(buf) < buffer_size:
            buf.append(item)
            continue
        j = int(rng.integers(buffer_size))
        buf[j], item = item, buf[j]
        yield item
    for j in rng.permutation(len(buf)):
        yield buf[int(j)]


class ExampleTooLongError(DatasetFormatError):
    """An example is longer than ``max_length`` and ``on_too_long="error"`` (names file:line and field)."""


DataOrder = Literal["seeded", "cookbook"]


def epoch_permutation(n: int, epoch: int, seed: int = 0, order: DataOrder = "seeded") -> np.ndarray:
    """Order of ``n`` items in epoch ``epoch`` (int64, shape (n,)): ``numpy.random.default_rng``
    seeded by ``(seed, epoch)``; with ``order="cookbook"`` by ``epoch`` alone, as tinker-cookbook
    0.6.1's ``SupervisedDatasetFromHFDataset.set_epoch(seed=epoch)`` (Hugging Face
    ``Dataset.shuffle(seed=epoch)``) orders its training rows."""
    return np.random.default_rng(epoch if order == "cookbook" else [seed, epoch]).permutation(n)


def batch_at(n: int, batch_size: int, seed: int, step: int, order: DataOrder = "seeded") -> list[int]:
    """Example indices (``batch_size`` of them) of the batch at training step ``step``: epoch
    ``step // (n // batch_size)`` in :func:`epoch_permutation` order (``order``), cut into
    batches, the last incomplete batch of each epoch dropped.

    Raises:
        ValueError: ``n < batch_size`` (not even one batch).
    """
    per_epoch = n // batch_size
    if per_epoch == 0:
        raise ValueError(f"batch_size={batch_size} is larger than the training set ({n} examples)")
    epoch, index = divmod(step, per_epoch)
    perm = epoch_permutation(n, epoch, seed, order)
    return [int(i) for i in perm[index * batch_size : (index + 1) * batch_size]]


def render_example(
    renderer: Renderer,
    conversation: Conversation,
    *,
    train_on_what: str = "all_assistant_messages",
    max_length: int | None = None,
    on_too_long: OnTooLong = "truncate",
) -> tuple[list[int], np.ndarray] | None:
    """Render one conversation to ``(tokens (N,), weights float32 (N,))`` with ``N <= max_length``;
    media are :class:`~prefect_tinker.recipes.media.MediaToken` runs, and truncation ends before
    a media item it would cut (the item is dropped whole).

    Returns None when the example must be skipped: longer than ``max_length`` with
    ``on_too_long="skip"``, or no trained target token left after truncation (``"truncate"``;
    ``"truncate_keep"`` keeps it, with all weights 0, as tinker-cookbook 0.6.1's
    ``conversation_to_datum`` does).

    Raises:
        DatasetFormatError: the renderer rejects the conversation (no trainable token, bad
            message); :class:`ExampleTooLongError` (a subclass) when the example is too long with
            ``on_too_long="error"``; the message names the conversation's ``file:line`` and field.
    """
    where = f"{conversation.source or 'conversation'}: field {conversation.field!r}"
    try:
        tools = conversation.metadata.get("tools") if renderer.supports_tools else None
        # media as MediaToken runs (by reference)
        tokens, weights = renderer.build_supervised_sequence(conversation.messages, train_on_what, tools=tools or None)
    except (RendererError, MediaError) as exc:
        raise DatasetFormatError(f"{where}: {exc}") from exc
    if max_length is None or len(tokens) <= max_length:
        return tokens, weights
    if on_too_long == "error":
        raise ExampleTooLongError(
            f"{where}: example has {len(tokens)} tokens, more than max_length={max_length} "
            "(use on_too_long='truncate' or 'skip')"
        )
    if on_too_long == "skip":
        return None
    if on_too_long not in ("truncate", "truncate_keep"):
        raise ValueError(f"on_too_long must be 'truncate', 'truncate_keep', 'skip' or 'error', got {on_too_long!r}")
    cut = safe_cut(tokens, max_length)  # a media item is dropped whole, never cut
    tokens, weights = tokens[:cut], weights[:cut]
    return (tokens, weights) if on_too_long == "truncate_keep" or weights[1:].any() else None


def batch_datums(
    datums: Sequence[tinker.Datum], batch_size: int, *, drop_last: bool = False
) -> list[list[tinker.Datum]]:
    """Consecutive batches of ``batch_size`` datums (the last one shorter unless ``drop_last``)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out = [list(datums[i : i + batch_size]) for i in range(0, len(datums), batch_size)]
    return out[:-1] if drop_last and out and len(out[-1]) < batch_size else out


class SupervisedDataset:
    """Batches of ``tinker.Datum`` for supervised training, from one or more sources.

    Args:
        sources: :class:`~prefect_tinker.recipes.data_reading.SourceSpec` s (or paths / dataset ids) with weights.
        renderer: a :class:`prefect_tinker.recipes.renderers.Renderer`.
        batch_size: datums per batch.
        max_length: tokens per example at most (None: no limit).
        train_on_what: passed to the renderer.
        on_too_long: ``"truncate"`` (keep the first ``max_length`` tokens and their weights),
            ``"skip"`` (counted) or ``"error"``.
        on_error: bad records and conversations the renderer rejects: ``"raise"`` or ``"skip"``
            (counted in :attr:`stats`).
        test_size: held-out conversations: a count, or a fraction (not for streamed sources, where
            the first ``test_size`` conversations of the stream are held out).
        seed: seeds interleaving, the split, and each epoch's shuffle.
        data_order: ``"seeded"`` (each epoch permuted by ``(seed, epoch)``, the split keeping the
            source order) or ``"cookbook"`` (tinker-cookbook 0.6.1's: the records permuted by
            ``seed``, the first ``test_size`` held out, epoch ``e`` permuted by ``e``; see
            :func:`epoch_permutation` and :func:`~prefect_tinker.recipes.datasets.split_conversations`).
        stopping: interleaving strategy (see :func:`interleave`).
        shuffle_buffer_size: buffer of the per-epoch shuffle of streamed sources.
        drop_last: drop a final short batch.

    In memory (no streamed source), sources are read and rendered once; epoch ``e`` is the
    datums in :func:`epoch_permutation` order.  With a streamed source, every epoch re-reads the
    sources, shuffling through a buffer seeded by ``(seed, epoch)`` (and :attr:`stats` counts a
    skipped record again each time it is read).
    """

    def __init__(
        self,
        sources: Sequence[SourceSpec | str],
        renderer: Any,
        *,
        batch_size: int,
        max_length: int | None = None,
        train_on_what: str = "all_assistant_messages",
        on_too_long: OnTooLong = "truncate",
        on_error: OnError = "raise",
        test_size: int | float = 0,
        seed: int = 0,
        data_order: DataOrder = "seeded",
        stopping: Stopping = "first_exhausted",
        shuffle_buffer_size: int = 10_000,
        drop_last: bool = False,
    ):
        if not sources:
            raise ValueError("at least one source is needed")
        self.specs = [SourceSpec.coerce(s) for s in sources]
        self.renderer, self.batch_size, self.max_length = renderer, batch_size, max_length
        self.train_on_what, self.on_too_long, self.on_error = train_on_what, on_too_long, on_error
        self.test_size, self.seed, self.stopping, self.data_order = test_size, seed, stopping, data_order
        self.shuffle_buffer_size, self.drop_last = shuffle_buffer_size, drop_last
        self.streaming = any(s.streaming for s in self.specs)
        if self.streaming and not (isinstance(test_size, int) and not isinstance(test_size, bool)):
            raise ValueError(f"with streamed sources test_size must be a count, got {test_size!r}")
        self.stats = SkipStats()
        self._train: list[tuple[list[int], np.ndarray]] | None = None  # rendered (tokens, weights)
        self._test: list[tuple[list[int], np.ndarray]] | None = None

    # ---- conversations ----------------------------------------------------------------
    def _source_iter(self, spec: SourceSpec) -> Callable[[], Iterator[Conversation]]:
        return lambda: iter_conversations(spec, on_error=self.on_error, stats=self.stats)

    def conversations(self) -> Iterator[Conversation]:
        """All sources interleaved by weight (seeded)."""
        if len(self.specs) == 1:
            return self._source_iter(self.specs[0])()
        srcs: list[Any] = [self._source_iter(s) if s.streaming else list(self._source_iter(s)()) for s in self.specs]
        return interleave(srcs, [s.weight for s in self.specs], seed=self.seed, stopping=self.stopping)

    # ---- rendering --------------------------------------------------------------------
    def _example(self, conv: Conversation) -> tuple[list[int], np.ndarray] | None:
        """``(tokens (N,), weights (N,))`` of one conversation, or None when it is skipped (counted)."""
        try:
            out = render_example(
                self.renderer,
                conv,
                train_on_what=self.train_on_what,
                max_length=self.max_length,
                on_too_long=self.on_too_long,
            )
        except DatasetFormatError as exc:
            if self.on_error == "raise" or isinstance(exc, ExampleTooLongError):
                raise
            self.stats.skip("render_error", str(exc))
            return None
        if out is None:
            self.stats.skip(
                "too_long",
                f"{conv.source}: longer than max_length={self.max_length} "
                f"(on_too_long={self.on_too_long!r}) or nothing trained within it",
            )
            return None
        problem = (
            "an example needs at least 2 tokens"
            if len(out[0]) < 2
            else "no trained target token (only the first token has weight)"
            if not np.asarray(out[1])[1:].any() and self.on_too_long != "truncate_keep"
            else None
        )
        if problem:  # nothing to predict
            message = f"{conv.source}: field {conv.field!r}: {problem}"
            if self.on_error == "raise":
                raise DatasetFormatError(message)
            self.stats.skip("render_error", message)
            return None
        return out

    def _datum(self, conv: Conversation) -> tinker.Datum | None:
        out = self._example(conv)
        return None if out is None else datum_from_example(out[0], out[1])

    def _render_all(self, convs: Iterable[Conversation]) -> list[tuple[list[int], np.ndarray]]:
        return [e for e in map(self._example, convs) if e is not None]

    def _load(self) -> None:
        if self._train is not None:
            return
        if self.streaming:
            head = list(itertools.islice(self.conversations(), int(self.test_size)))
            self._test, self._train = self._render_all(head), []
            return
        convs = list(self.conversations())
        if not convs:
            raise DatasetFormatError(
                f"no conversations in {', '.join(s.path for s in self.specs)} ({self.stats.summary()})"
            )
        train, test = split_conversations(convs, self.test_size, seed=self.seed, order=self.data_order)
        self._train, self._test = self._render_all(train), self._render_all(test)
        if not self._train:
            raise DatasetFormatError(f"no training example left ({self.stats.summary()})")

    def train_examples(self) -> list[tuple[list[int], np.ndarray]]:
        """Rendered training examples ``(tokens (N,), weights float32 (N,))`` in source order
        (in-memory datasets only; rendered once)."""
        if self.streaming:
            raise TypeError("a streamed dataset has no in-memory list of examples; iterate batches()")
        self._load()
        return list(self._train or [])

    def test_examples(self) -> list[tuple[list[int], np.ndarray]]:
        """Rendered held-out examples ``(tokens, weights)`` (rendered once)."""
        self._load()
        return list(self._test or [])

    @property
    def num_train(self) -> int:
        """Training datums per epoch (in-memory datasets only)."""
        if self.streaming:
            raise TypeError("the size of a streamed dataset is unknown before reading it")
        self._load()
        return len(self._train or [])

    def num_batches(self) -> int:
        """Batches per epoch (in-memory datasets only)."""
        n = self.num_train
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def batches(self, epoch: int = 0) -> Iterator[list[tinker.Datum]]:
        """The batches of epoch ``epoch``: a reshuffled order each epoch (seeded)."""
        self._load()
        if not self.streaming:
            train = self._train or []
            order = epoch_permutation(len(train), epoch, self.seed, self.data_order)
            datums = [datum_from_example(*train[i]) for i in order]
            yield from batch_datums(datums, self.batch_size, drop_last=self.drop_last)
            return
        convs = itertools.islice(self.conversations(), int(self.test_size), None)
        rng_seed = int(np.random.default_rng([self.seed, epoch]).integers(2**31))
        batch: list[tinker.Datum] = []
        for conv in shuffle_buffer(convs, self.shuffle_buffer_size, rng_seed):
            d = self._datum(conv)
            if d is not None:
                batch.append(d)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch
