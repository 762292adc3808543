"""``prefect-tinker show-example``: print rendered examples with their trained tokens highlighted.

Shows what the model is trained on: each example is rendered by the chosen renderer, decoded in
runs of equal weight, and the trained runs are highlighted -- in colour (ANSI, green) when writing
to a terminal, between ``[[`` and ``]]`` otherwise (``--color always|never`` overrides).  A footer
gives the token count, the trained count and whether ``--max-length`` cut the example.

Example::

    prefect-tinker show-example data.jsonl.gz --format hh --field text=chosen \\
        --tokenizer ../shared/data/tokenizer/smollm2 --renderer smollm2 --index 3 --count 2

``--tokenizer`` is a local tokenizer directory, ``tiny`` / ``smollm2`` (the local server's model
presets, built or exported on first use under ``--cache-dir``), or a Hugging Face id already in the
local cache.  The parser is registered in ``cli/main.py`` through :func:`add_parser`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from prefect_tinker.recipes.tokenizers import resolve_tokenizer

__all__ = ["add_parser", "format_example", "main", "run"]

_GREEN, _DIM, _RESET = "\x1b[1;32m", "\x1b[2m", "\x1b[0m"
_OPEN, _CLOSE = "[[", "]]"


def _runs(tokens: Sequence[int], weights: Iterable[float]) -> list[tuple[list[int], bool]]:
    out: list[tuple[list[int], bool]] = []
    for tok, w in zip(tokens, weights, strict=True):
        trained = float(w) > 0
        if out and out[-1][1] == trained:
            out[-1][0].append(int(tok))
        else:
            out.append(([int(tok)], trained))
    return out


def format_example(tokenizer: Any, tokens: Sequence[int], weights: Iterable[float], *, color: bool) -> str:
    """The decoded example with trained runs highlighted (ANSI green, or ``[[...]]`` brackets).

    Args:
        tokens: token ids, shape (N,).
        weights: per-token weights, shape (N,) (> 0 = trained).
        color: ANSI colour instead of brackets.
    """
    parts = []
    for run, trained in _runs(tokens, weights):
        text = tokenizer.decode(run, skip_special_tokens=False)
        if trained:
            parts.append(f"{_GREEN}{text}{_RESET}" if color else f"{_OPEN}{text}{_CLOSE}")
        else:
            parts.append(text)
    return "".join(parts)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``show-example`` subcommand to an argparse ``subparsers`` object (sets ``func``)."""
    p = subparsers.add_parser("show-example", help="print rendered examples with the trained tokens highlighted")
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from prefect_tinker.recipes.data_sources import converter_names
    from prefect_tinker.recipes.renderers import TRAIN_ON_CHOICES, renderer_names

    p.add_argument("dataset", help="JSONL(.gz) file, local dataset file/dir, builtin:example_chat, or HF dataset id")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory, 'tiny', 'smollm2', or a cached HF id")
    p.add_argument("--renderer", default="auto", help=f"auto or one of: {', '.join(renderer_names())}")
    p.add_argument("--train-on-what", default="all_assistant_messages", choices=TRAIN_ON_CHOICES)
    p.add_argument(
        "--special-tokens-in-content",
        action="store_true",
        help="let special-token strings in message content become control tokens (default: text)",
    )
    p.add_argument("--format", default="messages", help=f"record format: {', '.join(converter_names())}")
    p.add_argument("--field", action="append", default=[], metavar="NAME=PATH", help="field mapping (repeatable)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", help="converter option (repeatable)")
    p.add_argument("--split", default="train")
    p.add_argument("--index", type=int, default=0, help="first example to show (0-based)")
    p.add_argument("--count", type=int, default=1, help="number of examples to show")
    p.add_argument("--max-length", type=int, default=None, help="show the cut a max_length would make")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    p.add_argument("--ids", action="store_true", help="also list token ids, weights and pieces")
    p.add_argument("--cache-dir", default=None, help="root for the tiny/smollm2 presets (default $PREFECT_TINKER_HOME)")


def _pairs(items: Sequence[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--{what} expects NAME=VALUE, got {item!r}")
        out[key] = value
    return out


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``show-example`` for parsed ``args``; returns the exit status (2 for bad input)."""
    from prefect_tinker.recipes.data_reading import SourceSpec, iter_conversations
    from prefect_tinker.recipes.data_sources import DatasetFormatError
    from prefect_tinker.recipes.media import safe_cut
    from prefect_tinker.recipes.renderers import RendererError, get_renderer

    out = out or sys.stdout
    color = args.color == "always" or (args.color == "auto" and out.isatty() and not os.environ.get("NO_COLOR"))
    try:
        spec = SourceSpec(
            path=args.dataset,
            format=args.format,
            fields=_pairs(args.field, "field"),
            options=_pairs(args.option, "option"),
            split=args.split,
        )
        tok = resolve_tokenizer(args.tokenizer, args.cache_dir)
        renderer = get_renderer(args.renderer, tok, special_tokens_in_content=args.special_tokens_in_content)
        convs = list(itertools.islice(iter_conversations(spec), args.index, args.index + max(args.count, 1)))
        if not convs:
            raise ValueError(f"{args.dataset}: no example at index {args.index}")
        for conv in convs:
            # media (images, audio) show as their placeholder tokens; truncation never cuts one
            tokens, weights = renderer.build_supervised_sequence(conv.messages, args.train_on_what)
            n = len(tokens)
            cut = args.max_length is not None and n > args.max_length
            if cut:
                keep = safe_cut(tokens, args.max_length)
                tokens, weights = tokens[:keep], weights[:keep]
            legend = f"{_GREEN}trained{_RESET}" if color else f"{_OPEN}trained{_CLOSE}"
            head = (
                f"== {conv.source} (field {conv.field!r}) | renderer {renderer.name} | {args.train_on_what} | {legend}"
            )
            print(_DIM + head + _RESET if color else head, file=out)
            print(format_example(tok, tokens, weights, color=color), file=out)
            trained = int((weights > 0).sum())
            foot = f"-- {len(tokens)} tokens, {trained} trained ({100.0 * trained / max(len(tokens), 1):.1f}%)"
            if cut:
                foot += f", cut from {n} to max_length={args.max_length}"
            print(foot, file=out)
            if args.ids:
                for i, (t, w) in enumerate(zip(tokens, weights, strict=True)):
                    print(f"{i:6d} {t:8d} {float(w):4.1f} {tok.decode([t], skip_special_tokens=False)!r}", file=out)
    except (DatasetFormatError, RendererError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m prefect_tinker.cli.show DATASET --tokenizer T ...`` (same options as
    ``prefect-tinker show-example``)."""
    p = argparse.ArgumentParser(prog="prefect-tinker show-example", description=__doc__.split("\n")[0])
    _add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
