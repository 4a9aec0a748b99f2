"""Name the model line behind a tracing failure that happens in backward, and what a user can do.

A boolean-mask assignment in forward (``hidden[mask] = embed``: SpecAugment in transformers' speech
encoders) traces fine, but its backward indexes by the mask, which is ``aten.nonzero``: a shape that
depends on the data. That failure is raised inside autograd's backward, where no frame of the model
is on the stack, so the message had no model line. :func:`boolean_index_sites` traces the step again,
only on that failure path, with a ``TorchFunctionMode`` that records the model line and module of
every indexing call with a boolean tensor index; the error names them.

:func:`config_advice` says which config fields make a known model family's training step traceable.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

__all__ = ["IndexSite", "boolean_index_sites", "config_advice", "user_frame"]

#: Indexing calls whose boolean index becomes a data-dependent ``nonzero`` (forward or backward).
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put,
             torch.index_put, torch.Tensor.masked_select, torch.masked_select}


@dataclass(frozen=True)
class IndexSite:
    """A model line that indexes with a boolean mask: ``file:line (code)`` and the running module."""

    filename: str
    lineno: int
    line: str
    module: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} ({self.line}) in module {self.module or '(the model)'!r}"


def user_frame(frames) -> traceback.FrameSummary | None:
    """The innermost frame that is neither torch's nor this package's."""
    for frame in reversed(frames):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and "/remat_compiler/" not in path and "/functorch/" not in path:
            return frame
    return None


class _Recorder(TorchFunctionMode):
    def __init__(self, running: Callable[[], str]):
        super().__init__()
        self.running = running
        self.sites: list[IndexSite] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INDEXING and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool
                                     for a in pytree.tree_leaves((args[1:], kwargs))):
            frame = user_frame(traceback.extract_stack()[:-1])
            if frame is not None:
                site = IndexSite(frame.filename, frame.lineno or 0, (frame.line or "").strip(), self.running())
                if site not in self.sites:
                    self.sites.append(site)
        return func(*args, **kwargs)


def boolean_index_sites(run: Callable[[], object], running: Callable[[], str]) -> list[IndexSite]:
    """Run ``run`` (a trace that is expected to fail again) recording the boolean-mask indexing
    sites of the model; ``running()`` names the module running at each. Any exception ``run``
    raises is the one already reported, so it is dropped here."""
    recorder = _Recorder(running)
    try:
        with recorder:
            run()
    except Exception:  # noqa: BLE001 - the failure being described; its own message is raised by the caller
        pass
    return recorder.sites


def config_advice(model: torch.nn.Module) -> str | None:
    """What makes a known family's training step traceable, from the model's config (None: no
    family known). Speech encoders of the Wav2Vec2 family (Wav2Vec2, HuBERT, WavLM, Data2VecAudio,
    UniSpeech, SEW) carry three data-dependent parts in their default training step."""
    config = next((getattr(m, "config", None) for m in model.modules() if hasattr(m, "config")), None)
    if config is None or not all(hasattr(config, f) for f in ("mask_time_prob", "layerdrop", "apply_spec_augment")):
        return None
    return ("this speech encoder's default training step has three data-dependent parts: the CTC loss and its "
            "label check (compute the loss outside the compiled module: compile the model without labels, or its "
            "encoder, e.g. model.wav2vec2, and apply torch.nn.functional.ctc_loss to the logits it returns), "
            "layerdrop (config.layerdrop=0.0) and SpecAugment's random masks (config.apply_spec_augment=False, "
            "or mask_time_prob=0.0 and mask_feature_prob=0.0); with all three out of the compiled module the "
            "step traces and plans")
