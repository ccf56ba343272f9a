"""Data-parallel (and FSDP) training as sharded jit: state, step, fit loop, checkpoints."""

from meshkit.train._checkpoint import Checkpointer as Checkpointer
from meshkit.train._checkpoint import abstract_like as abstract_like
from meshkit.train._loop import FitResult as FitResult
from meshkit.train._loop import NonFiniteLossError as NonFiniteLossError
from meshkit.train._loop import fit as fit
from meshkit.train._precision import LossScale as LossScale
from meshkit.train._precision import Precision as Precision
from meshkit.train._preemption import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
from meshkit.train._preemption import PreemptionWatcher as PreemptionWatcher
from meshkit.train._state import Model as Model
from meshkit.train._state import TrainState as TrainState
from meshkit.train._state import abstract_train_state as abstract_train_state
from meshkit.train._state import create_train_state as create_train_state
from meshkit.train._state import init_state_from_key as init_state_from_key
from meshkit.train._state import linen_model as linen_model
from meshkit.train._state import nnx_model as nnx_model
from meshkit.train._state import state_shardings_of as state_shardings_of
from meshkit.train._state import train_state_shardings as train_state_shardings
from meshkit.train._step import LossFn as LossFn
from meshkit.train._step import LossOutput as LossOutput
from meshkit.train._step import apply_model as apply_model
from meshkit.train._step import classification_loss as classification_loss
from meshkit.train._step import classification_metrics as classification_metrics
from meshkit.train._step import make_train_step as make_train_step
from meshkit.train._step import train_step_fn as train_step_fn
