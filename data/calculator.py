"""The calculator tool: exact arithmetic on integers and decimals, without `eval`.

The expression is parsed by Python's own parser (`ast`, mode "eval": one expression, no
statements) and walked over a closed set of nodes — numbers, `+ - * / // % **`, unary
signs and parentheses; a name, call, attribute, string or anything else is refused by
name. Values are exact fractions (`fractions.Fraction`), so `0.1 + 0.2` is `0.3` and
`1 / 3 * 3` is `1`; a result that is not a finite decimal is rounded to 30 significant
digits. What could make it slow is bounded: the expression's length, exponents, and the
digits of any intermediate value.
"""

from __future__ import annotations

import ast
import decimal
import operator
from fractions import Fraction

MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 1000  # of any value's numerator or denominator
MAX_EXPONENT = 1000
SIGNIFICANT_DIGITS = 30

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_LIMIT = 10 ** MAX_DIGITS


def calculator(expression: str) -> str:
    """Exact arithmetic.

    Args:
        expression: e.g. "2 * (3 - 0.5)"
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression has {len(expression)} characters; the calculator "
                         f"takes at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _format(_value(tree.body, expression))


def _value(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        text = ast.get_source_segment(source.strip(), node) or repr(node.value)
        value = Fraction(node.value) if isinstance(node.value, int) else Fraction(
            decimal.Decimal(text.replace("_", "")))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, source), _value(node.right, source)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponents must be whole numbers of at most {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise ValueError("division by zero")
            size = max(abs(left.numerator), left.denominator)
            if size > 1 and (len(str(size)) - 1) * abs(right) > MAX_DIGITS:
                raise ValueError(f"the result would have more than {MAX_DIGITS} digits")
            right = int(right)
        value = _BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_value(node.operand, source))
    else:
        raise ValueError(f"the calculator takes numbers, + - * / // % ** and parentheses; "
                         f"not {type(node).__name__.lower()} "
                         f"{ast.get_source_segment(source.strip(), node)!r}")
    if abs(value.numerator) >= _LIMIT or value.denominator >= _LIMIT:
        raise ValueError(f"a value has more than {MAX_DIGITS} digits")
    return Fraction(value)


def _format(value: Fraction) -> str:
    """An integer as itself; otherwise the exact decimal when there is one, else the
    decimal rounded to SIGNIFICANT_DIGITS."""
    if value.denominator == 1:
        return str(value.numerator)
    denominator, twos, fives = value.denominator, 0, 0
    while denominator % 2 == 0:
        denominator, twos = denominator // 2, twos + 1
    while denominator % 5 == 0:
        denominator, fives = denominator // 5, fives + 1
    places = max(twos, fives) if denominator == 1 else None
    context = decimal.Context(prec=MAX_DIGITS * 2 + 10 if places is not None
                              else SIGNIFICANT_DIGITS)
    quotient = context.divide(decimal.Decimal(value.numerator),
                              decimal.Decimal(value.denominator))
    if places is not None:
        quotient = quotient.quantize(decimal.Decimal(1).scaleb(-places), context=context)
    return format(quotient.normalize(context), "f")
