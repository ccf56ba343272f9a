"""Per-example random generators for a whole batch at once.

A pipeline gives each example ``np.random.default_rng([seed, tag, epoch, position])``,
so augmentation depends only on the example, never on the process layout. numpy
hashes each generator's entropy in Python-level code, which costs more per image than
reading its record: ``generators`` computes the same hash (numpy's ``SeedSequence``,
whose algorithm numpy keeps fixed for reproducibility) for a batch with array
operations and hands each ``PCG64`` its state words. The generators are those
``default_rng`` builds, bit for bit (tested), spawning included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R = 0xCA01F9DD, 0x4973F715
_XSHIFT = 16
_POOL = 4
_WORD = 1 << 32


class _Hashed(np.random.bit_generator.ISpawnableSeedSequence):
    """A ``SeedSequence`` whose state words were computed ahead (for ``PCG64``)."""

    def __init__(self, entropy: list[int], words: np.ndarray):
        self.entropy = entropy
        self._words = words
        self._spawner: np.random.SeedSequence | None = None

    def generate_state(self, n_words: int, dtype: Any = np.uint32) -> np.ndarray:
        if n_words == 4 and np.dtype(dtype) == np.uint64:
            return self._words
        return np.random.SeedSequence(self.entropy).generate_state(n_words, dtype)

    def spawn(self, n_children: int) -> list[np.random.bit_generator.ISpawnableSeedSequence]:
        if self._spawner is None:  # numpy's own, so repeated spawns continue alike
            self._spawner = np.random.SeedSequence(self.entropy)
        return list(self._spawner.spawn(n_children))


def generators(prefix: Sequence[int], last: Sequence[int]) -> list[np.random.Generator]:
    """``[np.random.default_rng([*prefix, value]) for value in last]``, faster.

    Examples:
        >>> a = generators([7, 1, 0], [0, 5])
        >>> b = [np.random.default_rng([7, 1, 0, v]) for v in (0, 5)]
        >>> [g.integers(1 << 30) for g in a] == [g.integers(1 << 30) for g in b]
        True
    """
    if len(prefix) != _POOL - 1 or not all(0 <= int(v) < _WORD for v in [*prefix, *last]):
        return [np.random.default_rng([*prefix, int(v)]) for v in last]
    entropy_NxP = np.empty((len(last), _POOL), np.uint32)
    entropy_NxP[:, :-1] = np.asarray(prefix, np.uint64).astype(np.uint32)
    entropy_NxP[:, -1] = np.asarray(last, np.uint64).astype(np.uint32)
    words_Nx4 = _state_words(_pools(entropy_NxP))
    return [
        # numpy takes any ISeedSequence here; its type stubs name SeedSequence only
        np.random.Generator(
            np.random.PCG64(_Hashed([*map(int, prefix), int(v)], words))  # pyright: ignore[reportArgumentType]
        )
        for v, words in zip(last, words_Nx4, strict=True)
    ]


def _pools(entropy_NxP: np.ndarray) -> np.ndarray:
    """``SeedSequence.pool`` of each row's four 32-bit entropy words."""
    hash_const = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal hash_const
        value = value ^ np.uint32(hash_const)
        hash_const = (hash_const * _MULT_A) % _WORD
        value = value * np.uint32(hash_const)
        return value ^ (value >> np.uint32(_XSHIFT))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        result = np.uint32(_MIX_MULT_L) * x - np.uint32(_MIX_MULT_R) * y
        return result ^ (result >> np.uint32(_XSHIFT))

    with np.errstate(over="ignore"):
        mixer = [hashmix(entropy_NxP[:, i]) for i in range(_POOL)]
        for src in range(_POOL):
            for dst in range(_POOL):
                if src != dst:
                    mixer[dst] = mix(mixer[dst], hashmix(mixer[src]))
    return np.stack(mixer, axis=1)


def _state_words(pool_NxP: np.ndarray) -> np.ndarray:
    """``SeedSequence.generate_state(4, np.uint64)`` of each row's pool."""
    hash_const = _INIT_B
    words = []
    with np.errstate(over="ignore"):
        for index in range(8):
            value = pool_NxP[:, index % _POOL] ^ np.uint32(hash_const)
            hash_const = (hash_const * _MULT_B) % _WORD
            value = value * np.uint32(hash_const)
            words.append(value ^ (value >> np.uint32(_XSHIFT)))
    return np.ascontiguousarray(np.stack(words, axis=1)).view("<u8")
