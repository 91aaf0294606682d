"""Which engine wraps the model, known in one place: DDP, DeepSpeed, FSDP (1 and 2), torch.compile and PEFT.

Trainers, the sampler and the scoring passes reach the model only through this module:

* :func:`unwrap_model` / :func:`model_config` / :func:`vocab_size` read the transformers model and its config through
  every wrapper (a ``DeepSpeedEngine`` has a ``.config`` of its own, and sharded weights have no meaningful local
  shape, so sizes always come from the config);
* :func:`logits_at` runs the wrapped module's own forward, so that every engine's hooks fire (FSDP2's root unit
  gathers the embeddings and the LM head, ZeRO-3 gathers each layer, PEFT applies its adapters), while the LM head
  runs only at the positions the caller reads;
* :func:`forward_replacing` runs a computation of many submodule calls inside that one forward (same reasons);
* :func:`paused_gradient_sync` / :func:`backward_without_step` / :func:`backward_syncs_every_call` are what a trainer
  needs to backpropagate one sampled step at a time under each engine.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

SUPPORTED_ATTENTION = ("eager", "sdpa")
"""Attention implementations that take the explicit bidirectional 4-D mask (see :mod:`.bidirectional`)."""


def _is_wrapper(model: nn.Module) -> bool:
    names = {cls.__name__ for cls in type(model).__mro__}
    return bool(names & {"DistributedDataParallel", "DeepSpeedEngine", "FullyShardedDataParallel"})


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model inside any DDP / DeepSpeed / FSDP1 / torch.compile / PEFT wrappers.

    FSDP2 (``fully_shard``) shards a module in place, so an FSDP2 model is returned as it is.
    """
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif _is_wrapper(model) and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        elif callable(getattr(model, "get_base_model", None)):  # PEFT
            base = model.get_base_model()
            if base is model:
                return model
            model = base
        else:
            return model


def model_config(model: nn.Module):
    """The transformers config of ``model``, through any wrapper."""
    config = getattr(unwrap_model(model), "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} wraps no transformers model (no `.config`).")
    return config


def vocab_size(model: nn.Module) -> int:
    """Rows of the output vocabulary, from the config (a sharded weight's local shape says nothing)."""
    config = model_config(model)
    return int(config.get_text_config().vocab_size)


def decoder_of(model: nn.Module) -> nn.Module:
    """The ``*Model`` decoder inside a ``*ForCausalLM`` (through any wrapper)."""
    base = unwrap_model(model)
    decoder = getattr(base, "model", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise TypeError(
            f"{type(base).__name__} does not look like a transformers *ForCausalLM with a `.model.layers` decoder."
        )
    return decoder


def check_attention_implementation(config) -> None:
    """Refuse attention kernels that cannot take the explicit bidirectional mask."""
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attn_implementation={implementation!r} is not supported for diffusion LMs: it cannot take the explicit "
            "bidirectional attention mask (FlashAttention builds its own causal/varlen masks), so the model would "
            f"silently attend causally or to padding. Load the model with attn_implementation='sdpa' (fast, fused "
            "on GPU) or 'eager'."
        )


def logits_at(model: nn.Module, rows: torch.Tensor, columns: torch.Tensor, **forward_kwargs):
    """Run ``model``'s own forward (wrappers included) and return ``(logits (N, V), past_key_values)`` at the
    ``N`` positions ``(rows[n], columns[n])`` of the input, so the LM head runs only where the caller reads.

    A forward hook on the decoder keeps only those hidden states; the model's own forward then applies its head (and
    anything it does to logits) to them, inside the forward where FSDP2 / ZeRO-3 have the head's weights gathered.
    """
    decoder = decoder_of(model)

    def keep_positions(module, args, output):
        output.last_hidden_state = output.last_hidden_state[rows, columns].unsqueeze(0)
        return output

    handle = decoder.register_forward_hook(keep_positions)
    try:
        output = model(**forward_kwargs, logits_to_keep=0)
    finally:
        handle.remove()
    return output.logits[0], output_cache(output)


def output_cache(output):
    """The KV cache a model output carries: its ``cache`` field on transformers ≥ 5.24 (where reading
    ``past_key_values`` logs a deprecation), ``past_key_values`` before; ``None`` when it holds none."""
    for name in ("cache", "past_key_values"):
        if name in output.keys():
            return output[name]
    return None


def apply_at(model: nn.Module, rows: torch.Tensor, columns: torch.Tensor, fn, **forward_kwargs):
    """Run ``model``'s own forward and return ``fn(hidden (N, d), head)`` at the ``N`` positions ``(rows, columns)``,
    computed inside that forward (where FSDP2 / ZeRO-3 have the head's weights gathered). ``fn`` applies the head as
    it likes (e.g. in chunks); the model's own head then runs on nothing."""
    decoder = decoder_of(model)
    head = unwrap_model(model).get_output_embeddings()
    result = []

    def read_positions(module, args, output):
        hidden = output.last_hidden_state
        result.append(fn(hidden[rows, columns], head))
        output.last_hidden_state = hidden[:0]
        return output

    handle = decoder.register_forward_hook(read_positions)
    try:
        model(**forward_kwargs, logits_to_keep=0)
    finally:
        handle.remove()
    return result[0]


def forward_replacing(model: nn.Module, inner: nn.Module, fn):
    """Run ``model``'s own forward (wrappers included) with the submodule ``inner``'s forward replaced, for this call,
    by ``fn()``; return the model's output.

    For a computation that does not fit the model's forward signature (DiffusionGemma's replay: encoder calls over
    the prompt and each finished canvas, decoder calls over row-selected views of that cache), done inside the one
    forward every engine expects: DDP arms its gradient reducer on that forward's output, FSDP2's root unit gathers
    its weights (embeddings, head, norms) around it, ZeRO-3 gathers each layer ``fn`` reaches, PEFT applies its
    adapters. ``fn`` returns what ``inner`` would, so the rest of the model's forward (its head) runs on it.
    """
    own = inner.__dict__.get("forward")
    inner.forward = lambda *args, **kwargs: fn()
    try:
        return model()
    finally:
        if own is None:
            del inner.forward
        else:
            inner.forward = own


def keep_buffers_out_of_ddp(model: nn.Module) -> None:
    """Tell DDP not to synchronise ``model``'s buffers (RoPE frequencies: constants, equal on every process).

    DDP broadcasts buffers in every forward that will synchronise gradients, but processes run different numbers of
    such forwards per step (one per sampled step with ``backward_mode="per_micro_batch"``), so the broadcasts would
    pair up with the wrong collectives. ``broadcast_buffers=False`` said this before torch 2.13 deprecated it, and
    accelerate cannot pass its replacement (``forward_sync_buffers``); the ignore list works on every version.
    """
    names = [name for name, _ in model.named_buffers()]
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def prepare_model_buffers(model: nn.Module, accelerator) -> None:
    """What the engines need done about ``model``'s buffers and shared Parameters before they wrap it (the policy, at
    the trainer's set-up).

    * DDP must not synchronise them (:func:`keep_buffers_out_of_ddp`).
    * FSDP2 with ``cpu_ram_efficient_loading``: transformers loaded the weights on rank 0 only (zeros elsewhere), and
      accelerate moves the model to the meta device, shards it and broadcasts rank 0's state dict into the shards,
      expecting every entry to be a sharded parameter. A persistent buffer (an MoE router's float32
      ``e_score_correction_bias``, which steers every routing decision) stays a plain tensor under ``fully_shard``,
      and accelerate ≤ 1.15 fails on it (``'Tensor' object has no attribute 'device_mesh'``, huggingface/accelerate
      issue 3898). For a model with persistent buffers, rank 0's parameters and buffers are broadcast here and
      accelerate's meta-device path is switched off (accelerate's own advice where it cannot take a model), so it
      shards each process's full copy; the checkpoint is still read on rank 0 only.
    * FSDP2 and Parameters shared between layers (DiffusionGemma's encoder and decoder): the modules sharing them are
      sharded as one group each before accelerate wraps the rest (:func:`shard_shared_parameter_groups`), with the
      meta-device path switched off as above.
    """
    keep_buffers_out_of_ddp(model)
    if not getattr(accelerator, "is_fsdp2", False):
        return
    plugin = accelerator.state.fsdp_plugin
    persistent = any(name not in module._non_persistent_buffers_set
                     for module in model.modules() for name, _ in module.named_buffers(recurse=False))
    tied = shared_parameter_groups(model)
    if plugin.cpu_ram_efficient_loading and (persistent or tied):
        broadcast_from_main(model, accelerator)
        plugin.cpu_ram_efficient_loading = False
    if tied:
        shard_shared_parameter_groups(model, accelerator, tied)


def shared_parameter_groups(model: nn.Module) -> list[list[nn.Module]]:
    """Groups of modules that must share one FSDP2 shard group because they hold the same Parameters: the layers
    (``_no_split_modules`` classes) joined by a shared Parameter, then one group of the other modules holding a shared
    Parameter (tied embeddings, LM head, norms). Empty when no Parameter is shared, or only between the input
    embedding and the LM head (accelerate groups those itself)."""
    base = unwrap_model(model)
    owners: dict[int, list[nn.Module]] = {}
    for module in base.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    shared = {key for key, modules in owners.items() if len(modules) > 1}
    layer_classes = set(getattr(base, "_no_split_modules", None) or ())
    layer_groups: list[tuple[set, list[nn.Module]]] = []
    for layer in (m for m in base.modules() if type(m).__name__ in layer_classes):
        keys = {id(p) for p in layer.parameters()} & shared
        if not keys:
            continue
        joined = next((group for group in layer_groups if group[0] & keys), None)
        if joined is None:
            layer_groups.append((keys, [layer]))
        else:
            joined[0].update(keys)
            joined[1].append(layer)
    in_layers = set().union(*(keys for keys, _ in layer_groups))
    # In module order, the same on every process (a set's order follows the ids, i.e. each process's addresses, and
    # a group's flat layout must match across processes).
    outside = shared - in_layers
    rest = [m for m in base.modules() if any(id(p) in outside for p in m.parameters(recurse=False))]
    if not layer_groups and len(rest) <= 2:  # at most embedding + head: accelerate's own tied-embedding group
        return []
    return [layers for _, layers in layer_groups] + ([rest] if rest else [])


def shard_shared_parameter_groups(model: nn.Module, accelerator, groups: list[list[nn.Module]]) -> None:
    """FSDP2: shard each of ``groups`` (:func:`shared_parameter_groups`) as one unit before accelerate wraps the rest.

    accelerate shards every ``_no_split_modules`` layer on its own and carves the embeddings, final norm and LM head
    into one group; where layers of two classes share their Parameters (DiffusionGemma: encoder layer i and decoder
    layer i; also its two embeddings, head and norms) a Parameter would land in two groups, which torch refuses
    ("shared with a parameter already managed by another FSDP group"). accelerate skips modules already sharded and
    wraps the rest as usual; it is told the layer classes the model really contains (``_no_split_modules`` may name
    others, e.g. an audio layer the text model lacks, which accelerate cannot find)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    plugin = accelerator.state.fsdp_plugin
    mesh = getattr(accelerator, "torch_device_mesh", None)
    kwargs = dict(reshard_after_forward=plugin.reshard_after_forward, offload_policy=plugin.cpu_offload,
                  mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy(),
                  mesh=mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None)
    for group in groups:
        fully_shard(group, **kwargs)
    base = unwrap_model(model)
    present = {type(m).__name__ for m in base.modules()}
    if plugin.transformer_cls_names_to_wrap is None:
        plugin.transformer_cls_names_to_wrap = [name for name in base._no_split_modules if name in present]


def forwards_are_collective(model: nn.Module) -> bool:
    """Whether a forward of ``model`` is a collective of every process (SPEC §9): an FSDP-sharded model (each unit
    all-gathers its weights), or a model under ZeRO-3's hooks (TRL's rollout with ``ds3_gather_for_generation``
    gathers the weights and removes them). Under DDP and ZeRO-1/2 a forward is local."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from torch.distributed.fsdp import FSDPModule

    levels = [model]
    while _is_wrapper(levels[-1]) or hasattr(levels[-1], "_orig_mod") or callable(getattr(levels[-1], "get_base_model", None)):
        inner = getattr(levels[-1], "_orig_mod", None) or getattr(levels[-1], "module", None)
        if inner is None:
            inner = levels[-1].get_base_model()
        if inner is levels[-1] or not isinstance(inner, nn.Module):
            break
        levels.append(inner)
    for level in levels:
        if isinstance(level, FSDPModule) or type(level).__name__ == "FullyShardedDataParallel":
            return True
        # ZeRO-3's hooks run collectives in every forward (weight gathers, and bookkeeping broadcasts even when every
        # weight is under the persistence threshold); TRL's gathered rollout removes them.
        if any(getattr(hook, "__module__", "").startswith("deepspeed.runtime.zero")
               for hook in level._forward_pre_hooks.values()):
            return True
    return False


class LockStep:
    """Keeps every process's forwards of one model in step when each forward is a collective (SPEC §9), as
    transformers' ``generate(synced_gpus=True)`` does: a process that is done asks whether any other is not, and
    meanwhile runs idle forwards (same modules, a token of input, results dropped) so that the weight gathers of the
    busiest process always have a partner. Off (``active`` False) under DDP, ZeRO-1/2 and a single process, where
    nothing changes and no collective is added.

    ``also``: switch it on for another reason (DeepSpeed communicates in every backward, so per-step backward needs
    as many backward calls on every process)."""

    def __init__(self, model: nn.Module, also: bool = False):
        self.active = also or forwards_are_collective(model)
        self.device = next(iter(model.parameters())).device if self.active else None
        self.idle_forwards = 0  # run by this process since it was built: what being done early cost it

    def any_process(self, flag: bool) -> bool:
        """``flag`` of this process OR'ed over all processes (``flag`` itself when inactive)."""
        if not self.active:
            return flag
        import torch.distributed as dist

        value = torch.tensor([1 if flag else 0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def most(self, count: int) -> int:
        """The largest ``count`` of all processes (``count`` itself when inactive)."""
        if not self.active:
            return count
        import torch.distributed as dist

        value = torch.tensor([count], dtype=torch.long, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    @contextlib.contextmanager
    def matched_forwards(self, model: nn.Module, idle_forward):
        """Inside, before each forward of ``model`` this process tells the others it is still busy; on exit it runs
        ``idle_forward()`` while any other process still is (one flag exchange per forward, as ``synced_gpus``), so
        every forward of the busiest process has a partner. For no-grad passes (an idle forward there needs no
        backward partner)."""
        if not self.active:
            yield
            return
        # First among the forward's pre-hooks: FSDP2's root all-gathers in its own, which must come after.
        def busy(module, args):
            self.any_process(True)  # (a pre-hook's return value would replace the forward's arguments)

        handle = model.register_forward_pre_hook(busy, prepend=True)
        try:
            yield
        finally:
            handle.remove()
        while self.any_process(False):
            idle_forward()
            self.idle_forwards += 1


def is_deepspeed(accelerator) -> bool:
    return getattr(accelerator.state, "deepspeed_plugin", None) is not None


def backward_syncs_every_call(accelerator) -> bool:
    """Whether every ``backward`` call communicates gradients whatever the accumulation state.

    DeepSpeed cannot skip its gradient reduction for a backward that is not the last of the micro-batch (ZeRO-2/3
    reduce-scatter in every backward; its ``no_sync`` refuses them), so there one backward per micro-batch is cheaper.
    DDP and FSDP accumulate locally under ``no_sync``.
    """
    return is_deepspeed(accelerator) and accelerator.num_processes > 1


def gradients_accessible(accelerator) -> bool:
    """Whether the accumulated gradients sit in the parameters' ``.grad`` (DeepSpeed keeps them in its own buffers),
    so that a trainer can rescale them before the optimizer step."""
    return not is_deepspeed(accelerator)


@contextlib.contextmanager
def paused_gradient_sync(accelerator, model: nn.Module):
    """No gradient synchronisation for the backward calls inside; on exit the sync state is what it was before.

    ``Accelerator.no_sync`` turns FSDP2's sync back *on* when it exits, which would cancel the Trainer's own
    ``no_sync`` around a gradient-accumulation micro-batch; DDP's ``no_sync`` restores the previous state itself.
    """
    if getattr(accelerator, "is_fsdp2", False):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            # The Trainer syncs only on the last micro-batch of an accumulation step (or every one when asked to).
            sync_each = accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
            model.set_requires_gradient_sync(bool(accelerator.sync_gradients or sync_each))
    else:
        with accelerator.no_sync(model):
            yield


def backward_without_step(accelerator, loss: torch.Tensor) -> None:
    """Backpropagate ``loss`` now, leaving the optimizer step to the Trainer (DeepSpeed's wrapper would step)."""
    if is_deepspeed(accelerator):
        accelerator.deepspeed_engine_wrapped.backward(loss, sync_gradients=False, scale_wrt_gas=False)
    else:
        accelerator.backward(loss)


def is_partitioned(model: nn.Module) -> bool:
    """Whether the weights were partitioned at load (DeepSpeed ZeRO-3 ``zero3_init_flag``): no rank holds them whole."""
    return any(hasattr(p, "ds_id") for p in unwrap_model(model).parameters())


def is_fsdp(accelerator) -> bool:
    return getattr(accelerator.state, "fsdp_plugin", None) is not None


def broadcast_from_main(module: nn.Module, accelerator) -> None:
    """Copy the main process's parameters and buffers into ``module`` on every process.

    A model built or loaded per process need not be the same everywhere: with FSDP's ``cpu_ram_efficient_loading``
    transformers loads the weights on rank 0 only and zeros elsewhere, for the engine to broadcast when it prepares
    the policy. A module the engine never prepares that way (the frozen reference) is broadcast here. Tensors are
    sent where they are: CPU tensors over a gloo group (NCCL cannot send them).
    """
    if accelerator.num_processes == 1:
        return
    import torch.distributed as dist

    tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t.device.type != "meta"]
    if not tensors:
        return
    on_cpu = tensors[0].device.type == "cpu"
    group = dist.new_group(backend="gloo") if on_cpu and dist.get_backend() != "gloo" else None
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor.data, src=0, group=group)
    if group is not None:
        dist.destroy_process_group(group)


def check_launch(accelerator) -> None:
    """Refuse a launch that would not run what it asked for: processes that did not join one process group (each
    would train alone), or an engine config that accelerate silently replaced by plain data parallel."""
    import os

    for variable, engine, active in (
        ("ACCELERATE_USE_FSDP", "FSDP", is_fsdp(accelerator)),
        ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed", is_deepspeed(accelerator)),
    ):
        if os.environ.get(variable, "false").lower() == "true" and not active:
            raise RuntimeError(
                f"This run was launched with a {engine} config, but accelerate set up "
                f"{accelerator.distributed_type.value} instead"
                + (" (accelerate enables FSDP only on GPUs)" if engine == "FSDP" else "")
                + f", so the {engine} settings would be silently ignored. On a machine without GPUs use "
                "examples/accelerate_configs/multi_gpu.yaml with the script flag `--use_cpu true`"
                + (" (DeepSpeed runs on CPU with DS_ACCELERATOR=cpu)" if engine == "DeepSpeed" else "") + "."
            )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes == 1:
        raise RuntimeError(_alone_message(launched))
    if is_fsdp(accelerator) and not getattr(accelerator, "is_fsdp2", False):
        raise RuntimeError(
            "fsdp_version: 1 is not supported: FSDP1 shards the weights of each wrapped unit inside a root wrapper "
            "that the rollout and the scoring passes do not go through (TRL gathers them with summon_full_params, "
            "per call). Set fsdp_version: 2 in the accelerate config (examples/accelerate_configs/fsdp.yaml), which "
            "keeps every process's forwards in step (SPEC §9)."
        )


def _alone_message(launched: int) -> str:
    return (
        f"{launched} processes were launched (WORLD_SIZE={launched}) but this one would run alone: no process group "
        "is initialised without an accelerator, so each process would train its own copy into the same output_dir. "
        "On a machine without GPUs set use_cpu=True (script flag `--use_cpu true`, gloo backend), e.g. `accelerate "
        "launch --multi_gpu --num_processes 2 examples/rldf_math.py --use_cpu true`; on GPUs check that CUDA is "
        "visible."
    )


def check_launch_environment(use_cpu: bool) -> None:
    """Before the training arguments set up distribution: refuse a multi-process launch that would run alone."""
    import os

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and not use_cpu and not torch.accelerator.is_available():
        raise ValueError(_alone_message(launched))


def check_weights_pass_gradients(model: nn.Module) -> None:
    """Refuse to train through bitsandbytes 4-bit layers repacked for CPU inference.

    On CPU, bitsandbytes repacks a 4-bit weight for a faster inference kernel at the first forward in eval mode and
    keeps it that way; that kernel has no backward, so every gradient upstream of it (the LoRA adapters of QLoRA)
    would silently be zero.
    """
    packed = [
        name for name, module in unwrap_model(model).named_modules()
        if getattr(getattr(getattr(module, "weight", None), "quant_state", None), "packing_format_for_cpu", False)
    ]
    if packed:
        raise RuntimeError(
            f"{len(packed)} 4-bit layers (e.g. {packed[0]}) were repacked by bitsandbytes for CPU inference when the "
            "model ran in eval mode, and no longer pass gradients: on CPU, train a 4-bit model before evaluating it "
            "with model.eval(), or reload it."
        )


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The model inside a PEFT wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def uses_peft(model: nn.Module, peft_config=None) -> bool:
    """Whether training goes through PEFT adapters: a ``peft_config`` to apply, or a model that carries one."""
    return peft_config is not None or hasattr(model, "peft_config")


def prepare_frozen_model(module: nn.Module, accelerator) -> nn.Module:
    """A frozen model (the KL reference) prepared for the engine that runs: DeepSpeed, FSDP or neither."""
    from trl.models import prepare_deepspeed, prepare_fsdp  # TRL only where a trainer runs

    if is_deepspeed(accelerator):
        return prepare_deepspeed(module, accelerator)
    if is_fsdp(accelerator):
        return prepare_fsdp(module, accelerator)
    return accelerator.prepare_model(module, evaluation_mode=True)
