"""Tools an agent calls during an RL episode: a name, an OpenAI function schema (rendered in the
system prompt by `data.chat.tools_section`, the calls parsed back by `infer.tools`), and a call on
the parsed JSON arguments that returns the text of the tool-role message.

A tool never raises on what the model sends: malformed arguments, expressions it cannot evaluate,
results over its limits all come back as one line starting with "error:", which the model reads
as the tool's answer (as a real tool would reply), so an episode goes on.

`Calculator` evaluates arithmetic exactly on Python integers: + - * / // % ** and parentheses
over integers and decimals (`^` is read as a power, `×` `÷` as * and /). The expression is parsed
with `ast` and only number literals and those operators are evaluated (no names, calls,
attributes or subscripts), so model text cannot run code. Sizes are bounded before computing:
an integer result may have at most `max_digits` digits (a product's or a power's size is
estimated from its operands' bit lengths first, so 9**9**9 is refused at once, not computed),
and the expression at most `max_chars` characters.

`Search` ranks the documents of a local corpus for a query with BM25 (the `bm25s` library;
English stopwords removed) and returns the `k` best, numbered, each cut to `max_doc_chars`.

`PythonTool` runs a program in the hardened sandbox (`rl.sandbox`: private root, no network,
unprivileged, resource limits, a wall-clock deadline) and returns its status, stdout and stderr,
each cut to `max_output_chars` (stderr keeps its end, where a traceback says what failed).
"""

from __future__ import annotations

import ast
import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from ..data.tasks import CALCULATOR_TOOL

__all__ = ["Calculator", "PythonTool", "Search", "Tool", "ToolError"]


class ToolError(ValueError):
    """A call the tool refuses; its message is what the model reads (after "error: ")."""


class Tool(ABC):
    """A callable tool: `name`, `description` and the JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]

    def spec(self) -> dict[str, Any]:
        """The OpenAI `tools` entry of this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def __call__(self, arguments: Any) -> str:
        """The tool message for these arguments (a parsed JSON object); refusals are one
        "error: ..." line."""
        try:
            if not isinstance(arguments, Mapping):
                raise ToolError(f"arguments must be a JSON object, got {type(arguments).__name__}")
            return self.run(arguments)
        except ToolError as err:
            return f"error: {err}"

    @abstractmethod
    def run(self, arguments: Mapping[str, Any]) -> str:
        """The result text; raise `ToolError` to refuse."""

    @staticmethod
    def _only_string(arguments: Mapping[str, Any], name: str) -> str:
        """The tool's one argument `name`, a string; `ToolError` for anything else."""
        extra = sorted(set(arguments) - {name})
        if extra:
            raise ToolError(f"unknown argument {extra[0]!r}; the only argument is {name!r}")
        value = arguments.get(name)
        if not isinstance(value, str):
            raise ToolError(f"{name!r} must be a string")
        return value


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator(Tool):
    """Exact arithmetic on one expression (module docstring). Integer results are printed in
    full; a division that is not exact, or any decimal operand, gives a float printed with up to
    15 significant digits."""

    # the schema lives with the calculator tasks (`data.tasks`), whose SFT chats offer it
    name = CALCULATOR_TOOL["name"]
    description = CALCULATOR_TOOL["description"]
    parameters = CALCULATOR_TOOL["parameters"]

    def __init__(self, *, max_digits: int = 1000, max_chars: int = 256) -> None:
        if not 1 <= max_digits <= 4000:  # Python prints at most 4300 digits of an int
            raise ValueError(f"max_digits must be in [1, 4000], got {max_digits}")
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_digits = max_digits
        self.max_chars = max_chars
        # a bit budget a little above max_digits, for the cheap checks before multiplying
        self._max_bits = math.ceil(max_digits * math.log2(10)) + 1

    def run(self, arguments: Mapping[str, Any]) -> str:
        return self.format(self.evaluate(self._only_string(arguments, "expression")))

    def evaluate(self, expression: str) -> int | float:
        """The value of `expression`; `ToolError` for anything else."""
        text = expression.strip()
        if not text:
            raise ToolError("the expression is empty")
        if len(text) > self.max_chars:
            raise ToolError(f"the expression is longer than {self.max_chars} characters")
        if "," in text:
            raise ToolError("write numbers without thousands separators (12345, not 12,345)")
        text = text.replace("^", "**").replace("×", "*").replace("÷", "/")
        try:
            tree = ast.parse(text, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise ToolError(f"cannot parse {expression.strip()!r} as arithmetic") from None
        try:
            return self._eval(tree.body)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except (OverflowError, RecursionError):
            raise ToolError("the result is too large") from None

    def format(self, value: int | float) -> str:
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ToolError("the result is not a finite number")
            if value.is_integer() and abs(value) < 2**53:
                return str(int(value))
            return f"{value:.15g}"
        return str(value)

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise ToolError(f"only numbers are allowed, not {node.value!r}")
            return self._checked(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(a, b)
            elif isinstance(node.op, ast.Mult) and isinstance(a, int) and isinstance(b, int):
                if a.bit_length() + b.bit_length() > self._max_bits + 1:
                    raise ToolError(f"the result has more than {self.max_digits} digits")
            exact = isinstance(node.op, ast.Div) and isinstance(a, int) and isinstance(b, int)
            if exact and b != 0 and a % b == 0:
                value = a // b  # an exact quotient stays an integer, however large
            else:
                value = _BINARY[type(node.op)](a, b)
            if isinstance(value, complex):  # a negative number to a fractional power
                raise ToolError("the result is not a real number")
            return self._checked(value)
        what = type(node).__name__
        raise ToolError(f"only numbers, + - * / // % ** and parentheses are allowed (got {what})")

    def _check_power(self, base: int | float, exp: int | float) -> None:
        if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
            if (base.bit_length() - 1) * exp > self._max_bits:
                raise ToolError(f"the result has more than {self.max_digits} digits")
        elif abs(exp) > 10_000 and abs(base) not in (0, 1):
            raise ToolError("the exponent is too large")

    def _checked(self, value: int | float) -> int | float:
        if isinstance(value, int) and value.bit_length() > self._max_bits:
            raise ToolError(f"the result has more than {self.max_digits} digits")
        if isinstance(value, int) and len(str(abs(value))) > self.max_digits:
            raise ToolError(f"the result has more than {self.max_digits} digits")
        return value


class Search(Tool):
    """BM25 search over a local corpus (module docstring). The index is built once, at
    construction; calls only query it, so one instance serves every episode."""

    name = "search"
    description = "Search the reference documents; returns the best matching passages."
    parameters = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "what to look for"}},
        "required": ["query"],
        "additionalProperties": False,
    }

    def __init__(
        self,
        corpus: Sequence[str],
        *,
        k: int = 3,
        max_query_chars: int = 512,
        max_doc_chars: int = 400,
    ) -> None:
        try:
            import bm25s
        except ImportError as err:
            raise ImportError(
                f"the search tool needs bm25s: pip install 'hybridlm[rl]' ({err})"
            ) from None
        docs = list(corpus)
        if not docs or not all(isinstance(d, str) and d.strip() for d in docs):
            raise ValueError("the search corpus must be a non-empty list of non-empty strings")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.docs = docs
        self.k = min(k, len(docs))
        self.max_query_chars = max_query_chars
        self.max_doc_chars = max_doc_chars
        self._bm25s = bm25s
        self._index = bm25s.BM25()
        tokens = bm25s.tokenize(docs, stopwords="en", show_progress=False)
        self._index.index(tokens, show_progress=False)

    def run(self, arguments: Mapping[str, Any]) -> str:
        query = self._only_string(arguments, "query")
        if not query.strip():
            raise ToolError("'query' must be a non-empty string")
        if len(query) > self.max_query_chars:
            raise ToolError(f"the query is longer than {self.max_query_chars} characters")
        hits = self.search(query)
        if not hits:
            return "no results"
        lines = []
        for rank, (doc, _) in enumerate(hits, 1):
            text = self.docs[doc]
            if len(text) > self.max_doc_chars:
                text = text[: self.max_doc_chars - 3] + "..."
            lines.append(f"[{rank}] {text}")
        return "\n".join(lines)

    def search(self, query: str) -> list[tuple[int, float]]:
        """(document index, BM25 score) of the best `k` documents with a positive score."""
        q = self._bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not q.ids or not q.ids[0]:  # only stopwords or punctuation
            return []
        docs, scores = self._index.retrieve(q, k=self.k, show_progress=False)
        return [(int(d), float(x)) for d, x in zip(docs[0], scores[0], strict=True) if x > 0]


class PythonTool(Tool):
    """Runs Python in the sandbox (module docstring). The sandbox is built on first use (it
    probes the machine's isolation) and not pickled (each Ray worker builds its own)."""

    name = "python"
    description = (
        "Run a Python program in a sandbox (no network, no files but its own) and get its exit "
        "status, stdout and stderr. Use it to test code before answering."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program to run"}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(
        self,
        sandbox: Any = None,
        *,
        timeout_s: float = 10.0,
        max_code_chars: int = 20_000,
        max_output_chars: int = 2_000,
    ) -> None:
        self._sandbox = sandbox
        self.timeout_s = timeout_s
        self.max_code_chars, self.max_output_chars = max_code_chars, max_output_chars

    @property
    def sandbox(self) -> Any:
        if self._sandbox is None:
            from .sandbox import Sandbox, SandboxConfig

            self._sandbox = Sandbox(SandboxConfig(timeout_s=self.timeout_s))
        return self._sandbox

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_sandbox": None}

    def run(self, arguments: Mapping[str, Any]) -> str:
        code = self._only_string(arguments, "code")
        if not code.strip():
            raise ToolError("'code' must be a non-empty program")
        if len(code) > self.max_code_chars:
            raise ToolError(f"the program is longer than {self.max_code_chars} characters")
        r = self.sandbox.run(code)
        n = self.max_output_chars
        out = r.stdout if len(r.stdout) <= n else r.stdout[: n - 3] + "..."
        err = r.stderr if len(r.stderr) <= n else "..." + r.stderr[-(n - 3) :]
        status = {"ok": "exit 0", "error": "error", "timeout": "timeout", "killed": "killed"}
        lines = [f"status: {status.get(r.status, r.status)}"]
        if r.status != "ok" and r.reason:
            lines[0] += f" ({r.reason})"
        if out:
            lines.append(f"stdout:\n{out}")
        if err:
            lines.append(f"stderr:\n{err}")
        return "\n".join(lines)
