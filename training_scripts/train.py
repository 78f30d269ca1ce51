"""Pipeline-parallel pretraining of a Hugging Face causal LM.

    accelerate launch --config_file training_scripts/accelerate/cpu_2proc.yaml \
        training_scripts/train.py --config training_scripts/configs/tiny_moe.yaml [--key value ...]
    torchrun --nproc_per_node 2 training_scripts/train.py --config ...
    python training_scripts/train.py --config ...        # one process, pp_size 1
"""

import sys

from hf_asyncpp.run import main

if __name__ == "__main__":
    sys.exit(main())
