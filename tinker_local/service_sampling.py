"""Sampling endpoints of the local Tinker server (a part of ``LocalService``: its ``sampling``): sampling sessions,
``GET samplers/{id}``, and ``asample``, whose jobs the compute thread runs in batches through
``Engine.sample_many`` (see ``tinker_local.futures`` for how queued requests are batched), or,
when the service has a ``sampler_pool`` (``serve --sampler-workers N``), the threads of the
``"sampler"`` executor run them in the pool's worker processes (``tinker_local.sampler_pool``)
while training continues on the compute thread."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

from . import protocol as P
from . import protocol_sampling
from .errors import HttpError, int_field, required_field
from .outcomes import is_user_error
from .registry import SamplerRecord
from .request_limits import check_sampling
from .request_log import ContentSeeds, content_key, weights_identity
from .service_base import ServiceState
from .service_stability import StabilityRecords
from .trace import session_of

DEFAULT_MAX_TOKENS = 256  # SamplingParams.max_tokens=None
# A sampling request heading a batch waits for more requests at most this share of its expected
# compute time (max_tokens x the seconds per decode step measured on the last batch): catching a
# request that arrives a few ms late saves it a whole decode loop of its own.  The requests of one
# RL step's rollout tasks reach the server up to ~100 ms apart (each task's Prefect start-up comes
# first); at a tenth (and a 20 ms quiet window), a batch of 64-token replies of the tiny model
# sometimes left all but the first behind, for a second decode loop.
LINGER_FRACTION = 0.25
SAMPLER_EXECUTOR = "sampler"  # FutureStore side executor of the sampler worker pool
#: seconds a finished sampling batch waits for a request's sequence ids (set right after it is
#: queued) before giving up recording its sequences for ``record_stability_info``
SEQUENCE_IDS_WAIT_S = 30.0
SAMPLING_COUNTERS = (
    "requests",
    "prompt_tokens_cached",
    "prompt_tokens_uncached",
    "sampled_tokens",
    "stability_not_recorded",
)

logger = logging.getLogger("tinker_local.sampling")
# request fields that are not part of what a content-seeded request asks (tinker_local.request_log)
_NOT_CONTENT = frozenset({"base_model", "weights_path", "prompt_tokens", "num_samples", "seed"})
_LOGGED_PARAMS = ("max_tokens", "temperature", "top_k", "top_p", "stop", "seed")  # the request's seed (None: unset)


def _seq_or(seq: int | None) -> int:
    return -1 if seq is None else seq


def _prompt_len(prompt: Any) -> int:
    """Tokens of a parsed prompt (a token list, or chunks: token lists and media chunks, these by
    their ``expected_tokens`` when given)."""
    if prompt and isinstance(prompt[0], int):
        return len(prompt)
    return sum(len(c) if isinstance(c, list) else int(c.expected_tokens or 0) for c in prompt)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


class SamplingCounters:
    """The sampling counters of a ``LocalService`` since start (a part it creates in ``__init__``):
    ``requests`` served, ``prompt_tokens_cached`` (served by another request's prefill in the same
    batch), ``prompt_tokens_uncached`` (prefilled for the request), ``sampled_tokens``, and
    ``stability_not_recorded`` (``record_stability_info`` requests whose sequence ids came more than
    ``SEQUENCE_IDS_WAIT_S`` after their batch finished, so their sequences cannot be named by
    provenance spans; logged once).

    Attributes:
        counts: counter name -> value. lock: one lock over all of them (batches finish on the compute
            thread and on every sampler-worker thread at once; a snapshot holds whole batches).
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(SAMPLING_COUNTERS, 0)
        self.lock = threading.Lock()

    def add(self, **increments: int) -> None:
        """Add ``increments`` to the counters, under the lock."""
        with self.lock:
            for name, n in increments.items():
                self.counts[name] += n

    def snapshot(self) -> dict[str, int]:
        """A copy of the counters, taken under the lock."""
        with self.lock:
            return dict(self.counts)


class InflightTargets:
    """Where inflight sampling clients sample (a part of ``LocalService``): an inflight save of a
    training model (``SamplingClientKind`` "inflight") makes its sampler weights the target of every
    inflight sampling session of the model; snapshot sessions keep their weights. In memory: after a
    server restart an inflight session samples the weights of its own save.

    Attributes:
        targets: training model id -> weights folder of its newest inflight save.
        sessions: inflight sampling session id -> its training model id.
    """

    def __init__(self) -> None:
        self.targets: dict[str, str] = {}
        self.sessions: dict[str, str] = {}

    def publish(self, model_id: str, weights_path: str, sampler_id: str | None) -> None:
        """An inflight save of ``model_id``: ``weights_path`` becomes the target of its inflight
        sessions, the existing ones and ``sampler_id`` (new, when given)."""
        self.targets[model_id] = weights_path
        if sampler_id is not None:
            self.sessions[sampler_id] = model_id

    def weights(self, sampler_id: str) -> str | None:
        """The weights folder an inflight sampling session samples now; None for other sessions."""
        model_id = self.sessions.get(sampler_id)
        return None if model_id is None else self.targets.get(model_id)


class SamplingEndpoints:
    """The sampling endpoints (see the module docstring).  Sampling clients of kind
    "inflight" follow their training model's newest inflight save (``InflightTargets``);
    ``record_stability_info`` requests record their sequences (``tinker_local.service_stability``)."""

    def __init__(self, state: ServiceState):
        self.state = state
        self.sampler_pool: Any = None  # a SamplerPool (attach_sampler_pool), or None: in-process
        self.sample_step_s: float | None = None  # wall seconds per decode step of the last batch
        self.counters = SamplingCounters()
        self.inflight = InflightTargets()
        self.stability = StabilityRecords(lambda: state.clock(), state.store)

    def attach_sampler_pool(self, pool: Any) -> None:
        """Serve sampling through ``pool`` (one ``"sampler"`` executor thread per worker);
        before the store starts."""
        self.sampler_pool = pool
        self.state.store.add_executor(SAMPLER_EXECUTOR, pool.workers)

    # -- sampling ---------------------------------------------------------------------------------
    def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        ep = "create_sampling_session"
        session_id = str(required_field(body, "session_id", ep))
        seq = int_field(body, "sampling_session_seq_id", ep)
        sid = f"{session_id}:sample:{seq}"
        self.state.registry.add_sampler(self._sampler_record(sid, body, ep))
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def _sampler_record(self, sid: str, body: dict[str, Any], ep: str) -> SamplerRecord:
        if body.get("model_path"):
            ck = self.state.checkpoint_record(str(body["model_path"]))
            run = self.state.registry.runs.get(ck.model_id)
            base = body.get("base_model") or (run.base_model if run else None)
            if base is None:
                raise HttpError(404, f"{ep}: base model of {ck.uri} is unknown")
            self.state.model_allow.check(base, ep)
            return SamplerRecord(sid, str(base), ck.uri, ck.path)
        if not body.get("base_model"):
            raise HttpError(422, f"{ep}: give 'model_path' (tinker://...) or 'base_model'")
        self.state.model_allow.check(body["base_model"], ep)
        return SamplerRecord(sid, str(body["base_model"]))

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        rec = self.state.registry.samplers.get(sampler_id)
        if rec is None:
            raise HttpError(404, f"unknown sampling session {sampler_id!r}")
        return {
            "sampler_id": rec.sampler_id,
            "base_model": self.state.client_model_name(rec.base_model),
            "model_path": rec.model_path,
        }

    def join_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        sid = str(required_field(body, "sampling_session_id", "join_sampling_session"))
        n = self.state.registry.join_sampler(sid)
        if n is None:
            raise HttpError(404, f"unknown sampling session {sid!r}")
        return {"type": "join_sampling_session", "client_counter": n}

    def asample(self, body: dict[str, Any]) -> dict[str, Any]:
        ep = "asample"
        n = int_field(body, "num_samples", ep, 1)
        if n < 1:
            raise HttpError(422, f"{ep}: num_samples must be >= 1, got {n}")
        sid = body.get("sampling_session_id")
        if sid is not None:
            rec = self.state.registry.samplers.get(str(sid))
            if rec is None:
                raise HttpError(404, f"{ep}: unknown sampling session {sid!r}")
            self.state.model_allow.check(rec.base_model, ep)  # the list may have changed since
        else:
            rec = self._sampler_record("adhoc", body, ep)
        try:
            prompt = protocol_sampling.prompt_from_json(required_field(body, "prompt", ep))
            sp = body.get("sampling_params") or {}
            stop = protocol_sampling.stop_from_json(sp.get("stop"))
            target, target_csr = (
                protocol_sampling.target_ids_from_json(body["target_prompt_logprobs"])
                if body.get("target_prompt_logprobs") is not None
                else (None, None)
            )
        except P.ProtocolError as e:
            raise HttpError(422, f"{ep}: {e}") from e
        weights_path = self.inflight.weights(str(sid)) if sid is not None else None
        weights_path = weights_path or rec.weights_path
        topk = int_field(body, "topk_prompt_logprobs", ep, 0)
        last_n = int_field(body, "prompt_logprobs_last_n", ep)
        max_tokens = int_field(sp, "max_tokens", ep)
        check_sampling(
            self.state.request_limits, n, DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, _prompt_len(prompt)
        )
        try:
            job: dict[str, Any] = {
                "engine": dict(
                    base_model=rec.base_model,
                    prompt_tokens=prompt,
                    num_samples=n,
                    weights_path=Path(weights_path) if weights_path else None,
                    max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                    temperature=float(_or(sp.get("temperature"), 1.0)),
                    top_k=int_field(sp, "top_k", ep) if sp.get("top_k") is not None else -1,
                    top_p=float(_or(sp.get("top_p"), 1.0)),
                    seed=int_field(sp, "seed", ep),
                    stop=stop,
                    include_prompt_logprobs=bool(body.get("prompt_logprobs")) or topk > 0,
                    topk_prompt_logprobs=topk,
                    topk_sample_logprobs=int_field(body, "topk_sample_logprobs", ep, 0),
                    prompt_logprobs_last_n=last_n,
                    target_prompt_logprobs=target,
                    prompt_alt_tokens_k=int_field(body, "prompt_alt_tokens_k", ep, 0),
                ),
                "prompt_logprobs": bool(body.get("prompt_logprobs")),
                "topk": topk,
                "last_n": last_n,
                "target_csr": target_csr,
                "sampler_id": None if sid is None else str(sid),
                "record": bool(body.get("record_stability_info")),
                "ids": threading.Event(),
            }
        except (TypeError, ValueError) as e:
            raise HttpError(422, f"{ep}: sampling_params must be numbers ({e})") from e
        seq = int_field(body, "seq_id", ep)
        job["seq"] = seq
        key = (f"sample:{sid}", seq) if sid is not None and seq is not None else None
        span = None
        if sid is not None and (key is None or self.state.store.lookup_seq(*key) is None):
            span = self.state.tracer.open_span(
                session_of(str(sid)),
                "sample",
                str(sid),
                seq_id=seq,
                num_samples=n,
                prompt_tokens=len(prompt),
                max_tokens=job["engine"]["max_tokens"],
            )
        job["span"] = span
        step_s = self.sample_step_s
        linger = None if step_s is None else LINGER_FRACTION * step_s * (job["engine"]["max_tokens"] + 1)
        rid = self.state.store.submit(
            "sample",
            None,
            dedupe_key=key,
            batch_key="sample",
            payload=job,
            batch_fn=self._sample_batch,
            max_linger_s=linger,
            executor=SAMPLER_EXECUTOR if self.sampler_pool is not None else None,
        )
        self.state.tracer.bind(span, rid)
        job["sequence_ids"] = protocol_sampling.sequence_ids(rid, n)
        job["ids"].set()  # the batch may already be running: it waits for the ids to record them
        return {"request_id": rid, "sample_sequence_ids": job["sequence_ids"]}

    def _sample_batch(self, jobs: list[dict[str, Any]]) -> list[Any]:
        """Run queued ``asample`` jobs together (compute thread): one ``SampleResponse`` proto
        (bytes) or exception per job."""
        reqs = [j["engine"] for j in jobs]
        t0 = time.monotonic()
        spans = [j.get("span") for j in jobs]
        start = self.state.tracer.clock()
        for sp in spans:
            if sp is not None:
                sp.start, sp.args["batch_size"] = start, len(jobs)
        out: list[Any] = []
        try:
            out = self._sample_reqs(jobs, reqs)
            return out
        finally:
            steps = max(int(r.get("max_tokens") or 1) for r in reqs) + 1  # prefill + decode steps
            self.sample_step_s = (time.monotonic() - t0) / steps
            end = self.state.tracer.clock()
            for k, sp in enumerate(spans):
                if sp is not None:
                    res = out[k] if k < len(out) else None
                    sp.end = end
                    sp.status = (
                        "server error"
                        if res is None
                        else "ok"
                        if not isinstance(res, BaseException)
                        else "user error"
                        if is_user_error(res)
                        else "server error"
                    )

    def _content_seeded(
        self, seeds: ContentSeeds, jobs: list[dict[str, Any]], reqs: list[dict[str, Any]]
    ) -> tuple[list[dict], Any]:
        """``serve --sampling-seed content``: each job's request split into one request per sequence,
        each with its :func:`~tinker_local.request_log.content_seed` (occurrences counted per session
        in (sampling session, seq_id) order within the batch); returns the requests and a function
        merging their results back into one result per job (``tinker_local.request_log``)."""
        order = sorted(range(len(jobs)), key=lambda k: (str(jobs[k]["sampler_id"]), _seq_or(jobs[k].get("seq"))))
        expanded: list[dict[str, Any]] = []
        spans: list[tuple[int, int]] = [(0, 0)] * len(jobs)
        for k in order:
            r, job = reqs[k], jobs[k]
            ident = self._weights_identity(r)
            params = {n: v for n, v in r.items() if n not in _NOT_CONTENT}
            key = content_key(r["prompt_tokens"], params, ident)
            job["weights"], job["seeds"] = (
                ident,
                seeds.take(session_of(job["sampler_id"]) or "adhoc", key, int(r["num_samples"])),
            )
            spans[k] = (len(expanded), len(job["seeds"]))
            expanded.extend(dict(r, num_samples=1, seed=seed) for seed in job["seeds"])

        def merge(results: list[Any]) -> list[Any]:
            out: list[Any] = []
            for start, n in spans:
                parts = results[start : start + n]
                bad = next((p for p in parts if isinstance(p, BaseException)), None)
                out.append(
                    bad
                    if bad is not None
                    else dataclasses.replace(parts[0], sequences=[s for p in parts for s in p.sequences])
                )
            return out

        return expanded, merge

    def _weights_identity(self, req: dict[str, Any]) -> str:
        try:
            return weights_identity(str(req["base_model"]), req.get("weights_path"))
        except (OSError, ValueError) as e:  # unreadable weights: the request fails in the engine
            return f"unreadable:{req.get('weights_path')}:{e}"

    def _log_samples(self, jobs: list[dict[str, Any]], results: list[Any]) -> None:
        for job, res in zip(jobs, results, strict=True):
            if isinstance(res, BaseException) or job["sampler_id"] is None:
                continue
            r = job["engine"]
            self.state.log_request(
                session_of(job["sampler_id"]),
                {
                    "op": "sample",
                    "sampler": job["sampler_id"],
                    "seq_id": job.get("seq"),
                    "weights": job.get("weights") or self._weights_identity(r),
                    "prompt": r["prompt_tokens"],
                    "num_samples": r["num_samples"],
                    "sampling_params": {n: r[n] for n in _LOGGED_PARAMS},
                    "prompt_logprobs": bool(r["include_prompt_logprobs"]),
                    "topk_prompt_logprobs": r["topk_prompt_logprobs"],
                    "seeds": job.get("seeds"),
                    "sequences": [{k: s.get(k) for k in ("tokens", "logprobs", "stop_reason")} for s in res.sequences],
                    "prompt_logprobs_out": res.prompt_logprobs if job["prompt_logprobs"] else None,
                },
            )

    def _sample_reqs(self, jobs: list[dict[str, Any]], reqs: list[dict[str, Any]]) -> list[Any]:
        merge = None
        seeds = self.state.content_seeds
        if seeds is not None:
            # each sequence drawn alone: a batch's shape changes the float results (by ~1e-7), so a sequence's
            # tokens and logprobs must not depend on what else was asked at the same time
            reqs, merge = self._content_seeded(seeds, jobs, reqs)
            results = [r for req in reqs for r in self._run_sample_reqs([req])]
            results = merge(results)
        else:
            results = self._run_sample_reqs(reqs)
        if self.state.request_log is not None:
            self._log_samples(jobs, results)
        return self._sample_responses(jobs, results)

    def _run_sample_reqs(self, reqs: list[dict[str, Any]]) -> list[Any]:
        if self.sampler_pool is not None:
            results = self.sampler_pool.sample_many(reqs)
        else:
            results = self.state.engine.sample_many(reqs)
        return results

    def _sample_responses(self, jobs: list[dict[str, Any]], results: list[Any]) -> list[Any]:
        out: list[Any] = []
        for job, res in zip(jobs, results, strict=True):
            if isinstance(res, BaseException):
                out.append(res)
                continue
            hit = int(res.prompt_cache_hit_tokens)
            self.counters.add(
                requests=1,
                prompt_tokens_cached=hit,
                prompt_tokens_uncached=len(job["engine"]["prompt_tokens"]) - hit,
                sampled_tokens=sum(len(s["tokens"]) for s in res.sequences),
            )
            if job["record"]:
                if job["ids"].wait(SEQUENCE_IDS_WAIT_S):  # set right after submission
                    self.stability.record(
                        job["sampler_id"], job["sequence_ids"], job["engine"]["prompt_tokens"], res.sequences
                    )
                else:
                    self._not_recorded(job)
            out.append(
                protocol_sampling.sample_response_to_proto(
                    res.sequences,
                    res.prompt_logprobs if job["prompt_logprobs"] else None,
                    res.topk_prompt_logprobs if job["topk"] > 0 else None,
                    prompt_logprobs_last_n=job["last_n"],
                    target_prompt_logprobs=res.target_prompt_logprobs,
                    target_csr=job["target_csr"],
                    prompt_alt_tokens=res.prompt_alt_tokens,
                    prompt_cache_hit_tokens=hit,
                )
            )
        return out

    # -- counters and inflight sampling clients -----------------------------------------------------
    @property
    def sampling_stats(self) -> dict[str, int]:
        """A snapshot of the counters since start (``GET local_stats`` -> ``"sampling"``; see
        :class:`SamplingCounters`)."""
        return self.counters.snapshot()

    def _not_recorded(self, job: dict[str, Any]) -> None:
        counters = self.counters
        with counters.lock:
            counters.counts["stability_not_recorded"] += 1
            first = counters.counts["stability_not_recorded"] == 1
        if first:
            logger.warning(
                "a record_stability_info sampling request of %s got its sequence ids more than %g s after its "
                "batch finished: its sequences are not recorded, so provenance naming them is refused "
                "(counted in local_stats sampling.stability_not_recorded; said once)",
                job["sampler_id"] or "an ad-hoc sampler",
                SEQUENCE_IDS_WAIT_S,
            )
