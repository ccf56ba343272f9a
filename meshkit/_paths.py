"""Paths that may live on an object store: ``gs://``, ``s3://`` and local alike."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import socket

from etils import epath

PathLike = str | os.PathLike[str]
"""A local path, a ``pathlib.Path``, an ``epath.Path`` or a ``gs://``-style string."""


def is_remote(path: PathLike) -> bool:
    """Whether ``path`` names an object store (``gs://``, ``s3://``...) rather than a disk.

    Examples:
        >>> is_remote("gs://bucket/run"), is_remote("/tmp/run"), is_remote("runs/a")
        (True, False, False)
    """
    return "://" in os.fspath(path)


def as_path(path: PathLike) -> epath.Path:
    """``path`` as an ``epath.Path``: local paths made absolute, object-store URIs kept.

    ``pathlib.Path("gs://bucket/run")`` collapses the ``//`` and ``.absolute()`` then
    makes it a local folder; ``epath`` keeps the URI and reads and writes it through
    the store's client (``gcsfs`` for ``gs://``, ``s3fs`` for ``s3://``).

    Examples:
        >>> str(as_path("gs://bucket/run") / "checkpoints")
        'gs://bucket/run/checkpoints'
        >>> as_path("runs/a").is_absolute()
        True
    """
    result = epath.Path(path)
    return result if is_remote(path) else result.absolute()


_STORE_PACKAGES = {"gs": ("gcsfs", "gcs", "Google Cloud Storage"), "s3": ("s3fs", "s3", "S3")}

_STORE_HOSTS = {
    "gs": ("STORAGE_EMULATOR_HOST", "storage.googleapis.com"),
    "s3": ("AWS_ENDPOINT_URL", "s3.amazonaws.com"),
}
RESOLVE_SECONDS = 10.0
"""How long the store's host name may take to resolve before the store counts as unreachable."""


class StoreUnreachableError(ConnectionError):
    """An object-store path whose store cannot be reached from this machine."""


def check_store_packages(path: PathLike, *, what: str = "workdir") -> None:
    """Raises one clear ``ImportError`` when ``path`` is on an object store whose client
    package is missing: before any compile, not at the first write.

    Examples:
        >>> check_store_packages("/tmp/run")  # a disk: nothing to check
    """
    scheme = os.fspath(path).split("://", 1)[0] if is_remote(path) else None
    if scheme not in _STORE_PACKAGES:
        return
    package, extra, store = _STORE_PACKAGES[scheme]
    try:  # what epath uses: fsspec's filesystem for the scheme (a registered one counts)
        import fsspec

        client = fsspec.get_filesystem_class(scheme)
    except ImportError:
        raise ImportError(
            f"The {what} {os.fspath(path)} is on {store}: meshkit writes its records and "
            f"config there through etils.epath, which needs the {package} package "
            f'(pip install "meshkit[{extra}]", or pip install {package}); Orbax writes the '
            "checkpoints through TensorStore, which needs nothing more.",
            name=package,
        ) from None
    if not client.__module__.startswith(package):
        return  # another filesystem registered for the scheme (a test's, an in-memory one)
    host = _store_host(scheme)
    failure = _resolve(host)
    if failure:  # no network to the store: its client would retry for a minute or more
        raise StoreUnreachableError(
            f"The {what} {os.fspath(path)} is on {store}, but its host {host} cannot be "
            f"reached from this machine ({failure}). Run where {store} is reachable, or "
            f"use a local {what}."
        )


def _store_host(scheme: str) -> str:
    """The host a store's client talks to: an emulator or endpoint set in the environment
    (``http://localhost:4443``), else the store's public one."""
    variable, default = _STORE_HOSTS[scheme]
    endpoint = os.environ.get(variable, "")
    if not endpoint:
        return default
    from urllib.parse import urlsplit

    return urlsplit(endpoint if "://" in endpoint else f"//{endpoint}").hostname or default


@functools.cache
def _resolve(host: str) -> str:
    """``""`` when ``host`` resolves within ``RESOLVE_SECONDS``, else why not (once per host)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        pool.submit(socket.getaddrinfo, host, 443).result(timeout=RESOLVE_SECONDS)
    except concurrent.futures.TimeoutError:
        return f"its name did not resolve within {RESOLVE_SECONDS:.0f} s"
    except OSError as error:
        return f"{type(error).__name__}: {error}"
    finally:
        pool.shutdown(wait=False)
    return ""


def write_text_atomically(path: epath.Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary sibling and a rename.

    On a disk the rename is atomic: a kill leaves the old file or the new one, never
    part of one.
    """
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text)
    partial.replace(path)
