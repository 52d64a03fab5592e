"""The environment interface's loading and the built-in calculator task's pieces: a config names an
async function or is refused with the reason; the calculator evaluates arithmetic only, within
bounds; the tool latency follows its median and p99."""

from __future__ import annotations

import random
import statistics

import pytest

from specroll.envs.base import EnvironmentLoadError, import_environment
from specroll.envs.calculator import Latency, calculate


@pytest.mark.parametrize(("spec", "message"), [
    ("os:system", "not an async function"), ("builtins:print", "not an async function"),
    ("json:nothing", "has no function 'nothing'"), ("no_such_module_x:f", "does not import"),
    ("calculator_without_colon", "expected 'package.module:function'"),
])
def test_an_environment_that_is_not_an_async_function_is_refused(spec: str, message: str) -> None:
    with pytest.raises(EnvironmentLoadError, match=message):
        import_environment(spec)


def test_an_async_function_and_an_object_with_an_async_call_load(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_envs.py").write_text(
        "class Env:\n    async def __call__(self, client, prompt):\n        return 1.0\n"
        "async def env(client, prompt):\n    return 1.0\nenv_object = Env()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_environment("my_envs:env").__name__ == "env"
    assert type(import_environment("my_envs:env_object")).__name__ == "Env"


@pytest.mark.parametrize(("expression", "result"), [
    ("37 * 48", "1776"), ("(2 + 3) * 4", "20"), ("7 / 2", "3.5"), ("-3 * 3", "-9"), ("12 x 3", "36"),
    ("__import__('os')", "error: only numbers"), ("2 ** 100", "error: only numbers"), ("1 / 0", "error: division"),
    ("9" * 300, "error: expression longer"), ("99999999 * 99999999", "error: a value beyond"),
])
def test_the_calculator_evaluates_arithmetic_only(expression: str, result: str) -> None:
    assert calculate(expression).startswith(result)


def test_tool_latency_has_its_median_and_p99() -> None:
    rng = random.Random(0)
    draws = sorted(Latency(1.0, 10.0).sample(rng) for _ in range(20000))
    assert statistics.median(draws) == pytest.approx(1.0, rel=0.05)
    assert draws[int(0.99 * len(draws))] == pytest.approx(10.0, rel=0.15)
    assert Latency().sample(rng) == 0.0 and Latency(2.0, 2.0).sample(rng) == 2.0
    with pytest.raises(ValueError, match="median"):
        Latency(2.0, 1.0)
