"""EleutherAI lm-evaluation-harness (0.4.x) backend: `--model hybridlm`.

The `LM` subclass below answers the harness's three request types with this package's own
machinery, so its numbers equal `hybridlm eval`'s for the same items:

- `loglikelihood`: `loglik.encode_pair` + the batched, padded `loglik.loglikelihood`;
- `loglikelihood_rolling`: `loglik.rolling_windows` (each token predicted once, conditioned on
  BOS, later windows with full context);
- `generate_until`: the continuous-batching `infer.Engine`, greedy unless the task asks for
  sampling, with the task's `until` stop strings and `max_gen_toks`.

lm-eval finds models only in its own registry, filled by `@register_model` when the defining
module is imported (0.4.x reads no entry points for models), so the command line goes through
this module, which registers the backend and then runs lm-eval's own CLI:

    python -m hybridlm.eval.lm_eval_adapter run --model hybridlm \\
        --model_args path=runs/quickstart/checkpoints/step_00001200 \\
        --tasks hellaswag --limit 100

(`run` is lm-eval's sub-command; every lm-eval flag works). From Python, importing this module
is enough: `lm_eval.simple_evaluate(model="hybridlm", model_args="path=DIR", tasks=[...])`.
Importing it leaves lm-eval's own backends (`hf`, `vllm`, `local-completions`, ...) available.
`model_args`: `path` (training checkpoint, run directory or HF directory) or `preset` (random
init), `dtype`, `tokenizer`, `max_length`, `max_batch_tokens`, `batch_size` (generation
concurrency), `max_gen_toks`, `seed`, `device`.

Offline standard tasks: lm-eval's task YAMLs name Hugging Face hub datasets. The group in
`examples/lm_eval/gsm8k_local.yaml` reruns the built-in `gsm8k` task (its 5-shot prompt, stop
strings, strict / flexible answer filters and exact_match) with only the dataset replaced by the
packaged GSM8K files (`dataset_path: json`, `dataset_kwargs.data_files`); from the repository
root, with nothing downloaded:

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python -m hybridlm.eval.lm_eval_adapter run \\
        --model hybridlm --model_args path=runs/speedrun/rl/model \\
        --include_path examples/lm_eval --tasks gsm8k_local --limit 50

and the same items through lm-eval's `hf` backend on the transformers directory (a run's
`model/`, or `hybridlm export-hf --checkpoint DIR --out hf/`), which gives the same generations
and log-likelihoods to fp32 rounding (tests/test_eval_lm_eval.py; its rolling log-likelihoods
also score a second BOS, EleutherAI/lm-evaluation-harness#3333):

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 lm_eval run \\
        --model hf --model_args pretrained=runs/speedrun/rl/model,dtype=float32 \\
        --include_path examples/lm_eval --tasks gsm8k_local --limit 50

Point `data_files` at other JSONL files, or write the same kind of group for another built-in
task (`- task: arc_easy` with its fields, `hellaswag`, ...), to run it offline on local data.
"""

from __future__ import annotations

import sys
from typing import Any

import lm_eval.models  # noqa: F401  (before `register_model`: see the note below)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ..data.chat import IM_START, STOP, render
from ..infer.sampling import SamplingParams
from .harness import load_model
from .tasks import EvalRunner

# lm-eval fills its model registry with the built-in backends (`hf`, `vllm`, `local-completions`,
# ... as lazy "module:Class" placeholders) by importing `lm_eval.models`, and `get_model` does
# that import only while the registry is empty (`get_model` in lm_eval/api/registry.py, 0.4.13).
# Registering `hybridlm` into an empty registry would hide every built-in backend in this
# process, so the import above comes first; when `lm_eval.models` was imported earlier it is a
# no-op (its `_register_all_models` skips names already registered).


@register_model("hybridlm")
class HybridLMEval(LM):
    """A hybridlm model behind lm-evaluation-harness's `LM` interface."""

    def __init__(
        self,
        path: str | None = None,
        preset: str | None = None,
        *,
        dtype: str = "float32",
        tokenizer: str | None = None,
        max_length: int | None = None,
        max_batch_tokens: int = 16_384,
        batch_size: int | str = 8,
        max_gen_toks: int = 256,
        seed: int = 0,
        device: str | None = None,
        max_batch_size: int | None = None,  # lm-eval passes it; log-likelihood batches by tokens
        runner: EvalRunner | None = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ValueError(
                f"unknown hybridlm model_args {sorted(unknown)}; known: path, preset, dtype, "
                "tokenizer, max_length, max_batch_tokens, batch_size, max_gen_toks, seed, device"
            )
        if runner is None:
            loaded = load_model(
                path, preset=preset, seed=int(seed), dtype=dtype, tokenizer=tokenizer
            )
            bs = 8 if str(batch_size).startswith("auto") else int(batch_size)
            # lm-eval's CLI passes device="cuda" by default: use it when it exists
            if device and (not str(device).startswith("cuda") or torch.cuda.is_available()):
                loaded.model.to(device)
            runner = EvalRunner(
                model=loaded.model,
                tokenizer=loaded.tokenizer,
                max_batch_tokens=int(max_batch_tokens),
                gen_batch_size=bs,
                max_len=int(max_length) if max_length else None,
            )
        self.runner = runner
        self.max_gen_toks = int(max_gen_toks)

    @property
    def max_length(self) -> int:
        return self.runner.max_len or self.runner.model.config.max_seq_len

    @property
    def tokenizer_name(self) -> str:
        return f"hybridlm-{type(self.runner.tokenizer).__name__}"

    def chat_template(self, chat_template: bool | str = False) -> str:
        """A name for the cache fingerprint: the template is `data.chat`'s, in code."""
        return "hybridlm.data.chat" if chat_template else ""

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """`--apply_chat_template`: the project's chat template (`data.chat.render`); the
        generation then stops at its end-of-turn marker."""
        return render(chat_history, add_generation_prompt=add_generation_prompt)

    # ------------------------------------------------------------------ requests
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple]:
        pairs = [tuple(r.args) for r in requests]
        res, _ = self.runner.loglik(pairs)  # type: ignore[arg-type]
        return [(r.logprob, r.is_greedy) for r in res]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list:
        return self.runner.rolling([r.args[0] for r in requests])

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for r in requests:
            context, gen_kwargs = r.args
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            do_sample = bool(kw.pop("do_sample", False))
            temperature = float(kw.pop("temperature", 0.0)) if do_sample else 0.0
            if IM_START in context:  # a chat-template prompt: stop at end of turn
                until.append(STOP)
            params.append(
                SamplingParams(
                    max_tokens=int(kw.pop("max_gen_toks", self.max_gen_toks)),
                    temperature=temperature,
                    top_p=float(kw.pop("top_p", 1.0) or 1.0) if do_sample else 1.0,
                    seed=int(kw.pop("seed", 0)) if do_sample else None,
                    stop=[s for s in until if s],
                )
            )
            prompts.append(context)
        return self.runner.generate(prompts, params)


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the `hybridlm` backend registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
