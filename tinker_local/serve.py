"""Run ``tinker_local`` as a process: build the engine (and the sampler workers) under a root folder,
preload the models, and serve the app of ``tinker_local.server.create_app`` with uvicorn until
interrupted (``python -m tinker_local serve``, ``tinker_local.cli``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from .faults import FaultConfig
from .keys import KeyStore
from .loss_limits import GraphLimits
from .request_limits import RequestLimits
from .server import create_app
from .tenancy import Limits, is_loopback

logger = logging.getLogger("tinker_local.server")


def serve(
    model: list[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    root: Path | str = ".",
    *,
    dtype: str = "auto",
    device: str | None = None,
    num_threads: int | None = None,
    log_level: str = "info",
    faults: FaultConfig | None = None,
    custom_loss_server_side: bool = True,
    jwt_auth: bool = False,
    sampler_workers: int = 0,
    tls_cert: Path | str | None = None,
    tls_key: Path | str | None = None,
    limits: Limits | None = None,
    record_requests: Path | str | None = None,
    content_seeds: bool = False,
    default_lora_seed: int | None = None,
    request_limits: RequestLimits | None = None,
    graph_limits: GraphLimits | None = None,
    max_base_model_bytes: int | None = None,
) -> None:
    """Build an Engine under ``root``, preload ``model`` names, and serve until interrupted.

    ``sampler_workers`` N > 0: sampling runs in N worker processes next to the trainer
    (``tinker_local.sampler_pool``); ``num_threads`` (default: the CPUs this process may use) is
    then the total, split by ``split_threads`` (each worker ``total // (N + 1)``, the trainer the
    rest).  The workers are ready before the port is bound.

    Blocking. Models named later in ``create_model`` calls are loaded lazily by the engine.
    ``faults``: fault injection for reliability tests (default: from the environment,
    ``TINKER_LOCAL_FAIL_EVERY`` / ``TINKER_LOCAL_DROP_EVERY``).
    ``tls_cert``/``tls_key``: PEM files; the server then speaks HTTPS (uvicorn's ``ssl_certfile`` /
    ``ssl_keyfile``).  ``limits``: per-user limits (``tinker_local.tenancy.Limits``);
    ``request_limits`` / ``graph_limits``: bounds of one request and of uploaded custom losses
    (``tinker_local.request_limits``, ``tinker_local.loss_limits``; None: the defaults);
    ``max_base_model_bytes``: bytes of base models kept loaded by the trainer's engine (least
    recently used unloaded first; None: half of the device's memory, ``default_base_budget``).
    Raises whatever the engine raises for an unknown model name (before binding the port);
    ``InsecureBind`` before loading anything when ``host`` is not a loopback address and the
    server has no API keys.
    """
    import uvicorn

    from .compute import keep_freed_memory
    from .engine import Engine

    keep_freed_memory()  # no page faults on every step's activations (see its docstring)
    root = Path(root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    check_bind(host, root)
    pool = None
    if sampler_workers > 0:
        from .compute import available_cpus
        from .sampler_pool import SamplerPool, split_threads

        total = int(num_threads or available_cpus())
        num_threads, per_worker = split_threads(total, sampler_workers)
        if num_threads + sampler_workers * per_worker > total:
            logger.warning(
                "--threads %d is less than --sampler-workers %d + 1: trainer and workers "
                "use %d threads in all, more than asked",
                total,
                sampler_workers,
                num_threads + sampler_workers * per_worker,
            )
        logger.info("threads: trainer %d, %d sampler worker(s) x %d", num_threads, sampler_workers, per_worker)
        pool = SamplerPool(
            root, sampler_workers, threads_per_worker=per_worker, device=device, dtype=dtype, preload=list(model)
        )
    engine = Engine(root, device=device, dtype=dtype, num_threads=num_threads)
    engine.max_base_bytes = max_base_model_bytes or default_base_budget(engine.device)
    logger.info("base models: at most %.2f GB loaded at once", engine.max_base_bytes / 1e9)
    for name in model:
        t0 = time.monotonic()
        info = engine.load_base_model(name)
        logger.info(
            "preloaded %s in %.1fs (tokenizer %s, context %s)",
            name,
            time.monotonic() - t0,
            info.get("tokenizer_id"),
            info.get("max_context"),
        )
    if pool is not None:
        t0 = time.monotonic()
        pool.start(wait_ready=True)
        logger.info("%d sampler worker(s) ready in %.1fs", sampler_workers, time.monotonic() - t0)
    faults = faults if faults is not None else FaultConfig.from_env()
    if faults.active:
        logger.warning(
            "fault injection on: 503 every %d requests, connection drop every %d", faults.fail_every, faults.drop_every
        )
    app = create_app(
        engine,
        root,
        models=list(model),
        faults=faults,
        custom_loss_server_side=custom_loss_server_side,
        jwt_auth=jwt_auth,
        sampler_pool=pool,
        limits=limits,
        record_requests=record_requests,
        content_seeds=content_seeds,
        default_lora_seed=default_lora_seed,
        request_limits=request_limits,
        graph_limits=graph_limits,
    )
    scheme = "https" if tls_cert else "http"
    logger.info(
        "tinker_local serving %s on %s://%s:%d (root %s, %d API key(s))",
        ", ".join(model) or "-",
        scheme,
        host,
        port,
        root,
        len(KeyStore(root).entries()),
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        ssl_certfile=str(tls_cert) if tls_cert else None,
        ssl_keyfile=str(tls_key) if tls_key else None,
    )


def default_base_budget(device) -> int:
    """Half the memory of ``device`` (a ``torch.device``): the GPU's for CUDA, else physical RAM."""
    import os

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 2
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


class InsecureBind(RuntimeError):
    """``serve`` on a non-loopback address of a server without API keys."""


def check_bind(host: str, root: Path) -> None:
    """Raise ``InsecureBind`` (one line saying how to add a key) when ``host`` is not a loopback
    address and ``root`` holds no API keys: anyone reaching the port could use the server."""
    if not is_loopback(host) and not KeyStore(root).any():
        raise InsecureBind(
            f"refusing to serve on {host}: the server in {root} has no API keys, so anyone "
            f"who can reach it could use it; add one first: prefect-tinker local keys add NAME "
            f"--root {root}"
        )
