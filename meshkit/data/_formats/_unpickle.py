"""A restricted unpickler for CIFAR batches: builds data, never calls what a file names.

``pickle.load`` calls any function a file names (``os.system``, ``builtins.eval``)
while it reads, before anything can be validated. A CIFAR batch needs only dicts,
lists, bytes, strings, numbers and numpy arrays, so :class:`CifarUnpickler` resolves
the few globals that rebuild numpy arrays and refuses every other one.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        # ndarray.__reduce__: _reconstruct(ndarray, shape, dtype), then __setstate__.
        # numpy 1.x writes numpy.core, numpy 2.x writes numpy._core.
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        # numpy scalars (a label list of np.int64 rather than int).
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        # ndarray.__reduce_ex__ at protocol 5.
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        # bytes written by Python 3 at protocol 2 (the official files are Python 2's).
        ("_codecs", "encode"),
    }
)
"""``(module, name)`` pairs a CIFAR pickle may name; everything else is refused."""

_PYTHON_2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}
"""Python 3 writes these at protocols 0-2 under their Python 2 names; messages show both."""


class DisallowedGlobalError(pickle.UnpicklingError):
    """A pickle named a global outside :data:`ALLOWED_GLOBALS`; nothing named was called."""

    def __init__(self, module: str, name: str):
        self.module = _PYTHON_2_MODULES.get(module, module)
        self.name = name
        written = f" (written as {module}.{name})" if module != self.module else ""
        self.qualname = f"{self.module}.{name}{written}"
        super().__init__(f"the global {self.qualname} is not allowed")


class CifarUnpickler(pickle.Unpickler):
    """Unpickles only what a CIFAR batch holds: refuses globals outside :data:`ALLOWED_GLOBALS`.

    Examples:
        >>> import io, os, pickle
        >>> class Evil:
        ...     def __reduce__(self):
        ...         return (os.system, ("echo hacked",))
        >>> try:
        ...     CifarUnpickler(io.BytesIO(pickle.dumps(Evil()))).load()
        ... except DisallowedGlobalError as error:
        ...     print(error.module in ("posix", "nt"), error.name)
        True system
    """

    def find_class(self, module: str, name: str) -> Any:
        """The global ``module.name`` if allowed; raises :class:`DisallowedGlobalError`."""
        if (module, name) not in ALLOWED_GLOBALS:
            raise DisallowedGlobalError(module, name)
        return super().find_class(module, name)


def load_cifar_pickle(path: Path) -> object:
    """Unpickles ``path`` with :class:`CifarUnpickler` (``bytes`` encoding, as CIFAR's).

    Raises:
        ValueError: The file names a disallowed global (the message names the file and
            the global), or is not a readable pickle.
    """
    try:
        with path.open("rb") as file:
            return CifarUnpickler(file, encoding="bytes").load()
    except DisallowedGlobalError as error:
        raise ValueError(
            f"{path} was refused: it names the global {error.qualname}, which a "
            "CIFAR batch never needs (it holds dicts, lists, bytes, numbers and numpy "
            "arrays only). Unpickling it could run code, so nothing it names was called. "
            "Use the python version of the official CIFAR archive, or save your own data "
            "with np.savez and read it with meshkit.data.load_npz."
        ) from None
    except Exception as error:  # unpickling can fail in many ways; all mean "not CIFAR"
        raise ValueError(
            f"{path} is not a readable CIFAR pickle ({type(error).__name__}: {error}); "
            "expected the python version of the official archive."
        ) from None
