"""Paths that may live on an object store: ``gs://``, ``s3://`` and local alike."""

from __future__ import annotations

import os

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

        fsspec.get_filesystem_class(scheme)
    except ImportError:
        raise ImportError(
            f"The {what} {os.fspath(path)} is on {store}: meshkit writes its records and "
            f"config there through etils.epath, which needs the {package} package "
            f'(pip install "meshkit[{extra}]", or pip install {package}); Orbax writes the '
            "checkpoints through TensorStore, which needs nothing more."
        ) from None


def write_text_atomically(path: epath.Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary sibling and a rename.

    On a disk the rename is atomic: a kill leaves the old file or the new one, never
    part of one.
    """
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text)
    partial.replace(path)
