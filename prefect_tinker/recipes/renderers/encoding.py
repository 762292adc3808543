"""Token encoding for renderers: markup versus untrusted text.

A renderer writes two kinds of text:

- **markup**, its own format strings (``<|im_start|>user\\n``, ``<think>\\n``, a tool preamble):
  special-token strings in it become their control tokens, as ``tokenizer.encode`` does;
- **content**, text from users, datasets, agents or the model (message content, reasoning,
  tool-call arguments, tool schemas): encoded as *text*, so that a string such as ``<|im_end|>``
  in it becomes ordinary tokens (``<``, ``|``, ``im``, ...) and can never forge a turn boundary.

For Hugging Face fast tokenizers the text encoding runs the tokenizer's own normalizer,
pre-tokenizer and BPE model with its added-token vocabulary removed (a copy of the backend
``tokenizers.Tokenizer``).  That is stricter than ``encode(..., split_special_tokens=True)``, which
still matches added tokens not flagged special -- e.g. Qwen3's ``<think>`` and ``<tool_call>``.
The copy is checked against ``tokenizer.encode`` on probe text when built; other tokenizers fall
back to ``encode(text, add_special_tokens=False, split_special_tokens=True)``.

:meth:`TextEncoder.pieces` encodes a run of markup and content pieces *jointly*, as the
tokenizer would encode their concatenation (byte-level BPE merges whitespace across a piece
boundary) except that special tokens are recognised only in markup; each token goes to the piece
holding its last character.  Added-token flags ``lstrip`` / ``rstrip`` / ``single_word`` are not
emulated (no chat tokenizer we know sets them on its control tokens).
"""

from __future__ import annotations

import bisect
import json
import re
import threading
from collections.abc import Sequence
from typing import Any, cast

__all__ = ["Piece", "Tag", "TextEncoder", "split_tags", "text_encoder"]

#: ``(text, is_markup)``: a run of text and whether special-token strings in it are control tokens.
Piece = tuple[str, bool]


class Tag(str):
    """A tag item of decoded output (``<think>``, ``<tool_call>``): a marker, as opposed to text.

    ``"".join(items)`` of a list of text and tag items gives the literal text back.
    """

    __slots__ = ()


def split_tags(text: str, tags: Sequence[str]) -> list[str]:
    """Split ``text`` at every occurrence of a string in ``tags``; those become :class:`Tag` items."""
    if not tags or not text:
        return [text] if text else []
    items: list[str] = []
    pos = 0
    for m in re.finditer("|".join(map(re.escape, sorted(tags, key=len, reverse=True))), text):
        if m.start() > pos:
            items.append(text[pos : m.start()])
        items.append(Tag(m.group()))
        pos = m.end()
    if pos < len(text):
        items.append(text[pos:])
    return items


_PROBES = ("Hello, world!\n\n  x = 1;\tdone.\r\n", "Ça va ? 日本語で 🙂 — 12345 x² \n\n\n  ")


def _added_tokens(tokenizer: Any) -> dict[str, int]:
    """``{text: id}`` of the tokenizer's added tokens that encode to exactly that one id."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    out: dict[str, int] = {}
    for tid, tok in dict(decoder).items():
        text = getattr(tok, "content", None) or str(tok)
        try:
            if text and list(tokenizer.encode(text, add_special_tokens=False)) == [int(tid)]:
                out[text] = int(tid)
        except Exception:  # exotic tokenizer: treat as having no added tokens
            return {}
    return out


def _plain_backend(tokenizer: Any) -> Any | None:
    """A copy of the fast tokenizer's backend without added tokens or post-processor, or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from tokenizers import Tokenizer

        spec = json.loads(backend.to_str())
        spec.update(added_tokens=[], post_processor=None, truncation=None, padding=None)
        plain = Tokenizer.from_str(json.dumps(spec))
        for probe in _PROBES:
            if plain.encode(probe, add_special_tokens=False).ids != list(
                tokenizer.encode(probe, add_special_tokens=False)
            ):
                return None
        return plain
    except Exception:
        return None


class TextEncoder:
    """Markup and text encodings for one tokenizer (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer, or any object with ``encode(text, add_special_tokens=False)``.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        #: ``{text: id}`` of added tokens (``<|im_start|>``, ``<think>``, ...).
        self.control_ids = _added_tokens(tokenizer)
        names = sorted(self.control_ids, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, names))) if names else None
        self._plain = _plain_backend(tokenizer)
        self._markup_cache: dict[str, list[int]] = {}
        self._text_cache: dict[str, list[int]] = {}

    @property
    def exact(self) -> bool:
        """True when text encoding ignores every added token (a fast tokenizer's backend copy)."""
        return self._plain is not None

    def markup(self, text: str) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=False)``: special-token strings are control tokens."""
        hit = self._markup_cache.get(text)
        if hit is None:
            hit = list(self.tokenizer.encode(text, add_special_tokens=False))
            if len(text) <= 64:
                self._markup_cache[text] = hit
        return list(hit)

    def text(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: no special or added token is matched."""
        if not text:
            return []
        hit = self._text_cache.get(text)
        if hit is not None:
            return list(hit)
        if self._plain is not None:
            ids = list(self._plain.encode(text, add_special_tokens=False).ids)
        else:
            try:
                ids = list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
            except TypeError:  # a tokenizer without that option (and, usually, without special tokens)
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if len(text) <= 64:
            self._text_cache[text] = ids
        return list(ids)

    def _atoms(self, pieces: Sequence[Piece]) -> list[tuple[int, str | int]]:
        """``(piece index, text chunk or control id)`` in order; control ids only from markup."""
        atoms: list[tuple[int, str | int]] = []
        for k, (text, markup) in enumerate(pieces):
            if not markup or self._pattern is None:
                if text:
                    atoms.append((k, text))
                continue
            pos = 0
            for m in self._pattern.finditer(text):
                if m.start() > pos:
                    atoms.append((k, text[pos : m.start()]))
                atoms.append((k, self.control_ids[m.group()]))
                pos = m.end()
            if pos < len(text):
                atoms.append((k, text[pos:]))
        return atoms

    def pieces(self, pieces: Sequence[Piece]) -> list[list[int]]:
        """Encode ``pieces`` jointly; returns one token list per piece (see the module docstring).

        Without a backend copy (slow or custom tokenizers) text chunks are encoded one by one.
        """
        out: list[list[int]] = [[] for _ in pieces]
        atoms = self._atoms(pieces)
        i = 0
        while i < len(atoms):
            k, atom = atoms[i]
            if isinstance(atom, int):
                out[k].append(atom)
                i += 1
                continue
            j = i
            while j < len(atoms) and isinstance(atoms[j][1], str):
                j += 1
            run = cast(list[tuple[int, str]], atoms[i:j])  # all text: the scan above stopped at the first id
            if self._plain is None or len(run) == 1:
                for k2, chunk in run:
                    out[k2].extend(self.text(chunk))
            else:
                text = "".join(chunk for _, chunk in run)
                ends = []
                acc = 0
                for _, chunk in run:
                    acc += len(chunk)
                    ends.append(acc)
                enc = self._plain.encode(text, add_special_tokens=False)
                for tid, (start, end) in zip(enc.ids, enc.offsets, strict=True):
                    last = max(end - 1, start)
                    out[run[min(bisect.bisect_right(ends, last), len(run) - 1)][0]].append(tid)
            i = j
        return out

    def tag_items(self, tokens: Sequence[int], tags: Sequence[str]) -> list[str]:
        """Decode sampled ``tokens`` into text items and :class:`Tag` items.

        A tag the tokenizer has as one added token is a :class:`Tag` only where that token was
        sampled (text spelling it stays text); a tag without its own token is recognised in the
        decoded text (a text format cannot tell the two apart).
        """
        ids = {self.control_ids[t]: t for t in tags if t in self.control_ids}
        literal = [t for t in tags if t not in self.control_ids]
        items: list[str] = []
        run: list[int] = []
        for tok in [*map(int, tokens), None]:
            if tok is None or tok in ids:
                if run:
                    items.extend(split_tags(self.tokenizer.decode(run, skip_special_tokens=False), literal))
                    run = []
                if tok is not None:
                    items.append(Tag(ids[tok]))
            else:
                run.append(tok)
        return items


_CACHE: dict[int, tuple[Any, int, TextEncoder]] = {}
_LOCK = threading.Lock()


def text_encoder(tokenizer: Any) -> TextEncoder:
    """The :class:`TextEncoder` of ``tokenizer``, shared per tokenizer object (rebuilt after ``add_tokens``)."""
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else -1
    with _LOCK:
        hit = _CACHE.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer and hit[1] == size:
            return hit[2]
    enc = TextEncoder(tokenizer)
    with _LOCK:
        if len(_CACHE) >= 16:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[id(tokenizer)] = (tokenizer, size, enc)
    return enc
