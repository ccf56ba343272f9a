"""Sets the fake CPU device count before any test touches the JAX backend.

``MESHKIT_TEST_DEVICES`` (default 8) chooses it; ``nox -s tests`` runs the suite at 1
and at 8. Tests that need more devices than exist skip.
"""

from __future__ import annotations

import os
import signal

import jax
import pytest

from meshkit.testing import set_cpu_devices

DEVICES = int(os.environ.get("MESHKIT_TEST_DEVICES", "8"))
PASSES = (1, 8)
"""The device counts ``nox -s tests`` runs the suite at."""

jax.config.update("jax_platforms", "cpu")
set_cpu_devices(DEVICES)

# Started with SIGINT ignored (`nohup ... &`, a background job of a non-interactive
# shell), Python installs no KeyboardInterrupt handler and child processes inherit the
# ignoring. The Ctrl-C tests need the interactive disposition: set it for the suite,
# and so for the processes it starts (a caught signal is reset to the default on exec).
if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Under `nohup` SIGHUP is ignored too, and a launcher started with SIGHUP ignored keeps
# ignoring it (as it should: the user asked for it), so the hangup tests would wait
# for a stop that never comes. They need the default disposition.
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "devices(n): needs at least n JAX devices; skipped otherwise"
    )
    config.addinivalue_line(
        "markers",
        "once(n=None): the result does not depend on the device count; runs in one pass "
        "only: the n-device one, else the 1-device one (usually the cheapest), or the "
        "8-device one when it also needs devices(n) (``nox -s tests`` runs the suite at 1 "
        "and at 8)",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("devices")
    needs = 1 if marker is None else marker.args[0]
    if jax.device_count() < needs:
        pytest.skip(f"needs {needs} devices, have {jax.device_count()}")
    once = item.get_closest_marker("once")
    if once is not None:
        # once(n) names the pass; plain once takes the cheapest pass that can run it
        home = once.args[0] if once.args else 1 if needs <= 1 else PASSES[-1]
        if jax.device_count() != home:
            pytest.skip(f"device-count independent: runs in the {home}-device pass")
