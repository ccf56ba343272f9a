"""Data formats: readers and writers of data on disk, and the built-in data sets.

Everything here turns some outside representation into a :class:`meshkit.data.Source`
(or writes one): meshkit's fixed-shape ArrayRecord files (``ArrayRecordSource``,
``write_array_record``), ArrayRecord files of any encoding (``EncodedRecordSource``) and
its encoded image records (``image_records``, ``write_image_records``, image folders
with ``write_image_folder``), the MNIST and CIFAR files as distributed (CIFAR's pickles
through a restricted unpickler), TFDS data sets (``TfdsSource``), the offline built-in
sets (scikit-learn's ``digits``, ``synthetic`` data, the Python reference's text) and
``convert``, behind ``python -m meshkit.data.convert``.

The core of :mod:`meshkit.data` (sources, labels, pipelines, the global batch iterator)
knows none of these: the formats import the core, never the reverse, so a new format is
a new module here and no change there. Users import these names from
:mod:`meshkit.data`, their public face.
"""

from meshkit.data._formats._array_record import ArrayRecordSource as ArrayRecordSource
from meshkit.data._formats._array_record import write_array_record as write_array_record
from meshkit.data._formats._convert import convert as convert
from meshkit.data._formats._digits import digits as digits
from meshkit.data._formats._digits import synthetic as synthetic
from meshkit.data._formats._encoded import EncodedRecordSource as EncodedRecordSource
from meshkit.data._formats._files import cifar10 as cifar10
from meshkit.data._formats._files import cifar100 as cifar100
from meshkit.data._formats._files import fashion_mnist as fashion_mnist
from meshkit.data._formats._files import mnist as mnist
from meshkit.data._formats._image_records import decode_image_record as decode_image_record
from meshkit.data._formats._image_records import encode_image_record as encode_image_record
from meshkit.data._formats._image_records import image_records as image_records
from meshkit.data._formats._image_records import write_image_records as write_image_records
from meshkit.data._formats._image_sets import write_digits_images as write_digits_images
from meshkit.data._formats._image_sets import write_image_folder as write_image_folder
from meshkit.data._formats._text import decode_bytes as decode_bytes
from meshkit.data._formats._text import reference_text as reference_text
from meshkit.data._formats._text import text_windows as text_windows
from meshkit.data._formats._text import token_windows as token_windows
from meshkit.data._formats._tfds import TfdsSource as TfdsSource
