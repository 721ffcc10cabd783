"""The L3 distillation term on any layout (used by mscale.hook.fuse.actions.distill); what it takes
and where, in full: docs/healing.md#l2-and-l3-on-real-models.

Teacher: the text MPU's final hidden states, detached (its output's, or its LM head's input where
it has a head: `lm_head_of`). Student: the failing MPU's output as the text model receives it
(through the aligner where there is one), projected to the text width at L3 entry where it is not
(`state`/`restore` keep that projection in the snapshots). Placed per sample from the model's
inputs (`Term._pair`): at its image (or audio) placeholders, as the text model's leading rows,
or, by cross-attention, against all of the sample's text. The term is contrastive over the batch
(each image's student against every caption's teacher, its own the class: a plain distance
collapses the images onto one target, benchmarks/fuse_real_models.py); it needs two samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import nn
from torch.nn import functional as F

from mscale.hook.core.families import config_of, placeholders
from mscale.hook.fuse.placement import tensors

if TYPE_CHECKING:
    from mscale.hook.core.mpu import Mpu

TEMPERATURE = 0.1  # of the contrastive term's cosine similarities (CLIP's learned value is about 0.01)


def text_width(text: nn.Module) -> int | None:
    """The text MPU's hidden size: its config's, else its input embedding's width."""
    cfg = getattr(text, "config", None)
    h = getattr(cfg, "hidden_size", None)
    if isinstance(h, int) and h > 0:
        return h
    for m in text.modules():
        if isinstance(m, nn.Embedding):
            return int(m.embedding_dim)
    return None


def lm_head_of(text: nn.Module) -> nn.Module | None:
    """The LM head of a text MPU that has one (a `*ForCausalLM`'s `get_output_embeddings()`), whose
    input is the final hidden states; None for a text MPU without one (most families' base models)."""
    head = getattr(text, "get_output_embeddings", lambda: None)()
    return head if isinstance(head, nn.Module) and head is not text else None


def teacher_of(output: object, width: int) -> torch.Tensor | None:
    t = getattr(output, "last_hidden_state", None)
    if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == width:
        return t
    for t in tensors(output):
        if t.dim() == 3 and t.is_floating_point() and t.shape[-1] == width:
            return t
    return None


def student_of(output: object, keys: tuple[str, ...] = ("pooler_output", "last_hidden_state")) -> torch.Tensor | None:
    """The student in an MPU's output: the first of `keys` there (a decoder's cross-attention
    reads an encoder's `last_hidden_state`, not its pooled output), else its first tensor."""
    for key in keys:
        t = getattr(output, key, None)
        if isinstance(t, (tuple, list)) and t and all(isinstance(x, torch.Tensor) for x in t):
            t = torch.cat(list(t))
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2:
            return t
    for t in tensors(output):
        if t.is_floating_point() and t.dim() >= 2:
            return t
    return None


def _leads(lead: object, student: torch.Tensor, b: int) -> bool:
    """The student is the text MPU's leading input (the tiny model) or its first rows (GIT
    concatenates the projected image before the text embeddings: a prefix without placeholders)."""
    if not (isinstance(lead, torch.Tensor) and lead.dim() == 3 and student.dim() == 3 and lead.shape[0] == b):
        return False
    n = student.shape[1]
    if lead is student:
        return True
    return lead.shape[1] > n and lead.shape[2] == student.shape[2] and bool(torch.equal(lead[:, :n], student))


@dataclass
class Captured:
    """One step's tensors for the term."""

    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    outputs: dict[str, object] = field(default_factory=dict)  # mpu_id -> output
    calls: list[tuple[str, object]] = field(default_factory=list)  # (mpu_id, output) of this forward, in order
    text_inputs: tuple[object, ...] = ()
    text_kwargs: dict[str, object] = field(default_factory=dict)  # the text MPU's keyword inputs
    hidden: object = None  # the text MPU's final hidden states, where it has an LM head (its input)


class Projection(TypedDict):
    """A term's projection as a snapshot holds it (`Term.state`)."""

    in_features: int
    weights: dict[str, torch.Tensor]  # its state dict, detached copies
    optimizer: dict[str, object]  # its optimizer's state dict


class Term:
    """The distillation term of one failing MPU: where its student comes from, how it is
    placed against the teacher, the projection when one is needed."""

    def __init__(self, model: nn.Module, mpus: list[Mpu], failing: Mpu, optimizer_lr: float = 1e-3) -> None:
        self.model, self.failing = model, failing
        self.text = next((m for m in mpus if m.name == "text"), None)
        aligner = next((m for m in mpus if m.name == "aligner"), None)
        # the MPU whose output the text model receives: the projector, for the encoders upstream of it
        self.carrier = aligner if aligner is not None and failing.name not in ("aligner", "text") else failing
        self.width = text_width(self.text.module) if self.text is not None else None
        cfg = config_of(model, str(getattr(failing, "path", "") or ""))
        # the placeholder tokens the student may fill, its own modality's first (`_positions`)
        self.tokens = placeholders(cfg, failing.name, str(getattr(failing, "path", "") or ""))
        # an encoder-decoder (VisionEncoderDecoder, Pix2Struct): no placeholders, cross-attention
        self.cross = bool(getattr(cfg, "is_encoder_decoder", False))
        self.projection: nn.Linear | None = None
        self._opt: torch.optim.Optimizer | None = None
        self._initial: Projection | None = None  # the projection's state as made
        self.lr = optimizer_lr

    @property
    def token(self) -> int | None:
        """The placeholder token id of the failing MPU's own modality first (None: no placeholders)."""
        return self.tokens[0][1] if self.tokens else None

    def why_not(self) -> str:
        """Why no term can be built for this layout ("" when one can)."""
        if self.text is None:
            return "no text MPU to take the teacher from"
        if self.failing is self.text:
            return "the text MPU is the teacher; nothing to distill from"
        if self.width is None:
            return "the text MPU's hidden size is unknown"
        return ""

    def loss(self, cap: Captured) -> tuple[torch.Tensor | None, str]:
        """(the term, "") or (None, why not) for this step's captured tensors."""
        if self.text is None or self.width is None:
            return None, self.why_not()
        out = self._carried(cap)
        text_out = cap.outputs.get(self.text.mpu_id)
        if out is None or text_out is None:
            return None, "the failing MPU or the text MPU did not run this step"
        student = self._student(cap, out)
        teacher = teacher_of(cap.hidden if cap.hidden is not None else text_out, self.width)
        if student is None:
            return None, f"no floating-point tensor of 2 or more dimensions in the {self.carrier.name} MPU's output"
        if teacher is None:
            return None, f"no ({self.width} wide) hidden-state tensor in the text MPU's output"
        rows = student.reshape(-1, student.shape[-1])
        if rows.shape[-1] != self.width:
            rows = self._project(rows)
        placed = self._pair(cap, student, rows, teacher.detach())
        if isinstance(placed, str):
            return None, placed
        s, t = placed
        if s.shape[0] < 2:
            return None, "the contrastive term needs at least 2 samples in the batch"
        # each image's student against every caption's teacher: its own caption is the class
        logits = F.normalize(s.float(), dim=-1) @ F.normalize(t.float(), dim=-1).T / TEMPERATURE
        return F.cross_entropy(logits, torch.arange(s.shape[0], device=logits.device)), ""

    def _carried(self, cap: Captured) -> object:
        """The carrier's output for the failing MPU: a projector shared by several towers
        (Video-LLaVA's images and videos) runs once for each, so its call after the failing
        MPU's last one (the last of a re-run's); None when the failing MPU did not run."""
        if not cap.calls:
            return cap.outputs.get(self.carrier.mpu_id)
        ids = [mpu_id for mpu_id, _ in cap.calls]
        if self.failing.mpu_id not in ids:
            return None
        if self.carrier is self.failing:
            return cap.outputs.get(self.failing.mpu_id)
        last = len(ids) - 1 - ids[::-1].index(self.failing.mpu_id)
        at = next((i for i in range(last + 1, len(ids)) if ids[i] == self.carrier.mpu_id), None)
        if at is None:
            return cap.outputs.get(self.carrier.mpu_id)
        while at + 1 < len(ids) and ids[at + 1] == self.carrier.mpu_id:
            at += 1
        return cap.calls[at][1]

    def _student(self, cap: Captured, out: object) -> torch.Tensor | None:
        """The carrier's output as the text model reads it: the tensor the text MPU takes as
        `encoder_hidden_states` (BLIP), an encoder-decoder's `last_hidden_state`, else `pooler_output` first."""
        read = cap.text_kwargs.get("encoder_hidden_states")
        if isinstance(read, torch.Tensor) and any(t is read for t in tensors(out)):
            return read
        return student_of(out, ("last_hidden_state",) if self.cross else ("pooler_output", "last_hidden_state"))

    def _pair(
        self, cap: Captured, student: torch.Tensor, rows: torch.Tensor, teacher: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | str:
        """Per sample: (the mean of its student rows, the mean of the teacher over its text positions)."""
        ids = cap.input_ids
        b = teacher.shape[0]
        if self.tokens and isinstance(ids, torch.Tensor) and ids.shape == teacher.shape[:2]:
            found = self._positions(ids.to(teacher.device), rows.shape[0], b)
            if isinstance(found, str):
                return found
            _, counts, modality = found
            text = torch.ones_like(ids, dtype=torch.bool, device=teacher.device)
            for _, token in self.tokens:  # text: no placeholder of any modality
                text &= ids.to(teacher.device) != token
            if cap.attention_mask is not None and cap.attention_mask.shape == text.shape:
                text = text & cap.attention_mask.to(text.device).bool()
            if int(counts.sum()) == rows.shape[0]:
                pooled = torch.stack([r.mean(dim=0) for r in torch.split(rows, counts.tolist())])
            else:
                pooled = rows.reshape(b, -1, rows.shape[-1]).mean(dim=1)
            self.layout = f"{modality}-token positions"
        elif (
            (self.cross or cap.text_kwargs.get("encoder_hidden_states") is student)
            and student.dim() == 3
            and student.shape[0] == b
        ):
            # cross-attention (an encoder-decoder, BLIP's decoder): the student reaches the text
            # model only there, so each sample's student is all of its own rows and every text
            # position is text
            text = torch.ones(teacher.shape[:2], dtype=torch.bool, device=teacher.device)
            pooled = rows.reshape(b, -1, rows.shape[-1]).mean(dim=1)
            self.layout = "text positions (cross-attention)"
        else:
            lead = cap.text_inputs[0] if cap.text_inputs else None
            if not _leads(lead, student, b):
                return "the student's positions in the text sequence are not known (no image token id in the model's config)"
            n = student.shape[1]
            self.layout = "leading positions of the text input"
            if teacher.shape[1] <= n:
                return "no text positions after the student's"
            text = torch.zeros(teacher.shape[:2], dtype=torch.bool, device=teacher.device)
            text[:, n:] = True
            pooled = rows.reshape(b, n, -1).mean(dim=1)
        weights = text.to(teacher.dtype).unsqueeze(-1)
        target = (teacher * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
        return pooled, target

    layout = ""  # where the student was placed at the last step (the event says it)

    def _positions(self, ids: torch.Tensor, rows: int, b: int) -> tuple[torch.Tensor, torch.Tensor, str] | str:
        """(positions, count per sample, modality) of the first placeholder holding the student's
        rows, else why none does. Rows added after the MPU (LLaVA-NeXT's row-end newlines) break a
        row a position: with equal counts each sample's rows are its equal share, in batch order."""
        seen = []
        for modality, token in self.tokens:
            at = ids == token
            counts = at.sum(dim=1)
            shares = bool((counts == counts[0]).all()) and rows % b == 0
            if not bool((counts == 0).any()) and (int(counts.sum()) == rows or shares):
                return at, counts, modality
            seen.append(f"{int(counts.sum())} {modality}-token positions")
        return f"{', '.join(seen)} for {rows} student rows"

    def _project(self, student: torch.Tensor) -> torch.Tensor:
        if self.projection is None or self.projection.in_features != student.shape[-1]:
            self.projection = nn.Linear(student.shape[-1], int(self.width or 0)).to(student.device)
            self._opt = torch.optim.Adam(self.projection.parameters(), lr=self.lr)
            # a rollback to a step before this one restores the projection as made
            self._initial = self.state()
        return self.projection(student.to(self.projection.weight.dtype))

    def state(self) -> Projection | None:
        """The projection made here and its optimizer's state (None when there is none): what
        a snapshot holds of this term."""
        if self.projection is None or self._opt is None:
            return None
        return {
            "in_features": self.projection.in_features,
            "weights": {k: v.detach().clone() for k, v in self.projection.state_dict().items()},
            "optimizer": self._opt.state_dict(),
        }

    def restore(self, state: Projection | None) -> None:
        """Back to a snapshot's `state()`; None (the snapshot predates the projection): back to
        the projection as it was made, with a fresh optimizer."""
        state = state if state is not None else self._initial
        if state is None or self.projection is None or self._opt is None:
            return
        if int(state["in_features"]) != self.projection.in_features:
            raise ValueError(
                f"the snapshot's L3 projection takes {state['in_features']} features, this one {self.projection.in_features}"
            )
        with torch.no_grad():
            for k, v in self.projection.state_dict().items():
                v.copy_(state["weights"][k])
        self._opt = torch.optim.Adam(self.projection.parameters(), lr=self.lr)
        if state.get("optimizer", {}).get("state"):
            self._opt.load_state_dict(state["optimizer"])

    def step(self) -> None:
        """Train the projection made here (the model's optimizer does not hold it)."""
        if self._opt is not None:
            self._opt.step()
            self._opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        self.projection, self._opt, self._initial = None, None, None
