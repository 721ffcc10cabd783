"""`mscale.accelerate.attach(accelerator, model, optimizer, job_id=...)`: the guard under Hugging
Face Accelerate (defined in mscale.hook.integrations.accelerate, the training job's room; imports torch and
accelerate, which `import mscale` does not)."""

from __future__ import annotations

from mscale.hook.integrations.accelerate import attach

__all__ = ["attach"]
