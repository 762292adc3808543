"""The teacher's side of distillation, as Prefect tasks.

- :func:`check_teacher`: before training, open the teacher (a base model or a ``tinker://``
  checkpoint, on any backend) and refuse what cannot work: a checkpoint the server does not
  have, a tokenizer other than the student's, a top-K the server does not return.
- :data:`teacher_logprobs`: the teacher's logprobs of whole sequences (``compute_logprobs``),
  the cached ``reference-logprobs`` task under its own name: keyed by (teacher weights, sequences).
- :func:`teacher_topk`: the teacher's top-K logprobs at every target of each sequence, cached by
  (teacher weights, K, sequences).
- :func:`teacher_samples`: the teacher's replies to prompts written as a JSONL chat dataset in the
  store (``<root>/datasets/teacher-samples/<key>.jsonl``), a Prefect asset with the teacher's
  weights and the prompt data upstream; cached by (teacher, its renderer and view, the prompts,
  the sampling settings, the store), so a resumed run never asks the teacher twice.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tinker
from prefect import task
from prefect.assets import materialize
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from prefect_tinker.recipes.distill.align import tokenizer_fingerprint
from prefect_tinker.recipes.distill.prompts import PromptRecord, TeacherView
from prefect_tinker.tasks.clients import sampling_client
from prefect_tinker.tasks.policies import RETRY_OPTIONS, cached_options, is_transient
from prefect_tinker.tasks.rollouts import reference_logprobs

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = [
    "TeacherError",
    "TeacherSamples",
    "check_teacher",
    "read_samples",
    "teacher_asset",
    "teacher_logprobs",
    "teacher_samples",
    "teacher_topk",
    "weights_tokenizer",
]


class TeacherError(ValueError):
    """The teacher cannot serve this run (the message names the teacher and what is wrong)."""


#: Teacher logprobs of whole sequences: (L-1,) per sequence (L,), cached by (teacher, sequences).
teacher_logprobs = reference_logprobs.with_options(name="teacher-logprobs")


def weights_tokenizer(credentials: TinkerCredentials, weights: str) -> Any:
    """The tokenizer of ``weights`` (``base:<model>`` or ``tinker://...``) on ``credentials``'
    backend. A checkpoint's sampler names its base model as the server announces it; a base model
    on the embedded local server is named by the server only through a training client's
    ``get_info`` (its presets have no hub id), so a frozen rank-1 client reads it there -- also for
    a checkpoint whose base model the SDK cannot resolve (a local preset on a served
    ``tinker_local``, reached by ``base_url``).

    Raises:
        OSError: the tokenizer cannot be loaded. The SDK's errors for unknown weights.
    """
    from prefect_tinker.tasks.clients import reference_client, tokenizer

    def from_server(base: str) -> Any:
        return tokenizer(reference_client(credentials, base).get_info().model_data.tokenizer_id)

    if weights.startswith("base:") and credentials.backend_name() == "local":
        return from_server(weights)
    client = sampling_client(credentials, weights)
    try:
        return client.get_tokenizer()
    except OSError:  # no hub id for the base model: ask the server, as for the embedded one
        return from_server(f"base:{client.get_base_model()}")


def teacher_asset(weights: str) -> str:
    """Asset key of teacher weights: the ``tinker://`` path, or ``model://<name>`` for a base model."""
    return weights if weights.startswith("tinker://") else "model://" + weights.removeprefix("base:").lstrip("/")


@task(name="check-teacher", task_run_name="check-teacher", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def check_teacher(
    credentials: TinkerCredentials, weights: str, student_tokenizer: Any, student_name: str, topk: int = 0
) -> dict:
    """Open the teacher ``weights`` (``base:<model>`` or ``tinker://...``) and check it against
    the student's tokenizer (``student_name`` names the student in messages).

    Returns ``{"weights", "vocab_size", "tokenizer": fingerprint}``.

    Raises:
        TeacherError: the server cannot open the weights (e.g. a missing checkpoint); the teacher's
            tokenizer differs from the student's; the server refuses top-``topk`` prompt logprobs
            or returns fewer than ``topk`` per position. Transient server errors are re-raised as
            they are (retried).
    """
    who = f"teacher {weights!r} ({credentials.backend_name()} backend)"
    try:
        client = sampling_client(credentials, weights)
        tok = weights_tokenizer(credentials, weights)
        probe = [int(t) for t in tok.encode("The teacher reads this.", add_special_tokens=False)][:6] or [0, 1]
        if len(probe) < 2:
            probe = probe * 2
        client.compute_logprobs(tinker.ModelInput.from_ints(probe)).result()
    except Exception as exc:
        if is_transient(exc):
            raise
        raise TeacherError(f"{who} cannot be opened: {exc}") from exc
    if tokenizer_fingerprint(tok) != tokenizer_fingerprint(student_tokenizer):
        raise TeacherError(
            f"{who} has another tokenizer than the student {student_name!r} ({len(tok)} vs {len(student_tokenizer)} "
            f"tokens, {getattr(tok, 'name_or_path', '?')!r} vs {getattr(student_tokenizer, 'name_or_path', '?')!r}): "
            "distillation re-uses the student's tokens, so teacher and student must share one tokenizer"
        )
    if topk > 0:
        try:
            resp = client.sample(
                prompt=tinker.ModelInput.from_ints(probe),
                num_samples=1,
                sampling_params=tinker.SamplingParams(max_tokens=1),
                include_prompt_logprobs=True,
                topk_prompt_logprobs=int(topk),
            ).result()
        except Exception as exc:
            if is_transient(exc):
                raise
            raise TeacherError(f"topk={topk}: {who} refuses top-{topk} prompt logprobs: {exc}") from exc
        rows = [r for r in (resp.topk_prompt_logprobs or [])[1:] if r is not None]
        got = min((len(r) for r in rows), default=0)
        if got < min(int(topk), len(tok)):
            raise TeacherError(
                f"topk={topk}: {who} returned only {got} prompt logprobs per position; choose topk <= {got}"
            )
    return {"weights": weights, "vocab_size": len(tok), "tokenizer": tokenizer_fingerprint(tok)}


def _topk_key(context: Any, params: dict[str, Any]) -> str:
    h = hashlib.sha256(f"{params['teacher']}|{int(params['k'])}".encode())
    for seq in params["sequences"]:
        h.update(np.asarray(seq, dtype=np.int64).tobytes() + b"|")
    return h.hexdigest()


@task(
    name="teacher-topk",
    **cached_options(_topk_key),
)
def teacher_topk(
    credentials: TinkerCredentials, teacher: str, sequences: list[list[int]], k: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Top-``k`` teacher logprobs at every target of each sequence (one forward each, through
    ``sample(..., topk_prompt_logprobs=k)``).

    Returns, per sequence (L,), ``(ids int32 (L-1, k), logprobs float32 (L-1, k))``: row ``i``
    is the teacher's distribution of token ``i+1`` given tokens ``0..i``, most likely first;
    empty slots have id -1 and logprob -inf.
    """
    client = sampling_client(credentials, teacher)
    futures = [
        client.sample(
            prompt=tinker.ModelInput.from_ints([int(t) for t in s]),
            num_samples=1,
            sampling_params=tinker.SamplingParams(max_tokens=1),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=int(k),
        )
        for s in sequences
    ]
    out = []
    for seq, fut in zip(sequences, futures, strict=True):
        rows = (fut.result().topk_prompt_logprobs or [])[1:]
        ids = np.full((len(seq) - 1, k), -1, dtype=np.int32)
        lps = np.full((len(seq) - 1, k), -np.inf, dtype=np.float32)
        for i, row in enumerate(rows[: len(seq) - 1]):
            for j, (tid, lp) in enumerate((row or [])[:k]):
                if lp > -99999.0:  # the SDK's empty-slot sentinel
                    ids[i, j], lps[i, j] = int(tid), float(lp)
        out.append((ids, lps))
    return out


class TeacherSamples(BaseModel):
    """Where the teacher's replies were written: ``uri`` (store URL, the asset key), ``rows``
    (conversations written), ``dropped`` (truncated replies left out) and ``stop_reasons``."""

    uri: str
    rows: int
    dropped: int = 0
    stop_reasons: dict[str, int] = {}


def _samples_digest(params: dict[str, Any]) -> str:
    body = {
        k: params[k]
        for k in ("teacher", "renderer", "max_tokens", "temperature", "seed", "num_samples", "keep_truncated", "store")
    }
    body["view"] = TeacherView.model_validate(params["view"]).model_dump()
    body["records"] = hashlib.sha256(repr([(r.messages, r.answer) for r in params["records"]]).encode()).hexdigest()
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def samples_uri(store: str, digest: str) -> str:
    """``<store>/datasets/teacher-samples/<digest>.jsonl`` as a URL (``file://`` for a folder)."""
    if "://" in store:
        return f"{store.rstrip('/')}/datasets/teacher-samples/{digest[:32]}.jsonl"
    return (Path(store).expanduser().resolve() / "datasets" / "teacher-samples" / f"{digest[:32]}.jsonl").as_uri()


def _write(uri: str, data: bytes) -> None:
    import fsspec

    from tinker_blocks.atomic import atomic_write_bytes
    from tinker_blocks.store_config import resolve_storage_options

    if uri.startswith("file://"):
        atomic_write_bytes(None, uri.removeprefix("file://"), data, local=True)
        return
    fs, path = fsspec.core.url_to_fs(uri, **resolve_storage_options(uri))
    atomic_write_bytes(fs, path, data, local=False)


def read_samples(uri: str, cache_dir: str | Path | None = None) -> str:
    """A local path holding the samples file ``uri`` (the file itself for a folder store; a copy
    under ``cache_dir`` -- default ``~/.prefect-tinker/cache`` -- for S3).

    Raises:
        FileNotFoundError: the file is gone.
    """
    if uri.startswith("file://"):
        path = uri.removeprefix("file://")
        if not Path(path).is_file():
            raise FileNotFoundError(f"teacher samples {uri} are missing")
        return path
    import fsspec

    from tinker_blocks.store_config import resolve_storage_options

    local = Path(cache_dir or Path.home() / ".prefect-tinker" / "cache") / "teacher-samples" / uri.rsplit("/", 1)[-1]
    if not local.is_file():
        local.parent.mkdir(parents=True, exist_ok=True)
        fs, path = fsspec.core.url_to_fs(uri, **resolve_storage_options(uri))
        tmp = local.with_suffix(".part")
        fs.get(path, str(tmp))
        tmp.replace(local)
    return str(local)


def _sample_teacher(
    credentials: TinkerCredentials,
    teacher: str,
    records: list[PromptRecord],
    renderer: str,
    tokenizer_id: str,
    view: dict,
    max_tokens: int,
    temperature: float,
    seed: int,
    num_samples: int,
    keep_truncated: bool,
    store: str,
) -> TeacherSamples:
    from prefect_tinker.recipes.rl.problem_env import load_renderer

    rend = load_renderer(renderer, tokenizer_id)
    tview = TeacherView.model_validate(view)
    client = sampling_client(credentials, teacher)
    futures = [
        client.sample(
            prompt=rend.build_generation_prompt(tview.messages(r)),
            num_samples=num_samples,
            sampling_params=tinker.SamplingParams(
                max_tokens=max_tokens, temperature=temperature, seed=seed + i, stop=rend.get_stop_sequences()
            ),
        )
        for i, r in enumerate(records)
    ]
    lines, dropped, reasons = list[str](), 0, dict[str, int]()
    for r, fut in zip(records, futures, strict=True):
        for j, seq in enumerate(fut.result().sequences):
            parsed = rend.parse_response(list(seq.tokens))
            reasons[parsed.termination.value] = reasons.get(parsed.termination.value, 0) + 1
            if not parsed.ok and not keep_truncated:
                dropped += 1
                continue
            msgs = r.message_list() + [{"role": "assistant", "content": parsed.message.get("content") or ""}]
            lines.append(
                json.dumps(
                    {
                        "messages": msgs,
                        "prompt_id": r.id,
                        "sample": j,
                        "source": r.source,
                        "termination": parsed.termination.value,
                    },
                    ensure_ascii=False,
                )
            )
    if not lines:
        raise TeacherError(
            f"teacher {teacher!r} finished none of its {len(records) * num_samples} replies within "
            f"max_tokens={max_tokens} ({reasons}); raise teacher_max_tokens or keep_truncated=true"
        )
    uri = samples_uri(
        store,
        _samples_digest(
            dict(
                teacher=teacher,
                renderer=renderer,
                max_tokens=max_tokens,
                temperature=temperature,
                seed=seed,
                num_samples=num_samples,
                keep_truncated=keep_truncated,
                store=store,
                view=view,
                records=records,
            )
        ),
    )
    _write(uri, ("\n".join(lines) + "\n").encode())
    return TeacherSamples(uri=uri, rows=len(lines), dropped=dropped, stop_reasons=reasons)


def teacher_samples(
    credentials: TinkerCredentials,
    teacher: str,
    records: list[PromptRecord],
    *,
    renderer: str,
    tokenizer_id: str,
    view: TeacherView,
    max_tokens: int,
    temperature: float,
    seed: int,
    num_samples: int = 1,
    keep_truncated: bool = False,
    store: str,
    upstream: list[str] | None = None,
    name: str = "teacher-samples",
) -> TeacherSamples:
    """Sample the teacher's replies to ``records`` and write them as a chat JSONL dataset (see
    the module docstring), as the ``teacher-samples`` asset materialization.

    Each line is ``{"messages": <the record's messages> + [assistant reply], "prompt_id",
    "sample", "source", "termination"}``: the *student's* view of the prompt (the teacher's system
    prompt or template is not written) and the teacher's reply parsed by the teacher's renderer.
    Replies that hit ``max_tokens`` are dropped unless ``keep_truncated``. Prompt ``i`` is
    sampled with seed ``seed + i``.

    Raises:
        TeacherError: no reply finished.
    """
    params = dict(
        teacher=teacher,
        renderer=renderer,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        num_samples=num_samples,
        keep_truncated=keep_truncated,
        store=store,
        view=view.model_dump(),
        records=records,
    )
    uri = samples_uri(store, _samples_digest(params))
    run = materialize(
        uri,
        asset_deps=[teacher_asset(teacher), *(upstream or [])],
        name="teacher-samples",
        task_run_name=name,
        **cached_options(lambda ctx, p: _samples_digest(p)),
    )(_sample_teacher)
    args = (
        credentials,
        teacher,
        records,
        renderer,
        tokenizer_id,
        view.model_dump(),
        max_tokens,
        temperature,
        seed,
        num_samples,
        keep_truncated,
        store,
    )
    out = run(*args)
    try:
        read_samples(out.uri)
    except FileNotFoundError:  # a cached result whose file was deleted: sample again
        out = run.with_options(refresh_cache=True)(*args)
    return out
