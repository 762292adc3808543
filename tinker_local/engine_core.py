"""The state of a ``tinker_local.engine.Engine`` and what its training and sampling share: the
base models (loaded once per canonical name, one ``peft.PeftModel`` holding the resident
adapters), the training models (LoRA adapter, AdamW state, step), the lock serialising calls, the
device, the training dtype and the torch thread count (see the ``tinker_local.engine`` docstring).

Every peft operation on a ``PeftModel`` (adding, activating, deleting an adapter) walks all its
modules, the LoRA modules of every adapter it holds included, so its cost grows with their
number: a server that has created its 200th training model took 1.4 s to create the next one,
against 0.07 s for the second (``tiny``).  So at most ``Engine.max_resident_adapters`` training
adapters stay injected per base model (least recently used go, like sampler adapters); the
parameters of one that goes, its AdamW state and pending gradients stay with its
``TrainingState``, and it is injected again, with those very parameter objects, when next used.

Base models themselves are bounded by ``Engine.max_base_bytes`` (None: no bound): when loading one
would take the loaded ones' parameter and buffer bytes over it, the least recently used others are
unloaded first; their training adapters are parked as above (``TrainingState`` keeps parameters,
AdamW state and gradients) and injected again, with the adapter names they had, when the base model
is next used, which loads it again (a few seconds for SmolLM2 from its cache directory).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .adapters import add_adapter, rebind_adapter, remove_adapter
from .attention import SEGMENT_ATTENTION
from .compute import available_cpus, bf16_supported, choose_attn_implementation, to_weights_dtype
from .errors import EngineUserError
from .media import media_support
from .models import ModelSpec, resolve_model
from .packing import packing_supported

logger = logging.getLogger("tinker_local.engine")

MAX_RESIDENT_ADAPTERS = 8  # training adapters injected per base model (least recently used go)
_OFF = ("0", "off", "false", "no")


@dataclass
class BaseModelState:
    """A loaded base model with its adapters (see the module docstring)."""

    spec: ModelSpec
    model: Any  # the transformers model (LoRA layers are injected into it in place)
    tokenizer: Any
    n_params: int
    n_bytes: int  # bytes of its parameters and buffers when loaded (adapters injected later not counted)
    peft: Any = None  # peft.PeftModel once the first adapter exists
    counter: int = 0
    sampler_adapters: OrderedDict[tuple, str] = field(default_factory=OrderedDict)
    sampler_params: dict[str, Any] = field(default_factory=dict)  # sampler adapter -> its parameters
    resident: OrderedDict[str, None] = field(default_factory=OrderedDict)  # training adapters injected, LRU first
    active: str | None = None  # adapter last activated by set_adapter (None: unknown)
    media: Any = False  # tinker_local.media.Support | None once looked up (False: not yet)
    packs: bool | None = None  # whether padding-free rows keep datums apart (None: not checked yet)
    attn_implementation: str = SEGMENT_ATTENTION  # the attention kernels it runs (compute.choose_attn_implementation)

    def use(self, adapter: str) -> None:
        """Make ``adapter`` the active one; ``set_adapter`` walks every module, so only when it changes."""
        if self.active != adapter:
            self.peft.set_adapter(adapter)
            self.active = adapter


@dataclass
class TrainingState:
    """A training model: LoRA adapter ``adapter`` over base model ``base_key``, its parameters
    (peft state-dict key -> parameter), its AdamW state and the optimizer steps taken."""

    model_id: str
    base_name: str  # as given by the caller
    base_key: str  # canonical spec name
    adapter: str
    lora_rank: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    seed: int
    config: Any  # its peft.LoraConfig
    params: OrderedDict[str, torch.nn.Parameter]  # peft state-dict key -> parameter
    optimizer: torch.optim.AdamW
    step: int = 0


class EngineCore:
    """An engine's state and the helpers its training (``Engine``) and sampling
    (``tinker_local.engine_sampling.SamplingMixin``) share."""

    def __init__(
        self,
        root: Path,
        *,
        device: str | None = None,
        dtype: str = "auto",
        num_threads: int | None = None,
        weights_dtype: str = "auto",
    ):
        """``root``: folder for checkpoints and the model cache (created).  ``device``: torch
        device string (default "cuda" when available, else "cpu").  ``dtype``: "auto" | "fp32" |
        "bf16" for training/forward compute (ValueError otherwise).  ``num_threads``: torch
        intra-op threads (default: number of CPUs this process may use).  ``weights_dtype``:
        "auto" | "fp32" | "bf16", the dtype base weights are held in: "auto" is the compute dtype
        on CUDA (bf16 weights: no cast of every weight at every forward, half the memory) and fp32
        elsewhere (the CPU samples in fp32, see ``tinker_local.engine_sampling``); the output head
        stays fp32 either way (``tinker_local.compute.to_weights_dtype``)."""
        self.root = Path(root)
        (self.root / "checkpoints").mkdir(parents=True, exist_ok=True)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype not in ("auto", "fp32", "bf16"):
            raise ValueError(f"dtype must be 'auto', 'fp32' or 'bf16', got {dtype!r}")
        if dtype == "auto":
            dtype = "bf16" if bf16_supported(self.device) else "fp32"
        self.dtype = dtype
        if weights_dtype not in ("auto", "fp32", "bf16"):
            raise ValueError(f"weights_dtype must be 'auto', 'fp32' or 'bf16', got {weights_dtype!r}")
        if weights_dtype == "auto":
            weights_dtype = "bf16" if dtype == "bf16" and self.device.type == "cuda" else "fp32"
        self.weights_dtype = weights_dtype
        self.num_threads = int(num_threads or available_cpus())
        torch.set_num_threads(self.num_threads)
        # padded tokens per micro-batch; None: 2**27 // vocab_size (<= 128M fp32 logits: 512 MiB), in
        # [256, 16384] (one pass for 8 x 256 tokens of a 49k vocabulary, as a plain torch step does)
        self.max_batch_tokens: int | None = None
        # padding-free micro-batches (tinker_local.packing) for text-only models that keep packed
        # datums apart; environment TINKER_LOCAL_PACKING=off turns them off (the padded path)
        self.packing = os.environ.get("TINKER_LOCAL_PACKING", "on").lower() not in _OFF
        # packed datums with a common prefix compute it once (tinker_local.packing, shared prefixes);
        # environment TINKER_LOCAL_SHARE_PREFIXES=off lays every datum out in full
        self.share_prefixes = os.environ.get("TINKER_LOCAL_SHARE_PREFIXES", "on").lower() not in _OFF
        # training adapters kept injected per base model (see the module docstring)
        self.max_resident_adapters = MAX_RESIDENT_ADAPTERS
        # what the engine fell back on (``GET local_stats`` -> ``"engine"``): ``packing_fallbacks``
        # counts forward/forward_backward calls of a text-only model that ran padded because the
        # model failed the packing check (logged once per base model)
        self.stats: dict[str, int] = {"packing_fallbacks": 0}
        # bytes of loaded base models (parameters and buffers) before the least recently used go
        self.max_base_bytes: int | None = None
        self._lock = threading.RLock()
        self._bases: OrderedDict[str, BaseModelState] = OrderedDict()  # least recently used first
        self._base_names: dict[str, str] = {}  # canonical name -> a name it was loaded by
        self._counters: dict[str, int] = {}  # canonical name -> adapters named so far (kept across unloads)
        self.base_loads: dict[str, int] = {}  # canonical name -> times loaded (GET local_stats)
        self._models: dict[str, TrainingState] = {}
        # the autograd graph of the last ``forward`` of a training model, for a ``forward_backward``
        # of the same tokens that follows it (``Engine._run``): (model id, key, [(items, logprobs)])
        self._kept_forward: tuple[str, tuple, list] | None = None
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except Exception:  # pragma: no cover - cosmetic only
            pass

    def load_base_model(self, base_model: str) -> dict:
        """Load ``base_model`` now (e.g. at server start) and return
        ``{"base_model", "tokenizer_id", "max_context", "vocab_size", "weights_dtype",
        "attn_implementation"}``.  Raises EngineUserError."""
        with self._lock:
            b = self._base(base_model)
            return {
                "base_model": base_model,
                "tokenizer_id": b.spec.tokenizer_dir,
                "max_context": b.spec.max_context,
                "vocab_size": b.spec.vocab_size,
                "weights_dtype": self.weights_dtype,
                "attn_implementation": b.attn_implementation,
            }

    def base_model_dir(self, base_model: str) -> Path | None:
        """The local Hugging Face directory of ``base_model`` (config, weights, tokenizer), or
        None when it has none (a preset not yet built)."""
        d = resolve_model(base_model, self.root / "models").model_dir
        return Path(d) if d else None

    def _threads(self, n: int | None = None) -> None:
        n = n or self.num_threads
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def _autocast(self):
        if self.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _sampling_autocast(self):
        """Sampling runs in the weights' dtype: fp32 weights sample in fp32 (no autocast), bf16
        weights under bf16 autocast (their LoRA layers in bf16, the output head in fp32)."""
        if self.weights_dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _canonical(self, base_model: str) -> str:
        return resolve_model(base_model, self.root / "models").name

    def _base(self, base_model: str) -> BaseModelState:
        spec = resolve_model(base_model, self.root / "models")
        b = self._bases.get(spec.name)
        if b is None:
            model, tok = spec.load()  # on the CPU: room is made on the device before it moves there
            for p in model.parameters():
                p.requires_grad_(False)
            wdtype = torch.bfloat16 if self.weights_dtype == "bf16" else torch.float32
            to_weights_dtype(model, wdtype)  # before counting its bytes: they are the compute dtype's
            n_bytes = _model_bytes(model)
            self._make_room(n_bytes, spec.name)
            model.to(self.device).eval()
            attn = choose_attn_implementation(self.device, wdtype)
            if getattr(model.config, "_attn_implementation", None) != attn:
                try:
                    model.set_attn_implementation(attn)
                except (ValueError, ImportError, AttributeError) as e:  # the architecture does not support it
                    logger.warning(
                        "%s: attention %s not available (%s); keeping %s",
                        spec.name,
                        attn,
                        e,
                        model.config._attn_implementation,
                    )
            spec.vocab_size = int(model.get_input_embeddings().weight.shape[0])
            n_params = sum(p.numel() for p in model.parameters())
            b = self._bases[spec.name] = BaseModelState(spec, model, tok, n_params, n_bytes)
            b.attn_implementation = str(getattr(model.config, "_attn_implementation", None) or "eager")
            logger.info(
                "loaded %s on %s: weights %s, attention %s",
                spec.name,
                self.device,
                self.weights_dtype,
                b.attn_implementation,
            )
            b.counter = self._counters.get(spec.name, 0)
            self._base_names[spec.name] = base_model
            self.base_loads[spec.name] = self.base_loads.get(spec.name, 0) + 1
        self._bases.move_to_end(spec.name)
        return b

    def _loaded(self, key: str) -> BaseModelState:
        """The base model of canonical name ``key`` (a training model's ``base_key``), loaded again
        when it was unloaded to make room."""
        b = self._bases.get(key)
        if b is None:
            return self._base(self._base_names[key])
        self._bases.move_to_end(key)
        return b

    def _make_room(self, incoming: int, name: str) -> None:
        """Unload least recently used base models until ``incoming`` more bytes fit within
        ``max_base_bytes`` (their training adapters stay parked in their ``TrainingState``)."""
        if self.max_base_bytes is None:
            return
        while self._bases and sum(b.n_bytes for b in self._bases.values()) + incoming > self.max_base_bytes:
            old, b = self._bases.popitem(last=False)
            self._kept_forward = None  # a kept graph holds the activations of a base model
            self._counters[old] = b.counter
            b.peft = b.model = None
            logger.info("unloaded base model %s to make room for %s (--max-base-model-bytes)", old, name)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resident_bases(self) -> dict[str, dict[str, int]]:
        """Loaded base models (least recently used first): ``{name: {"bytes", "loads"}}``, ``bytes``
        their parameters and buffers as loaded.  Reads a snapshot without the engine lock, which a
        long training job on the compute thread holds: it touches no model (one unloaded meanwhile
        still shows, with the bytes it had)."""
        bases = list(self._bases.items())
        return {k: {"bytes": b.n_bytes, "loads": self.base_loads.get(k, 0)} for k, b in bases}

    def _media(self, b: BaseModelState):
        """The media the base model accepts (``tinker_local.media.Support``; None: text only)."""
        if b.media is False:
            b.media = media_support(b.model, b.spec.model_dir)
        return b.media

    def _packs(self, b: BaseModelState) -> bool:
        """Whether ``b`` trains padding-free: text-only (media datums take the padded path) and
        checked once by ``tinker_local.packing.packing_supported`` in the layout it will use. A
        text-only model that fails the check trains padded: said once per base model, counted per
        call in ``stats["packing_fallbacks"]``."""
        text_only = self._media(b) is None
        if b.packs is None:
            b.packs = text_only and packing_supported(
                b.model, b.spec.vocab_size, self.device, segments=self._segments(b)
            )
            if text_only and not b.packs:
                logger.warning(
                    "base model %s: two datums packed into one row did not give the logits each gives alone "
                    "(tinker_local.packing.packing_supported), so it trains on padded batches, slower on datums "
                    "of mixed lengths (counted in local_stats engine.packing_fallbacks; said once per base model)",
                    b.spec.name,
                )
        if text_only and not b.packs:
            self.stats["packing_fallbacks"] += 1
        return b.packs

    @staticmethod
    def _segments(b: BaseModelState) -> bool:
        """Whether ``b`` runs segment attention (``tinker_local.attention``), so packed datums
        are kept apart by the row's segments and may share prefixes; other attention kernels
        (flash-attention 2) keep them apart by restarting positions."""
        return getattr(b.model.config, "_attn_implementation", None) == SEGMENT_ATTENTION

    def _train(self, model_id: str) -> TrainingState:
        st = self._models.get(model_id)
        if st is None:
            raise EngineUserError(f"unknown model_id {model_id!r}")
        return st

    def _activate(self, b: BaseModelState, st: TrainingState) -> None:
        if st.adapter not in b.resident:
            self._inject(b, st.adapter, st.config, st.seed)
            rebind_adapter(b.peft, st.adapter, st.params)
        b.resident.move_to_end(st.adapter)
        b.use(st.adapter)
        for p in st.params.values():  # peft toggles requires_grad (set_adapter, disable_adapter)
            p.requires_grad_(True)

    def _inject(self, b: BaseModelState, name: str, config: Any, seed: int) -> None:
        """Add training adapter ``name`` (its ``peft.LoraConfig``, initialised from ``seed``) to
        ``b.peft``, first taking the least recently used ones out until it fits within
        ``max_resident_adapters``."""
        while b.resident and len(b.resident) >= max(1, self.max_resident_adapters):
            old, _ = b.resident.popitem(last=False)
            remove_adapter(b.peft, old)
        b.peft = add_adapter(b.peft, b.model, name, config, seed, self.device)
        b.resident[name] = None
        b.active = None


def _model_bytes(model: Any) -> int:
    """Bytes of a model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def new_adamw(params: dict[str, torch.nn.Parameter]) -> torch.optim.AdamW:
    """A fresh AdamW over ``params`` (its hyperparameters are set at every ``optim_step``; these
    are Tinker's defaults)."""
    return torch.optim.AdamW(list(params.values()), lr=0.0, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
