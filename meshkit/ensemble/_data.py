"""Batches that give each member its own data order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import NamedSharding

from meshkit._checks import check_int
from meshkit.data import InputSettings, Record, Source, TrainPipeline, Transform
from meshkit.data._input import checked_settings


def member_seed(seed: int, index: int) -> int:
    """The shuffle seed of member ``index``: drawn from ``(seed, index)``, independent of K.

    Examples:
        >>> member_seed(0, 1) == member_seed(0, 1) != member_seed(0, 2)
        True
    """
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


class MemberTrainPipeline(TrainPipeline):
    """K training streams in one: member ``i`` visits the examples in its own order.

    Each global batch holds, for every row, one example per member: fields are shaped
    ``[global_batch_size, K, ...]``, and column ``i`` is batch ``step`` of a
    ``TrainPipeline`` shuffled with ``member_seed(seed, i)``. Every member sees every
    example once per epoch, in a different order (and, with ``transform``, its own
    augmentations). Rows are split over the data axis as usual; the member axis stays
    whole on every process, and the ensemble step (``member_batches=True``) hands each
    device only its members' columns. So each process loads K examples per row: small
    next to the K networks it trains.

    Resuming works as for ``TrainPipeline`` (the data state also records K).

    Args:
      source: the training examples.
      num_members: K.
      global_batch_size: rows per global batch (each member trains on this many).
      sharding: the batch sharding (``EnsembleLayout.batch_sharding``).
      seed: the base seed of the members' orders.
      transform: optional per-example augmentation, as for ``TrainPipeline``.
      num_epochs: stop after this many epochs; ``None`` repeats forever.
      member_seeds: each member's shuffle seed, so member ``i`` reads the data in the
        order ``TrainPipeline(seed=member_seeds[i])`` does (a sweep's ``data_seed``);
        ``None``: ``member_seed(seed, i)``.
      input_settings: threads, workers, prefetch, resident data and placement, as for
        ``TrainPipeline`` (workers build whole batches). Resident, each member's batch is
        gathered on the devices by its own indices: one copy serves all K members.

    Examples:
        >>> import numpy as np, meshkit
        >>> from meshkit.data import ArraySource
        >>> from meshkit.ensemble import EnsembleLayout, MemberTrainPipeline
        >>> layout = EnsembleLayout(meshkit.make_mesh("ensemble=1,data=-1"), 3)
        >>> source = ArraySource({"x": np.arange(64), "label": np.arange(64) % 10})
        >>> pipeline = MemberTrainPipeline(source, 3, global_batch_size=16,
        ...                                sharding=layout.batch_sharding)
        >>> batch = pipeline.local_batch(0)
        >>> batch["x"].shape, len({tuple(batch["x"][:, i]) for i in range(3)})
        ((16, 3), 3)
    """

    def __init__(
        self,
        source: Source,
        num_members: int,
        *,
        global_batch_size: int,
        sharding: NamedSharding,
        seed: int = 0,
        transform: Transform | None = None,
        num_epochs: int | None = None,
        member_seeds: Sequence[int] | None = None,
        input_settings: InputSettings | None = None,
    ):
        settings = checked_settings(type(self).__name__, input_settings)
        check_int(num_members, name="num_members", minimum=1)
        if member_seeds is None:
            member_seeds = [member_seed(seed, index) for index in range(num_members)]
        member_seeds = [check_int(s, name="member_seeds entry", minimum=0) for s in member_seeds]
        if len(member_seeds) != num_members:
            raise ValueError(
                f"member_seeds has {len(member_seeds)} seeds for {num_members} members: "
                "give one per member, or None for seeds drawn from seed."
            )
        super().__init__(
            source,
            global_batch_size=global_batch_size,
            sharding=sharding,
            seed=seed,
            transform=transform,
            num_epochs=num_epochs,
            input_settings=settings,
        )
        self.num_members = num_members
        self.members = tuple(
            TrainPipeline(
                source,
                global_batch_size=global_batch_size,
                sharding=sharding,
                seed=member_seeds[index],
                transform=transform,
                num_epochs=num_epochs,
                # The members' batches are built by this pipeline's threads.
                input_settings=InputSettings(num_threads=0),
            )
            for index in range(num_members)
        )
        self.member_seeds = tuple(member_seeds)
        self.batched = True  # local_batch builds whole [rows, K, ...] batches; threads take them
        self._finish = None  # each member's batch comes finished

    def local_batch(self, step: int) -> Record:
        """This process's rows of global batch ``step``: fields ``[rows, K, ...]``."""
        columns = [member.local_batch(step) for member in self.members]
        return {key: np.stack([column[key] for column in columns], axis=1) for key in columns[0]}

    def global_indices(self, step: int) -> np.ndarray:
        """Source indices of global batch ``step``: ``[global_batch_size, K]``, column ``i``
        member ``i``'s."""
        return np.stack([member.global_indices(step) for member in self.members], axis=1)

    def state_fields(self) -> dict[str, Any]:
        """What a checkpoint must match to resume: the pipeline's fields and K."""
        return {**super().state_fields(), "num_members": self.num_members}
