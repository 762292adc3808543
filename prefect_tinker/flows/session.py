"""The run session: what every recipe's run shares, from the store check to the summary artifact.

A recipe's flow opens one session, trains inside it (usually through
:class:`~prefect_tinker.flows.loop.StepLoop`), and finishes it::

    with RunSession(config) as session:
        data = prepare_dataset(session.dataset_builder, session.tokenizer_id)
        StepLoop(session, total, evaluators=[...]).run(one_step)
        return session.finish({"first_loss": ...})

The session reads what the run needs from the config, through the recipe protocol every recipe's
config implements (:class:`~prefect_tinker.flows.config.RecipeConfig`, the same methods
``prefect-tinker run`` calls before it starts the flow): ``dataset_builder(renderer)`` (its
``check()`` before anything starts, its fingerprint recorded), ``preflight()``,
``data_fingerprint(renderer)`` (the data's identity when there is no builder: an RL environment's
problems), ``env_context(renderer, tokenizer_id)`` (an RL run's environment context) and
``resume_fields()`` (the fields marked ``RESUME``).

Opening (:meth:`RunSession.__enter__`):

0. the config's checks: ``dataset_builder(renderer).check()`` (every record of the local data
   files) and ``preflight()``;
1. the weights to start from (``model`` / ``load_checkpoint_path`` may be ``alias:LINE@ALIAS`` or
   ``run:RUN`` references, resolved once: :meth:`~prefect_tinker.flows.config.RecipeConfig.start_weights`;
   :attr:`RunSession.config` is the config with them resolved), the backend's credentials
   (:func:`~prefect_tinker.flows.config.resolve_credentials`), the store check (``check-store``:
   wrong S3 credentials fail before any training) and a slot of the backend's training limit
   (``tinker-train:<backend>``, :mod:`prefect_tinker.tasks.limits`: waits while it is full);
2. the resume point: the run's last state checkpoint in the training store; on resume the stored
   config is compared with the new one -- a change of a field in the config's ``resume_fields()``
   (batch size, seed, loss, ...), of the dataset's content fingerprint or of the resolved renderer
   would silently alter the data position or the objective, so it is a
   :class:`~prefect_tinker.flows.resume_checks.ResumeConfigError` naming the field, unless listed
   in ``allow_config_change`` (the checks: :mod:`prefect_tinker.flows.resume_checks`);
3. the training client (``open-training-run``: resumed with its optimizer state, or initialised
   from ``load_checkpoint_path``, whose recorded renderer must match this run's);
4. ``renderer="auto"`` resolved once (:func:`~prefect_tinker.recipes.renderers.resolve_renderer_name`);
5. the ``running`` row in ``runs`` with what the run resolved (``meta_json``).

While it runs: buffered store rows (:meth:`record`, :meth:`buffer`) written before each
checkpoint row (:meth:`checkpoint`), so a resumed run has exactly one row per key; rewinds after a
lost client (:meth:`rewind`); a ``prefect-tinker.checkpoint.saved`` event per recorded checkpoint
(:mod:`prefect_tinker.tasks.events`). Ctrl-C (:mod:`prefect_tinker.flows.interrupts`): while the
session is open the first SIGINT only sets :attr:`stop_requested`, which the step loop answers by
saving a checkpoint and raising :class:`~prefect_tinker.flows.interrupts.RunInterrupted`
(:meth:`interrupted`); that, or a second SIGINT's :class:`KeyboardInterrupt`, records the run
``interrupted``. On any other exception the run is recorded ``failed``. :meth:`finish` writes what
is left, records ``completed``, compacts the run's tables to one part each and posts the summary
artifact; either way a ``prefect-tinker.run.finished`` event says how it ended.

Callbacks (:class:`~prefect_tinker.flows.callbacks.RunCallbacks`, installed with
:func:`~prefect_tinker.flows.callbacks.run_callbacks`) let tests and plugins observe every run of the
process: ``after_step``, ``after_checkpoint``, ``before_compaction``. The buffered rows:
:mod:`prefect_tinker.flows.run_rows`; the summary artifact: :mod:`prefect_tinker.flows.run_summary`.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from prefect import get_run_logger

from prefect_tinker.flows.callbacks import emit
from prefect_tinker.flows.config import RecipeConfig, resolve_credentials
from prefect_tinker.flows.interrupts import RunInterrupted, StopRequest
from prefect_tinker.flows.resume_checks import (
    check_resumed_config,
    check_resumed_meta,
    check_same_recipe,
    check_start_renderer,
    warn_damaged_parts,
)
from prefect_tinker.flows.run_rows import RunRows
from prefect_tinker.flows.run_summary import post_run_summary
from prefect_tinker.recipes.file_reads import reading_once
from prefect_tinker.tasks.clients import ClientRewound, TrainingRun, run_tokenizer
from prefect_tinker.tasks.events import emit_checkpoint_saved, emit_run_finished
from prefect_tinker.tasks.limits import training_slot
from prefect_tinker.tasks.records import check_store, compact_finished_run, record_checkpoint, record_run
from prefect_tinker.tasks.reporting import report_run
from prefect_tinker.tasks.run_context import RunContext
from prefect_tinker.tasks.runners import TaskRunnerFields
from prefect_tinker.tasks.training import open_training_run, save_checkpoint, save_sampler_weights

if TYPE_CHECKING:
    from prefect_tinker.recipes.builders import DatasetBuilder
    from tinker_blocks.credentials import TinkerCredentials
    from tinker_blocks.lease import Lease

__all__ = ["RunSession"]


ConfigT = TypeVar("ConfigT", bound=RecipeConfig, covariant=True)


class RunSession(Generic[ConfigT]):
    """The lifecycle of one training run (see the module docstring).

    Args:
        config: the recipe's config (a :class:`~prefect_tinker.flows.config.RecipeConfig`): its
            ``dataset_builder``, ``preflight``, ``data_fingerprint``, ``env_context`` and
            ``resume_fields`` are called as the module docstring says.
        credentials: the backend's credentials when the flow resolved them already (distillation
            checks its teachers with them before the session opens); None: resolved on opening.
        upstream: asset URIs the run's checkpoints depend on (besides the data and the start).

    Attributes (after entering): ``context`` (the :class:`~prefect_tinker.tasks.run_context.RunContext`
    resolved once: credentials, store, renderer, tokenizer, data fingerprint, env context, task
    runner), ``credentials``, ``backend``, ``model`` (the base model name checked for the backend),
    ``store`` (the run's one :class:`~tinker_blocks.stores.TrainingStore`: every row and query of
    the session goes through it), ``rows`` (its rows buffered until the next checkpoint: a
    :class:`~prefect_tinker.flows.run_rows.RunRows`), ``run`` (the :class:`~prefect_tinker.tasks.clients.TrainingRun`
    handle), ``renderer`` (resolved), ``tokenizer_id`` (the config's ``tokenizer``, else the one
    the backend names), ``builder``, ``resumed_from`` (the state
    checkpoint row resumed, or None), ``samplers`` (optimizer step -> sampler path recorded for
    this run).

    While the session is open each local data file is opened and hashed once
    (:func:`~prefect_tinker.recipes.file_reads.reading_once`).
    """

    def __init__(
        self,
        config: ConfigT,
        *,
        credentials: TinkerCredentials | None = None,
        upstream: list[str] | None = None,
    ):
        self.config, self.given, self.recipe = config, config, config.recipe or type(config).__name__.lower()
        self.run_id = cast(str, config.run_name)  # set by the config's validator
        self._credentials = credentials
        self.lease: Lease | None = None
        self.upstream = list(upstream or [])
        self.samplers: dict[int, str] = {}
        self._recorded_samplers: set[int] = set()
        self.checkpoints: list[str] = []
        self.builder: DatasetBuilder | None = None
        self.resumed_from: dict[str, Any] | None = None
        self.saved_step: int | None = None
        self._status_recorded = False
        self._reads = ExitStack()
        self.line: str | None = None  # the model line of an ``alias:`` start
        self.start_ref: str | None = None  # the reference the run started from, as given
        self._stop = StopRequest()
        self._run: TrainingRun | None = None  # the training client's handle, from opening on

    # ----- opening -----------------------------------------------------------------------------
    def __enter__(self) -> RunSession[ConfigT]:
        c = self.given
        # a bad model name or bad data fails first: before a server starts, a lease is taken or a row is written
        base, start, ref = c.start_weights()
        self.model = c.check_model(base)
        if ref is not None:  # the references resolved once: the run trains from what they named now
            self.config = cast(ConfigT, c.model_copy(update={"model": base, "load_checkpoint_path": start}))
            self.line = ref.line
            self.start_ref = c.model if c.model != base else c.load_checkpoint_path
        self._reads.enter_context(self._stop)  # Ctrl-C from now on: stop at the next step boundary
        self._reads.enter_context(reading_once())  # each local data file opened and hashed once per run
        try:
            checked = c.dataset_builder(c.renderer)
            if checked is not None:
                checked.check()
            c.preflight()
            self.credentials = self._credentials or resolve_credentials(c.backend)
            self.backend = self.credentials.backend_name()
            from tinker_blocks.stores import TrainingStore

            self.store = TrainingStore(root=c.store)  # the run's one store object: every row and query
            self.rows = RunRows(self.store, self.run_id)  # rows buffered until the next checkpoint
            check_store(self.store)  # wrong credentials / unwritable store: fail before any training
            self.lease = self._acquire_lease()
            # a slot of the backend's training limit, held until the run ends (waits while it is full)
            self._reads.enter_context(training_slot(self.credentials, self.run_id))
        except BaseException:
            self._release()  # the data files, and the lease when it was taken
            raise
        try:
            return self._open()
        except BaseException:
            self._release()
            raise

    def _acquire_lease(self) -> Any:
        """One writer per run name: the run's lease in the store (a second run with this name
        fails now, naming the holder; a crashed holder's lease is taken over after its timeout)."""
        from tinker_blocks.lease import acquire_lease

        try:
            from prefect.runtime import flow_run

            owner = f"flow run {flow_run.name} ({flow_run.id})" if flow_run.id else None
        except Exception:  # outside a flow run
            owner = None
        return acquire_lease(self.store, self.run_id, owner=owner)

    def _release(self) -> None:
        self._reads.close()
        if self.lease is not None:
            try:
                self.lease.release()
            except Exception as exc:  # the lease goes stale on its own; say why it was not released
                get_run_logger().warning("could not release the lease of run %s: %s", self.run_id, exc)
            self.lease = None

    def _open(self) -> RunSession[ConfigT]:
        c, log = self.config, get_run_logger()
        stored = self.store.get_run(self.run_id)
        rows = self.store.query(
            "SELECT step, kind, path FROM checkpoints WHERE run_id = ? ORDER BY step, time", [self.run_id]
        )
        states = [r for r in rows if r["kind"] == "state"]
        self.samplers = {int(r["step"]): r["path"] for r in rows if r["kind"] == "sampler"}
        self._recorded_samplers = set(self.samplers)
        last = states[-1] if states else None
        if stored:  # the name is taken: by a run of this recipe, whose config may change only where it is safe
            check_same_recipe(self.run_id, json.loads(stored.get("meta_json") or "null") or {}, self.recipe)
        if last and stored:  # the config as given (references unresolved) against the stored one
            check_resumed_config(self.given, self.run_id, json.loads(stored.get("config_json") or "{}"))
        self.run = open_training_run(
            self.credentials,
            self.run_id,
            self.model,
            c.lora_rank,
            self.backend,
            seed=c.seed,
            resume_from=last["path"] if last else None,
            resume_step=int(last["step"]) if last else 0,
            init_from=None if last else c.load_checkpoint_path,
        )
        self.tokenizer_id, tok = run_tokenizer(self.run_id, self.model, c.tokenizer, self.run.tokenizer_id)
        from prefect_tinker.recipes.renderers import resolve_renderer_name

        self.renderer = resolve_renderer_name(c.renderer, tok)
        given = self.given  # the hooks of the config as given (its references unresolved)
        self.builder = given.dataset_builder(self.renderer)
        data_fp = self.builder.fingerprint() if self.builder is not None else given.data_fingerprint(self.renderer)
        self.meta = {
            "recipe": self.recipe,
            "renderer": self.renderer,
            "tokenizer_id": self.tokenizer_id,
            "dataset_fingerprint": data_fp,
            "init_from": c.load_checkpoint_path,
            **({"start": self.start_ref} if self.start_ref else {}),
            **({"line": self.line} if self.line else {}),
        }
        if last and stored:
            check_resumed_meta(c, self.run_id, json.loads(stored.get("meta_json") or "null") or {}, self.meta)
        elif c.load_checkpoint_path:
            check_start_renderer(c, self.store, c.load_checkpoint_path, self.renderer)
        if last:
            self.resumed_from, self.saved_step = last, int(last["step"])
            log.info("resuming run %s after its checkpoint at step %d (%s)", self.run_id, last["step"], last["path"])
            warn_damaged_parts(self.store, self.run_id)
        elif stored:  # interrupted or failed before its first checkpoint
            log.warning("no checkpoint of run %r yet: starting at step 1", self.run_id)
        self.context = RunContext(
            run_id=self.run_id,
            recipe=self.recipe,
            model=self.model,
            credentials=self.credentials,
            store=self.store,
            store_root=c.store,
            renderer=self.renderer,
            tokenizer_id=self.tokenizer_id,
            dataset_fingerprint=data_fp,
            evaluators=tuple(c.evaluators),
            inspect_backend=c.backend.inspect_args(),
            task_runner=c if isinstance(c, TaskRunnerFields) else None,
            env=given.env_context(self.renderer, self.tokenizer_id),
        )
        self._record("running")
        return self

    def _record(self, status: str) -> None:
        c = self.given  # as given: a resumed run compares its references, not what they named then
        record_run(
            self.store, self.run_id, self.model, self.backend, c.lora_rank, c.model_dump_json(), status, self.meta
        )
        self._status_recorded = True

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        # after a second Ctrl-C, an error is that interrupt as a library re-raised it (DuckDB: "Query interrupted")
        forced = exc is not None and not isinstance(exc, RunInterrupted) and self._stop.forced
        stopped = forced or isinstance(exc, (RunInterrupted, KeyboardInterrupt))
        try:
            if exc is not None and self._status_recorded:
                status = "interrupted" if stopped else "failed"
                try:
                    self._record(status)
                except Exception as inner:  # the original error matters more; say why the row is missing
                    get_run_logger().error("could not record run %s as %s: %s", self.run_id, status, inner)
                self._finished(status, error=None if stopped else f"{type(exc).__name__}: {exc}")
        finally:
            self._release()
        if forced or isinstance(exc, KeyboardInterrupt):  # the second Ctrl-C: stopped at once, nothing more saved
            raise self.interrupted() from None

    def _finished(self, status: str, error: str | None = None) -> None:
        """The ``prefect-tinker.run.finished`` event."""
        emit_run_finished(
            self.run_id,
            recipe=self.recipe,
            status=status,
            steps=self.step,
            checkpoints=[*self.checkpoints, *(self.samplers[s] for s in sorted(self._recorded_samplers))],
            line=self.line,
            error=error,
            store=self.config.store,
        )

    def _saved(self, path: str, kind: str, step: int) -> None:
        """The ``prefect-tinker.checkpoint.saved`` event of a recorded checkpoint."""
        emit_checkpoint_saved(
            path,
            kind=kind,
            run_id=self.run_id,
            step=step,
            recipe=self.recipe,
            line=self.line,
            state_path=self.checkpoints[-1] if kind == "sampler" and self.checkpoints else None,
            renderer=self.renderer,
            store=self.config.store,
            backend=self.given.backend.model_dump(mode="json"),
        )

    # ----- while training ----------------------------------------------------------------------
    @property
    def dataset_builder(self) -> DatasetBuilder:
        """The run's dataset builder for the resolved renderer.

        Raises:
            RuntimeError: the config has no dataset builder (``dataset_builder`` returned None).
        """
        if self.builder is None:
            raise RuntimeError(f"run {self.run_id!r}: this session has no dataset builder")
        return self.builder

    @property
    def run(self) -> TrainingRun:
        """The training client's handle (each step replaces it).

        Raises:
            RuntimeError: the session is not open yet.
        """
        if self._run is None:
            raise RuntimeError(f"run {self.run_id!r}: this session is not open")
        return self._run

    @run.setter
    def run(self, run: TrainingRun) -> None:
        self._run = run

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        return self.run.step

    @property
    def stop_requested(self) -> bool:
        """Whether Ctrl-C (SIGINT) asked the run to stop at the next step boundary."""
        return self._stop.requested

    def interrupted(self) -> RunInterrupted:
        """The :class:`~prefect_tinker.flows.interrupts.RunInterrupted` of stopping now: its step and
        the step of the run's last state checkpoint."""
        step = self._run.step if self._run is not None else self.saved_step
        return RunInterrupted(self.run_id, step if step is not None else 0, self.saved_step)

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """Buffer ``metrics`` (full names, e.g. ``train/loss``) as rows at ``step``."""
        self.rows.record(step, metrics)

    def buffer(self, table: str, rows: list[dict[str, Any]]) -> None:
        """Buffer rows of another training-store table (each with a ``step``), written with the
        metrics before the next checkpoint row."""
        self.rows.buffer(table, rows)

    def flush(self) -> None:
        """Write every buffered row now (metrics first)."""
        self.rows.flush()

    def rewind(self, rew: ClientRewound) -> None:
        """Continue from the checkpoint at ``rew.step`` after the client was lost: the handle comes
        from ``rew``; buffered rows of later steps are dropped (they will be redone)."""
        get_run_logger().warning("%s; continuing from step %d", rew, rew.step)
        self.run, self.saved_step = rew.run, rew.step
        self.rows.drop_from(rew.step)

    def _upstream(self) -> list[str]:
        c = self.config
        return [
            *(self.builder.uris() if self.builder is not None else []),
            *self.upstream,
            *([c.load_checkpoint_path] if c.load_checkpoint_path else []),
        ]

    def save_sampler(self, name: str | None = None, *, record: bool = False, asset: bool = False) -> str:
        """Save sampler weights of the current step (``save-sampler-weights``, or with ``asset``
        the ``save-checkpoint`` asset materialization); kept in :attr:`samplers`, and recorded in
        ``checkpoints`` with the next checkpoint (``record``: now)."""
        name = name or self.checkpoint_name(self.step)
        if asset:
            self.run, path = save_checkpoint(self.credentials, self.run, name, "sampler", upstream=self._upstream())
        else:
            path = save_sampler_weights(self.credentials, self.run, name)
        self.samplers[self.step] = path
        if record:
            self._record_sampler(self.step)
        return path

    def sampler_at(self, step: int) -> str:
        """The sampler path of ``step``, saving one when the current step has none.

        Raises:
            KeyError: ``step`` is not the current step and no sampler was saved at it.
        """
        if step not in self.samplers and step == self.step:
            self.save_sampler()
        return self.samplers[step]

    def _record_sampler(self, step: int) -> None:
        if step in self.samplers and step not in self._recorded_samplers:
            record_checkpoint(self.store, self.run_id, step, self.samplers[step], "sampler", self.renderer)
            self._recorded_samplers.add(step)
            self._saved(self.samplers[step], "sampler", step)

    def checkpoint_name(self, step: int) -> str:
        return f"{self.run_id}-step-{step:06d}"

    def checkpoint(self) -> str:
        """State checkpoint at the current step (weights + optimizer, an asset with the data and
        the start weights upstream); writes the buffered rows, the sampler row of this step (if
        any), then the state row -- the resume marker -- and posts the report. Returns the path."""
        done = self.step
        if self.lease is not None:
            self.lease.check()  # LeaseLostError: another writer took the run over; write nothing more
        self.run, path = save_checkpoint(
            self.credentials, self.run, self.checkpoint_name(done), "state", upstream=self._upstream()
        )
        self.flush()
        self._record_sampler(done)
        record_checkpoint(self.store, self.run_id, done, path, "state", self.renderer)
        self.checkpoints.append(path)
        self._saved(path, "state", done)
        self.saved_step = done
        self.report(done)
        emit(lambda cb: cb.after_checkpoint, self.run_id, done, path)
        return path

    def report(self, step: int) -> None:
        """The run's latest-metrics table and curves picture (``report-run``)."""
        from prefect_tinker.flows.registry import get_recipe

        curves = get_recipe(self.recipe).curves if self.recipe else ()
        report_run(self.store, self.run_id, step, kind=self.recipe, curves=curves)

    def metric_ends(self, name: str) -> tuple[Any, Any]:
        """``(value at the first step, value at the last step)`` of metric ``name`` over the whole
        run (every invocation), read back from the store after writing what is buffered."""
        return self.rows.metric_ends(name)

    def metric_sum(self, name: str) -> float:
        """Sum of metric ``name`` over the whole run (e.g. ``train/tokens``)."""
        return self.rows.metric_sum(name)

    # ----- the end ---------------------------------------------------------------------------
    def finish(self, summary: dict[str, Any], *, title_fields: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write what is buffered, record ``completed``, compact the run's tables (one part per
        table: S3 queries cost a request per part) and post the summary artifact.

        Returns ``summary`` with ``run_name``, ``steps`` (optimizer steps taken), ``renderer``,
        ``checkpoints`` (every checkpoint path of the run, all invocations) and ``store`` added.
        """
        self.flush()
        self._record("completed")
        emit(lambda cb: cb.before_compaction, self.run_id)
        compact_finished_run(self.store, self.run_id)
        rows = self.store.query("SELECT path FROM checkpoints WHERE run_id = ? ORDER BY step, kind", [self.run_id])
        out = {
            "run_name": self.run_id,
            "steps": self.step,
            "renderer": self.renderer,
            **summary,
            "checkpoints": [r["path"] for r in rows],
            "store": self.config.store,
        }
        post_run_summary(
            self.recipe, self.run_id, self.model, self.renderer, self.config.store, out, title_fields or {}
        )
        self._finished("completed")
        return out
