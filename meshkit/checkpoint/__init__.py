"""Checkpoints of a sharded train state: saved by Orbax, checked by a digest, restored
into any layout, with what went wrong said in a line."""

from meshkit.checkpoint._checkpointer import CheckpointDamagedError as CheckpointDamagedError
from meshkit.checkpoint._checkpointer import Checkpointer as Checkpointer
from meshkit.checkpoint._checkpointer import CheckpointSaveError as CheckpointSaveError
