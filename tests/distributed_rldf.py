"""A small RLDF run for the engine tests, launched by tests/test_distributed.py through ``accelerate launch``
(DDP, DeepSpeed ZeRO-2/3, FSDP2, single process) on CPU.

Usage: ``distributed_rldf.py OUTPUT_DIR [key=value ...]``; keys: ``model`` (``memory`` for a tiny in-memory LLaDA,
else a checkpoint folder, loaded *after* the training arguments so that ZeRO-3 can partition it at load), ``beta``,
``backward_mode`` (passed only when given), ``steps``, ``save`` (``1``: a checkpoint at the last step),
``fsdp_on_cpu`` (see :func:`fsdp_state_on_cpu`), ``use_cpu``, ``count_comm`` (count collectives during training,
for ``benchmarks/engines.py``), ``family`` (``diffusion_gemma``: ``model`` is a DiffusionGemma checkpoint, trained
with its own sampler and loss), ``task`` (``sure_unsure``: the shipped Sudoku toy on prompts it is sure of — given
grids, decoded in a few steps, whose groups drop as zero-variance — for process 0 and unsure of — 10–12 blanks, up
to 20 steps — for process 1, with dynamic unmasking, so that the processes decode different step counts and run
different numbers of loss forwards; see :func:`sure_unsure_dataset`). Each process records its rollouts' forward
counts and its real loss chunks per step (``nfe``, ``loss_chunks`` in the result, one row per process), all its
forwards of the policy (``forwards``: rollouts, scoring, loss and idle ones) and its rollout seconds; ``batch``:
completions per process (``sure_unsure``; 2 by default); ``task=toy_thresholds``: the shipped addition toy
(``load_toy()``'s checkpoint, its sampler settings) with dynamic unmasking thresholds per process — process 0's so low
that each block commits in one step, process 1's so high that it commits one token per step; ``trainer``: ``rldf``
or ``dppo`` (:class:`~dllm_trl.DiffusionDPPOMaskTrainer`); ``num_iterations`` (π_old scored by an old-policy pass);
``is_correction`` (``1``: ``rollout_importance_sampling_correction``); ``reward_fault`` (``raise@R``: the reward
raises on process ``R`` at its first call; ``hang@R``: it never returns there); ``ddp_timeout`` (seconds a
collective may wait). Every process checks that its view of the full parameters, and its buffers, equal
the others'; rank 0 writes ``OUTPUT_DIR/result.pt`` (losses, KLs, the full trained parameters, the engine that ran).
The harness reads the engines through accelerate and torch only, not through the code under test.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time

import torch
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from tests.conftest import addition_dataset, length_reward, make_char_tokenizer  # noqa: E402

from dllm_trl import load_diffusion_model  # noqa: E402
from dllm_trl.generation import DiffusionGemmaSampler, DiffusionGemmaSamplerConfig  # noqa: E402
from dllm_trl.losses import DiffusionGemmaRLDFLoss  # noqa: E402
from tests.tiny_models import build_tiny_llada  # noqa: E402
from dllm_trl.trainers import RLDFConfig, RLDFTrainer  # noqa: E402


def distinct_reward(completions, **kwargs):
    """A reward that varies between a random model's completions: distinct characters and length."""
    return [len(set(c)) + 0.1 * len(c) for c in completions]


def parse(argv):
    options = dict(model="memory", beta="0.01", backward_mode="", steps="2", save="0", fsdp_on_cpu="0", use_cpu="1",
                   count_comm="0", family="masked", task="addition", batch="2", trainer="rldf", num_iterations="1",
                   is_correction="0", reward_fault="", ddp_timeout="")
    for item in argv:
        key, value = item.split("=", 1)
        if key not in options:
            raise SystemExit(f"unknown option {key!r}")
        options[key] = value
    return options


COMMUNICATION = {"calls": 0, "bytes": 0, "on": False}


def count_collectives():
    """Count the calls and bytes of torch.distributed's collectives while ``COMMUNICATION["on"]`` (before any engine
    captures the functions), for the engine benchmark."""
    import torch.distributed as dist

    def counted(function):
        def wrapper(*args, **kwargs):
            if COMMUNICATION["on"]:
                first = next(iter(args), None) if args else next(iter(kwargs.values()), None)
                first = first[0] if isinstance(first, (list, tuple)) else first
                COMMUNICATION["calls"] += 1
                COMMUNICATION["bytes"] += first.numel() * first.element_size() if torch.is_tensor(first) else 0
            return function(*args, **kwargs)

        return wrapper

    for name in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_gather",
                 "broadcast", "reduce"):
        setattr(dist, name, counted(getattr(dist, name)))


class CommunicationPerStep(TrainerCallback):
    """Collective calls and bytes of each optimizer step (the first one also holds the engine's set-up)."""

    def __init__(self):
        self.marks = [(0, 0)]

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append((COMMUNICATION["calls"], COMMUNICATION["bytes"]))
        COMMUNICATION.setdefault("per_step", []).append(
            tuple(now - before for now, before in zip(self.marks[-1], self.marks[-2]))
        )


def faulty(reward, kind: str, rank: str):
    """``reward``, except on process ``rank``, where its first call raises (``kind`` ``raise``) or never returns
    (``hang``)."""
    def reward_with_fault(completions, **kwargs):
        if os.environ.get("RANK") == rank:
            if kind == "raise":
                raise RuntimeError(f"reward service unreachable on process {rank}")
            time.sleep(3600)
        return reward(completions, **kwargs)

    reward_with_fault.__name__ = getattr(reward, "__name__", "reward")
    return reward_with_fault


def fsdp_state_on_cpu():
    """The accelerate state an FSDP launch gets on GPUs, on CPU processes over gloo.

    accelerate turns an FSDP launch into FSDP only on GPU-like devices (``AcceleratorState`` keeps ``MULTI_CPU``
    on CPU). Here the state is initialised as accelerate does on CPU (gloo process group), then its distributed
    type is set to FSDP with the plugin the launcher's FSDP_* variables describe, exactly what the GPU branch of
    ``AcceleratorState`` does. Everything after that — accelerate's FSDP2 preparation (``fully_shard`` per decoder
    layer and at the root, on a CPU device mesh), its state-dict and checkpoint code, the Trainer, our trainer and
    engine module — runs unmodified. The training arguments must then say ``use_configured_state``.
    """
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = Accelerator(cpu=True).state
    PartialState().distributed_type = state.distributed_type = DistributedType.FSDP  # both shared states
    state.fsdp_plugin = FullyShardedDataParallelPlugin()
    return state


def sure_unsure_dataset(size: int = 8):
    """Sudoku prompts alternating sure (a given grid: the toy copies it in 2–7 steps, its two completions mostly
    equal, so the group drops as zero-variance) and unsure (10–12 blanks: 12–15 steps, rewards that vary). Unshuffled,
    with 2 completions per prompt and 2 per process, process 0 always gets a sure prompt and process 1 an unsure one."""
    import random

    from datasets import Dataset

    from dllm_trl.toy.sudoku import all_grids, make_puzzle, sudoku_prompt

    rng, grids = random.Random(0), all_grids()
    puzzles = [make_puzzle(grids[rng.randrange(len(grids))], rng, 0 if i % 2 == 0 else 10 + i % 3) for i in range(size)]
    return Dataset.from_dict({"prompt": [sudoku_prompt(p) for p in puzzles], "puzzle": puzzles})


class RecordingSampler:
    """The trainer's sampler, recording each rollout's model forwards (``nfe``)."""

    def __init__(self, sampler, record):
        self.sampler, self.config, self.record = sampler, sampler.config, record

    def check_model(self, model):
        self.sampler.check_model(model)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        output = self.sampler(*args, **kwargs)
        self.seconds = getattr(self, "seconds", 0.0) + time.perf_counter() - start
        self.record.append(output.nfe)
        return output


def full_parameters(model) -> torch.Tensor:
    """This process's view of every parameter in full, flattened (gathering ZeRO-3 partitions and FSDP2 shards)."""
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return torch.cat([p.detach().flatten().clone() for p in params])
    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten() for p in params])


def main(output_dir: str, options: dict):
    torch.set_num_threads(1)
    tokenizer = make_char_tokenizer()
    extra = {}
    if options["count_comm"] == "1":
        count_collectives()
    if options["fsdp_on_cpu"] == "1":
        fsdp_state_on_cpu()
        extra["accelerator_config"] = {"use_configured_state": True}
    if options["backward_mode"]:
        extra["backward_mode"] = options["backward_mode"]
    steps = int(options["steps"])
    gemma = options["family"] == "diffusion_gemma"
    sure_unsure = options["task"] == "sure_unsure"
    if not gemma:
        extra["temperature"] = 1.0  # a masked-diffusion decoding field (DiffusionGemma's follows its schedule)
    shape = dict(per_device_train_batch_size=4 // int(os.environ.get("WORLD_SIZE", "1")), num_generations=4,
                 max_completion_length=8, block_length=4, learning_rate=1e-3)
    if sure_unsure:  # one prompt per process and step, in dataset order; one block of 20, dynamic unmasking
        batch = int(options["batch"])
        shape = dict(per_device_train_batch_size=batch, num_generations=batch, max_completion_length=20, block_length=20,
                     shuffle_dataset=False, learning_rate=1e-5)
        if not gemma:  # DiffusionGemma's rows stop early by their own confidence (its toy sampler's settings)
            shape.update(unmasking="dynamic", unmasking_threshold=0.9)
    toy_thresholds = options["task"] == "toy_thresholds"
    if toy_thresholds:  # the addition toy's sampler settings, one threshold per process (see the module docstring)
        from dllm_trl.toy.model import toy_generation_config

        gen = toy_generation_config()
        rank = int(os.environ.get("RANK", "0"))
        shape = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=gen.gen_length,
                     block_length=gen.block_length, unmasking="dynamic", unmasking_threshold=1e-6 if rank == 0 else 1.0,
                     cache_mode="dual", learning_rate=1e-5, shuffle_dataset=False)
    if options["ddp_timeout"]:
        extra["ddp_timeout"] = int(options["ddp_timeout"])
    if options["num_iterations"] != "1":
        extra["num_iterations"] = int(options["num_iterations"])
    if options["is_correction"] == "1":
        extra["rollout_importance_sampling_correction"] = True
    config_class = RLDFConfig
    if options["trainer"] == "dppo":
        from dllm_trl.trainers import DPPOMaskConfig

        config_class = DPPOMaskConfig
    args = config_class(
        output_dir=output_dir, max_steps=steps, logging_steps=1, report_to="none", beta=float(options["beta"]), seed=0, use_cpu=options["use_cpu"] == "1",
        bf16=False,  # fp32 everywhere, so that engines can be compared tightly
        save_strategy="steps" if options["save"] == "1" else "no", save_steps=steps,
        num_sampled_timesteps=4, drop_zero_variance_groups=True, **shape, **extra,
    )
    pieces, reward, dataset = {}, length_reward, addition_dataset()
    if toy_thresholds:
        from transformers import AutoTokenizer

        from dllm_trl.toy import toy_assets_dir, toy_dataset, toy_reward

        path = str(toy_assets_dir()) if options["model"] == "memory" else options["model"]
        model, tokenizer = load_diffusion_model(path), AutoTokenizer.from_pretrained(path)
        reward, dataset = toy_reward, toy_dataset(size=16)
    elif sure_unsure:
        from transformers import AutoTokenizer

        from dllm_trl.toy import sudoku_cell_reward, toy_assets_dir

        toy = "sudoku_diffusion_gemma" if gemma else "sudoku"
        path = str(toy_assets_dir(toy)) if options["model"] == "memory" else options["model"]
        model, tokenizer = load_diffusion_model(path), AutoTokenizer.from_pretrained(path)
        reward, dataset = sudoku_cell_reward, sure_unsure_dataset()
        if gemma:
            from dllm_trl.toy import sudoku_diffusion_gemma_sampler_config

            pieces["sampler"] = DiffusionGemmaSampler(sudoku_diffusion_gemma_sampler_config())
            pieces["loss"] = DiffusionGemmaRLDFLoss(args)
    elif options["model"] == "memory":
        torch.manual_seed(0)
        model = build_tiny_llada(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
    elif gemma:
        model = load_diffusion_model(options["model"])
        pieces["sampler"] = DiffusionGemmaSampler(DiffusionGemmaSamplerConfig(gen_length=8, max_denoising_steps=3))
        pieces["loss"] = DiffusionGemmaRLDFLoss(args)
        reward = distinct_reward
    else:
        model = load_diffusion_model(options["model"], mask_token_id=tokenizer.mask_token_id)
    partitioned_at_load = any(hasattr(p, "ds_id") for p in model.parameters())
    if options["reward_fault"]:
        reward = faulty(reward, *options["reward_fault"].split("@"))
    trainer_class = RLDFTrainer
    if options["trainer"] == "dppo":
        from dllm_trl.trainers import DiffusionDPPOMaskTrainer as trainer_class
    trainer = trainer_class(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, **pieces)
    nfe, loss_chunks = [], []
    trainer.sampler = RecordingSampler(trainer.sampler, nfe)
    real_chunks = trainer.loss.loss_chunks

    def recording_chunks(model, inputs, steps):
        chunks = real_chunks(model, inputs, steps)
        if torch.is_grad_enabled():
            loss_chunks.append(len(chunks))
        return chunks

    trainer.loss.loss_chunks = recording_chunks
    forwards = [0]  # every forward of the policy (rollout, scoring, loss, idle), for benchmarks/lock_step.py
    from dllm_trl.models.engines import unwrap_model

    unwrap_model(trainer.model_wrapped).register_forward_pre_hook(lambda m, a: forwards.__setitem__(0, forwards[0] + 1))
    COMMUNICATION["on"] = options["count_comm"] == "1"
    trainer.add_callback(CommunicationPerStep())
    trainer.train()
    COMMUNICATION["on"] = False

    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    losses = [entry["loss"] for entry in logs]
    assert all(math.isfinite(x) for x in losses), losses
    sharded = any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in trainer.model_wrapped.parameters())
    # Every process's view of the full parameters must be the same (replicas in sync, shards consistent), and so must
    # its buffers (engines leave them unsharded; e.g. an MoE router's correction bias, which steers the routing).
    views = trainer.accelerator.gather(full_parameters(trainer.model_wrapped).unsqueeze(0))
    assert all(torch.equal(views[0], view) for view in views), "parameters differ across processes"
    buffers = [b.detach().flatten().float() for b in trainer.model_wrapped.buffers()]
    buffer_views = trainer.accelerator.gather(torch.cat(buffers).unsqueeze(0))
    assert all(torch.equal(buffer_views[0], view) for view in buffer_views), "buffers differ across processes"
    COMMUNICATION["on"] = False
    # (one rollout per num_iterations steps: as many nfe rows as rollouts, loss_chunks rows as steps)
    per_process = list(zip(trainer.accelerator.gather(torch.tensor([nfe]).unsqueeze(0)).tolist(),
                           trainer.accelerator.gather(torch.tensor([loss_chunks]).unsqueeze(0)).tolist()))
    forward_counts = trainer.accelerator.gather(torch.tensor([forwards[0]])).tolist()
    rollout_seconds = trainer.accelerator.gather(torch.tensor([getattr(trainer.sampler, "seconds", 0.0)]))
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    peak_rss = trainer.accelerator.gather(rss).max().item()
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # full weights, gathered from the shards
    if trainer.accelerator.is_main_process:
        params = {name: value.detach().float().cpu().clone() for name, value in state.items()}
        torch.save(
            {
                "world_size": trainer.accelerator.num_processes,
                "losses": losses,
                "kl": [entry.get("kl") for entry in logs],
                "sampled_steps": [entry.get("rldf/sampled_steps") for entry in logs],
                "params": params,
                "global_step": trainer.state.global_step,
                "dtype": str(next(iter(state.values())).dtype),
                "partitioned_at_load": partitioned_at_load,
                "sharded": sharded,
                "distributed_type": str(trainer.accelerator.distributed_type),
                "mixed_precision": str(trainer.accelerator.mixed_precision),
                "step_time": [entry.get("step_time") for entry in logs],
                "collectives_per_step": COMMUNICATION.get("per_step", []),
                "peak_rss_mib": peak_rss,
                "forwards": forward_counts,
                "rollout_seconds": rollout_seconds.tolist(),
                "nfe": [row[0][0] for row in per_process],
                "loss_chunks": [row[1][0] for row in per_process],
            },
            os.path.join(output_dir, "result.pt"),
        )
        print(f"DISTRIBUTED_OK world={trainer.accelerator.num_processes} losses={losses}")
    # Tear the process group down while the interpreter is alive; `__main__` then leaves without interpreter
    # finalization. In CI the CPU DeepSpeed ZeRO-3 run aborted once after training, even with this teardown
    # ("terminate called without an active exception", rc -6; 0 of 6 local reruns): a joinable C++ thread destroyed
    # at finalization, most likely one of the gloo groups DeepSpeed's engine still holds (cf. pytorch/pytorch#190489).
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], parse(sys.argv[2:]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
