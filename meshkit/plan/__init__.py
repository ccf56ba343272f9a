"""Size a training job before booking hardware: compile-only memory, cost and a layout search.

Each candidate layout's train step is compiled on abstract, sharded inputs for stand-in
devices (fake CPU devices, or a TPU topology description with the TPU compiler), so a
laptop can plan for a pod: memory per device from the compiled program, FLOPs and
collectives from its HLO, and a step time from the chip's published figures at the
fractions of them that published measured runs reached (``Efficiency``).

Importing it prepares the planner's environment for libtpu and JAX's CUDA plugin on a
machine without their chips (``_environment``): import it before JAX starts.
"""

from meshkit.plan import _environment  # noqa: F401  (first: before JAX starts)
from meshkit.plan._accelerators import ACCELERATORS as ACCELERATORS
from meshkit.plan._accelerators import Accelerator as Accelerator
from meshkit.plan._cli import plan_in_subprocess as plan_in_subprocess
from meshkit.plan._efficiency import Efficiency as Efficiency
from meshkit.plan._layout import Layout as Layout
from meshkit.plan._layout import Target as Target
from meshkit.plan._layout import installed_compilers as installed_compilers
from meshkit.plan._layout import load_layout as load_layout
from meshkit.plan._measure import Measurement as Measurement
from meshkit.plan._measure import Workload as Workload
from meshkit.plan._planner import LayoutReport as LayoutReport
from meshkit.plan._planner import NoLayoutFitsError as NoLayoutFitsError
from meshkit.plan._planner import Plan as Plan
from meshkit.plan._planner import candidate_layouts as candidate_layouts
from meshkit.plan._planner import plan as plan
from meshkit.plan._workloads import transformer_workload as transformer_workload
