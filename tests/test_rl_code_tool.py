"""Environment (c) of agentic RL: the sandboxed Python tool (status, stdout, stderr's tail,
refusals, isolation from the host) and HumanEval episodes where the model runs its own tests
before its final code is scored on the hidden tests (scripted policy)."""

import json

import pytest

from _tiny import ForcedTokens
from hybridlm import HybridLM
from hybridlm.data import builtin
from hybridlm.data.chat import STOP
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.infer.engine import Engine
from hybridlm.infer.sampling import SamplingParams
from hybridlm.presets import get_preset
from hybridlm.rl.env_config import EnvConfig, build_environment
from hybridlm.rl.environments import CodeToolEnvironment
from hybridlm.rl.episodes import run_episodes
from hybridlm.rl.sandbox import Sandbox, SandboxConfig
from hybridlm.rl.tools import PythonTool

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxConfig(timeout_s=5.0), max_workers=2)


def test_python_tool_runs_code_and_reports_what_happened(sandbox):
    tool = PythonTool(sandbox, max_output_chars=200)
    assert tool({"code": "print(6 * 7)"}) == "status: exit 0\nstdout:\n42\n"
    out = tool({"code": "def f(x):\n    return x + 1\nassert f(1) == 3, 'f is wrong'"})
    assert out.startswith("status: error") and "AssertionError: f is wrong" in out
    long = tool({"code": "print('x' * 1000)\nraise ValueError('at the end')"})
    stdout = long.split("stdout:\n")[1].split("\nstderr:")[0]
    assert len(stdout) == 200 and stdout.endswith("...")
    assert "ValueError: at the end" in long.splitlines()[0]  # the error, on the status line
    noisy = tool({"code": "import sys\nsys.stderr.write('e' * 500 + 'LAST')"})
    assert noisy.endswith("LAST") and "stderr:\n..." in noisy  # stderr keeps its end
    assert tool({"code": "while True: pass"}).startswith("status: timeout")
    host = tool({"code": "print(open('/etc/hostname').read())"})
    assert host.startswith("status: error")  # the host's files are not in the sandbox
    assert tool({"code": ""}).startswith("error: 'code' must be a non-empty")
    assert tool({"code": 1}) == "error: 'code' must be a string"
    assert tool({"program": "1"}).startswith("error: unknown argument 'program'")
    assert PythonTool(max_code_chars=5)({"code": "print(1)"}).startswith("error: the program")


def _script(replies):
    it = iter(replies)
    return lambda: ForcedTokens(TOK.encode(next(it), add_bos=False), 258)


def test_code_episode_tests_then_answers_on_the_hidden_tests(sandbox):
    records = builtin.read_jsonl(builtin.path(builtin.HUMANEVAL), limit=2)
    env = CodeToolEnvironment(records, sandbox=sandbox, max_turns=3)
    p = env[0]
    assert p.messages[0]["role"] == "system" and "python tool" in p.messages[0]["content"]
    solution = records[0]["prompt"] + records[0]["canonical_solution"]
    own_test = solution + "\nassert has_close_elements([1.0, 2.0], 1.5)\nprint('my test ok')\n"
    call = json.dumps({"name": "python", "arguments": {"code": own_test}})
    wrong = records[0]["prompt"] + "    return False\n"
    replies = [
        f"<tool_call>{call}</tool_call>{STOP}",
        f"```python\n{solution}```{STOP}",
        f"```python\n{wrong}```{STOP}",  # the second episode answers at once, wrongly
    ]
    cfg = get_preset("tiny-super")
    cfg.vocab_size, cfg.mtp.pattern, cfg.max_seq_len = 258, "", 4096
    engine = Engine(HybridLM(cfg, seed=0).eval(), TOK)
    params = SamplingParams(max_tokens=1500, constraint=_script(replies))
    (good,) = run_episodes(engine, env, [p], params, max_turns=3)
    (bad,) = run_episodes(engine, env, [p], params, max_turns=3)
    assert (good.turns, good.reward, good.info["tool_calls"]) == (2, 1.0, 1)
    tool_msg = good.messages[-2]
    assert tool_msg["role"] == "tool" and "my test ok" in tool_msg["content"]
    assert (bad.turns, bad.reward) == (1, 0.0)
    # demonstrations run the canonical solution and answer with it; they score 1
    demo = env.demonstrations(2, seed=0)
    assert all(m["role"] != "tool" or m["content"].startswith("status: exit 0") for m in demo[0])


def test_code_tool_environment_from_a_config():
    env = build_environment(EnvConfig(kind="code_tool", max_turns=2))
    assert env.multi_turn and len(env) == 164 and env.max_turns == 2
    assert [t.name for t in env.tools()] == ["python"]
