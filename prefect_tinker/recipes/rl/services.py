"""Services an environment asks its run context for, by typed key.

An environment that needs something besides the policy -- a judge model, a reward model, sampling
clients of other weights, an evaluator class of the task layer, or a plugin's own service (a
lookup table, a search engine, a verifier) -- does not get a field of its context for it: it asks
``ctx.service(KEY)``, where ``KEY`` is a :class:`ServiceKey` naming the service and the type it
provides:

- in a rollout (:meth:`RolloutContext.service <prefect_tinker.recipes.rl.types.RolloutContext.service>`:
  ``make_envs_in``, ``run_group``, ``compute_group_rewards_in``), providers get the rollout task's
  backend credentials;
- when the run builds its dataset and evaluators
  (:meth:`EnvContext.service <prefect_tinker.recipes.rl.envs.EnvContext.service>`), they get none.

A provider is a callable ``provider(resources: ServiceResources) -> service`` registered under the
key's name in :data:`SERVICES` (a :class:`~prefect_tinker.recipes.registry.Registry`, entry point
group ``prefect_tinker.services``: ``name = "pkg.module:provider"``), or with
:func:`register_service`. It is called lazily, the first time a key is asked for, and its service is
kept for the process (one per key, provider and resources): a provider may load a table or open a
client once. The task layer registers the built-in providers (:mod:`prefect_tinker.tasks.services`).

Built-in keys: :data:`JUDGE`, :data:`PAIR_PREFERENCES`, :data:`SAMPLER`, :data:`SANDBOX` (rollouts),
:data:`RETRIEVAL` (both) and :data:`WIN_RATE_EVALUATOR` (build time).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, cast

from prefect_tinker.recipes.registry import Registry
from prefect_tinker.recipes.rl.judge import JudgeRequest

__all__ = [
    "ENTRY_POINT_GROUP",
    "JUDGE",
    "PAIR_PREFERENCES",
    "RETRIEVAL",
    "SAMPLER",
    "SANDBOX",
    "SERVICES",
    "WIN_RATE_EVALUATOR",
    "CodeTester",
    "Judge",
    "MissingServiceError",
    "PairPreferences",
    "Retriever",
    "Sampler",
    "SearchIndex",
    "ServiceKey",
    "ServiceProvider",
    "ServiceResources",
    "Services",
    "register_service",
]

T = TypeVar("T")

#: Entry point group of third-party service providers.
ENTRY_POINT_GROUP = "prefect_tinker.services"


@dataclass(frozen=True)
class ServiceKey(Generic[T]):
    """The name of a service and the type it provides: ``ctx.service(KEY)`` is typed ``T``.

    Attributes:
        name: the registry name of its providers (``"judge"``).
        type: the class or Protocol the service satisfies (documentation and type checkers).
        description: one line for listings and error messages.
    """

    name: str
    type: Any = object
    description: str = ""


@dataclass(frozen=True)
class ServiceResources:
    """What a provider is given to make its service.

    Attributes:
        credentials: the backend credentials of the rollout task (a
            :class:`~tinker_blocks.credentials.TinkerCredentials` block); ``None`` at build time and
            in a rollout outside a task.
        backend: the identity of that backend (``TinkerCredentials.backend_identity()``; ``""``
            without credentials): with the key and provider, it keys the per-process cache, so two
            backends never share a service.
    """

    credentials: Any = field(default=None, compare=False)
    backend: str = ""

    def require_credentials(self, service: str) -> Any:
        """The credentials, for a provider that talks to the backend.

        Raises:
            RuntimeError: there are none here (the message names ``service``).
        """
        if self.credentials is None:
            raise RuntimeError(
                f"service {service!r} needs the backend credentials of a rollout task: roll out inside "
                "rollout_group, or give run_group_rollout services=Services(...) with them or with the service"
            )
        return self.credentials


#: ``provider(resources) -> service``: makes the service of one key (see the module docstring).
ServiceProvider = Callable[[ServiceResources], Any]

#: Registered service providers by key name: entry points of :data:`ENTRY_POINT_GROUP` and
#: :func:`register_service` calls (the task layer's built-ins among them).
SERVICES: Registry[ServiceProvider] = Registry("service", ENTRY_POINT_GROUP)


class MissingServiceError(LookupError):
    """An environment asked for a service that no provider is registered for."""


def register_service(key: ServiceKey[T], provider: Callable[[ServiceResources], T]) -> Callable[[ServiceResources], T]:
    """Register ``provider`` for ``key`` (a later registration replaces an earlier one: tests and
    plugins may override a built-in) and return it."""
    SERVICES.register(key.name, provider)
    return provider


_instances: dict[tuple[str, Any, ServiceResources], Any] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class Services:
    """Resolves service keys for one context: ``given`` services first (a caller lending a ready
    one, e.g. a test's scripted judge), then the registered provider, whose service is made once
    per process, key, provider and ``resources``."""

    resources: ServiceResources = field(default_factory=ServiceResources)
    given: Mapping[str, Any] = field(default_factory=dict, hash=False)  # hashed by resources: contexts stay hashable

    def has(self, key: ServiceKey[Any]) -> bool:
        """Whether ``key`` is given or has a registered provider."""
        return key.name in self.given or key.name in SERVICES

    def get(self, key: ServiceKey[T]) -> T:
        """The service of ``key``.

        Raises:
            MissingServiceError: no provider is registered for ``key`` (the message names the key
                and the registered services).
            RuntimeError: the provider cannot make the service here (e.g. no credentials).
        """
        if key.name in self.given:
            return cast(T, self.given[key.name])
        if key.name not in SERVICES:
            what = f" ({key.description})" if key.description else ""
            raise MissingServiceError(
                f"no provider for service {key.name!r}{what}; registered services: "
                f"{', '.join(SERVICES.names()) or '(none)'}; register one with register_service or the "
                f"{ENTRY_POINT_GROUP} entry point group"
            )
        provider = SERVICES[key.name]
        cache_key = (key.name, provider, self.resources)
        with _lock:
            if cache_key not in _instances:
                _instances[cache_key] = provider(self.resources)
            return cast(T, _instances[cache_key])


class Judge(Protocol):
    """``judge(request) -> answer text``: a :class:`~prefect_tinker.recipes.rl.judge.JudgeRequest`
    graded by its judge model."""

    def __call__(self, request: JudgeRequest, /) -> str: ...


class PairPreferences(Protocol):
    """``pair_preferences(reward model sampler path, [(comparison, swapped comparison), ...])`` ->
    the reward model's preference in [0, 1] per pair (one float each)."""

    def __call__(self, path: str, comparisons: list[tuple[Any, Any]], /) -> list[float]: ...


class Sampler(Protocol):
    """``sampler(path) -> client`` with the SDK's ``sample`` interface for other weights on the
    task's backend (``base:<model>`` or ``tinker://.../sampler_weights/...``)."""

    def __call__(self, path: str, /) -> Any: ...


class CodeTester(Protocol):
    """``tester(code, tests, entry_point, timeout) -> CodeTestResult``: run ``code`` then ``tests``
    (defining ``check(candidate)``) then ``check(entry_point)`` in a sandbox, at most ``timeout``
    seconds (:func:`prefect_tinker.recipes.sandbox.run_tests` and its result)."""

    def __call__(self, code: str, tests: str, entry_point: str, timeout: float = 10.0, /) -> Any: ...


class SearchIndex(Protocol):
    """A searchable document collection (e.g. :class:`~prefect_tinker.recipes.tools.BM25Index`)."""

    def search(self, query: str, k: int = 3) -> list[Any]:
        """The top ``k`` passages for ``query``, best first."""
        ...

    def as_tool(self, k: int = 3, *, name: str = "search", max_passage_chars: int = 1500) -> Any:
        """The index as a :class:`~prefect_tinker.recipes.tools.Tool` the policy calls."""
        ...


class Retriever(Protocol):
    """``retriever(documents, sha256, text_field, id_field) -> SearchIndex``: the index of the JSONL
    collection at ``documents`` (content ``sha256``), documents read from ``text_field`` and
    ``id_field`` (None: line numbers); raises ValueError naming file and line for a bad record."""

    def __call__(
        self, documents: str, sha256: str, text_field: str = "text", id_field: str | None = "id", /
    ) -> Any: ...


#: The judge of judged envs (rubric): the rollout task's cached ``judge-reply`` task.
JUDGE: ServiceKey[Judge] = ServiceKey("judge", Judge, "a JudgeRequest graded by its judge model")
#: The pairwise reward model client (pairwise_preference): the cached ``reward-label-logprobs`` task.
PAIR_PREFERENCES: ServiceKey[PairPreferences] = ServiceKey(
    "pair_preferences", PairPreferences, "pairwise reward model preferences"
)
#: Sampling clients of other weights (an answerer, an opponent), created once per process.
SAMPLER: ServiceKey[Sampler] = ServiceKey("sampler", Sampler, "sampling clients of other weights")
#: The code sandbox of code envs (humaneval).
SANDBOX: ServiceKey[CodeTester] = ServiceKey("sandbox", CodeTester, "code run against tests in a sandbox")
#: The search index of retrieval envs (retrieval), built once per process and collection.
RETRIEVAL: ServiceKey[Retriever] = ServiceKey("retrieval", Retriever, "search over a document collection")
#: The task layer's win-rate evaluator class (build time; see
#: :class:`prefect_tinker.tasks.reward_model.WinRateEvaluator` for its arguments).
WIN_RATE_EVALUATOR: ServiceKey[Callable[..., Any]] = ServiceKey(
    "win_rate_evaluator", object, "the win-rate evaluator of reward-model environments"
)
