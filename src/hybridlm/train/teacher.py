"""The teacher of logit distillation, for every stage that distils (offline and cached
distillation, QAD, pretraining by distillation): a frozen teacher loaded from any model path with
the run's tokenizer, the vocabulary check, its top-k at the selected positions (from logits or a
cache lookup), and the teacher and spec of a cache pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..io import load_model
from ..model.model import HybridLM
from .config import TeacherConfig
from .teacher_cache import CacheSpec
from .trainer import check_tokenizer


def load_teacher(
    path: str, *, device: torch.device, tokenizer: Any, setting: str = "distill.teacher"
) -> HybridLM:
    """A frozen teacher (eval mode, no grad) from any model path; it must have been trained with
    the run's tokenizer (`setting` names the option the path came from)."""
    teacher = load_model(path, setting=setting).to(device).eval()
    teacher.requires_grad_(False)
    check_tokenizer(tokenizer, teacher, setting, path)
    return teacher


def check_vocab(student: HybridLM, teacher_vocab_size: int, name: str) -> None:
    """Logit distillation compares distributions id by id: the vocabularies must match (a
    teacher's, or a teacher cache's)."""
    vs, vt = student.config.vocab_size, teacher_vocab_size
    if vs != vt:
        raise ValueError(
            f"student vocab_size {vs} != teacher {name!r} vocab_size {vt}: logit distillation "
            "needs the same tokenizer and vocabulary (set the student's model.vocab_size)"
        )


TeacherOut = torch.Tensor | Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def teacher_topk_at(
    teacher: TeacherOut, mask_BL: torch.Tensor, k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-`k` (values [T, k], ids [T, k]) at the positions `mask_BL` selects:
    from its logits [B, L, V] (k clamped to the vocabulary, 0 = all of it), or from a lookup
    (a cache, which applies its own k)."""
    if callable(teacher):
        top_TK, ids_TK = teacher(mask_BL)
        return top_TK.to(device), ids_TK.to(device)
    t_TV = teacher[mask_BL].float()
    V = t_TV.shape[-1]
    return t_TV.topk(min(k, V) if k else V, dim=-1)


def cache_pass_teacher(
    dd: TeacherConfig, *, device: torch.device, tokenizer: Any
) -> tuple[HybridLM, CacheSpec]:
    """The teacher a cache pass runs and the cache's spec, from a run's teacher settings (an
    offline distillation's or a pretraining run's `distill` section)."""
    if not dd.teacher_cache:
        raise ValueError("set distill.teacher_cache: the directory the cache is written to")
    if not dd.teacher:
        raise ValueError("distill.teacher is empty: the cache is computed from the teacher")
    teacher = load_teacher(dd.teacher, device=device, tokenizer=tokenizer)
    spec = CacheSpec(
        teacher=dd.teacher,
        k=dd.top_k or teacher.config.vocab_size,
        vocab_size=teacher.config.vocab_size,
        logprob_dtype=dd.teacher_cache_dtype,
    )
    return teacher, spec
