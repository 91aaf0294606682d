"""Every engine we ship, launched for real with ``accelerate launch`` and 2 processes on CPU (gloo).

DDP is the plain run the others must agree with: the same 2 processes, seeds, data shards and rollouts, in float32,
so after two RLDF steps (β > 0) every engine's parameters equal DDP's up to reduction order. DeepSpeed runs on its
CPU accelerator (``DS_ACCELERATOR=cpu``). accelerate enables FSDP only on GPU-like devices; the FSDP test takes
accelerate's CPU state and sets its distributed type to FSDP as the GPU branch would (see
``distributed_rldf.fsdp_state_on_cpu``), after which accelerate's own FSDP2 preparation and checkpointing run
unmodified. The shipped configs that cannot run here must stop with a clear message.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dllm_trl import load_diffusion_model

from .conftest import make_char_tokenizer
from .test_models import llada_raw_config, llada_weights, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("distributed_rldf.py")
CONFIGS = ROOT / "examples" / "accelerate_configs"
AGREEMENT = dict(atol=1e-5, rtol=0)
"""Parameters after two steps vs the DDP run: float32 reductions in another order differ by ~1e-7."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(out: Path, *options: str, config: str | Path | None = "multi_gpu", processes: int = 2, check: bool = True,
           timeout: int = 900, env: dict | None = None):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="",
               DS_ACCELERATOR="cpu", **(env or {}))
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if config is not None:
        command += ["--config_file", str(config if isinstance(config, Path) else CONFIGS / f"{config}.yaml")]
    command += ["--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no", "--main_process_port", str(free_port()), str(SCRIPT), str(out), *options]
    done = run_bounded(command, timeout, env)
    output = done.stdout + done.stderr
    if check:
        assert done.returncode == 0, output[-6000:]
        assert f"DISTRIBUTED_OK world={processes}" in done.stdout, output[-3000:]
        return torch.load(out / "result.pt")
    return done.returncode, output


class LaunchHung(AssertionError):
    """A launch that did not finish within its time limit (a collective that never completed)."""


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (torchrun starts each worker in a session of its own, out of the launcher's
    process group)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def run_bounded(command, timeout: int, env: dict) -> subprocess.CompletedProcess:
    """``command`` in its own process group; past ``timeout`` seconds the launcher and every worker under it are
    killed and :class:`LaunchHung` raised with the end of the output, so that a hang fails the test instead of
    leaving workers behind."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in descendants(process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise LaunchHung(f"the launch hung (killed after {timeout} s):\n{(stdout + stderr)[-4000:]}") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def zero3_gathering_config(directory: Path) -> Path:
    """The shipped ZeRO-3 config with ``stage3_param_persistence_threshold: 0``: every weight is partitioned and
    gathered at each module call, as a real model's are (the toys' weights are all under the default threshold of
    1e5 elements, so with the shipped config ZeRO-3 gathers none of them). Written to ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "zero3_gathering.json").write_text(json.dumps({
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    }))
    shipped = (CONFIGS / "deepspeed_zero3.yaml").read_text()
    start, end = shipped.index("deepspeed_config:"), shipped.index("num_machines:")
    engine = (f"deepspeed_config:\n  deepspeed_multinode_launcher: standard\n  zero3_init_flag: true\n"
              f"  deepspeed_config_file: {directory / 'zero3_gathering.json'}\n")
    config = directory / "zero3_gathering.yaml"
    config.write_text(shipped[:start] + engine + shipped[end:].replace("mixed_precision: bf16", "mixed_precision: 'no'"))
    return config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny official-format LLaDA checkpoint (loaded by path, so that ZeRO-3 can partition it at load)."""
    tokenizer = make_char_tokenizer()
    raw = llada_raw_config(
        embedding_size=len(tokenizer), vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, d_model=32, mlp_hidden_size=64,
    )
    return write_checkpoint(tmp_path_factory.mktemp("llada"), raw, llada_weights(raw, seed=0))


@pytest.fixture(scope="module")
def ddp(checkpoint, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("ddp"), f"model={checkpoint}")  # auto: per-step backward under DDP


def assert_agrees(result, reference):
    assert result["world_size"] == 2 and result["dtype"] == "torch.float32"
    assert result["kl"][0] == 0.0, "step-0 KL must be 0: the reference is the policy as it started"
    assert result["kl"][1] > 0.0
    assert sorted(result["params"]) == sorted(reference["params"])
    for name, value in reference["params"].items():
        torch.testing.assert_close(result["params"][name], value, **AGREEMENT, msg=name)


def test_ddp_trains_and_keeps_replicas_identical(ddp, checkpoint):
    # The script asserts that both processes hold identical parameters; here: a real 2-process DDP run learned.
    assert ddp["world_size"] == 2 and ddp["distributed_type"] == "DistributedType.MULTI_CPU"
    # rldf/sampled_steps is per completion over both processes (k = 4 at most), not multiplied by the world size
    assert ddp["kl"][0] == 0.0 and all(1 < s <= 4 for s in ddp["sampled_steps"])
    start = load_diffusion_model(checkpoint).state_dict()
    moved = [n for n, v in start.items() if (v - ddp["params"][n]).abs().max() > 1e-4]
    assert len(moved) == len(start), f"only {moved} were trained"


def test_ddp_in_memory_model(tmp_path):
    result = launch(tmp_path, "model=memory")
    assert result["world_size"] == 2


@pytest.mark.parametrize("backward_mode", ["per_micro_batch"])
def test_ddp_backward_modes_agree(ddp, tmp_path, checkpoint, backward_mode):
    assert_agrees(launch(tmp_path, f"model={checkpoint}", f"backward_mode={backward_mode}"), ddp)


def test_deepspeed_zero2_agrees_with_ddp(ddp, tmp_path, checkpoint):
    result = launch(tmp_path, f"model={checkpoint}", config="deepspeed_zero2")
    assert result["distributed_type"] == "DistributedType.DEEPSPEED"
    assert_agrees(result, ddp)


def test_deepspeed_zero3_partitioned_at_load_agrees_with_ddp(ddp, tmp_path, checkpoint):
    result = launch(tmp_path, f"model={checkpoint}", "backward_mode=per_step", config="deepspeed_zero3")
    assert result["distributed_type"] == "DistributedType.DEEPSPEED"
    assert result["partitioned_at_load"] and result["sharded"], "zero3_init_flag must partition the weights at load"
    assert_agrees(result, ddp)


def test_fsdp2_trains_checkpoints_and_agrees_with_ddp(ddp, tmp_path, checkpoint):
    result = launch(tmp_path, f"model={checkpoint}", "fsdp_on_cpu=1", "save=1", config="fsdp")
    assert result["distributed_type"] == "DistributedType.FSDP" and result["sharded"]
    assert_agrees(result, ddp)
    saved = load_diffusion_model(str(tmp_path / "checkpoint-2"))
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(value, result["params"][name], atol=0, rtol=0, msg=name)


@pytest.fixture(scope="module")
def sure_unsure_ddp(tmp_path_factory):
    """DDP on prompts that make the processes differ (``distributed_rldf.sure_unsure_dataset``): nothing is kept in
    lock-step under DDP, whose forwards are local."""
    return launch(tmp_path_factory.mktemp("sure_unsure_ddp"), "task=sure_unsure", timeout=600)


def test_sure_and_unsure_prompts_make_the_processes_differ(sure_unsure_ddp):
    """The inputs of the lock-step tests do what they are for: on every step the process with the sure prompt decodes
    in fewer forwards than the other, and its groups all drop as zero-variance (no loss chunk) while the other
    backpropagates one per sampled step."""
    (sure_nfe, unsure_nfe), (sure_chunks, unsure_chunks) = sure_unsure_ddp["nfe"], sure_unsure_ddp["loss_chunks"]
    assert all(a < b for a, b in zip(sure_nfe, unsure_nfe)), sure_unsure_ddp["nfe"]
    assert sure_chunks == [0, 0] and all(n > 1 for n in unsure_chunks), sure_unsure_ddp["loss_chunks"]


@pytest.mark.parametrize(
    "config, options",
    [("fsdp", ("fsdp_on_cpu=1",)), ("deepspeed_zero3", ()), ("deepspeed_zero3", ("backward_mode=per_step",))],
    ids=["fsdp2", "zero3", "zero3_per_step"],
)
def test_processes_decoding_different_step_counts_stay_in_lock_step(sure_unsure_ddp, tmp_path, config, options):
    """Under engines whose forwards are collectives, the process that is done first (a sure block in 3–4 forwards
    against 13–15; no loss chunk against 4) runs idle forwards until the other is done (SPEC §9). Without it ZeRO-3
    hangs and FSDP2 aborts on a collective mismatch; with it the run finishes and trains as DDP does."""
    result = launch(tmp_path, "task=sure_unsure", *options, config=config, timeout=600)
    assert result["sharded"]
    assert result["nfe"] == sure_unsure_ddp["nfe"] and result["loss_chunks"] == sure_unsure_ddp["loss_chunks"]
    assert result["losses"] == pytest.approx(sure_unsure_ddp["losses"], abs=1e-6)
    for name, value in sure_unsure_ddp["params"].items():
        torch.testing.assert_close(result["params"][name], value, **AGREEMENT, msg=name)


def test_diffusion_gemma_rows_stopping_early_on_one_process_stay_in_lock_step(tmp_path):
    """DiffusionGemma's rows stop early by their own confidence: the DiffusionGemma Sudoku toy stops given grids after
    11 steps and unsure puzzles after 13–16. Under FSDP2 the process done first runs idle one-row calls of the same
    kind (encoder, then decoder steps) until the other is done; without them gloo aborts on a collective mismatch.
    The run trains as DDP does."""
    ddp = launch(tmp_path / "ddp", "task=sure_unsure", "family=diffusion_gemma", timeout=600)
    (sure, unsure), (sure_chunks, unsure_chunks) = ddp["nfe"], ddp["loss_chunks"]
    assert all(a < b for a, b in zip(sure, unsure)) and sure_chunks == [0, 0] and all(unsure_chunks), ddp
    result = launch(tmp_path / "fsdp2", "task=sure_unsure", "family=diffusion_gemma", "fsdp_on_cpu=1", config="fsdp",
                    timeout=600)
    assert result["sharded"] and result["nfe"] == ddp["nfe"] and result["loss_chunks"] == ddp["loss_chunks"]
    assert result["losses"] == pytest.approx(ddp["losses"], abs=1e-6)
    for name, value in ddp["params"].items():
        torch.testing.assert_close(result["params"][name], value, **AGREEMENT, msg=name)


def test_fsdp1_is_refused_with_the_fix(monkeypatch):
    """FSDP1 (``fsdp_version: 1``) would run rollouts through unwrapped FSDP units without TRL's summon_full_params:
    refused at the trainer's start (``check_launch``), naming the config key to change. accelerate's FSDP1 plugin
    itself refuses to start without a GPU ("no available devices"), so here the check reads an accelerator whose
    state says FSDP1, as accelerate builds it on GPUs."""
    from types import SimpleNamespace

    from dllm_trl.models.engines import check_launch

    monkeypatch.setenv("WORLD_SIZE", "2")
    state = SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=1), deepspeed_plugin=None)
    with pytest.raises(RuntimeError, match=r"fsdp_version: 1 is not supported.*fsdp_version: 2"):
        check_launch(SimpleNamespace(state=state, is_fsdp2=False, num_processes=2))
    check_launch(SimpleNamespace(state=state, is_fsdp2=True, num_processes=2))  # FSDP2 passes


def test_fsdp_config_on_cpu_is_refused(tmp_path, checkpoint):
    """Launched as is on CPU, accelerate silently falls back to plain data parallel: we refuse instead."""
    code, output = launch(tmp_path, f"model={checkpoint}", config="fsdp", check=False)
    assert code != 0 and "accelerate enables FSDP only on GPUs" in output, output[-3000:]


def test_multi_gpu_config_without_gpus_is_refused(tmp_path):
    """Without --use_cpu on a machine without GPUs, each process would train alone into the same output_dir."""
    code, output = launch(tmp_path, "use_cpu=0", check=False)
    assert code != 0 and "--use_cpu true" in output, output[-3000:]


def test_single_gpu_config_launches(tmp_path):
    result = launch(tmp_path, config="single_gpu", processes=1)
    assert result["world_size"] == 1


def test_documented_cpu_commands_run_as_written():
    """The multi-process commands of README.md and docs/engines.md, exactly as written (from the repo root)."""
    commands = []
    for doc in ("README.md", "docs/engines.md"):
        for block in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), flags=re.S):
            command = block.replace("\\\n", " ").strip()
            if command.startswith(("accelerate launch", "DS_ACCELERATOR=cpu accelerate launch")):
                commands.append(command)
    assert len(commands) == 3, commands
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    for command in dict.fromkeys(commands):
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
        assert done.returncode == 0, command + "\n" + (done.stdout + done.stderr)[-4000:]
        assert done.stdout.count("mean reward per logged step") == 2, command  # both processes trained
