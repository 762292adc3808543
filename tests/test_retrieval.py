"""BM25 retrieval over a JSONL collection: scores equal an independent Lucene-BM25 computation, and
questions of the Dolly slice find their own context passage (corpus built at test time)."""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import pytest

pytest.importorskip("bm25s", reason="the retrieval tool needs the 'tools' extra (bm25s)")

from prefect_tinker.recipes.tools import BM25Index, Toolset, load_documents  # noqa: E402
from tests.data_files import data_file  # noqa: E402

K1, B = 1.5, 0.75


def _dolly(tmp_path):
    """(corpus.jsonl path, [(question, id of its context)]) from the Dolly records with a context."""
    records = [json.loads(line) for line in data_file("sft/dolly_slice_messages.jsonl").open()]
    ids, questions = {}, []
    for rec in records:
        if rec["context"].strip():
            doc_id = ids.setdefault(rec["context"], f"dolly-{len(ids)}")
            questions.append((rec["instruction"], doc_id))
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for t, i in ids.items()))
    return path, questions


class _ReferenceBM25:
    """Lucene BM25 written from the formula (Kamphuis et al., ECIR 2020), same tokenisation."""

    def __init__(self, docs, stopwords):
        self.stop = set(stopwords)
        self.ids = [d["id"] for d in docs]
        self.tf = [Counter(self._tokens(d["text"])) for d in docs]
        self.len = [sum(c.values()) for c in self.tf]
        self.avg = sum(self.len) / len(self.len)
        df = Counter(t for c in self.tf for t in c)
        n = len(docs)
        self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def _tokens(self, text):
        return [t for t in re.findall(r"(?u)\b\w\w+\b", text.lower()) if t not in self.stop]

    def scores(self, query):
        out = {}
        for doc_id, tf, dl in zip(self.ids, self.tf, self.len, strict=True):
            s = 0.0
            for t in self._tokens(query):
                if t in tf:
                    s += self.idf[t] * tf[t] / (tf[t] + K1 * (1 - B + B * dl / self.avg))
            out[doc_id] = s
        return out


def test_scores_and_ranking_equal_the_reference(tmp_path):
    from bm25s.stopwords import STOPWORDS_EN

    path, questions = _dolly(tmp_path)
    docs = load_documents(path)
    index = BM25Index.from_jsonl(path, k1=K1, b=B)
    ref = _ReferenceBM25(docs, STOPWORDS_EN)
    assert len(docs) == 47 and len(questions) == 47
    for question, _ in questions:
        want = ref.scores(question)
        hits = index.search(question, k=5)
        assert hits, question
        ranked = sorted((s for s in want.values() if s > 0), reverse=True)[:5]
        assert [h.rank for h in hits] == list(range(1, len(hits) + 1))
        for hit, expected in zip(hits, ranked, strict=True):
            assert hit.score == pytest.approx(want[hit.id], rel=1e-4, abs=1e-5)  # float32 in bm25s
            assert hit.score == pytest.approx(expected, rel=1e-4, abs=1e-5)  # same order as the reference


def test_questions_find_their_own_context(tmp_path):
    from bm25s.stopwords import STOPWORDS_EN

    path, questions = _dolly(tmp_path)
    index = BM25Index.from_jsonl(path)
    ref = _ReferenceBM25(load_documents(path), STOPWORDS_EN)
    for k in (1, 5):
        found = sum(any(h.id == own for h in index.search(q, k)) for q, own in questions)
        expected = 0  # independent count over the reference's top k
        for q, own in questions:
            scores = ref.scores(q)
            top = sorted(scores, key=lambda i: -scores[i])[:k]
            expected += own in top and scores[own] > 0
        assert found == expected, k
        assert found / len(questions) >= (0.85 if k == 1 else 0.9), (k, found)


def test_search_tool_returns_passages_as_text(tmp_path):
    path, questions = _dolly(tmp_path)
    index = BM25Index.from_jsonl(path)
    search = index.as_tool(k=2, max_passage_chars=80)
    schema = search.schema["function"]
    assert schema["name"] == "search" and schema["parameters"]["required"] == ["query"]
    assert "query" in schema["parameters"]["properties"]
    question, own = questions[0]
    text = Toolset([search]).call({"name": "search", "arguments": json.dumps({"query": question})}).text
    first = index.search(question, 2)[0]
    assert text.startswith(f"[1] (id: {first.id}) {first.text[:80]}")
    assert "\n\n[2] (id: " in text
    assert search.call({"query": "zzzz qqqq"}).text == "No document matches the query."
    assert search.call({"query": "the of and"}).text == "No document matches the query."  # stop words only
    assert index.search(question, k=0) == [] and len(index.search(question, k=1000)) <= 47


def test_load_documents_names_bad_lines(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"id": 1, "text": "a"}\n{"id": "1", "text": "b"}\n')
    with pytest.raises(ValueError, match=r"docs.jsonl:2: id '1' repeats line 1"):
        load_documents(path)
    path.write_text('{"id": "a"}\n')
    with pytest.raises(ValueError, match=r"docs.jsonl:1: field 'text' must be a string"):
        load_documents(path)
    path.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"docs.jsonl:1: field 'id'"):
        load_documents(path)
    path.write_text("[1]\n")
    with pytest.raises(ValueError, match=r"docs.jsonl:1: expected an object"):
        load_documents(path)
    path.write_text("")
    with pytest.raises(ValueError, match="empty"):
        BM25Index.from_jsonl(path)
