"""The `fim` curation stage: documents rewritten with the fill-in-the-middle transform of
`hybridlm.data.fim` (Olmo 3 §4.3: 50% of the Stack-Edu code documents), keyed by document id so
the rewrite does not depend on shard order."""

from __future__ import annotations

from dataclasses import dataclass

from ..data.fim import FIMConfig, fim_transform
from .core import CurateDoc, Decision, DocStage, register_stage


@register_stage("fim")
@dataclass(kw_only=True)
class FIMStage(DocStage):
    """Rewrite documents with the FIM transform (keyed by document id); `metadata["fim"]` and
    the provenance record the mode (psm / spm / none / has_sentinel)."""

    rate: float = 0.5
    spm_rate: float = 0.5
    seed: int = 0

    def process(self, doc: CurateDoc) -> Decision:
        cfg = FIMConfig(rate=self.rate, spm_rate=self.spm_rate, seed=self.seed)
        res = fim_transform(doc.text, doc.id, cfg)
        doc.text = res.text
        doc.metadata["fim"] = res.mode
        return Decision.ok(fim=res.mode)
