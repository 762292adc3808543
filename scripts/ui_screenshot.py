"""Screenshot of the Prefect UI showing a completed SFT deployment run with its task runs, a retried
task and the run's artifacts: ``docs/ui-sft-run.png``.

    python scripts/ui_screenshot.py [--out docs/ui-sft-run.png] [--keep]

Starts a Prefect server on 127.0.0.1 (temporary ``PREFECT_HOME``), registers the deployments of
``prefect.yaml``, starts a process worker, saves a ``TinkerCredentials`` block for the embedded
local server and runs ``sft/sft-tiny`` (12 steps). While it runs, the local server's folder for
sampler weights is blocked by a file (a disk fault, in place from the model's creation) until the
``save-sampler`` task has failed once and awaits its retry, so the page shows a retried task.
Then headless Chromium (Debian's
``chromium``) photographs the flow run (task runs tab), its artifacts, the retried task run and the
curves artifact, and Pillow stacks the pictures into one PNG. ``--keep`` leaves the stack running
to browse it (Ctrl-C stops it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.prefect_stack import PrefectStack, block_sampler_saves, local_training_runs, wait_until  # noqa: E402

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]


class Browser:
    """Headless Chromium (Debian's ``chromium``) driven over the DevTools protocol: navigate, click a
    tab by its text, and take screenshots at a fixed viewport."""

    def __init__(self, profile: Path):
        import re

        profile.mkdir(parents=True, exist_ok=True)
        log = profile / "chromium.log"
        with open(log, "wb") as fh:  # a file, not a pipe: chromium keeps writing to stderr
            self.proc = subprocess.Popen(
                ["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
                stdout=subprocess.DEVNULL, stderr=fh,
            )
        deadline = time.monotonic() + 60
        port = None
        while port is None and time.monotonic() < deadline:
            m = re.search(r"DevTools listening on ws://127.0.0.1:(\d+)/", log.read_text(errors="replace"))
            port = int(m.group(1)) if m else None
            time.sleep(0.2)
        if port is None:
            raise RuntimeError("chromium did not start its DevTools endpoint")
        import json
        import urllib.request

        from websockets.sync.client import connect

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:  # noqa: S310
            page = next(t for t in json.loads(r.read()) if t["type"] == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=64 * 2**20)
        self.seq = 0

    def call(self, method: str, **params) -> dict:
        import json

        self.seq += 1
        self.ws.send(json.dumps({"id": self.seq, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=120))
            if msg.get("id") == self.seq:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def shoot(self, url: str, out: Path, size: tuple[int, int], click: str | None = None, wait_text: str = "",
              scroll: bool = False) -> Path:
        """Open ``url`` at ``size``, optionally click the element whose text is ``click`` (and scroll it
        to the top with ``scroll``), wait until the page shows ``wait_text``, save a PNG to ``out``."""
        import base64

        self.call(
            "Emulation.setDeviceMetricsOverride", width=size[0], height=size[1], deviceScaleFactor=1, mobile=False
        )
        self.call("Page.navigate", url="about:blank")  # never act on the previous page's DOM
        wait_until(lambda: self.js("location.href") == "about:blank", 30, "about:blank")
        self.call("Page.navigate", url=url)
        wait_until(lambda: self.js("location.href.startsWith('http') && document.readyState === 'complete'"), 60, url)
        if click:
            finder = ("[...document.querySelectorAll('button,a,[role=tab],li')]"
                      f".find(e => e.textContent.trim() === {click!r} && e.offsetWidth > 0)")
            shows = f"document.body.innerText.includes({wait_text!r})"
            for attempt in range(4):  # the tab bar re-renders while the run loads: click until it took
                wait_until(lambda: self.js(f"!!({finder})"), 60, f"{click!r} on {url}")
                time.sleep(2)
                self.js(f"({finder}).click()")
                if scroll:
                    self.js(f"({finder}).scrollIntoView({{block: 'start'}})")
                try:
                    wait_until(lambda: self.js(shows), 15, f"{wait_text!r} after clicking {click!r}")
                    break
                except TimeoutError:
                    if attempt == 3:
                        raise
        if wait_text:
            wait_until(lambda: self.js(f"document.body.innerText.includes({wait_text!r})"), 60, f"{wait_text!r}")
        time.sleep(2.5)  # charts and images settle
        data = self.call("Page.captureScreenshot", format="png")["data"]
        out.write_bytes(base64.b64decode(data))
        return out

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)


def stack_images(paths: list[Path], out: Path, width: int) -> None:
    """Stack images vertically, each scaled to ``width`` pixels, as one optimised PNG (palette)."""
    from PIL import Image

    imgs = [Image.open(p).convert("RGB") for p in paths]
    imgs = [im.resize((width, round(im.height * width / im.width)), Image.LANCZOS) for im in imgs]
    canvas = Image.new("RGB", (width, sum(im.height for im in imgs) + 6 * (len(imgs) - 1)), (120, 120, 120))
    y = 0
    for im in imgs:
        canvas.paste(im, (0, y))
        y += im.height + 6
    canvas.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)


def parse_ui_args(description: str, out_name: str, argv: list[str] | None) -> argparse.Namespace:
    """The screenshot scripts' command line (``--out docs/<out_name>``, ``--width``, ``--keep``); also sets the
    offline, no-telemetry environment the stack runs in."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=str(ROOT / "docs" / out_name))
    p.add_argument("--width", type=int, default=1000, help="width of the final picture (pixels)")
    p.add_argument("--keep", action="store_true", help="keep the stack running after the screenshot")
    args = p.parse_args(argv)
    os.environ.update(HF_HUB_OFFLINE="1", TINKER_TELEMETRY="0", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    return args


@contextlib.contextmanager
def ui_stack(tmp: Path, local_root: Path) -> Iterator[PrefectStack]:
    """A Prefect server on 127.0.0.1 (``PREFECT_HOME`` under ``tmp``) with the deployments of ``prefect.yaml``
    and the ``TinkerCredentials`` block ``local-tiny`` (embedded local server at ``local_root``, model ``tiny``).
    On exit (an exception or Ctrl-C included: they go on to the caller) the stack and the local server stop."""
    stack = PrefectStack(tmp / "prefect-home")
    try:
        stack.start_server()
        stack.deploy_all()
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from tinker_blocks import TinkerCredentials

        with temporary_settings({PREFECT_API_URL: stack.api_url}):
            TinkerCredentials(local=True, local_root=str(local_root), local_models=["tiny"]).save(
                "local-tiny", overwrite=True
            )
        yield stack
    finally:
        stack.close()
        from tinker_blocks.credentials import stop_local_server

        stop_local_server(local_root)


def photograph(tmp: Path, pages: Callable[[Browser, Path], list[Path]], args: argparse.Namespace,
               stack: PrefectStack) -> None:
    """Open headless Chromium, let ``pages(browser, shots_dir)`` take the single screenshots, stack them into
    ``args.out`` at ``args.width`` pixels; with ``args.keep`` leave ``stack`` running until Ctrl-C."""
    shots = tmp / "shots"
    shots.mkdir()
    browser = Browser(tmp / "chromium-profile")
    try:
        paths = pages(browser, shots)
    finally:
        browser.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    stack_images(paths, Path(args.out), args.width)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size // 1024} KiB); single shots in {shots}")
    if args.keep:
        print(f"stack running at {stack.ui_url} (Ctrl-C to stop)")
        while True:
            time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    args = parse_ui_args("Screenshot of a completed SFT run in the Prefect UI", "ui-sft-run.png", argv)
    import signal

    def _interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)  # stop the stack cleanly on kill, too

    tmp = Path(tempfile.mkdtemp(prefix="pt-ui-"))
    local_root, store = tmp / "tinker-local", tmp / "store"
    with contextlib.suppress(KeyboardInterrupt), ui_stack(tmp, local_root) as stack:  # Ctrl-C: a quiet stop
        stack.start_worker("worker-1")
        config = dict(model="tiny", batch_size=4, lora_rank=8, learning_rate=2e-3, max_length=128, max_steps=12,
                      save_every=4, eval_every=4, num_eval_samples=2, sample_max_tokens=16, run_name="nightly-demo",
                      store=str(store), backend={"credentials_block": "local-tiny"})
        fr = stack.run_deployment("sft/sft-tiny", {"config": config})
        print(f"flow run {fr.id}: {stack.ui_url}/runs/flow-run/{fr.id}", flush=True)

        # the fault goes in as soon as the run's model exists (before step 0: no race with training)
        model_id = wait_until(lambda: next(iter(local_training_runs(local_root) or ()), None), 600,
                              "the run's model on the local server", 0.2)
        blocker = block_sampler_saves(local_root, model_id)

        def failed_once() -> bool:  # from the state history: a missed short AwaitingRetry still counts
            with stack.client() as c:
                return any(st.name == "AwaitingRetry" for t in stack.task_runs(fr.id)
                           if t.name.startswith("save-sampler") for st in c.read_task_run_states(t.id))

        try:
            wait_until(failed_once, 900, "a retry of the sampler save")
        finally:
            blocker.unlink()
        run = stack.wait_final(fr.id, 900)
        print(f"flow run {run.name}: {run.state_name}", flush=True)

        retried = next(t for t in stack.task_runs(fr.id) if t.name.startswith("save-sampler"))
        curves = max(
            (a for a in stack.artifacts(fr.id) if a.key and a.key.endswith("-curves")), key=lambda a: a.created
        )
        time.sleep(3)  # let the last logs and events land
        flow_page = f"{stack.ui_url}/runs/flow-run/{fr.id}"
        photograph(tmp, lambda browser, shots: [
            browser.shoot(flow_page, shots / "task-runs.png", (1400, 1500), click="Task Runs", wait_text="step-11"),
            browser.shoot(flow_page, shots / "artifacts.png", (1400, 640), click="Artifacts", scroll=True,
                          wait_text="nightly-demo-metrics"),
            browser.shoot(f"{stack.ui_url}/runs/task-run/{retried.id}", shots / "retried.png", (1400, 500),
                          wait_text="Retry 1/3"),
            browser.shoot(f"{stack.ui_url}/artifacts/artifact/{curves.id}", shots / "curves.png", (1400, 480),
                          wait_text="curves at step"),
        ], args, stack)
    return 0


if __name__ == "__main__":
    sys.exit(main())
