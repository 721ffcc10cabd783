"""`mscale.lightning.MscaleCallback(job_id=...)`: the guard under PyTorch Lightning (defined in
mscale.hook.integrations.lightning, the training job's room; imports torch and lightning, which
`import mscale` does not)."""

from __future__ import annotations

from mscale.hook.integrations.lightning import MscaleCallback

__all__ = ["MscaleCallback"]
