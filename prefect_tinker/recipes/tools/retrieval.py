"""A retrieval tool: BM25 search over a document collection given as JSONL ``{id, text}``.

Scoring is Okapi BM25 (Robertson & Zaragoza, "The Probabilistic Relevance Framework: BM25 and
Beyond", 2009) in the Lucene variant (idf ``log(1 + (N - df + 0.5) / (df + 0.5))``, term part
``tf / (tf + k1 (1 - b + b |d| / avgdl))``; Kamphuis et al., ECIR 2020), computed by the ``bm25s``
library (PyPI, optional extra ``tools``).  Text is lowercased and split into words of 2+ word
characters; English stop words are dropped.  Documents with score 0 (no query word) are never
returned.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefect_tinker.recipes.tools.core import Tool, tool

__all__ = ["BM25Index", "Passage", "load_documents"]


@dataclass(frozen=True)
class Passage:
    """One search hit: the document's ``id`` and ``text``, its BM25 ``score`` and 1-based ``rank``."""

    id: str
    text: str
    score: float
    rank: int


def load_documents(path: str | Path) -> list[dict[str, str]]:
    """Read ``{id, text}`` records from JSONL (``.jsonl`` or ``.jsonl.gz``); ids become strings.

    Raises:
        ValueError: a line is not a JSON object, ``id`` is missing or repeated, or ``text`` is not a
            string (the message names the file and line).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    docs: list[dict[str, str]] = []
    seen: dict[str, int] = {}
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected an object with 'id' and 'text'")
            if not isinstance(rec.get("id"), (str, int)) or isinstance(rec.get("id"), bool):
                raise ValueError(f"{path}:{lineno}: field 'id' must be a string or integer, got {rec.get('id')!r:.60}")
            if not isinstance(rec.get("text"), str):
                raise ValueError(f"{path}:{lineno}: field 'text' must be a string, got {rec.get('text')!r:.60}")
            doc_id = str(rec["id"])
            if doc_id in seen:
                raise ValueError(f"{path}:{lineno}: id {doc_id!r} repeats line {seen[doc_id]}")
            seen[doc_id] = lineno
            docs.append({"id": doc_id, "text": rec["text"]})
    return docs


class BM25Index:
    """A BM25 index over documents ``[{"id", "text"}, ...]`` (bm25s, Lucene variant).

    Args:
        documents: the collection; ids must be unique.
        k1, b: BM25 term-frequency saturation and length normalisation (Lucene defaults 1.5, 0.75
            here as in bm25s; Robertson's 1.2 is also common).
        stopwords: ``"en"`` (bm25s's English list) or None.

    Raises:
        ImportError: bm25s is not installed (``pip install 'prefect-tinker[tools]'``).
        ValueError: the collection is empty or ids repeat.
    """

    def __init__(
        self, documents: Sequence[Mapping[str, str]], *, k1: float = 1.5, b: float = 0.75, stopwords: str | None = "en"
    ):
        try:
            import bm25s
        except ImportError:
            raise ImportError("the retrieval tool needs bm25s: pip install 'prefect-tinker[tools]'") from None
        self._bm25s = bm25s
        self.ids = [str(d["id"]) for d in documents]
        self.texts = [str(d["text"]) for d in documents]
        if not self.ids:
            raise ValueError("BM25Index: the document collection is empty")
        if len(set(self.ids)) != len(self.ids):
            raise ValueError("BM25Index: document ids repeat")
        self.stopwords = stopwords
        self._retriever = bm25s.BM25(k1=k1, b=b, method="lucene")
        self._retriever.index(self._tokenize(self.texts), show_progress=False)

    @classmethod
    def from_jsonl(cls, path: str | Path, **kwargs) -> BM25Index:
        """An index over the ``{id, text}`` records of a JSONL file (see :func:`load_documents`)."""
        return cls(load_documents(path), **kwargs)

    def _tokenize(self, texts: Sequence[str]) -> list[list[str]]:
        return self._bm25s.tokenize(list(texts), stopwords=self.stopwords, return_ids=False, show_progress=False)

    def search(self, query: str, k: int = 3) -> list[Passage]:
        """The top ``k`` documents for ``query`` by BM25 score (highest first; zero scores left out)."""
        k = max(0, min(int(k), len(self.ids)))
        tokens = self._tokenize([query])
        if k == 0 or not tokens[0]:
            return []
        docs, scores = self._retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        hits = [(int(i), float(s)) for i, s in zip(docs[0], scores[0], strict=True) if float(s) > 0.0]
        return [Passage(self.ids[i], self.texts[i], s, rank) for rank, (i, s) in enumerate(hits, 1)]

    def as_tool(self, k: int = 3, *, name: str = "search", max_passage_chars: int = 1500) -> Tool:
        """A :class:`~prefect_tinker.recipes.tools.Tool` ``name(query: str)`` returning the top ``k``
        passages as text (``[1] (id: ...) passage``), each cut to ``max_passage_chars``."""

        def search(query: str) -> str:
            """Search the document collection and return the most relevant passages.

            Args:
                query: keywords or a question describing what to look for.
            """
            hits = self.search(query, k)
            if not hits:
                return "No document matches the query."
            return "\n\n".join(f"[{h.rank}] (id: {h.id}) {h.text[:max_passage_chars]}" for h in hits)

        return tool(search, name=name, max_result_chars=max(4000, k * (max_passage_chars + 40)))
