"""meshkit: sharding-first training on JAX.

A mesh with named axes and ``PartitionSpec``s decide where every array lives; every
computation is a ``jax.jit`` with its shardings declared at the boundary.
"""

from meshkit import distributed as distributed
from meshkit._batch import batch_sharding as batch_sharding
from meshkit._batch import data_shard as data_shard
from meshkit._batch import shard_batch as shard_batch
from meshkit._compiles import count_compiles as count_compiles
from meshkit._describe import describe as describe
from meshkit._host import replicate as replicate
from meshkit._host import to_host as to_host
from meshkit._logical import logical_axes as logical_axes
from meshkit._mesh import DATA_AXIS as DATA_AXIS
from meshkit._mesh import make_mesh as make_mesh
from meshkit._rules import FSDP as FSDP
from meshkit._rules import PartitionRules as PartitionRules
from meshkit._rules import Placement as Placement
from meshkit._rules import infer_shardings as infer_shardings
from meshkit._types import Batch as Batch
from meshkit._types import Metrics as Metrics
from meshkit._types import PerExampleFn as PerExampleFn

__version__ = "0.1.0"
