"""Reinforcement learning with verifiable rewards: a code sandbox, verifiers, environments shared
with evaluation, and the GRPO objective (OlmoRL / Nemotron 3 Super RL).

The names below are imported on first use (PEP 562), so a process that only verifies (an
environment server's scoring worker, `rl.scoring`) never imports torch with the GRPO objective.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "environments": (
        "ArithmeticEnvironment", "CodeEnvironment", "DatasetEnvironment", "Environment",
        "GSM8KEnvironment", "InstructionFollowingEnvironment", "LowEffortEnvironment",
        "MathEnvironment", "MixtureEnvironment", "Problem", "filter_by_pass_rate",
        "reward_metrics",
    ),
    "grpo": (
        "ActiveSampler", "Group", "GRPOConfig", "group_advantages", "grpo_loss",
        "nonzero_variance_groups",
    ),
    "sandbox": (
        "FunctionTest", "Sandbox", "SandboxConfig", "SandboxResult", "SandboxUnavailable",
        "StdioTest",
    ),
    "verifiers": (
        "INSTRUCTIONS", "CodeVerifier", "GSM8KVerifier", "InstructionVerifier", "MathVerifier",
        "Reward",
    ),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ActiveSampler",
    "ArithmeticEnvironment",
    "CodeEnvironment",
    "CodeVerifier",
    "DatasetEnvironment",
    "Environment",
    "GRPOConfig",
    "GSM8KEnvironment",
    "GSM8KVerifier",
    "Group",
    "INSTRUCTIONS",
    "InstructionFollowingEnvironment",
    "InstructionVerifier",
    "LowEffortEnvironment",
    "MathEnvironment",
    "MathVerifier",
    "MixtureEnvironment",
    "Problem",
    "Reward",
    "FunctionTest",
    "Sandbox",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailable",
    "StdioTest",
    "filter_by_pass_rate",
    "group_advantages",
    "grpo_loss",
    "nonzero_variance_groups",
    "reward_metrics",
]
