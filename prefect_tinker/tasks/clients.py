"""The per-process client registry: live ``tinker`` training and sampling clients behind
picklable handles.

A task never receives a live client. It receives the credentials block (picklable, hashable) and a
small :class:`TrainingRun` handle, and asks this registry for the client:

- :func:`training_client` returns the run's live ``tinker.TrainingClient`` at ``run.step``. When
  the registry has none -- a new worker, a crash, or a client poisoned by a failed request (the
  SDK refuses further calls on it) -- it is recreated from the handle's last state checkpoint
  (weights and optimizer state), and :class:`ClientRewound` tells the caller to continue from that
  checkpoint's step, so no update is ever applied twice or lost.
- :func:`sampling_client` returns a cached ``tinker.SamplingClient`` for a ``tinker://`` sampler
  path or ``base:<model>`` (created once per process, not per call).
- :func:`reference_client` returns a frozen training client of fixed weights (a base model or a
  state checkpoint) used only for ``forward``: reference logprobs with the trainer's own numerics.
- :func:`tokenizer` returns a cached Hugging Face tokenizer for a ``tokenizer_id``.

Keys combine where the server is (local root or base URL) with the run name or path, so two
backends never share a client.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import tinker
from pydantic import BaseModel, Field

from prefect_tinker.tasks.limits import wait_sample_rate

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = [
    "ClientRewound",
    "TrainingRun",
    "WatchedSampler",
    "advance",
    "forget",
    "has_training_client",
    "reference_client",
    "register",
    "result",
    "run_tokenizer",
    "sampling_client",
    "tokenizer",
    "training_client",
]

#: Most sampling clients (and reference clients) kept per process; the least recently used go.
MAX_SAMPLING_CLIENTS = 16


class TrainingRun(BaseModel):
    """A small, picklable handle on one training run (never holds a live client).

    ``step`` counts completed optimizer steps; ``last_checkpoint`` is the ``tinker://.../weights/...``
    path of the newest saved state (weights + optimizer), taken at ``last_checkpoint_step``.
    ``init_from`` is the state the run started from (a fresh optimizer), when not the base model.
    """

    run_name: str
    base_model: str
    lora_rank: int
    backend: str = Field(description="'local', 'remote' or 'hosted'.")
    seed: int | None = None
    model_id: str | None = None
    tokenizer_id: str | None = None
    step: int = 0
    last_checkpoint: str | None = None
    last_checkpoint_step: int = 0
    init_from: str | None = None


class ClientRewound(RuntimeError):
    """The live client was lost and was recreated from the checkpoint at ``step``.

    The caller must continue training from ``step`` (the data position is a function of the step).
    """

    def __init__(self, run: TrainingRun, step: int):
        super().__init__(f"training client of run {run.run_name!r} was recreated from its checkpoint at step {step}")
        self.run = run
        self.step = step


_lock = threading.Lock()
_training: dict[tuple[str, str], tuple[tinker.TrainingClient, int]] = {}
_sampling: OrderedDict[tuple[str, str], Any] = OrderedDict()


def _key(credentials: TinkerCredentials, name: str) -> tuple[str, str]:
    return (credentials.backend_identity(), name)


def result(credentials: TinkerCredentials, future: Any, what: str) -> Any:
    """``future.result()`` of an SDK future, never waiting longer than the block's
    ``request_deadline_s`` and noticing a dead server while waiting
    (:func:`tinker_blocks.server_watch.wait_result`).

    When the server is gone, every client of it is dropped and an embedded server is restarted,
    then :class:`~tinker_blocks.server_watch.ServerGone` (transient: the task is retried, and its
    training client recreated from the last checkpoint) is raised.

    Raises:
        OlderServerAPIError: the server at ``base_url`` refused a request field of the installed
            SDK (HTTP 422 ``extra_forbidden``: it speaks an older Tinker API).
        ServerGone: the server's process exited or it stopped answering.
        ServerDeadline: no result within the deadline.
        LocalServerError: the embedded server could not be restarted (names its log).
    """
    from tinker_blocks.server_api import older_api_error
    from tinker_blocks.server_watch import ServerGone, wait_result

    try:
        return wait_result(future, credentials, deadline_s=credentials.request_deadline_s, what=what)
    except tinker.APIStatusError as exc:  # a server speaking an older API refuses the SDK's new fields
        older = older_api_error(exc, credentials.base_url) if credentials.base_url else None
        if older is not None:
            raise older from exc
        raise
    except ServerGone:
        where = credentials.backend_identity()
        with _lock:
            for table in (_training, _sampling):
                for key in [k for k in table if k[0] == where]:
                    del table[key]
        if credentials.local:
            credentials.restart_local_server()
        raise


def register(credentials: TinkerCredentials, run: TrainingRun, client: tinker.TrainingClient) -> TrainingRun:
    """Keep ``client`` as the live client of ``run`` at ``run.step``; returns the handle with the
    client's ``model_id`` and ``tokenizer_id`` filled in."""
    info = client.get_info()
    with _lock:
        _training[_key(credentials, run.run_name)] = (client, run.step)
    return run.model_copy(update={"model_id": str(client.model_id), "tokenizer_id": info.model_data.tokenizer_id})


def has_training_client(credentials: TinkerCredentials, run: TrainingRun) -> bool:
    """Whether the registry holds a live client of ``run`` at exactly ``run.step``."""
    with _lock:
        entry = _training.get(_key(credentials, run.run_name))
    return entry is not None and entry[1] == run.step


def training_client(credentials: TinkerCredentials, run: TrainingRun) -> tinker.TrainingClient:
    """The live client of ``run`` at step ``run.step``, recreating it from the last checkpoint
    (or, with none, from ``run.init_from`` / the base model at step 0).

    Raises:
        ClientRewound: the client had to be recreated at a step older than ``run.step``.
    """
    with _lock:
        entry = _training.get(_key(credentials, run.run_name))
    if entry is not None and entry[1] == run.step:
        return entry[0]
    forget(credentials, run)
    service = credentials.get_client()
    what = f"a training client of run {run.run_name!r}"
    if run.last_checkpoint is not None:
        client = result(
            credentials, service.create_training_client_from_state_with_optimizer(run.last_checkpoint), what
        )
        step = run.last_checkpoint_step
    elif run.init_from is not None:
        client = result(credentials, service.create_training_client_from_state(run.init_from), what)
        step = 0
    else:
        client = result(
            credentials,
            service.create_lora_training_client(base_model=run.base_model, rank=run.lora_rank, seed=run.seed),
            what,
        )
        step = 0
    new_run = register(credentials, run.model_copy(update={"step": step}), client)
    if new_run.step != run.step:
        raise ClientRewound(new_run, new_run.step)
    return client


def forget(credentials: TinkerCredentials, run: TrainingRun) -> None:
    """Drop the run's live client (after a failed request poisoned it); the next
    :func:`training_client` recreates it."""
    with _lock:
        _training.pop(_key(credentials, run.run_name), None)


def advance(credentials: TinkerCredentials, run: TrainingRun, client: tinker.TrainingClient, step: int) -> None:
    """Record that ``client`` has taken ``step`` optimizer steps."""
    with _lock:
        _training[_key(credentials, run.run_name)] = (client, step)


def _cached(credentials: TinkerCredentials, key: tuple[str, str], make: Callable[[], tinker.APIFuture[Any]]) -> Any:
    with _lock:
        if key in _sampling:
            _sampling.move_to_end(key)
            return _sampling[key]
    client = result(credentials, make(), f"a client for {key[1]}")
    with _lock:
        _sampling[key] = client
        while len(_sampling) > MAX_SAMPLING_CLIENTS:
            _sampling.popitem(last=False)
    return client


class _WatchedFuture:
    """An SDK future whose ``result()`` goes through :func:`result`."""

    def __init__(self, future: tinker.APIFuture[Any], credentials: TinkerCredentials, what: str):
        self._future, self._credentials, self._what = future, credentials, what

    def result(self, timeout: float | None = None) -> Any:
        return result(self._credentials, self._future, self._what)

    def future(self) -> Any:
        return self._future.future()

    def __await__(self) -> Any:  # async callers (the capture server) await the SDK future itself
        return self._future.__await__()


class WatchedSampler:
    """A ``tinker.SamplingClient`` whose ``sample`` / ``compute_logprobs`` futures are watched
    (:func:`result`: bounded wait, dead-server detection) and whose ``sample`` requests take a slot
    of the backend's sampling rate limit when one exists (:func:`~prefect_tinker.tasks.limits.wait_sample_rate`);
    everything else is the client's own. Picklable like the client."""

    def __init__(self, client: tinker.SamplingClient, credentials: TinkerCredentials, path: str):
        self.client, self.credentials, self.path = client, credentials, path

    def sample(self, *args: Any, **kwargs: Any) -> _WatchedFuture:
        wait_sample_rate(self.credentials)
        return _WatchedFuture(self.client.sample(*args, **kwargs), self.credentials, f"a sample from {self.path}")

    async def sample_async(self, *args: Any, **kwargs: Any) -> Any:
        """``await``-able ``sample`` for event loops (the capture server): the rate-limit wait runs
        in a worker thread, so the loop goes on serving other requests meanwhile."""
        await asyncio.to_thread(wait_sample_rate, self.credentials)
        return await self.client.sample(*args, **kwargs)

    def compute_logprobs(self, *args: Any, **kwargs: Any) -> _WatchedFuture:
        return _WatchedFuture(
            self.client.compute_logprobs(*args, **kwargs), self.credentials, f"logprobs from {self.path}"
        )

    def __getattr__(self, name: str) -> Any:
        if name in ("client", "credentials", "path"):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.client, name)


def sampling_client(credentials: TinkerCredentials, path: str, record_stability_info: bool = False) -> WatchedSampler:
    """A ``tinker.SamplingClient`` for ``path`` (a ``tinker://.../sampler_weights/...`` path, or
    ``base:<model>`` for a base model), created once per process (LRU of
    :data:`MAX_SAMPLING_CLIENTS`), its futures watched (:class:`WatchedSampler`).
    ``record_stability_info``: the server records every sampled sequence for StableReinforce
    training (a separate client of the same weights)."""
    service = credentials.get_client()
    kw = {"record_stability_info": True} if record_stability_info else {}
    key = _key(credentials, ("sample+stability|" if record_stability_info else "sample|") + path)
    if path.startswith("base:"):
        client = _cached(credentials, key, lambda: service.create_sampling_client(base_model=path[5:], **kw))
    else:
        client = _cached(credentials, key, lambda: service.create_sampling_client(model_path=path, **kw))
    return WatchedSampler(client, credentials, path)


def reference_client(
    credentials: TinkerCredentials, reference: str, *, lora_rank: int = 1, seed: int | None = None
) -> Any:
    """A frozen ``tinker.TrainingClient`` holding the weights ``reference`` (``base:<model>``, or a
    ``tinker://.../weights/...`` state path), used only for ``forward``: its logprobs are computed
    exactly as the policy's are (same engine, precision and LoRA path), so a policy equal to the
    reference has a log-ratio of exactly 0. LoRA starts with a zero ``B`` matrix, so a fresh LoRA
    client of a base model computes the base model. Cached per process.

    Raises:
        ValueError: ``reference`` is neither ``base:...`` nor a ``tinker://`` state path.
    """
    service = credentials.get_client()
    if reference.startswith("base:"):
        return _cached(
            credentials,
            _key(credentials, "ref|" + reference),
            lambda: service.create_lora_training_client(base_model=reference[5:], rank=lora_rank, seed=seed),
        )
    if reference.startswith("tinker://") and "/weights/" in reference:
        return _cached(
            credentials,
            _key(credentials, "ref|" + reference),
            lambda: service.create_training_client_from_state(reference),
        )
    raise ValueError(
        f"reference weights must be 'base:<model>' or a tinker://.../weights/... state path, got {reference!r}"
    )


@functools.lru_cache(maxsize=8)
def tokenizer(tokenizer_id: str) -> Any:
    """The Hugging Face tokenizer ``tokenizer_id`` (a local directory, or a hub id with the hub
    reachable), cached per process.

    Raises:
        OSError: the tokenizer cannot be loaded.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_id)


def run_tokenizer(run_id: str, model: str, configured: str | None, named: str | None) -> tuple[str, Any]:
    """A run's tokenizer id and its tokenizer: the config's ``tokenizer`` (``configured``), else the
    one the backend names for ``model`` (``named``), loaded by :func:`tokenizer`.

    Raises:
        ValueError: neither names one, or it does not load here (the message says which field to
            give a local directory in).
    """
    tokenizer_id = configured or named
    if tokenizer_id is None:
        raise ValueError(
            f"run {run_id!r}: the backend named no tokenizer for model {model!r}; "
            "give tokenizer=<local directory or hub name>"
        )
    try:
        return tokenizer_id, tokenizer(tokenizer_id)
    except OSError as exc:  # e.g. a hub name offline: say which field loads one from here
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = "this config's tokenizer" if configured else "the backend's tokenizer for this model"
        raise ValueError(
            f"run {run_id!r}: {where} {tokenizer_id!r} does not load here ({reason}); give "
            "tokenizer=<a local directory of it>"
        ) from exc
