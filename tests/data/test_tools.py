"""Tools as code: definitions from signatures and docstrings, the calculator's exact
arithmetic and refusals, and the runner containing tools that raise, hang, flood, exit
or return junk."""

from __future__ import annotations

import time

import pytest

from lathe.core.errors import ConfigError
from lathe.data.calculator import calculator
from lathe.data.tool_runner import ToolRunner
from lathe.data.tools import load_tool, load_tools

HERE = "tests.data.tools_for_tests"


def test_definition_from_signature_and_docstring():
    tool = load_tool(f"{HERE}:weather")
    assert tool.name == "weather"
    function = tool.definition["function"]
    assert function["description"] == "Today's temperature in a city."
    assert function["parameters"] == {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {
            "city": {"type": "string", "description": "the city's name, e.g. \"Paris\""},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius",
                     "description": "the temperature scale of the answer"}}}


def test_registered_and_refused_names():
    assert load_tool("calculator").definition["function"]["name"] == "calculator"
    for name, fragment in [("nope", "not one of"), ("os.path:nothing", "cannot be imported"),
                           ("lathe.data.tools:TOOLS", "not callable")]:
        with pytest.raises(ConfigError, match=fragment):
            load_tool(name)
    with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
        load_tools(["calculator", "lathe.data.calculator:calculator"])


@pytest.mark.parametrize("expression, value", [
    ("382 + 247", "629"), ("604 - 87", "517"), ("0.1 + 0.2", "0.3"), ("1 / 3 * 3", "1"),
    ("(1.5 - 0.25) * 4", "5"), ("2 ** -2", "0.25"), ("7 // 2", "3"), ("-7 % 3", "2"),
    ("1e3 + 1", "1001"), ("0.000001 / 8", "0.000000125"), ("2 ** 100", str(2 ** 100)),
    ("1 / 3", "0." + "3" * 30), ("-(4 - 10)", "6")])
def test_calculator_is_exact(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, fragment", [
    ("__import__('os').system('true')", "not call"), ("x + 1", "not name"),
    ("'a' * 3", "not constant"), ("1 / 0", "division by zero"), ("9 ** 99999", "exponents"),
    ("10 ** 1000", "more than 1000 digits"), ("99 ** 999", "more than 1000 digits"),
    ("1 +", "not an arithmetic expression"), ("(" * 150 + "1" + ")" * 150, "at most 200"),
    ("[1, 2]", "not list"), ("1j", "not constant"), ("2 ** 0.5", "whole numbers")])
def test_calculator_refuses(expression, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace("*", r"\*")):
        calculator(expression)


@pytest.fixture(scope="module")
def runner():
    names = ["calculator"] + [f"{HERE}:{n}" for n in (
        "weather", "shout", "fails", "hangs", "floods", "writes_to_fd", "huge", "junk", "exits",
        "counter", "writes_to_every_fd", "starts_a_sleeper")]
    with ToolRunner(load_tools(names), seconds=1.0) as runner:
        yield runner


def test_runner_answers(runner):
    assert runner.run("calculator", {"expression": "382 + 247"}).content == "629"
    result = runner.run("weather", '{"city": "Paris", "unit": "fahrenheit"}')
    assert not result.error
    assert result.content == '{"city": "Paris", "temperature": 70, "unit": "fahrenheit"}'
    assert runner.run("shout", {"text": "hi"}).content == "HI\n"  # printed, returned None
    assert [r.content for r in runner.run_many(
        [("counter", {"start": i}) for i in range(20)])] == [str(i + 1) for i in range(20)]
    assert [d["function"]["name"] for d in runner.definitions()][:2] == ["calculator", "weather"]


@pytest.mark.parametrize("name, arguments, fragment", [
    ("fails", {"x": 3}, "fails raised RuntimeError: no luck with 3"),
    ("fails", {"x": "abc"}, "bad arguments for fails: x: Input should be a valid integer"),
    ("fails", {}, "bad arguments for fails: x: Missing required argument"),
    ("floods", {}, "printed 10,485,760 characters, more than the limit of 4,096"),
    ("huge", {}, "returned 10,485,760 characters"),
    ("junk", {}, "returned a object, which is neither text nor JSON"),
    ("exits", {}, "exited (code 3) without answering"),
    ("nope", {}, "there is no tool 'nope'"),
    ("calculator", "{bad", "are not JSON"),
    ("calculator", "[1]", "must be a JSON object"),
    ("calculator", {"expression": "open('/etc/passwd')"}, "not call")])
def test_runner_contains_failures(runner, name, arguments, fragment):
    result = runner.run(name, arguments)
    assert result.error and result.content.startswith("error: ")
    assert fragment in result.content
    assert runner.run("counter", {"start": 1}).content == "2"  # and the runner goes on


def test_runner_stops_a_hanging_tool_in_time(runner):
    started = time.monotonic()
    result = runner.run("hangs", {})
    assert result.error and "did not finish within 1 s" in result.content
    assert time.monotonic() - started < 3
    assert runner.run("counter", {"start": 5}).content == "6"


def test_a_tool_cannot_forge_answers_on_the_pipe(runner):
    assert runner.run("writes_to_fd", {}).content == "honest"


def test_a_tool_cannot_reach_the_workers_pipes_to_answer_other_calls(runner):
    for start in range(4):  # a forged line left on a pipe would be the next call's answer
        assert runner.run("writes_to_every_fd", {}).content == "honest"
        assert runner.run("counter", {"start": start}).content == str(start + 1)


def gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_processes_a_tool_starts_die_with_its_call(runner):
    pids = [int(runner.run("starts_a_sleeper", {}).content) for _ in range(2)]
    deadline = time.monotonic() + 1
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() < deadline, "a tool's child outlived its call"
        time.sleep(0.02)
    assert runner.run("counter", {"start": 1}).content == "2"
