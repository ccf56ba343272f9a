"""Full-batch L-BFGS over data sharded on a mesh: exact under padding, one program per solve.

The problem is ``mean(loss_fn(params, batch) over the real rows) + l2 / 2 * ||params||²``
with the rows split over the mesh's ``data`` axis and the parameters replicated. See
``LBFGS`` for the solver and ``docs/lbfgs.md`` for a guide.

Examples:
    >>> from meshkit import lbfgs
    >>> lbfgs.Status.GRADIENT_TOLERANCE.succeeded
    True
"""

from meshkit.lbfgs._data import Dataset as Dataset
from meshkit.lbfgs._data import classification_data as classification_data
from meshkit.lbfgs._data import shard_dataset as shard_dataset
from meshkit.lbfgs._lbfgs import LBFGSState as LBFGSState
from meshkit.lbfgs._objective import L2Mask as L2Mask
from meshkit.lbfgs._objective import PerExampleLoss as PerExampleLoss
from meshkit.lbfgs._objective import l2_except as l2_except
from meshkit.lbfgs._objective import linear_params as linear_params
from meshkit.lbfgs._objective import multiclass_logreg as multiclass_logreg
from meshkit.lbfgs._solution import LBFGSError as LBFGSError
from meshkit.lbfgs._solution import Solution as Solution
from meshkit.lbfgs._solver import LBFGS as LBFGS
from meshkit.lbfgs._status import Status as Status
