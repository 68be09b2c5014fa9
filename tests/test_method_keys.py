"""Every run-config key a method's code reads is one it declares (its card, the cards of the classes
it inherits from, `fedskew.registry.config_keys`) or a common key (`fedskew.config.COMMON`).

A read of an undeclared key would fail at run time only on the branch that reads it, and the result
hash (`fedskew.reports.resultfile.config_sha256`) keeps only the running method's keys: a key of another
method that this one reads would not be in its hash. Keys are often built (`f"{self.rs_prefix}-tau"`,
`self.key("mu-bar")`), so `git grep` cannot find them; this test reads the source instead. For each
method it parses every fedskew class of its strategy's and its trainer's MRO (resolving `self.<attr>`
against the concrete class), the module-level code of their modules, `fedskew.losses.<module>` and
the functions of its `Wire`, and collects each `...cfg[<key>]` and `...cfg.get(<key>)`. A key it
cannot resolve to a string fails the test too: write it so that it can be read. The other way
round, a key the method declares and none of its code reads is dead, and fails too.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import textwrap
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from fedskew.config import COMMON
from fedskew.methods.card import MethodSpec
from fedskew.registry import METHODS, config_keys

Unresolved = object()  # a key expression this reader cannot evaluate


def _is_cfg(node: ast.expr) -> bool:
    """`cfg`, `self.cfg`, `dims.cfg`, `code_cfg`: the names this code base gives a run config."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name == "cfg" or name.endswith("_cfg")


class _Reader:
    """Evaluates key expressions in one parsed source, `self` being the class `concrete` (or None)."""

    def __init__(self, concrete: type | None) -> None:
        self.concrete = concrete

    def keys(self, tree: ast.AST, where: str) -> Iterator[tuple[str | object, str]]:
        for fn in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.Lambda))]:
            local = _assignments(fn) if isinstance(fn, ast.FunctionDef) else {}
            for node in _own_nodes(fn):
                expr = None
                if isinstance(node, ast.Subscript) and _is_cfg(node.value):
                    expr = node.slice
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get"
                    and _is_cfg(node.func.value)
                    and node.args
                ):
                    expr = node.args[0]
                if expr is not None:
                    yield self.value(expr, local), f"{where}:{node.lineno}"

    def value(self, expr: ast.expr, local: dict[str, ast.expr], depth: int = 0) -> Any:
        if depth > 8:
            return Unresolved
        if isinstance(expr, ast.Constant):
            return expr.value
        if isinstance(expr, ast.JoinedStr):
            values = [v.value if isinstance(v, ast.FormattedValue) else v for v in expr.values]
            parts = [self.value(v, local, depth + 1) for v in values]
            return Unresolved if any(p is Unresolved for p in parts) else "".join(str(p) for p in parts)
        if isinstance(expr, ast.Name) and expr.id in local:
            return self.value(local[expr.id], local, depth + 1)
        if _on_self(expr) and self.concrete is not None:
            found = getattr(self.concrete, expr.attr, Unresolved)
            return found if isinstance(found, str) else Unresolved
        if isinstance(expr, ast.Call) and _on_self(expr.func) and self.concrete is not None and not expr.keywords:
            return self.call(getattr(self.concrete, expr.func.attr, None), expr.args, local, depth)
        return Unresolved

    def call(self, method: Any, args: list[ast.expr], local: dict[str, ast.expr], depth: int) -> Any:
        """A helper `def key(self, name): return f"{self.prefix}-{name}"` called with resolvable args."""
        if not inspect.isfunction(method):
            return Unresolved
        fn = ast.parse(textwrap.dedent(inspect.getsource(method))).body[0]
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        params = [a.arg for a in fn.args.args][1:]
        if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None or len(args) != len(params):
            return Unresolved
        bound = {p: ast.Constant(self.value(a, local, depth + 1)) for p, a in zip(params, args, strict=True)}
        return self.value(body[0].value, bound, depth + 1)


def _on_self(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id in ("self", "cls")


def _own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """The nodes of `fn`'s body, not those of the functions nested in it (each read once, in its scope)."""
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.Lambda | ast.ClassDef):
            todo.extend(ast.iter_child_nodes(node))


def _assignments(fn: ast.FunctionDef) -> dict[str, ast.expr]:
    """`name = value` and `a, b = x, y` in `fn`'s own body (a name assigned twice: unresolvable)."""
    out: dict[str, ast.expr] = {}
    for node in _own_nodes(fn):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = [(target, value)]
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
                pairs = list(zip(target.elts, value.elts, strict=True))
            for t, v in pairs:
                if isinstance(t, ast.Name):
                    out[t.id] = ast.Name("__twice__") if t.id in out else v
    return out


def _module_level(module: ModuleType) -> ast.Module:
    """`module`'s source without its classes (those are read against a concrete class)."""
    tree = ast.parse(inspect.getsource(module))
    tree.body = [n for n in tree.body if not isinstance(n, ast.ClassDef)]
    return tree


def _functions(obj: Any, seen: set[int]) -> Iterator[Callable[..., Any]]:
    """The fedskew functions a `Wire`'s records are computed by, closures followed."""
    if id(obj) in seen or not callable(obj):
        return
    seen.add(id(obj))
    if inspect.isfunction(obj) and obj.__module__.startswith("fedskew"):
        yield obj
        for cell in obj.__closure__ or ():
            yield from _functions(cell.cell_contents, seen)


def _parsed(fn: Callable[..., Any]) -> ast.Module:
    """`fn`'s source; a lambda's line as the lambda alone (`uplink=lambda dims: ...,`)."""
    source = textwrap.dedent(inspect.getsource(fn)).strip()
    for text in (source, source.rstrip(",").partition("=")[2]):
        try:
            return ast.parse(text)
        except SyntaxError:
            continue
    raise AssertionError(f"cannot parse the source of {fn.__qualname__}: {source!r}")


def reads(spec: MethodSpec) -> list[tuple[str | object, str]]:
    """(key, where) for each run-config read of the method's code."""
    out: list[tuple[str | object, str]] = []
    modules: dict[str, ModuleType] = {}
    for concrete in (spec.strategy_class(), spec.trainer_class()):
        reader = _Reader(concrete)
        for cls in concrete.__mro__:
            if cls.__module__.startswith("fedskew."):
                modules[cls.__module__] = module = importlib.import_module(cls.__module__)
                tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
                out += reader.keys(tree, f"{module.__name__}.{cls.__qualname__}")
    for name in list(modules):
        losses = f"fedskew.losses.{name.rpartition('.')[2]}"
        if importlib.util.find_spec(losses) is not None:
            modules[losses] = importlib.import_module(losses)
    plain = _Reader(None)
    for name, module in sorted(modules.items()):
        out += plain.keys(_module_level(module), name)
    wire, seen = spec.wire, set[int]()
    for fn in [f for records in (wire.uplink, wire.downlink) for f in _functions(records, seen)]:
        out += plain.keys(_parsed(fn), f"{fn.__module__}.{fn.__qualname__}")
    return out


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_key_a_method_reads_is_declared(name: str) -> None:
    spec = METHODS[name]
    declared = set(COMMON) | config_keys(spec)
    found = reads(spec)
    unresolved = sorted(where for key, where in found if not isinstance(key, str))
    assert not unresolved, f"{name}: run-config keys this test cannot resolve at {unresolved}"
    undeclared = sorted({f"{key} ({where})" for key, where in found if key not in declared})
    assert not undeclared, f"{name} reads keys it does not declare: {undeclared}"
    unread = sorted(set(spec.params) - {key for key, _ in found})
    assert not unread, f"{name} declares keys its code never reads: {unread}"


def test_the_reader_sees_built_keys() -> None:
    """The reader finds literal, f-string and helper-built keys, so an undeclared one fails above."""

    class Probe:
        prefix = "fedrs"

        def key(self, name: str) -> str:
            return f"{self.prefix}-{name}"

        def read(self) -> None:
            p = self.prefix
            self.cfg["lr"], self.cfg[f"{p}-alpha"], self.cfg[self.key("tau")], self.cfg.get("fedrs-made-up")

    tree = ast.parse(textwrap.dedent(inspect.getsource(Probe)))
    keys = [k for k, _ in _Reader(Probe).keys(tree, "probe")]
    assert sorted(keys) == ["fedrs-alpha", "fedrs-made-up", "fedrs-tau", "lr"]
    assert "fedrs-made-up" not in set(COMMON) | config_keys(METHODS["fedrs"])


def test_a_class_several_methods_use_as_is_reads_none_of_their_keys() -> None:
    """FedAvgM and FedAwS run FedAvg's trainer as is, FedLC its strategy: their keys are not FedAvg's,
    so registering such a method leaves FedAvg's config hash, and its recorded seeds, alone. MAP's
    trainer subclasses FedRS's, so the fedrs- keys are MAP's."""
    assert config_keys(METHODS["fedavg"]) == set()
    assert config_keys(METHODS["fedavgm"]) == set(METHODS["fedavgm"].params)
    assert set(METHODS["fedrs"].params) <= config_keys(METHODS["map"])
    assert set(METHODS["scaffold"].params) <= config_keys(METHODS["feddc"])
