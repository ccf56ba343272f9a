"""Grain pipelines that feed exact, resumable global batches, on one process or many.

The package has three sides:

- the core, in this package's private modules: the ``Source`` protocol and
  ``ArraySource`` (``_source``), label checks (``_labels``), ``TrainPipeline`` and
  ``EvalPipeline`` (``_pipeline``), and how batches reach the devices: ``fit``'s ``Feed``
  and its one-step face ``GlobalBatchIterator`` (``_feed``). It reads any ``Source``
  and imports no format.
- the formats, in the private subpackage ``_formats``: the readers and writers of
  data on disk (ArrayRecord, encoded image records, image folders, MNIST and CIFAR
  files, TFDS) and the built-in data sets (digits, synthetic, reference text). They
  import the core.
- :mod:`meshkit.data.image`: image operations (decode, crops, flips, normalise) and the
  picklable classification transforms built from them.

``python -m meshkit.data.convert`` converts data you have to ArrayRecord. This module
is the one public face of the core and the formats alike: ``from meshkit.data import
mnist``.
"""

from meshkit.data._feed import GlobalBatchIterator as GlobalBatchIterator
from meshkit.data._formats import ArrayRecordSource as ArrayRecordSource
from meshkit.data._formats import EncodedRecordSource as EncodedRecordSource
from meshkit.data._formats import TfdsSource as TfdsSource
from meshkit.data._formats import cifar10 as cifar10
from meshkit.data._formats import cifar100 as cifar100
from meshkit.data._formats import decode_bytes as decode_bytes
from meshkit.data._formats import decode_image_record as decode_image_record
from meshkit.data._formats import digits as digits
from meshkit.data._formats import encode_image_record as encode_image_record
from meshkit.data._formats import fashion_mnist as fashion_mnist
from meshkit.data._formats import image_records as image_records
from meshkit.data._formats import mnist as mnist
from meshkit.data._formats import reference_text as reference_text
from meshkit.data._formats import synthetic as synthetic
from meshkit.data._formats import text_windows as text_windows
from meshkit.data._formats import token_windows as token_windows
from meshkit.data._formats import write_array_record as write_array_record
from meshkit.data._formats import write_digits_images as write_digits_images
from meshkit.data._formats import write_image_folder as write_image_folder
from meshkit.data._formats import write_image_records as write_image_records
from meshkit.data._input import InputSettings as InputSettings
from meshkit.data._pipeline import EvalPipeline as EvalPipeline
from meshkit.data._pipeline import EvalTransform as EvalTransform
from meshkit.data._pipeline import TrainPipeline as TrainPipeline
from meshkit.data._pipeline import Transform as Transform
from meshkit.data._source import ArraySource as ArraySource
from meshkit.data._source import Record as Record
from meshkit.data._source import Source as Source
from meshkit.data._source import load_npz as load_npz
