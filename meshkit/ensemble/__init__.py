"""Ensembles on an ``ensemble`` mesh axis: K members trained side by side, beside data parallelism.

Member states are stacked on a leading axis of size K, split over the mesh axis
``ensemble``; batches are split over ``data``. Each device trains its K / E members
inside one jitted step, batched with ``vmap`` on GPUs and TPUs and one after the other
as ordinary networks on CPUs (``strategy``).
"""

from meshkit.ensemble._data import MemberTrainPipeline as MemberTrainPipeline
from meshkit.ensemble._layout import EnsembleLayout as EnsembleLayout
from meshkit.ensemble._metrics import per_member as per_member
from meshkit.ensemble._predict import classification_values as classification_values
from meshkit.ensemble._predict import ensemble_metrics as ensemble_metrics
from meshkit.ensemble._predict import make_predict as make_predict
from meshkit.ensemble._state import abstract_ensemble_state as abstract_ensemble_state
from meshkit.ensemble._state import create_ensemble_state as create_ensemble_state
from meshkit.ensemble._state import member_state as member_state
from meshkit.ensemble._step import MemberLossFn as MemberLossFn
from meshkit.ensemble._step import MemberOutput as MemberOutput
from meshkit.ensemble._step import classification_loss as classification_loss
from meshkit.ensemble._step import make_ensemble_step as make_ensemble_step
