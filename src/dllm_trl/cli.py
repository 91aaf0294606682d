"""Removed: what this module held lives by kind now. Reading a name from here says where it went."""

from ._lazy import moved_names

__getattr__ = moved_names(__name__, {
    **dict.fromkeys(["toy_training_defaults", "toy_rldf_config", "sudoku_rldf_config"], "dllm_trl.toy.configs"),
    **dict.fromkeys(["model_init_kwargs", "check_trainable", "load_model_and_tokenizer", "save_trained_model"],
                    "dllm_trl.models.pretrained"),
    "RewardProgressBar": "dllm_trl.callbacks",
    "check_report_backends": "dllm_trl.prechecks",
})
