"""Tool use: multi-step word problems solved with a calculator the model calls in tags.

    Ann has 3 bags of 12 apples and gives away 5. How many apples are left?
    <calc>3*12</calc>             (the model calls the tool)
    <result>36</result>           (the environment answers)
    <calc>36-5</calc>
    <result>31</result>
    <answer>31</answer>           (reward 1 if right, and the episode ends)

Each problem needs `steps` operations (2 or 3), so the model must combine the tool's results.
Reward 1 for the right answer, 0 otherwise (a wrong answer ends the episode; so does running out
of `max_calls` turns); a turn in neither tag is told the format. The calculator takes integers,
+ - * and parentheses.
"""

from __future__ import annotations

import ast
import operator
import re
import threading

import numpy as np

from opd_jax.envs.protocol import StepResult, Turn

SPLITS = {"train": 0, "eval": 1}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

# (text with {a} {b} {c} [{d}], the calls that solve it, as expressions of the earlier results r0, r1)
_PROBLEMS = [
    ("{name} has {a} bags of {b} apples and gives away {c}. How many apples are left?", ["{a}*{b}", "r0-{c}"]),
    ("A box holds {a} pens. {name} buys {b} boxes and {c} loose pens. How many pens?", ["{a}*{b}", "r0+{c}"]),
    ("{name} reads {a} pages a day for {b} days, then {c} more pages. How many pages?", ["{a}*{b}", "r0+{c}"]),
    ("{name} had {a} coins and spent {b}; a friend has {c} times as many as are left. How many coins has the "
     "friend?", ["{a}-{b}", "r0*{c}"]),
    ("{name} packs {a} crates of {b} eggs and breaks {c}. How many eggs are whole?", ["{a}*{b}", "r0-{c}"]),
    ("Tickets cost {a} each. {name} buys {b} and a friend buys {c}. What do they pay together?",
     ["{b}+{c}", "r0*{a}"]),
    ("{name} earns {a} an hour for {b} hours and {c} an hour for {d} hours. How much in all?",
     ["{a}*{b}", "{c}*{d}", "r0+r1"]),
    ("A shelf has {a} rows of {b} books; {c} rows of {d} books are taken away. How many books remain?",
     ["{a}*{b}", "{c}*{d}", "r0-r1"]),
]
_PARSE_LOCK = threading.Lock()
_NAMES = ["Ann", "Ben", "Chen", "Dana", "Eli", "Fay", "Gus", "Hana"]


def calculate(expression: str) -> int:
    """An integer expression of + - * and parentheses; ValueError for anything else."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(expression)

    if len(expression) > 64:
        raise ValueError(expression)
    try:
        # The data pipeline builds episodes on several threads, and CPython 3.11's AST constructor
        # keeps its recursion depth in state shared by all of them: two parses at once can raise
        # "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905).
        with _PARSE_LOCK:
            tree = ast.parse(expression.strip(), mode="eval")
        return value(tree.body)
    except SyntaxError:
        raise ValueError(expression) from None


class CalculatorEnv:
    name = "calculator"

    def __init__(self, seed: int, split: str = "train", max_calls: int = 6, max_operand: int = 20):
        rng = np.random.default_rng([seed, SPLITS[split]])
        text, calls = _PROBLEMS[int(rng.integers(len(_PROBLEMS)))]
        a, b, c, d = (int(x) for x in rng.integers(2, max_operand + 1, 4))
        if "{a}-{b}" in calls[0]:  # keep results non-negative
            a, b = max(a, b), min(a, b)
        values = {"a": a, "b": b, "c": c, "d": d, "name": _NAMES[int(rng.integers(len(_NAMES)))]}
        if "r0-{c}" in calls:
            values["c"] = min(c, a * b)
        if "r0-r1" in calls and c * d > a * b:
            values.update(a=c, b=d, c=a, d=b)
        self.problem = text.format(**values)
        self.plan: list[str] = []
        results: list[int] = []
        for call in calls:
            expression = call.format(**values)
            for i, r in enumerate(results):
                expression = expression.replace(f"r{i}", str(r))
            self.plan.append(expression)
            results.append(calculate(expression))
        self.answer = results[-1]
        self.max_calls, self.turns = max_calls, 0

    @staticmethod
    def problem_space(max_operand: int = 20, **_: object) -> int:
        """An upper bound on distinct episodes: template x name x four operands."""
        return len(_PROBLEMS) * len(_NAMES) * (max_operand - 1) ** 4

    def problem_key(self) -> str:
        """The episode's content (held-out splits keep equal ones apart): its problem text."""
        return self.problem

    def reset(self) -> str:
        return self.problem + "\n"

    def step(self, turn: Turn) -> StepResult:
        self.turns += 1
        text = turn.text.strip()
        answer = re.fullmatch(r"<answer>\s*(-?\d+)\s*</answer>", text)
        if answer is not None:
            right = int(answer.group(1)) == self.answer
            return StepResult(reward=float(right), done=True, info={"success": right, "turns": self.turns})
        call = re.fullmatch(r"<calc>(.*)</calc>", text)
        if call is None:
            observation = "<error>use <calc>expression</calc> or <answer>number</answer></error>\n"
        else:
            try:
                observation = f"<result>{calculate(call.group(1))}</result>\n"
            except ValueError:
                observation = "<error>the calculator takes integers, + - * and parentheses</error>\n"
        if self.turns >= self.max_calls:
            return StepResult(done=True, info={"success": False, "turns": self.turns})
        return StepResult(observation=observation)

    def expert(self) -> str:
        """The next call of the plan (with the results so far), then the answer."""
        calls = self.turns
        return f"<calc>{self.plan[calls]}</calc>" if calls < len(self.plan) else f"<answer>{self.answer}</answer>"
