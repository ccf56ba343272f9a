"""Test helpers: fake CPU devices and local multi-process runs.

Example:
    >>> from meshkit.testing import run_processes, set_cpu_devices
"""

from meshkit.testing._processes import ProcessFailedError as ProcessFailedError
from meshkit.testing._processes import ProcessGroup as ProcessGroup
from meshkit.testing._processes import free_port as free_port
from meshkit.testing._processes import run_processes as run_processes
from meshkit.testing._processes import set_cpu_devices as set_cpu_devices
from meshkit.testing._processes import start_processes as start_processes
