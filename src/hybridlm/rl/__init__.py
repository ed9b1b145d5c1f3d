"""Reinforcement learning with verifiable rewards: a code sandbox, verifiers, environments shared
with evaluation, and the GRPO objective (OlmoRL / Nemotron 3 Super RL)."""

from hybridlm.rl.environments import (
    ArithmeticEnvironment,
    CodeEnvironment,
    DatasetEnvironment,
    Environment,
    GSM8KEnvironment,
    InstructionFollowingEnvironment,
    LowEffortEnvironment,
    MathEnvironment,
    MixtureEnvironment,
    Problem,
    filter_by_pass_rate,
    reward_metrics,
)
from hybridlm.rl.grpo import (
    ActiveSampler,
    Group,
    GRPOConfig,
    group_advantages,
    grpo_loss,
    nonzero_variance_groups,
)
from hybridlm.rl.sandbox import (
    FunctionTest,
    Sandbox,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailable,
    StdioTest,
)
from hybridlm.rl.verifiers import (
    INSTRUCTIONS,
    CodeVerifier,
    GSM8KVerifier,
    InstructionVerifier,
    MathVerifier,
    Reward,
)

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
