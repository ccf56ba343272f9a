"""The parts ``fit`` is made of, for a loop or a step of one's own.

``fit`` covers most training; when it does not (two optimisers, a batch that depends
on the last result, logging of one's own), these are its pieces, so a hand-written
loop still never stalls the devices and never saves a state that followed a
non-finite step (docs/training.md, "A loop of your own"):

- the loop: ``InFlight`` (the window of queued steps) and ``MetricSums`` (metric sums
  kept on the devices, read one interval late);
- the step: ``gradients`` / ``Gradients`` and ``apply_update``, what ``make_train_step``
  builds its step from;
- the state by parts: ``abstract_train_state`` (shapes, nothing allocated),
  ``train_state_shardings`` (a layout for them), ``init_state_from_key`` (one state
  from a key, traceable: what ensembles and sweeps vmap);
- the run: ``write_run_config``, the ``config.json`` a resumed run is checked against.
"""

from meshkit._inflight import InFlight
from meshkit.train._config import write_run_config
from meshkit.train._gradients import Gradients, apply_update, gradients
from meshkit.train._interval import MetricSums
from meshkit.train._state import abstract_train_state, init_state_from_key, train_state_shardings

__all__ = [
    "Gradients",
    "InFlight",
    "MetricSums",
    "abstract_train_state",
    "apply_update",
    "gradients",
    "init_state_from_key",
    "train_state_shardings",
    "write_run_config",
]
