r"""Evaluate a diffusion LM on math and code sets with paper 1's protocol (Table 2 / 3): greedy decoding at
generation lengths 128, 256 and 512, blocks of 32, dynamic (threshold 0.9) and static (one token per step)
unmasking. Writes ``results.json``, ``results.md``, ``results.png`` and ``completions.jsonl``.

With no arguments it evaluates the shipped toy model on the toy test split at lengths 4, 8 and 16 (CPU)::

    python examples/evaluate.py

LLaDA-8B-Instruct on the paper's benchmarks (AMC23 has no preset: pass a local file with ``problem`` and
``answer`` columns)::

    python examples/evaluate.py --model_name_or_path GSAI-ML/LLaDA-8B-Instruct --dtype bfloat16 \
        --datasets gsm8k math500 humaneval mbpp --gen_lengths 128 256 512 --unmasking dynamic static \
        --block_length 32 --threshold 0.9 --batch_size 16 --output_dir eval/llada-8b-instruct

Dream-7B-Instruct: ``--model_name_or_path Dream-org/Dream-v0-Instruct-7B``. A model trained with
``rldf_math.py`` / ``rldf_code.py``: its output folder (a LoRA adapter folder loads on top of its base model);
``--load_in_4bit`` loads the weights in 4 bits. Your checkpoint on your own test file, never contacting the Hub,
with pass@1 and pass@8 from 8 samples per problem at temperature 0.6::

    HF_HUB_OFFLINE=1 python examples/evaluate.py --model_name_or_path outputs/rldf-math --datasets my_test.jsonl \
        --gen_lengths 256 --unmasking dynamic --num_samples 8 --temperature 0.6 --pass_at_k 1 8

Same as ``python -m dllm_trl.evaluation``.
"""

import os
import sys

# This script shares its name with the `evaluate` library: drop its folder from the import path so that
# `import evaluate` (in dllm_trl.evaluation) finds the library and not this file.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

from dllm_trl.evaluation import main  # noqa: E402

if __name__ == "__main__":
    main()
