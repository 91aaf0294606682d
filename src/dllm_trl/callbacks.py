"""Training callbacks: the main job's one progress bar (:class:`RewardProgressBar`). The checks before loading
(``--report_to`` backends and more) are in :mod:`dllm_trl.prechecks`."""

from __future__ import annotations

import json
import time

from transformers import TrainerCallback

class RewardProgressBar(TrainerCallback):
    """One tqdm bar in place of transformers' progress bar and log printer: the mean rollout reward (moving average
    over ``window`` steps), the moving averages of the logged metrics named in ``shown`` (label → metric key), the
    held-out accuracy whenever ``evaluate(model)`` runs (every ``eval_steps``), and seconds per step.

    TRL's full metric dicts still reach the ``report_to`` backends, and go one JSON object per line to
    ``metrics_path``; ``accuracies`` collects ``(step, accuracy)`` of the evaluations during training.
    """

    def __init__(self, evaluate=None, eval_steps: int = 0, metrics_path: str | None = None, initial_accuracy=None,
                 window: int = 10, description: str = "RLDF", shown: dict | None = None):
        self.evaluate, self.eval_steps, self.metrics_path, self.window = evaluate, eval_steps, metrics_path, window
        self.description = description
        self.accuracies: list[tuple[int, float]] = []
        self.rewards: list[float] = []
        self.shown = {"reward": "reward", **(shown or {})}
        self.history: dict[str, list[float]] = {label: [] for label in self.shown}
        self.postfix = {} if initial_accuracy is None else {"acc": f"{initial_accuracy:.3f}"}
        self.bar = None
        self._step_start = time.perf_counter()

    def install(self, trainer):
        """Replace the trainer's own progress bar / log printer by this callback."""
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        trainer.remove_callback(ProgressCallback)
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(self)
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from tqdm.auto import tqdm

        if self.metrics_path:
            open(self.metrics_path, "w").close()
        self.bar = tqdm(total=state.max_steps, desc=self.description, dynamic_ncols=True, unit="step")

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        seconds = time.perf_counter() - self._step_start
        if (self.evaluate is not None and self.eval_steps and state.global_step % self.eval_steps == 0
                and state.global_step < state.max_steps):
            accuracy = self.evaluate(model)
            self.accuracies.append((state.global_step, accuracy))
            self.postfix["acc"] = f"{accuracy:.3f}"
        self.postfix["s/step"] = f"{seconds:.2f}"
        if self.bar is not None:
            self.bar.set_postfix(self.postfix, refresh=False)
            self.bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "reward" in logs:
            self.rewards.append(logs["reward"])
            averages = {}
            for label, key in self.shown.items():
                if key in logs:
                    self.history[label].append(logs[key])
                    recent = self.history[label][-self.window:]
                    averages[label] = f"{sum(recent) / len(recent):.3f}"
            self.postfix = {**averages, **{k: v for k, v in self.postfix.items() if k not in averages}}
        if self.metrics_path and state.is_world_process_zero:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps({"step": state.global_step, **logs}) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
