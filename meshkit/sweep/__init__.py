"""Hyperparameter sweeps on the ensemble axis: K settings trained as one program.

Each member of an ``ensemble`` mesh axis trains one point of a search space, with its
hyperparameters held as arrays in its optimizer state: one compile for any values,
every device busy. A ``Sweep`` says what is trained and how it is judged; ``run_sweep``
trains it, scores them, stops or replaces the worst
(``SuccessiveHalving``) or lets them copy the best (``PopulationBasedTraining``), and
returns a ranked ``SweepResult`` whose winner is an ordinary train state.
"""

from meshkit.sweep._definition import Sweep as Sweep
from meshkit.sweep._results import SweepResult as SweepResult
from meshkit.sweep._results import Trial as Trial
from meshkit.sweep._run import run_sweep as run_sweep
from meshkit.sweep._run import sweep_pipeline as sweep_pipeline
from meshkit.sweep._schedules import PopulationBasedTraining as PopulationBasedTraining
from meshkit.sweep._schedules import SuccessiveHalving as SuccessiveHalving
from meshkit.sweep._space import LogUniform as LogUniform
from meshkit.sweep._space import Space as Space
from meshkit.sweep._space import Uniform as Uniform
from meshkit.sweep._space import log_grid as log_grid
from meshkit.sweep._state import create_sweep_state as create_sweep_state
from meshkit.sweep._values import hyperparameter as hyperparameter
from meshkit.sweep._values import warmup_cosine as warmup_cosine
