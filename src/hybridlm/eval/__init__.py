"""Evaluation: log-likelihood and generative tasks, pass@k, RULER, the lm-evaluation-harness
adapter (`lm_eval_adapter`), and `hybridlm eval` (`harness`)."""

# every task module adds its tasks to `tasks.TASKS` when imported; importing them here (any
# `hybridlm.eval.*` import runs this first) makes the registry complete before any lookup
from ..report.stats import mean_pass_at_k, pass_at_k
from . import ifeval, speculative  # noqa: F401
from .loglik import LoglikResult, encode_pair, loglikelihood, loglikelihood_rolling
from .tasks import TASKS, EvalRunner, MCItem, MCTask, get_task, resolve_tasks

__all__ = [
    "TASKS",
    "EvalRunner",
    "LoglikResult",
    "MCItem",
    "MCTask",
    "encode_pair",
    "get_task",
    "loglikelihood",
    "loglikelihood_rolling",
    "mean_pass_at_k",
    "pass_at_k",
    "resolve_tasks",
]
