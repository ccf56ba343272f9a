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

jax.config.update("jax_platforms", "cpu")
set_cpu_devices(DEVICES)

# Started with SIGINT ignored (`nohup ... &`, a background job of a non-interactive
# shell), Python installs no KeyboardInterrupt handler and child processes inherit the
# ignoring. The Ctrl-C tests need the interactive disposition: set it for the suite,
# and so for the processes it starts (a caught signal is reset to the default on exec).
if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "devices(n): needs at least n JAX devices; skipped otherwise"
    )
    config.addinivalue_line(
        "markers",
        "once: the result does not depend on the device count; runs in the 8-device pass "
        "only (``nox -s tests`` runs the suite at 1 and at 8)",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("devices")
    if marker is not None and jax.device_count() < marker.args[0]:
        pytest.skip(f"needs {marker.args[0]} devices, have {jax.device_count()}")
    if item.get_closest_marker("once") is not None and jax.device_count() < 8:
        pytest.skip("device-count independent: runs in the 8-device pass")
