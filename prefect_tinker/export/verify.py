"""Verifying an export: its logprobs on fixed sequences against the server's ``compute_logprobs``.

The sequences are a few fixed texts encoded by the base model's tokenizer plus one seeded run of
random token ids (every position's logprob is checked, so a corrupted row of the embedding or of
the output projection shows). The exported files are loaded the way users load them --
``AutoModelForCausalLM.from_pretrained(folder)`` (merged) or ``PeftModel.from_pretrained(base,
folder)`` (PEFT) -- always with float32 compute (a bfloat16 / float16 export is upcast on load,
so what is measured is the rounding of the saved weights, not the low-precision arithmetic of
one particular runtime), and compared token by token with the reference logprobs.

Every export is checked twice when its dtype is not float32: first built in float32 and checked
at ``1e-4`` (the merge itself: ``W + (alpha / r) B A``), then cast to its dtype and checked again
at the dtype's tolerance (the saved files: rounding, overflow, config). Tolerances,
:data:`TOLERANCES` (nats, over every token): float32 max ``1e-4``; bfloat16 max ``0.5`` and mean
``0.1``; float16 max ``0.1`` and mean ``0.02``. The low-precision bounds are 2.5-6x what rounding
SmolLM2-135M's weights costs (bfloat16: max 0.198, mean 0.026; float16: max 0.014, mean 0.0032,
both about 6.6 unit roundoffs on average), leaving room for deeper models.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

__all__ = [
    "TOLERANCES",
    "TEXTS",
    "ExportVerificationError",
    "Verifier",
    "compare",
    "fixed_sequences",
    "model_logprobs",
    "load_exported",
]

#: dtype -> (max, mean) tolerance of |exported - reference| logprobs (nats); None: no mean bound
TOLERANCES: dict[str, tuple[float, float | None]] = {
    "float32": (1e-4, None),
    "bfloat16": (0.5, 0.1),
    "float16": (0.1, 0.02),
}
TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "user: What is 12 + 34?\nassistant: 12 + 34 = 46.",
    "def add(a, b):\n    return a + b\n",
    "Prefect schedules, retries and caches every step; Tinker trains and samples.",
)
RANDOM_LENGTH = 48


class ExportVerificationError(RuntimeError):
    """The exported model's logprobs differ from the server's beyond the tolerance, or the files
    did not load cleanly (missing / unexpected weights); the message gives the numbers."""


def fixed_sequences(tokenizer: Any, vocab_size: int, max_length: int, seed: int = 0) -> list[list[int]]:
    """Token ids of :data:`TEXTS` (each at most ``max_length``) and one sequence of
    :data:`RANDOM_LENGTH` ids drawn uniformly from ``[0, vocab_size)`` with ``seed``."""
    seqs = [list(tokenizer.encode(t, add_special_tokens=False))[:max_length] for t in TEXTS]
    rng = np.random.default_rng(seed)
    seqs.append(rng.integers(0, vocab_size, size=min(RANDOM_LENGTH, max_length)).tolist())
    return [s for s in seqs if len(s) >= 2]


@torch.no_grad()
def model_logprobs(model: Any, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Per sequence, the (N - 1,) float32 logprobs of tokens 1..N-1 under ``model``."""
    out = []
    for ids in sequences:
        x = torch.tensor([list(ids)])
        logits = model(input_ids=x).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].numpy())
    return out


def _check_loading(info: dict, what: str) -> None:
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise ExportVerificationError(f"{what} did not load cleanly: {bad}")


def load_exported(folder: Path, fmt: str, base_dir: Path | str) -> Any:
    """The exported model, float32, eval mode: merged -> ``AutoModelForCausalLM.from_pretrained(folder)``
    (missing, unexpected or mismatched weights are an :class:`ExportVerificationError`); peft ->
    ``PeftModel.from_pretrained(<base_dir model>, folder)`` (a missing adapter key is one too)."""
    from transformers import AutoModelForCausalLM

    if fmt == "merged":
        # with output_loading_info=True transformers returns (model, loading info); its annotation names the model only
        model, info = cast(
            tuple[Any, dict[str, Any]],
            AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True),
        )
        _check_loading(info, f"the merged model in {folder}")
        return model.eval()
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, str(folder))
    for w in caught:
        text = str(w.message)
        if "missing adapter keys" in text.lower() or "unexpected" in text.lower():
            raise ExportVerificationError(f"the adapter in {folder} did not load cleanly: {text[:500]}")
    return model.eval()


def compare(
    got: Sequence[np.ndarray], want: Sequence[Sequence[float]], tolerance: tuple[float, float | None]
) -> dict[str, Any]:
    """Token-by-token comparison against ``tolerance`` = (max, mean or None); returns
    ``{"sequences", "tokens", "max_abs_diff", "mean_abs_diff", "tolerance", "mean_tolerance",
    "passed"}`` (differences in nats).

    Raises:
        ExportVerificationError: lengths differ or a value is not finite.
    """
    diffs = []
    for i, (got_i, want_i) in enumerate(zip(got, want, strict=True)):
        w = np.asarray(want_i, dtype=np.float64)
        g = np.asarray(got_i, dtype=np.float64)
        if g.shape != w.shape:
            raise ExportVerificationError(
                f"sequence {i}: {g.shape[0]} exported logprobs vs {w.shape[0]} from the server"
            )
        if not (np.isfinite(g).all() and np.isfinite(w).all()):
            raise ExportVerificationError(f"sequence {i}: non-finite logprobs (exported {g[~np.isfinite(g)][:3]})")
        diffs.append(np.abs(g - w))
    flat = np.concatenate(diffs) if diffs else np.zeros(0)
    mx, mean = (float(flat.max()), float(flat.mean())) if flat.size else (0.0, 0.0)
    tol_max, tol_mean = tolerance
    return {
        "sequences": len(diffs),
        "tokens": int(flat.size),
        "max_abs_diff": mx,
        "mean_abs_diff": mean,
        "tolerance": tol_max,
        "mean_tolerance": tol_mean,
        "passed": bool(mx <= tol_max and (tol_mean is None or mean <= tol_mean)),
    }


class Verifier:
    """The fixed sequences of one export and the reference logprobs of ``reference`` (a
    ``tinker.SamplingClient``'s ``compute_logprobs``), computed once; :meth:`check` compares a
    folder with them.

    Args:
        sampler: an object with ``compute_logprobs(ModelInput)`` returning a future.
        reference: the sampler's checkpoint path (recorded). base_dir: the base model folder
            (its tokenizer and config give the sequences).
    """

    def __init__(self, sampler: Any, reference: str, base_dir: Path):
        import tinker
        from transformers import AutoConfig, AutoTokenizer

        cfg = AutoConfig.from_pretrained(str(base_dir)).get_text_config()
        length = min(int(getattr(cfg, "max_position_embeddings", 256) or 256), 256)
        self.sequences = fixed_sequences(AutoTokenizer.from_pretrained(str(base_dir)), int(cfg.vocab_size), length)
        futures = [sampler.compute_logprobs(tinker.ModelInput.from_ints(s)) for s in self.sequences]
        self.want = [list(f.result())[1:] for f in futures]
        self.reference, self.base_dir = reference, Path(base_dir)

    def _measure(self, folder: Path, fmt: str, tolerance: tuple[float, float | None]) -> dict[str, Any]:
        import gc

        model = load_exported(folder, fmt, self.base_dir)
        got = model_logprobs(model, self.sequences)
        del model
        gc.collect()
        return compare(got, self.want, tolerance)

    def check(self, folder: Path, fmt: str, dtype: str) -> dict[str, Any]:
        """Compare the export in ``folder`` (``fmt``, saved in ``dtype``) at ``TOLERANCES[dtype]``.

        Raises:
            ExportVerificationError: beyond the tolerance (the message has the numbers), or the
                files did not load cleanly.
        """
        result = self._measure(folder, fmt, TOLERANCES[dtype])
        if not result["passed"]:
            mean = (
                f", mean {result['mean_abs_diff']:.3g} (tolerance {result['mean_tolerance']:g})"
                if result["mean_tolerance"] is not None
                else f", mean {result['mean_abs_diff']:.3g}"
            )
            raise ExportVerificationError(
                f"the {fmt} export ({dtype}) differs from {self.reference}'s compute_logprobs by up to "
                f"{result['max_abs_diff']:.3g} nats (tolerance {result['tolerance']:g}){mean}, over {result['tokens']} "
                "tokens; nothing was published"
            )
        return {**result, "dtype": dtype}

    def adapter_effect(self) -> float:
        """Max |base model - reference| over the tokens: what the adapter changes (a check can
        only tell a dropped adapter when this exceeds its tolerance)."""
        return self._measure(self.base_dir, "merged", (float("inf"), None))["max_abs_diff"]
