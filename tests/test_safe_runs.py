"""Nothing lost, nothing wrongly credited (issue 25): atomic, checksummed checkpoints that resume exactly, clear errors
for broken checkpoint files, unscorable rewards counted, empty prompts refused."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from dllm_trl import RLDFConfig, RLDFTrainer, load_diffusion_model
from dllm_trl.models.integrity import MANIFEST_NAME, CheckpointError
from dllm_trl.trainers.common import STAGING_DIR

from .conftest import addition_dataset, length_reward, make_char_tokenizer, tiny_training_args
from .test_dppo_mask_trainer import snapshot, tiny_diffusion


class StepCounter(TrainerCallback):
    taken = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.taken += 1


def make_trainer(tmp_path, reward=length_reward, dataset=None, **overrides):
    args = tiny_training_args(RLDFConfig, tmp_path, **{"save_strategy": "steps", "save_steps": 2, "max_steps": 4,
                                                        **overrides})
    return RLDFTrainer(model=tiny_diffusion(), reward_funcs=reward, args=args,
                       train_dataset=addition_dataset() if dataset is None else dataset,
                       processing_class=make_char_tokenizer())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step run that saved checkpoints 2 and 4; its final weights."""
    tmp_path = tmp_path_factory.mktemp("run")
    trainer = make_trainer(tmp_path)
    trainer.train()
    return tmp_path, snapshot(trainer.model)


def test_checkpoints_are_renamed_into_place_with_a_manifest_and_resume_exactly(run, tmp_path):
    source, final = run
    out = source / "out"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2", "checkpoint-4"]
    assert not (out / STAGING_DIR).exists()
    manifest = json.loads((out / "checkpoint-2" / MANIFEST_NAME).read_text())["files"]
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "rldf_generator_0.pt"} <= set(manifest)
    copy = _broken_copy(run, tmp_path, lambda folder: shutil.rmtree(folder))  # as if killed after step 3
    resumed = make_trainer(tmp_path, output_dir=str(copy))
    steps = StepCounter()
    resumed.add_callback(steps)
    resumed.train(resume_from_checkpoint="true")  # the newest finished one: checkpoint-2
    assert steps.taken == 2  # it did resume: steps 3 and 4 only
    for name, value in snapshot(resumed.model).items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=0, msg=name)


def _broken_copy(run, tmp_path, damage):
    source, _ = run
    target = tmp_path / "out"
    shutil.copytree(source / "out", target)
    damage(target / "checkpoint-4")
    return target


def _truncate(name):
    def damage(folder):
        path = folder / name
        path.write_bytes(path.read_bytes()[: os.path.getsize(path) // 2])
    return damage


def _zeros_inside(folder):
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-70000:-4464] = bytes(65536)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, what", [
    (_truncate("model.safetensors"), "model.safetensors: .* bytes where"),
    (_truncate("optimizer.pt"), "optimizer.pt: .* bytes where"),
    (_truncate("scheduler.pt"), "scheduler.pt: .* bytes where"),
    (_truncate("rldf_generator_0.pt"), "rldf_generator_0.pt: .* bytes where"),
    (_truncate("trainer_state.json"), "trainer_state.json: .* bytes where"),
    (_truncate("rng_state.pth"), "rng_state.pth: .* bytes where"),
    (_zeros_inside, "model.safetensors: its contents changed"),
    (lambda folder: [p.unlink() for p in folder.iterdir()], "empty \\(a save was interrupted\\)"),
])
def test_a_broken_checkpoint_is_refused_naming_the_file_and_the_previous_one(run, tmp_path, damage, what):
    out = _broken_copy(run, tmp_path, damage)
    trainer = make_trainer(tmp_path, output_dir=str(out))
    with pytest.raises(CheckpointError, match=what) as error:
        trainer.train(resume_from_checkpoint="true")
    assert f"previous good checkpoint is {out / 'checkpoint-2'}" in str(error.value)


def test_without_a_manifest_unreadable_json_is_still_named(run, tmp_path):
    def damage(folder):
        (folder / MANIFEST_NAME).unlink()
        _truncate("trainer_state.json")(folder)
    out = _broken_copy(run, tmp_path, damage)
    with pytest.raises(CheckpointError, match="trainer_state.json: not valid JSON"):
        make_trainer(tmp_path, output_dir=str(out)).train(resume_from_checkpoint=str(out / "checkpoint-4"))


def test_a_save_killed_midway_leaves_nothing_resume_picks_up(run, tmp_path):
    """A kill during a save leaves only the staging folder: resume takes the last finished checkpoint, and the next
    save at that step replaces the stale staging copy."""
    def damage(folder):
        staged = folder.parent / STAGING_DIR / "checkpoint-4"
        staged.parent.mkdir()
        folder.rename(staged)
        (staged / "model.safetensors").write_bytes(b"")
    out = _broken_copy(run, tmp_path, damage)
    trainer = make_trainer(tmp_path, output_dir=str(out))
    steps = StepCounter()
    trainer.add_callback(steps)
    trainer.train(resume_from_checkpoint="true")  # checkpoint-2, then saves checkpoint-4 again
    assert steps.taken == 2
    assert (out / "checkpoint-4" / MANIFEST_NAME).exists() and not (out / STAGING_DIR).exists()
    torch.testing.assert_close(snapshot(trainer.model), run[1], rtol=0, atol=0)


def test_saved_models_are_verified_when_loaded(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1, save_strategy="no")
    trainer.save_model(str(tmp_path / "model"))
    assert load_diffusion_model(str(tmp_path / "model")) is not None
    _zeros_inside(tmp_path / "model")
    with pytest.raises(CheckpointError, match="model.safetensors: its contents changed"):
        load_diffusion_model(str(tmp_path / "model"))
    load_diffusion_model(str(tmp_path / "model"), verify_checksums=False)  # the opt-out


def _half_none(completions, **kwargs):
    return [None if n % 2 else 1.0 for n, _ in enumerate(completions)]


def test_unscorable_rewards_are_counted_warned_once_or_refused(tmp_path):
    trainer = make_trainer(tmp_path, reward=_half_none, max_steps=2, save_strategy="no")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert [m for m in trainer.state.log_history if "rewards/_half_none/unscorable_frac" in m][0][
        "rewards/_half_none/unscorable_frac"] == pytest.approx(0.5)
    assert sum("returned None, NaN or ±inf" in str(w.message) for w in caught) == 1
    strict = make_trainer(tmp_path, reward=_half_none, max_steps=1, save_strategy="no",
                          raise_on_unscorable_rewards=True)
    with pytest.raises(ValueError, match="_half_none.*raise_on_unscorable_rewards"):
        strict.train()


@pytest.mark.parametrize("prompts", [["1+2=", "  ", "3+4="], [[{"role": "user", "content": ""}]]])
def test_empty_prompts_are_refused_up_front_naming_the_row(tmp_path, prompts):
    with pytest.raises(ValueError, match="empty or whitespace-only prompt.*row"):
        make_trainer(tmp_path, dataset=Dataset.from_dict({"prompt": prompts}))
