"""The Hugging Face Trainer's arguments the tests train with: on the CPU, no saving, no
reports, no workers, no progress bar, seed 0; a test states what it changes."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainingArguments


def cpu_args(output_dir: Path | str, max_steps: int, batch: int, **changes: object) -> TrainingArguments:
    kwargs: dict[str, object] = dict(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=batch,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return TrainingArguments(**{**kwargs, **changes})  # type: ignore[arg-type]
