"""A deliberately broken resume for the tests that must see it fail (``vramsweep check``'s resume line and a
sweep's ``sweep.check`` pre-flight): the adapter and the scheduler are restored, the optimizer state is not."""

from __future__ import annotations

import torch


def restore_without_optimizer_state(monkeypatch) -> None:
    """``Resume.apply`` replaced by one that copies the adapter tensors and the scheduler only (fresh AdamW
    moments after the checkpoint)."""
    from vramsweep.production import checkpoint

    def weights_only(self, model, optimizer, scheduler):
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, t in self.tensors.items():
                params[n].copy_(t)
        scheduler.load_state_dict(self.torch_state["scheduler"])

    monkeypatch.setattr(checkpoint.Resume, "apply", weights_only)
