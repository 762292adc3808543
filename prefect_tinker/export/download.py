"""Safe downloads of an external weights checkpoint's files from their signed URLs.

``RestClient.get_external_weights_urls`` answers ``{relative path: signed URL}``; the paths come
from the server, so they are untrusted: :func:`check_listing` refuses (naming the entry) any path
that is absolute, has a drive letter or backslash, an empty, ``.`` or ``..`` segment, a control
or unusual character, a segment over 255 bytes, or that collides with another entry (also when
only the letter case differs, or when one entry is another's folder), and any URL that is not
``http(s)``. :func:`download_listing` then writes each file into a folder it creates itself
(mode 0700), opening every file with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (no existing file, link
or symlink is ever followed or replaced) and checks the finished tree (:func:`check_tree`):
only regular files with one link, and folders.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

__all__ = ["DownloadError", "UnsafeDownloadError", "check_listing", "check_tree", "download_listing"]

_SEGMENT = re.compile(r"^[A-Za-z0-9_.+=@-]+$")
_MAX_SEGMENT = 255
_MAX_DEPTH = 8


class DownloadError(RuntimeError):
    """A file of the listing could not be downloaded (HTTP 4xx; the message names the file and
    the status, never the signed URL)."""


class UnsafeDownloadError(ValueError):
    """A download listing or a downloaded tree that is not safe to write or use (the message
    names the entry and why)."""


def _check_path(rel: object) -> tuple[str, ...]:
    if not isinstance(rel, str) or not rel:
        raise UnsafeDownloadError(f"download listing: file name {rel!r} is not a non-empty string")
    if rel.startswith("/") or "\\" in rel or re.match(r"^[A-Za-z]:", rel):
        raise UnsafeDownloadError(f"download listing: file name {rel!r} is absolute or not a POSIX path")
    parts = tuple(rel.split("/"))
    if len(parts) > _MAX_DEPTH:
        raise UnsafeDownloadError(f"download listing: file name {rel!r} is nested deeper than {_MAX_DEPTH}")
    for p in parts:
        if p in ("", ".", ".."):
            raise UnsafeDownloadError(f"download listing: file name {rel!r} has an empty, '.' or '..' segment")
        if not _SEGMENT.match(p):
            raise UnsafeDownloadError(
                f"download listing: file name {rel!r} has characters other than letters, digits and . _ - + = @"
            )
        if len(p.encode()) > _MAX_SEGMENT:
            raise UnsafeDownloadError(
                f"download listing: file name {rel[:80]!r}... has a segment over {_MAX_SEGMENT} bytes"
            )
    return parts


def check_listing(urls: Mapping[str, str]) -> dict[str, str]:
    """Validate a ``{relative path: URL}`` listing (see the module docstring).

    Returns:
        The listing as a plain dict, in sorted path order.

    Raises:
        UnsafeDownloadError: an unsafe path or URL, or colliding paths (the message names them).
    """
    if not isinstance(urls, Mapping) or not urls:
        raise UnsafeDownloadError("download listing is empty or not a mapping of file names to URLs")
    seen: dict[str, str] = {}
    folders: set[str] = set()
    for rel in sorted(urls, key=str):
        parts = _check_path(rel)
        url = urls[rel]
        if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url):
            raise UnsafeDownloadError(f"download listing: the URL of {rel!r} is not an http(s) URL")
        low = rel.lower()
        if low in seen:
            raise UnsafeDownloadError(f"download listing: {rel!r} and {seen[low]!r} differ only in letter case")
        seen[low] = rel
        folders.update("/".join(parts[:i]).lower() for i in range(1, len(parts)))
    for low, rel in seen.items():
        if low in folders:
            raise UnsafeDownloadError(f"download listing: {rel!r} is both a file and a folder of other entries")
    return {rel: urls[rel] for rel in sorted(urls)}


def check_tree(root: str | os.PathLike[str]) -> list[str]:
    """Relative paths of the files under ``root``, after checking that it holds only folders and
    regular files with a single link (no symlinks, hard links, devices, fifos or sockets).

    Raises:
        UnsafeDownloadError: naming the first entry that is not.
    """
    root = Path(root)
    out = []
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = os.lstat(p)
            rel = p.relative_to(root).as_posix()
            if stat.S_ISLNK(st.st_mode):
                raise UnsafeDownloadError(f"{rel!r} under {root} is a symlink")
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeDownloadError(f"{rel!r} under {root} is not a regular file")
            if st.st_nlink != 1:
                raise UnsafeDownloadError(f"{rel!r} under {root} is a hard link ({st.st_nlink} links)")
            out.append(rel)
    return sorted(out)


def _open_new(dest: Path) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(dest, flags, 0o600)


def _mkdirs(root: Path, parts: tuple[str, ...]) -> Path:
    cur = root
    for p in parts:
        cur = cur / p
        try:
            os.mkdir(cur, 0o700)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(cur).st_mode):  # never descend through a symlink
                raise UnsafeDownloadError(f"{cur} exists and is not a folder") from None
    return cur


def _fetch(client, rel: str, url: str, fh, chunk: int) -> int:
    import httpx

    n = 0
    try:
        with client.stream("GET", url) as resp:
            if resp.status_code >= 400:
                body = resp.read()[:300].decode("utf-8", "replace")
                err = ConnectionError if resp.status_code >= 500 else DownloadError
                raise err(f"downloading {rel!r}: HTTP {resp.status_code} {body}")
            for block in resp.iter_bytes(chunk):
                fh.write(block)
                n += len(block)
    except httpx.HTTPError as exc:  # its text may hold the URL: name only the file and the kind
        raise ConnectionError(f"downloading {rel!r}: {type(exc).__name__}") from None
    return n


def download_listing(
    urls: Mapping[str, str], dest: str | os.PathLike[str], *, timeout_s: float = 120.0, chunk: int = 1 << 20
) -> dict[str, int]:
    """Download every file of a checked listing (:func:`check_listing`) into ``dest``, a folder
    that must not exist yet (it is created with mode 0700).

    Args:
        urls: ``{relative path: signed URL}`` (e.g. ``ExternalWeightsUrlsResponse.urls``).
        dest: the new folder.
        timeout_s: per-request connect/read timeout (seconds).

    Returns:
        ``{relative path: bytes written}``.

    Raises:
        UnsafeDownloadError: an unsafe listing or resulting tree.
        FileExistsError: ``dest`` exists.
        DownloadError: a URL answered 4xx (403: a tampered or expired signature).
        ConnectionError: network trouble (after 3 connection retries) or a 5xx answer: transient.

    Signed URLs are credentials while they last: no error message or log line holds one.
    """
    import httpx

    listing = check_listing(urls)
    dest = Path(dest)
    os.mkdir(dest, 0o700)
    sizes: dict[str, int] = {}
    transport = httpx.HTTPTransport(retries=3)
    with httpx.Client(transport=transport, timeout=timeout_s, follow_redirects=True) as client:
        for rel, url in listing.items():
            parts = tuple(rel.split("/"))
            folder = _mkdirs(dest, parts[:-1])
            fd = _open_new(folder / parts[-1])
            with os.fdopen(fd, "wb") as fh:
                sizes[rel] = _fetch(client, rel, url, fh, chunk)
    got = check_tree(dest)
    if got != sorted(listing):
        raise UnsafeDownloadError(f"downloaded tree {got} differs from the listing {sorted(listing)}")
    return sizes
