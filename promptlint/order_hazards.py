"""Python code that builds a prompt's parts in a different order on each run.

A prefix cache hits only on identical bytes. Three common ways application code makes them differ
between two requests that mean the same thing:

- ``random.shuffle(tools)`` / ``random.sample(examples, k)``: a new order every call;
- iterating a set (``for t in set(names)``, ``list({...})``, ``[f(x) for x in some_set]``,
  ``", ".join(some_set)``, ``str(some_set)``, ``f"{some_set}"``): the order
  of ``str`` elements changes between processes (hash randomization), so every worker caches its own;
- ``json.dumps(obj)`` without ``sort_keys=True``: key order follows however ``obj`` was built.

Only ``ast`` is used: nothing is imported or run. Set-valued names are found syntactically (a name
bound to a set display, comprehension or ``set()``/``frozenset()`` call in the same file).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

_SHUFFLERS = {"shuffle", "sample"}
_SET_CALLS = {"set", "frozenset"}
_ORDER_TAKERS = {"list", "tuple", "enumerate", "iter"}  # calls that freeze an iteration order


@dataclass(frozen=True, slots=True)
class OrderHazard:
    line: int
    column: int
    what: str  # the code, as a reader would name it
    why: str  # what varies


def find_order_hazards(tree: ast.Module) -> list[OrderHazard]:
    """Every shuffle, set iteration and unsorted ``json.dumps`` in ``tree``, in source order."""
    set_names = _set_valued_names(tree)
    found: list[OrderHazard] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            found += _call_hazards(node, set_names)
        elif isinstance(node, ast.FormattedValue) and _is_set(node.value, set_names):
            found.append(_at(node.value, f"formatting {_src(node.value)} into a string",
                             "a set's order changes between processes (hash randomization)"))
        elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension) and _is_set(node.iter, set_names):
            found.append(_at(node.iter, f"iterating {_src(node.iter)}",
                             "a set's order changes between processes (hash randomization)"))
    return sorted(set(found), key=lambda h: (h.line, h.column))


def _call_hazards(call: ast.Call, set_names: set[str]) -> list[OrderHazard]:
    name = _dotted(call.func)
    if name[-1:] and name[-1] in _SHUFFLERS and (len(name) == 1 or name[-2] == "random"):
        return [_at(call, f"{'.'.join(name)}(...)", "a new order on every call")]
    is_dumps = name[-2:] == ["json", "dumps"] or name == ["dumps"]
    if is_dumps and not any(k.arg == "sort_keys" and _is_true(k.value) for k in call.keywords):
        return [_at(call, "json.dumps(...) without sort_keys=True", "key order follows how the object was built")]
    if len(name) == 1 and name[0] in _ORDER_TAKERS and call.args and _is_set(call.args[0], set_names):
        return [_at(call, f"{name[0]}({_src(call.args[0])})",
                    "a set's order changes between processes (hash randomization)")]
    # ``", ".join(tags)`` (or ``sep.join(tags)``) and ``str(tags)``: the set's order becomes the text.
    is_join = isinstance(call.func, ast.Attribute) and call.func.attr == "join" and len(call.args) == 1
    if (is_join or name == ["str"]) and call.args and _is_set(call.args[0], set_names):
        what = f"{_src(call.func)}({_src(call.args[0])})"
        return [_at(call, what, "a set's order changes between processes (hash randomization)")]
    return []


def _set_valued_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_set(node.value, set()):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None
              and _is_set(node.value, set())):
            names.add(node.target.id)
    return names


def _is_set(node: ast.AST, set_names: set[str]) -> bool:
    if isinstance(node, ast.Set | ast.SetComp):
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _SET_CALLS:
        return True
    return isinstance(node, ast.Name) and node.id in set_names


def _is_true(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _dotted(node: ast.AST) -> list[str]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def _src(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 40 else text[:37] + "..."


def _at(node: ast.AST, what: str, why: str) -> OrderHazard:
    return OrderHazard(getattr(node, "lineno", 1), getattr(node, "col_offset", 0) + 1, what, why)
