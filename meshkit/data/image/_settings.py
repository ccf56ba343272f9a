"""Input settings for per-example image pipelines, chosen from measurements."""

from __future__ import annotations

import os

from meshkit.data._input import InputSettings

DECODE_BOUND_SIDE = 128
"""From this trained image side up, decoding and resampling (which release the GIL)
dominate an image's cost, and threads scale; below it, Python's per-image work does,
and only processes scale."""


def input_settings(image_side: int, *, cores: int | None = None) -> InputSettings:
    """The ``InputSettings`` (threads, workers) for a pipeline of encoded images.

    The choice ``python -m benchmarks input_pipeline`` measures as fastest for the
    image classification transform (decode, random-resized crop, flip, normalise):

    - one core: no threads and no workers, batches built in the
      caller's thread (anything else only adds hand-offs);
    - images of side ``DECODE_BOUND_SIDE`` (128) and more: ``num_threads`` = cores.
      Decoding and resampling release the GIL, so threads run in parallel and start
      at once;
    - smaller images: ``worker_count`` = cores. Per image, Python's own work (the
      JPEG header, the crop's random draws, the generator) outweighs the decode and
      holds the GIL, so only processes scale. Worker processes are spawned: the
      script needs an ``if __name__ == "__main__":`` guard, and they take a second or
      two to start.

    ``cores`` defaults to the CPUs this process may run on. The measured table is in
    docs/data.md ("Input at scale"); pass the result as ``input_settings=``, and
    override a value with ``dataclasses.replace`` where a host measures otherwise.

    Examples:
        >>> input_settings(32, cores=2)
        InputSettings(num_threads=0, worker_count=2, prefetch=4, resident=False, placement='auto')
        >>> input_settings(224, cores=8)
        InputSettings(num_threads=8, worker_count=0, prefetch=4, resident=False, placement='auto')
        >>> input_settings(224, cores=1)
        InputSettings(num_threads=0, worker_count=0, prefetch=4, resident=False, placement='auto')
    """
    if isinstance(image_side, bool) or not isinstance(image_side, int) or image_side < 1:
        raise ValueError(f"image_side must be a positive int (pixels), got {image_side!r}.")
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be a positive int, got {cores!r}.")
    if cores == 1:
        return InputSettings(num_threads=0, worker_count=0)
    if image_side >= DECODE_BOUND_SIDE:
        return InputSettings(num_threads=cores, worker_count=0)
    return InputSettings(num_threads=0, worker_count=cores)
