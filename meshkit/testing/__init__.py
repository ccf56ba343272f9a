"""Test helpers: fake CPU devices and local multi-process runs.

Examples:
    >>> from meshkit.testing import run_processes, set_cpu_devices
"""

from meshkit.testing._files import write_cifar10 as write_cifar10
from meshkit.testing._files import write_cifar100 as write_cifar100
from meshkit.testing._files import write_mnist as write_mnist
from meshkit.testing._processes import ProcessFailedError as ProcessFailedError
from meshkit.testing._processes import ProcessGroup as ProcessGroup
from meshkit.testing._processes import run_processes as run_processes
from meshkit.testing._processes import set_cpu_devices as set_cpu_devices
from meshkit.testing._processes import start_processes as start_processes
