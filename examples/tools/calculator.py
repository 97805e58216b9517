"""Tools and an environment written as TRL's documentation writes them (GRPOTrainer(tools=...,
environment_factory=...)): `hetrl train ... tools=examples/tools/calculator.py:multiply,add` or
`environment=examples/tools/calculator.py:CalculatorEnv`."""


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def add(a: float, b: float) -> float:
    """
    Adds two numbers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The sum of the two numbers.
    """
    return a + b


class CalculatorEnv:
    """One instance per rollout: counts the calls it answers and rewards an episode that used the calculator."""

    def reset(self, **kwargs) -> str | None:
        self.calls = 0
        return None

    def multiply(self, a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        self.calls += 1
        return a * b

    def get_reward(self) -> float:
        return float(self.calls > 0)
