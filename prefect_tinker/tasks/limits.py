"""Prefect global concurrency limits per backend: training and sampling clients take slots, sampling
requests are rate-limited.

- ``tinker-train:<backend>``: a slot is held by a run session from before its training client opens
  until the run ends;
- ``tinker-sample:<backend>``: a slot is held by an evaluation batch while it samples (``eval-batch``);
- ``tinker-sample-rate:<backend>``: a rate limit (its slot decay is the sampling requests per second
  the backend allows): each sampling request through the client registry takes one slot.

``<backend>`` is the credentials' :meth:`~tinker_blocks.credentials.TinkerCredentials.backend_name`
(``local``, ``remote``, ``hosted``). A limit that does not exist on the Prefect server costs nothing
and limits nothing, so the flows run unchanged until one is created (``prefect-tinker ops
install-limits --train 1``, or Prefect's own ``prefect gcl create``). A run beyond the limit waits
for a slot -- its progress line says so, with the slots in use -- instead of failing the way the
hosted service answers ``concurrent LoRA rate limit hit``. Slots are leases (Prefect renews them
while the run lives), so a killed run's slot frees itself.

Source: Prefect's global concurrency limits and rate limits
(https://docs.prefect.io/v3/how-to-guides/workflows/global-concurrency-limits).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from prefect_tinker.recipes.progress import phase

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = [
    "LimitState",
    "RateLimitedSampler",
    "limit_state",
    "sample_limit_name",
    "sample_rate_limit_name",
    "sampling_slot",
    "train_limit_name",
    "training_slot",
    "wait_sample_rate",
]

#: seconds a slot's lease lasts between renewals (Prefect renews it while the holder lives)
LEASE_SECONDS = 300.0
#: seconds of the first try for a slot; a holder still waiting after it says so (and waits on)
FIRST_TRY_S = 1.0
#: seconds a "this limit does not exist" answer (and, for callers that need no slot counts, a "this
#: limit exists" one) is trusted before asking the server again
_KNOWN_TTL = 30.0


def train_limit_name(credentials: TinkerCredentials) -> str:
    """``tinker-train:<backend>``."""
    return f"tinker-train:{credentials.backend_name()}"


def sample_limit_name(credentials: TinkerCredentials) -> str:
    """``tinker-sample:<backend>``."""
    return f"tinker-sample:{credentials.backend_name()}"


def sample_rate_limit_name(credentials: TinkerCredentials) -> str:
    """``tinker-sample-rate:<backend>``."""
    return f"tinker-sample-rate:{credentials.backend_name()}"


class LimitState:
    """A global concurrency limit as the server reports it: ``name``, ``limit`` (slots),
    ``active_slots`` (in use), ``slot_decay_per_second`` (> 0: a rate limit)."""

    def __init__(self, name: str, limit: int, active_slots: int, slot_decay_per_second: float):
        self.name, self.limit, self.active_slots = name, int(limit), int(active_slots)
        self.slot_decay_per_second = float(slot_decay_per_second or 0.0)

    @property
    def full(self) -> bool:
        """No slot free now."""
        return self.active_slots >= self.limit


_known: dict[str, tuple[float, LimitState | None]] = {}  # name -> (time.monotonic() asked, answer)
_known_lock = threading.Lock()


def limit_state(name: str, *, counts: bool = True) -> LimitState | None:
    """The active limit ``name`` on the Prefect server, or None when it does not exist, is
    inactive, no Prefect API is configured (``PREFECT_API_URL``) or none answers (then nothing is
    limited). Each answer is remembered for 30 s: a missing limit is not asked for again meanwhile,
    nor is an existing one when ``counts`` is False (the caller needs whether it exists and its
    ``slot_decay_per_second``, not its ``active_slots``, which are then up to 30 s old), so callers
    on a hot path (one sampling request each) ask the server rarely."""
    with _known_lock:
        asked, known = _known.get(name, (-1e9, None))
    if time.monotonic() - asked < _KNOWN_TTL and (known is None or not counts):
        return known
    if not _api_configured():  # never start Prefect's in-process ephemeral API just to ask
        return None
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            found = client.read_global_concurrency_limit_by_name(name)
    except Exception:  # not found, no API, an old server: no limit
        found = None
    state = None
    if found is not None and found.active:
        state = LimitState(found.name, found.limit, found.active_slots, found.slot_decay_per_second or 0.0)
    with _known_lock:
        _known[name] = (time.monotonic(), state)
    return state


def _api_configured() -> bool:
    from prefect.settings import get_current_settings

    return bool(os.environ.get("PREFECT_API_URL") or get_current_settings().api.url)


@contextmanager
def _slot(name: str, run: str, what: str) -> Iterator[None]:
    state = limit_state(name)
    if state is None or state.slot_decay_per_second > 0:
        yield
        return
    from prefect.concurrency.sync import concurrency

    with ExitStack() as held:
        try:  # a short first try: a run announces a wait only when the limit really holds it back
            held.enter_context(
                concurrency(name, occupy=1, timeout_seconds=FIRST_TRY_S, lease_duration=LEASE_SECONDS, strict=False)
            )
        except TimeoutError:  # Prefect's AcquireConcurrencySlotTimeoutError
            now = limit_state(name) or state
            used = f"{max(now.active_slots, now.limit)} of {now.limit} in use"
            with phase(run, f"waiting for a slot of {name} ({used}) for {what}"):
                _log(f"{run}: {name} is full ({used}): waiting for a slot")
                held.enter_context(concurrency(name, occupy=1, lease_duration=LEASE_SECONDS, strict=False))
        yield


def _log(message: str) -> None:
    try:
        from prefect import get_run_logger

        get_run_logger().info(message)
    except Exception:  # outside a run
        pass


@contextmanager
def training_slot(credentials: TinkerCredentials, run_id: str) -> Iterator[None]:
    """Hold a slot of ``tinker-train:<backend>`` for the body (a run's whole training); waits,
    announcing it, while the limit is full. No limit on the server: returns at once."""
    with _slot(train_limit_name(credentials), run_id, "its training client"):
        yield


@contextmanager
def sampling_slot(credentials: TinkerCredentials, what: str) -> Iterator[None]:
    """Hold a slot of ``tinker-sample:<backend>`` for the body (a batch of sampling requests)."""
    with _slot(sample_limit_name(credentials), what, "sampling"):
        yield


def wait_sample_rate(credentials: TinkerCredentials) -> None:
    """Take one slot of the rate limit ``tinker-sample-rate:<backend>`` (waiting while the rate
    is spent); returns at once when it does not exist. Whether it exists is asked of the
    Prefect API at most once per 30 s (:func:`limit_state` with ``counts=False``)."""
    name = sample_rate_limit_name(credentials)
    state = limit_state(name, counts=False)  # once per 30 s, not once per request
    if state is None or state.slot_decay_per_second <= 0:
        return
    from prefect.concurrency.sync import rate_limit

    rate_limit(name, occupy=1, strict=False)


class RateLimitedSampler:
    """A sampling client whose ``sample`` first takes a slot of the backend's sampling rate limit
    (:func:`wait_sample_rate`); everything else is the client's own."""

    def __init__(self, client: Any, credentials: TinkerCredentials):
        self.client, self.credentials = client, credentials

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        wait_sample_rate(self.credentials)
        return self.client.sample(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("client", "credentials"):
            raise AttributeError(name)
        return getattr(self.client, name)
