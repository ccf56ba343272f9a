"""Full evaluation: every example exactly once, fixed shapes, one compile, multi-host safe."""

from meshkit.evaluate._full_eval import EvalResult as EvalResult
from meshkit.evaluate._full_eval import full_eval as full_eval
from meshkit.evaluate._pad import pad_shard_unpad as pad_shard_unpad
from meshkit.evaluate._stream import stream_eval as stream_eval
