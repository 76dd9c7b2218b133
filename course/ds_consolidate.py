"""Turn a ZeRO checkpoint (one shard per rank) into one plain fp32 state_dict file.

    python course/ds_consolidate.py runs/ds_ckpt consolidated.pt     # the folder holding `latest`

With ZeRO-3 no rank ever holds the whole model: each saved its shard of the weights and optimizer state. This
gathers the shards on the CPU, no GPUs or process group needed, and writes a state_dict that loads into the plain
model (`SimpleCNN().load_state_dict(torch.load("consolidated.pt"))`). DeepSpeed also copies a `zero_to_fp32.py`
into every checkpoint folder that does the same from the command line (it needs the huggingface_hub package).
"""
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # consolidation is CPU work; do not look for GPUs

import torch  # noqa: E402  (imports after DS_ACCELERATOR is set)
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402

from helpers.rank.runtime import end_rank  # noqa: E402


def main() -> int:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    checkpoint_dir, output = sys.argv[1:]
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir)  # reads `latest` for the tag
    torch.save(state_dict, output)
    print(f"{len(state_dict)} tensors, {sum(t.numel() for t in state_dict.values()):,} parameters -> {output}")
    return 0


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
