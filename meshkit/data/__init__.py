"""Grain pipelines that feed exact, resumable global batches, on one process or many."""

from meshkit.data._array_record import ArrayRecordSource as ArrayRecordSource
from meshkit.data._array_record import write_array_record as write_array_record
from meshkit.data._digits import digits as digits
from meshkit.data._digits import synthetic as synthetic
from meshkit.data._encoded import EncodedRecordSource as EncodedRecordSource
from meshkit.data._files import cifar10 as cifar10
from meshkit.data._files import cifar100 as cifar100
from meshkit.data._files import fashion_mnist as fashion_mnist
from meshkit.data._files import mnist as mnist
from meshkit.data._image_records import decode_image_record as decode_image_record
from meshkit.data._image_records import encode_image_record as encode_image_record
from meshkit.data._image_records import image_records as image_records
from meshkit.data._image_records import write_image_records as write_image_records
from meshkit.data._image_sets import write_digits_images as write_digits_images
from meshkit.data._image_sets import write_image_folder as write_image_folder
from meshkit.data._iterator import GlobalBatchIterator as GlobalBatchIterator
from meshkit.data._iterator import check_state as check_state
from meshkit.data._pipeline import EvalPipeline as EvalPipeline
from meshkit.data._pipeline import EvalTransform as EvalTransform
from meshkit.data._pipeline import TrainPipeline as TrainPipeline
from meshkit.data._pipeline import Transform as Transform
from meshkit.data._pipeline import stack_records as stack_records
from meshkit.data._source import ArraySource as ArraySource
from meshkit.data._source import Record as Record
from meshkit.data._source import Source as Source
from meshkit.data._source import load_npz as load_npz
