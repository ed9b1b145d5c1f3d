"""Evaluation: log-likelihood and generative tasks, pass@k, RULER, the lm-evaluation-harness
adapter (`lm_eval_adapter`), and `hybridlm eval` (`harness`)."""

from .loglik import LoglikResult, encode_pair, loglikelihood, loglikelihood_rolling
from .passk import mean_pass_at_k, pass_at_k
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
