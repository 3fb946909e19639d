"""A streamed model's state dict: each streamed weight is read from its home and written to it.

A released block's parameters have no device memory (their storage is empty), so torch's own `state_dict` and
`load_state_dict` cannot touch them; these hooks, registered by `ParamStreamer` on each block, stand in for them.

What this is not: the streaming itself (model/streaming.py), nor checkpoints of the optimizer.
"""

from __future__ import annotations

from torch import nn


def state_dict_hooks(streamer, block, module: nn.Module) -> list:
    """state_dict hooks: a streamed weight's value comes from home and goes home (its device tensor may have no
    memory)."""
    local = {id(p): name for name, p in module.named_parameters()}
    names = [local[id(p)] for p in block.params]

    def saved(_, state_dict, prefix, local_metadata):
        for param, name in zip(block.params, names, strict=True):
            if prefix + name in state_dict:
                # a compact copy: torch.save of a view writes its whole storage
                state_dict[prefix + name] = streamer.host_value(param).clone()

    loaded: list[str] = []

    def loading(_, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if any(prefix + name in state_dict for name in names):
            streamer.quiesce()
        for param, name in zip(block.params, names, strict=True):
            value = state_dict.get(prefix + name)
            if value is None:
                continue
            if value.shape != param.shape:
                errors.append(f"size mismatch for {prefix + name}: copying a param with shape {tuple(value.shape)}"
                              f" from checkpoint, the shape in current model is {tuple(param.shape)}.")
                continue
            streamer.set_weights(param, value.detach().to("cpu", param.dtype))
            del state_dict[prefix + name]  # written home: torch's own copy into the empty device tensor is skipped
            loaded.append(prefix + name)
        if streamer.swapper is not None:
            streamer.updated()

    def after_load(_, incompatible):
        for key in loaded:  # taken out above, so torch counts them missing: they were loaded
            if key in incompatible.missing_keys:
                incompatible.missing_keys.remove(key)
        loaded.clear()

    return [module.register_state_dict_post_hook(saved),
            module.register_load_state_dict_pre_hook(loading),
            module.register_load_state_dict_post_hook(after_load)]

