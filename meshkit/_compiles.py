"""Counting XLA compilations, to prove that a step compiles once."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class CompileLog:
    """The compilations seen inside a ``count_compiles()`` block.

    Attributes:
      events: ``(function name, seconds)`` for each backend compilation, in order.
    """

    events: list[tuple[str, float]] = dataclasses.field(default_factory=list)

    def count(self, name: str | None = None) -> int:
        """Compilations in all, or of functions whose name contains ``name``."""
        return sum(1 for fun_name, _ in self.events if name is None or name in fun_name)

    def seconds(self, name: str | None = None) -> float:
        """Seconds spent compiling, in all or for functions whose name contains ``name``."""
        return sum(s for fun_name, s in self.events if name is None or name in fun_name)


@contextlib.contextmanager
def count_compiles() -> Iterator[CompileLog]:
    """Records every XLA backend compilation in the block.

    A call that finds its program in the jitted function's own cache is not one; a
    program loaded from JAX's persistent compilation cache
    (``jax_compilation_cache_dir``) is, as it stands in for a compilation.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def double(x):
        ...     return 2 * x
        >>> step = jax.jit(double)
        >>> with count_compiles() as log:
        ...     _ = step(jnp.ones(3)); _ = step(jnp.ones(3)); _ = step(jnp.ones(4))
        >>> log.count("double")
        2
    """
    log = CompileLog()
    lock = threading.Lock()

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with lock:
                log.events.append((str(kwargs.get("fun_name", "?")), duration_secs))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield log
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
