"""What happens when a process of a run fails, stalls, is asked to stop or loses a peer.

Read the modules in this order; each tells its part in its own docstring.

1. **Noticing.** A Python error in a process is noticed where it is raised. A stop
   request arrives as a signal: SIGTERM or Ctrl-C from a scheduler, a launcher or a
   user, or a cluster's warning before its time limit (``signals``: SLURM's SIGUSR1 by
   default, passed on as SIGTERM to JAX's preemption service). A stall has no signal:
   ``stall`` watches the training loop's waits and declares one that outlasts the stall
   timeout. A peer that dies without a word (the out-of-memory killer, a lost host) is
   noticed by JAX's distributed runtime, and one whose Python code fails announces it
   (``peers``).
2. **Agreeing.** ``preemption`` turns a stop request into one step at which every
   process saves a checkpoint and stops (JAX's preemption sync point, reported for
   every step of a dispatch). ``peers`` publishes the first failure of a job through
   JAX's key-value store, and every other process stops within a fraction of a second,
   naming the process that failed.
3. **Reporting.** The job's output ends on its one real error: the failing process
   prints its traceback last (its peers one line each); ``abort`` reduces the C++
   report of the runtime's fatal error (20 to 30 lines per process) to one line naming
   the lost process; a stall prints where the main thread waits.
4. **Exiting.** The exit code says what happened: a preempted run that saved exits 75
   (``PREEMPTED_EXIT_CODE``: try again), a stalled one 1, a process stopped because a
   peer failed with the peer's code. ``watchdog`` makes a launcher's processes die with
   the launcher, however it dies.

``meshkit.distributed.initialize`` starts the job-wide part (signals, the peer watcher,
the abort filter) and ``meshkit.train.fit`` the run's part (``PreemptionWatcher``,
``StallWatch``); both import it from this package.
"""

from meshkit._runtime import abort as abort
from meshkit._runtime import peers as peers
from meshkit._runtime import signals as signals
from meshkit._runtime.preemption import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
from meshkit._runtime.preemption import PreemptionWatcher as PreemptionWatcher
from meshkit._runtime.stall import StallWatch as StallWatch
from meshkit._runtime.watchdog import Watchdog as Watchdog
