"""Faults and bad inputs (issue 30, items 3 and 4): each ends in one clear error naming the cause and the fix, with
nothing lost and nothing silently changed."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from dllm_trl import RLDFTrainer
from dllm_trl.models.integrity import MANIFEST_NAME, CheckpointError
from tests.tiny_models import build_tiny_llada
from dllm_trl.trainers.common import STAGING_DIR, verify_checkpoint
from dllm_trl.trainers.safe_runs import (
    ABANDONED_PREFIX,
    OutputDirInUseError,
    ResumeMismatchError,
    TrainingInterrupted,
)

from .conftest import addition_dataset, length_reward, make_char_tokenizer
from .test_safe_runs import StepCounter, make_trainer


class AtStep(TrainerCallback):
    """Calls ``action(trainer)`` at the end of step ``step``."""

    def __init__(self, step, action):
        self.step, self.action, self.trainer = step, action, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.action(self.trainer)


def with_callback(trainer, step, action):
    callback = AtStep(step, action)
    callback.trainer = trainer
    trainer.add_callback(callback)
    return trainer


# ---------------------------------------------------------------------------------------------- shared output_dir
HOLDER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("safe_runs", sys.argv[2])  # the standard library only: starts fast
safe_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(safe_runs)
safe_runs.acquire_output_dir(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_run_on_the_same_output_dir_is_refused_naming_the_first(tmp_path):
    """Two real processes: one holding output_dir, then this one's trainer and the main job, refused; the lock goes
    with its holder."""
    import dllm_trl.trainers.safe_runs as safe_runs

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), safe_runs.__file__], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        trainer = make_trainer(tmp_path, max_steps=1, save_strategy="no")
        busy = f"in use by another run \\(pid {holder.pid} .*another --output_dir"
        with pytest.raises(OutputDirInUseError, match=busy):
            trainer.train()
        assert not (out / "log_history.jsonl").exists() and not list(out.glob("checkpoint-*"))
        job = subprocess.run([sys.executable, "-m", "dllm_trl", "--output_dir", str(out), "--max_steps", "1"],
                             capture_output=True, text=True, timeout=300)
        assert job.returncode != 0, job.stdout + job.stderr
        last = job.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: output_dir {out} is in use by another run (pid {holder.pid}"), job.stderr
        assert "Traceback" not in job.stderr
    finally:
        holder.kill()
        holder.wait()
    make_trainer(tmp_path, max_steps=1, save_strategy="no").train()  # a killed holder frees it


def test_a_stale_staging_folder_is_removed_at_the_next_start(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1, save_strategy="no")
    stale = tmp_path / "out" / STAGING_DIR / "checkpoint-7"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    trainer.train()
    assert not (tmp_path / "out" / STAGING_DIR).exists()


# ----------------------------------------------------------------------------------------------------- disk full
def _fill(folder, keep_bytes):
    """Write a ballast file that leaves ``keep_bytes`` free on the filesystem of ``folder``."""
    free = shutil.disk_usage(folder).free
    with open(os.path.join(folder, "ballast"), "wb") as handle:
        handle.write(bytes(max(free - keep_bytes, 0)))


def _assert_save_failed_cleanly(out, message):
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists()
    verify_checkpoint(str(out / "checkpoint-2"))  # the previous checkpoint survived whole
    assert not (out / STAGING_DIR).exists()  # the half-written one is gone
    assert f"previous checkpoint {out / 'checkpoint-2'} is intact" in message


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root; the file-size-limit test runs anywhere")
def test_a_full_disk_during_a_save_is_named_and_leaves_the_previous_checkpoint(tmp_path):
    """A real full disk: output_dir on an 8 MiB tmpfs, filled after the first checkpoint."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], check=True)
    try:
        out = disk / "out"
        trainer = make_trainer(tmp_path, output_dir=str(out))
        with_callback(trainer, 3, lambda _: _fill(disk, 64 << 10))
        with pytest.raises(OSError, match="failed: the disk is full .* MiB free.*Free space there") as error:
            trainer.train()
        _assert_save_failed_cleanly(out, str(error.value))
    finally:
        subprocess.run(["umount", str(disk)], check=True)


FILE_SIZE_LIMITED = """
import pathlib, resource, signal, sys
from tests.test_faults import make_trainer, with_callback
tmp = pathlib.Path(sys.argv[1])
trainer = make_trainer(tmp)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write instead of a killed process
limits = resource.getrlimit(resource.RLIMIT_FSIZE)
with_callback(trainer, 3, lambda _: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1])))
try:
    trainer.train()
except OSError as error:
    print(error)
"""


def test_a_file_size_limit_during_a_save_is_named_and_leaves_the_previous_checkpoint(tmp_path):
    """The same fault without root, in a process of its own (pytest's capture files would hit the limit too):
    RLIMIT_FSIZE (``ulimit -f``) lowered after the first checkpoint makes the next save's writes fail as a full disk
    does (EFBIG instead of ENOSPC)."""
    job = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMITED, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)),
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    message = job.stdout.strip().splitlines()[-1] if job.stdout.strip() else job.stderr
    assert message.startswith(f"Saving checkpoint-4 to {tmp_path / 'out'} failed: a file hit this process's "
                              "file-size limit (`ulimit -f`)"), message
    _assert_save_failed_cleanly(tmp_path / "out", message)


# ------------------------------------------------------------------------------------------------------ resuming
@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """Checkpoints 2 and 4 of a run of the model saved in ``model-a``."""
    tmp_path = tmp_path_factory.mktemp("faults-run")
    trainer = make_trainer(tmp_path)
    trainer.model.save_pretrained(tmp_path / "model-a")
    trainer.model.config._name_or_path = str(tmp_path / "model-a")  # as if loaded from there
    trainer.train()
    return tmp_path / "out"


def _copy(source, tmp_path):
    target = tmp_path / "out"
    shutil.copytree(source, target)
    return target


def test_resume_with_a_changed_setting_is_refused_naming_it(two_checkpoints, tmp_path):
    out = _copy(two_checkpoints, tmp_path)
    trainer = make_trainer(tmp_path, learning_rate=3e-3, beta=0.02)
    changed = "beta 0.01 → 0.02; learning_rate 0.001 → 0.003.*--model_name_or_path"
    with pytest.raises(ResumeMismatchError, match=changed):
        trainer.train(resume_from_checkpoint="true")
    longer = make_trainer(tmp_path, max_steps=5, save_steps=5)  # training longer is what a resume is for
    steps = StepCounter()
    longer.add_callback(steps)
    longer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert steps.taken == 1


def test_resume_with_another_model_is_refused_naming_both(two_checkpoints, tmp_path):
    _copy(two_checkpoints, tmp_path)
    tokenizer = make_char_tokenizer()
    model = build_tiny_llada(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(tmp_path / "other-model")
    trainer = make_trainer(tmp_path)
    trainer.model.config._name_or_path = str(tmp_path / "other-model")
    with pytest.raises(ResumeMismatchError, match=f"trained from the model {two_checkpoints.parent / 'model-a'}, "
                                                  f"not {tmp_path / 'other-model'}"):
        trainer.train(resume_from_checkpoint="true")


def test_resume_true_after_resuming_from_an_earlier_checkpoint_continues_that_run(two_checkpoints, tmp_path):
    """checkpoints 2 and 4; resume from 2 and save 3: `true` must then pick 3, not the abandoned run's 4 (which is
    moved aside, not deleted)."""
    out = _copy(two_checkpoints, tmp_path)
    with pytest.warns(UserWarning, match="set aside checkpoint-4 \\(later checkpoints of the run abandoned there\\)"):
        make_trainer(tmp_path, max_steps=3, save_steps=1).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    (aside,) = out.glob(f"{ABANDONED_PREFIX}checkpoint-2-*")
    verify_checkpoint(str(aside / "checkpoint-4"))  # kept whole
    again = make_trainer(tmp_path, max_steps=4, save_steps=1)
    steps = StepCounter()
    again.add_callback(steps)
    again.train(resume_from_checkpoint="true")
    assert steps.taken == 1  # from step 3


def test_a_checkpoint_without_its_manifest_and_optimizer_is_refused(two_checkpoints, tmp_path):
    out = _copy(two_checkpoints, tmp_path)
    (out / "checkpoint-4" / MANIFEST_NAME).unlink()
    (out / "checkpoint-4" / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=f"missing {MANIFEST_NAME}, optimizer.pt: .*fresh optimizer.*"
                                              f"previous good checkpoint is {out / 'checkpoint-2'}"):
        make_trainer(tmp_path).train(resume_from_checkpoint="true")


# -------------------------------------------------------------------------------------------------------- SIGTERM
@pytest.mark.parametrize("jit", [False, True])
def test_sigterm_saves_a_checkpoint_and_stops_saying_so(tmp_path, jit):
    trainer = make_trainer(tmp_path, max_steps=6, save_strategy="no", enable_jit_checkpoint=jit)
    with_callback(trainer, 3, lambda _: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(TrainingInterrupted, match="SIGTERM: saved .*checkpoint-3 and stopped at step 3 of 6") as stop:
        trainer.train()
    assert stop.value.code == 143 and stop.value.step == 3
    out = tmp_path / "out"
    verify_checkpoint(str(out / "checkpoint-3"))
    resumed = make_trainer(tmp_path, max_steps=6, save_strategy="no", enable_jit_checkpoint=jit)
    steps = StepCounter()
    resumed.add_callback(steps)
    resumed.train(resume_from_checkpoint="true")
    assert steps.taken == 3
    assert signal.getsignal(signal.SIGTERM) is not None


def test_the_main_job_on_sigterm_saves_marks_the_summary_interrupted_and_exits_143(tmp_path):
    out = tmp_path / "out"
    job = subprocess.Popen([sys.executable, "-m", "dllm_trl", "--output_dir", str(out), "--max_steps", "50",
                            "--skip_eval", "--prompts_per_step", "1", "--num_generations", "4", "--threads", "1",
                            "--enable_jit_checkpoint", "true"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while job.poll() is None and time.time() < deadline and not (
            (out / "log_history.jsonl").exists() and (out / "log_history.jsonl").read_text().count("\n") >= 1):
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 143, stdout + stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and 1 <= summary["steps"] < 50
    assert (out / f"checkpoint-{summary['steps']}").is_dir()
    assert f"saved {out / ('checkpoint-' + str(summary['steps']))}" in stderr.strip().splitlines()[-1]


# -------------------------------------------------------------------------------------------------------- push
class FakeHub:
    """Stands in for huggingface_hub's API (no network): records what each upload was handed."""

    def __init__(self):
        self.uploads = []

    def upload_folder(self, folder_path, path_in_repo=None, **kwargs):
        self.uploads.append((str(folder_path), path_in_repo, os.path.isdir(folder_path)))
        done = concurrent.futures.Future()
        done.set_result(None)
        return done


def test_a_checkpoint_push_uploads_the_renamed_folder(tmp_path, monkeypatch):
    import transformers.trainer

    hub = FakeHub()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.args.push_to_hub, trainer.args.hub_strategy, trainer.hub_model_id = True, "checkpoint", "me/run"
    trainer.push_in_progress = None  # what the Trainer's init sets up when push_to_hub is given there
    trainer.train()
    checkpoint_uploads = [(path, there) for path, where, there in hub.uploads if where == "last-checkpoint"]
    assert checkpoint_uploads == [(str(tmp_path / "out" / "checkpoint-2"), True)]


# ---------------------------------------------------------------------------------------------------- rewards
def test_an_inf_reward_is_no_reward_for_its_row_and_counted(tmp_path):
    def with_inf(completions, answer, **kwargs):
        rewards = length_reward(completions, answer)
        rewards[0] = math.inf
        return rewards

    trainer = make_trainer(tmp_path, reward=with_inf, max_steps=1, save_strategy="no")
    with pytest.warns(UserWarning, match="with_inf.*None, NaN or ±inf"):
        trainer.train()
    (logged,) = [m for m in trainer.state.log_history if "loss" in m]
    assert logged["rewards/with_inf/unscorable_frac"] == pytest.approx(1 / 4)
    assert logged["grad_norm"] > 0 and math.isfinite(logged["reward"])


def _two_d(completions, **kwargs):
    return torch.ones(len(completions), 2)


def _strings(completions, **kwargs):
    return ["1.0"] * len(completions)


def _bare_float(completions, **kwargs):
    return 1.0


def _one_string(completions, **kwargs):
    return "1.0"


async def _async_bare_float(completions, **kwargs):
    return 1.0


@pytest.mark.parametrize("reward, message", [
    (_two_d, "'_two_d' returned a 2-D Tensor of shape \\(3, 2\\)"),
    (_strings, "'_strings' returned str '1.0' for completion 0"),
    (_bare_float, "'_bare_float' returned float 1.0 instead of one reward per completion"),
    (_one_string, "'_one_string' returned str '1.0' instead of one reward per completion"),  # not 3 rewards
    (_async_bare_float, "'_async_bare_float' returned float 1.0 instead of one reward per completion"),
])
def test_a_reward_function_returning_no_list_of_numbers_is_refused_at_the_first_batch(tmp_path, reward, message):
    trainer = make_trainer(tmp_path, reward=reward, max_steps=1, save_strategy="no", num_generations=3,
                           per_device_train_batch_size=3)
    with pytest.raises(ValueError, match=message + ".*list \\(or 1-D tensor / array\\) of 3 numbers or None"):
        trainer.train()


# ------------------------------------------------------------------------------------------------- bad inputs
def test_a_tokenizer_with_ids_past_the_vocabulary_is_refused_at_init(tmp_path):
    tokenizer = make_char_tokenizer()
    model = build_tiny_llada(vocab_size=len(tokenizer) - 2, mask_token_id=tokenizer.mask_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    from .conftest import tiny_training_args
    from dllm_trl import RLDFConfig

    with pytest.raises(ValueError, match=f"tokenizer has {len(tokenizer)} tokens .* vocab_size={len(tokenizer) - 2}.*"
                                         "resize_token_embeddings"):
        RLDFTrainer(model=model, reward_funcs=length_reward, args=tiny_training_args(RLDFConfig, tmp_path),
                    train_dataset=addition_dataset(), processing_class=tokenizer)


def test_a_prompt_past_max_position_embeddings_is_refused_at_its_batch(tmp_path):
    long = Dataset.from_dict({"prompt": ["1+2=" * 15] * 4, "answer": ["3"] * 4})  # 60 tokens + 8 > 64
    trainer = make_trainer(tmp_path, dataset=long, max_steps=1, save_strategy="no")
    trainer.model.config.max_position_embeddings = 64
    with pytest.raises(ValueError, match="60-token prompt \\+ max_completion_length=8 = 68 positions exceed the "
                                         "model's max_position_embeddings=64"):
        trainer.train()


def test_diffusion_gemma_refuses_a_prompt_past_its_positions(tmp_path):
    from dllm_trl.generation import DiffusionGemmaSampler, DiffusionGemmaSamplerConfig
    from dllm_trl.losses import DiffusionGemmaRLDFLoss

    from .test_diffusion_gemma_training import digit_ones_reward, toy_args, toy_model

    model, tokenizer = toy_model()
    args = toy_args(max_steps=1)
    args.output_dir = str(tmp_path / "out")
    limit = model.config.get_text_config().max_position_embeddings
    prompt = "1" * (limit - 4)
    with pytest.raises(ValueError, match=f"exceed the model's max_position_embeddings={limit}"):  # at init
        RLDFTrainer(model=model, reward_funcs=digit_ones_reward, args=args,
                    train_dataset=Dataset.from_dict({"prompt": [prompt] * 4}), processing_class=tokenizer,
                    sampler=DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=8)),
                    loss=DiffusionGemmaRLDFLoss(args))
