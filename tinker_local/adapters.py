"""LoRA adapters over a shared base model (peft), for the local engine.

Targets: ``train_attn`` -> every Linear (or GPT-2 style Conv1D) under a module whose name
contains "attn"/"attention"; ``train_mlp`` -> every one under "mlp"/"feed_forward"/"ffn";
``train_unembed`` -> the output embedding (``lm_head``) itself as a LoRA target (peft supports a
Linear head; with tied embeddings the shared base weight stays frozen, only the LoRA delta on
the output side is trained).  ``lora_alpha = 32`` (scale 32/rank, as in Thinking Machines'
"LoRA Without Regret"), no dropout, A Kaiming-uniform from the seed, B zero.  The layers run
leaner than peft's defaults without computing anything else (``_lean_lora_layers``).
"""

from __future__ import annotations

import types
import warnings
from collections import OrderedDict

import torch

from .errors import EngineUserError

LORA_ALPHA = 32
_ATTN_HINTS = ("attn", "attention")
_MLP_HINTS = ("mlp", "feed_forward", "ffn")


def lora_config(model, rank: int, *, mlp: bool, attn: bool, unembed: bool, model_name: str):
    """A ``peft.LoraConfig`` of rank ``rank`` targeting the chosen module groups of ``model`` (a
    transformers causal LM, possibly with LoRA layers already injected).  EngineUserError if no
    module matches."""
    from peft import LoraConfig
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    heads = (head, getattr(head, "base_layer", head))
    targets = []
    for mname, mod in model.named_modules():
        if "lora_" in mname or not isinstance(mod, (torch.nn.Linear, Conv1D)):
            continue
        mname = mname[: -len(".base_layer")] if mname.endswith(".base_layer") else mname
        if any(mod is h for h in heads):
            if unembed:
                targets.append(mname)
            continue
        parts = mname.lower().split(".")
        if attn and any(h in p for p in parts for h in _ATTN_HINTS):
            targets.append(mname)
        elif mlp and any(h in p for p in parts for h in _MLP_HINTS):
            targets.append(mname)
    if not targets:
        raise EngineUserError(
            f"no LoRA target modules found in {model_name!r} for train_mlp={mlp}, "
            f"train_attn={attn}, train_unembed={unembed}"
        )
    return LoraConfig(
        r=rank,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        bias="none",
        target_modules=sorted(set(targets)),
        task_type="CAUSAL_LM",
    )


def add_adapter(peft_model, model, name: str, cfg, seed: int, device: torch.device):
    """Inject adapter ``name`` (config ``cfg``) into ``model``, initialised from ``seed`` without
    touching the global RNG.  ``peft_model``: the existing ``PeftModel`` wrapping ``model``, or
    None for the first adapter.  Returns the ``PeftModel``.  Trainable adapters get
    ``requires_grad``; inference-mode ones stay frozen."""
    import peft

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        warnings.filterwarnings("ignore", message=".*tied.*")
        torch.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
        if peft_model is None:
            peft_model = peft.get_peft_model(model, cfg, adapter_name=name)
        else:
            peft_model.add_adapter(name, cfg)
    for pname, p in peft_model.named_parameters():
        if f".{name}." in pname:
            p.data = p.data.to(device)
            p.requires_grad_(not cfg.inference_mode)
    _lean_lora_layers(peft_model)
    return peft_model


def _lean_lora_layers(peft_model) -> None:
    """Make every LoRA layer cheaper to run without changing what it computes:

    - peft's cast of each layer's input to the adapter's dtype (fp32) is off.  The engine runs
      LoRA layers either all in fp32 (nothing to cast) or under bf16 autocast, where that cast is
      a round trip (bf16 -> fp32 -> bf16 again for the matmul) that changes no value but costs two
      copies of the activation per layer and two more in backward: ~7 % of a training step of a
      small model (measured with ``torch.profiler`` on the like-for-like benchmark model);
    - plain ``Linear`` LoRA layers compute ``B (s A x)`` instead of peft's ``(B A x) s``
      (:func:`_lora_linear_forward`): the scale multiplies the rank-r activation instead of the
      layer's whole output, forward and backward (the output head's: a vocabulary-wide pass).
      With ``s = 32 / r`` a power of two (r = 1, 2, 4, ..., 64) the products are bit-identical;
      otherwise they differ by float rounding."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in peft_model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False  # type: ignore[attr-defined]  # set in LoraLayer.__init__
        if type(module) is LoraLinear and "forward" not in vars(module):
            module.forward = types.MethodType(_lora_linear_forward, module)  # type: ignore[method-assign]


def _lora_linear_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's ``lora.Linear.forward`` for plain LoRA (no dropout in effect, no variant such as
    DoRA, no per-row adapter names, not merged), with the scale applied in rank space; anything
    else goes to peft's own forward."""
    if self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None or self.lora_variant:
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    out_dtype = result.dtype
    for name in self.active_adapters:
        if name not in self.lora_A:
            continue
        h = self.lora_A[name](self.lora_dropout[name](x))
        result = result + self.lora_B[name](h * self.scaling[name])
    return result.to(out_dtype)


def adapter_params(peft_model, name: str) -> OrderedDict[str, torch.nn.Parameter]:
    """The parameters of adapter ``name`` keyed as in peft's saved state dict
    (``base_model.model.<module>.lora_A.weight``), in module order."""
    out = OrderedDict()
    for pname, p in peft_model.named_parameters():
        if f".{name}." in pname and "lora_" in pname:
            out[pname.replace(f".{name}.", ".")] = p
    return out


def remove_adapter(peft_model, name: str) -> None:
    """Delete adapter ``name`` from ``peft_model`` (peft then activates another if it was the
    active one, which callers track themselves: no warning).

    peft names the model's new active adapter after the first LoRA layer it walks; when no adapter
    left targets that layer (one trained on the MLP only, the deleted one on attention too) it names
    none and the model keeps naming the deleted one, so ``disable_adapter()`` (sampling the base
    model) raised ``KeyError``. The model then names a remaining adapter (the layers are left as
    peft set them; every use activates its adapter first)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
        peft_model.delete_adapter(name)
    if peft_model.peft_config and peft_model.active_adapter not in peft_model.peft_config:
        peft_model.active_adapter = next(iter(peft_model.peft_config))


def rebind_adapter(peft_model, name: str, params: OrderedDict[str, torch.nn.Parameter]) -> None:
    """Make ``params`` (keyed as by ``adapter_params``) the parameters of adapter ``name`` of
    ``peft_model`` in place of the ones it was injected with, so that an optimizer holding them
    (and any gradient they carry) goes on unchanged.  KeyError if the adapter has a parameter
    ``params`` lacks."""
    for pname, _ in list(peft_model.named_parameters()):
        if f".{name}." in pname and "lora_" in pname:
            module, attr = pname.rsplit(".", 1)
            setattr(peft_model.get_submodule(module), attr, params[pname.replace(f".{name}.", ".")])


def load_sampler_adapter(
    peft_model,
    model,
    name: str,
    path,
    device: torch.device,
    *,
    reuse: str | None = None,
    reuse_params: OrderedDict[str, torch.nn.Parameter] | None = None,
):
    """Add the adapter saved at checkpoint dir ``path`` as frozen adapter ``name``; returns
    ``(PeftModel, the adapter's name, its parameters keyed as by adapter_params)``.  ``reuse``
    (with ``reuse_params``, its parameters): a frozen adapter that may be overwritten instead
    (the least recently used sampler adapter): when its LoRA config equals the checkpoint's, the
    checkpoint's tensors are copied into its parameters and it keeps its name (no injection into
    every targeted module, no deletion walk, no state-dict walk: a new sampler checkpoint every
    RL step costs a file read and a copy), else it is deleted and ``name`` added.
    EngineUserError if the tensors do not fit the base model."""
    from peft import LoraConfig

    cfg = LoraConfig.from_pretrained(str(path))
    cfg.inference_mode = True
    if reuse is not None and reuse_params is not None and _same_lora(peft_model.peft_config.get(reuse), cfg):
        try:
            _copy_tensors(reuse_params, path)
        except EngineUserError:
            remove_adapter(peft_model, reuse)
            raise
        return peft_model, reuse, reuse_params
    if reuse is not None:
        remove_adapter(peft_model, reuse)
    peft_model = add_adapter(peft_model, model, name, cfg, seed=0, device=device)
    try:
        _load_tensors(peft_model, name, path)
    except EngineUserError:
        remove_adapter(peft_model, name)
        raise
    return peft_model, name, adapter_params(peft_model, name)


def _copy_tensors(params: OrderedDict[str, torch.nn.Parameter], path) -> None:
    """Copy the tensors of checkpoint ``path`` into ``params`` (the same keys and shapes, else
    EngineUserError, leaving the parameters partly overwritten: the caller drops them)."""
    from safetensors.torch import load_file

    sd = load_file(str(path / "adapter_model.safetensors"))
    if set(sd) != set(params):
        missing, unexpected = sorted(set(params) - set(sd)), sorted(set(sd) - set(params))
        raise EngineUserError(
            f"weights at {str(path)!r} do not fit this base model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    with torch.no_grad():
        for k, p in params.items():
            if sd[k].shape != p.shape:
                raise EngineUserError(f"weights at {str(path)!r} do not fit this base model: {k} {tuple(sd[k].shape)}")
            p.copy_(sd[k])


def _same_lora(a, b) -> bool:
    """Whether two LoRA configs give layers of the same shapes and scaling on the same modules."""
    if a is None:
        return False
    keys = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "bias", "rank_pattern", "alpha_pattern")
    da, db = a.to_dict(), b.to_dict()
    norm = {"target_modules": lambda v: sorted(v) if isinstance(v, (list, set, tuple)) else v}
    return all(norm.get(k, lambda v: v)(da.get(k)) == norm.get(k, lambda v: v)(db.get(k)) for k in keys)


def _load_tensors(peft_model, name: str, path) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    sd = load_file(str(path / "adapter_model.safetensors"))
    try:
        res = set_peft_model_state_dict(peft_model, sd, adapter_name=name)
    except RuntimeError as e:  # shape mismatch
        raise EngineUserError(f"weights at {str(path)!r} do not fit this base model: {e}") from e
    missing = [k for k in getattr(res, "missing_keys", []) if f".{name}." in k]
    unexpected = list(getattr(res, "unexpected_keys", []))
    if missing or unexpected:
        raise EngineUserError(
            f"weights at {str(path)!r} do not fit this base model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
