"""Converts data you already have to ArrayRecord: fixed-shape arrays or encoded images.

Command line (nothing is downloaded; ``--data-dir`` must hold the original files)::

    python -m meshkit.data.convert mnist --data-dir ~/data/mnist --out ~/data/mnist-ar

writes ``train.array_record`` and ``test.array_record`` (each with a ``.json``
sidecar) and prints their record counts and sizes. Read them back with
``meshkit.data.ArrayRecordSource``. With ``--encoded jpeg`` (or ``png``) the images
are written as encoded image records instead (read them with
``meshkit.data.image_records``), optionally enlarged (``--size 32``), made RGB
(``--rgb``) and sharded (``--shards 4``)::

    python -m meshkit.data.convert digits --encoded jpeg --size 32 --rgb --out /tmp/digits_jpeg

An image folder (``ROOT/<class name>/*.jpg``, the ImageNet layout) becomes one set of
image records, its files stored as they are::

    python -m meshkit.data.convert images --from-folder ~/data/flowers/train \\
        --out ~/data/flowers-ar/train.array_record --shards 4
    python -m meshkit.data.convert images --from-folder ~/data/flowers/test \\
        --out ~/data/flowers-ar/test.array_record \\
        --class-names-from ~/data/flowers-ar/train.array_record

(the second keeps the training split's class indices, even if a class has no test
images).

CIFAR pickles are read with a restricted unpickler that rebuilds numpy arrays, dicts,
lists, bytes and numbers only: a file naming any other global is refused before
anything it names is called. The sidecars record the number of classes, so reading a
record back checks its label against it.

The conversions live in :mod:`meshkit.data._formats` (``convert``); this module is the
command line's stable path.
"""

from meshkit.data._formats._convert import convert, main

__all__ = ["convert", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
