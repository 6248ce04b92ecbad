"""Static analysis of Python sources read from an sdist: which modules an entry script
imports when it runs, and which calls run at import time (outside any function body).

DeepSpeed's install-time behaviour is decided by code that runs at import, so these two
questions are enough to derive it without executing anything."""

from __future__ import annotations

import ast
from typing import Iterator, Optional


def module_files(files: dict[str, bytes]) -> dict[str, str]:
    """Dotted module name -> path, for every .py file (`a/b/__init__.py` is `a.b`)."""
    out = {}
    for path in files:
        if not path.endswith(".py"):
            continue
        parts = path[:-3].split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and all(p.isidentifier() for p in parts):
            out[".".join(parts)] = path
    return out


def parse(files: dict[str, bytes], path: str) -> Optional[ast.Module]:
    try:
        return ast.parse(files[path], filename=path)
    except (SyntaxError, ValueError):
        return None


def import_time_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node that runs when the module is imported: module and class bodies, the
    branches of top-level if/try/with/for, but nothing inside a function or lambda."""
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            # decorators and default values do run at import
            stack.extend(getattr(node, "decorator_list", []))
            args = node.args
            stack.extend([*args.defaults, *(d for d in args.kw_defaults if d is not None)])
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _package_of(module: str, path: str) -> str:
    return module if path.endswith("__init__.py") else module.rpartition(".")[0]


def imported_modules(tree: ast.Module, module: str, path: str, known: dict[str, str]) -> set[str]:
    """The sdist modules an import of `module` executes directly (parents included)."""
    found: set[str] = set()

    def add(name: str) -> None:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in known:
                found.add(prefix)

    for node in import_time_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module, path)
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = ".".join(p for p in (base, node.module or "") if p)
            else:
                target = node.module or ""
            add(target)
            for alias in node.names:
                add(f"{target}.{alias.name}")
    found.discard(module)
    return found


def import_closure(files: dict[str, bytes], entry: str) -> dict[str, list[str]]:
    """Every sdist module that running `entry` (a path such as setup.py, run from the sdist
    root) imports, mapped to the import chain that reaches it."""
    known = module_files(files)
    tree = parse(files, entry)
    if tree is None:
        return {}
    chains: dict[str, list[str]] = {}
    queue = [(m, [entry]) for m in sorted(imported_modules(tree, "__main__", entry, known))]
    while queue:
        module, chain = queue.pop(0)
        if module in chains:
            continue
        chains[module] = chain + [known[module]]
        sub = parse(files, known[module])
        if sub is not None:
            for child in sorted(imported_modules(sub, module, known[module], known)):
                if child not in chains:
                    queue.append((child, chains[module]))
    return chains


def call_name(call: ast.Call) -> str:
    """`torch.cuda.get_device_capability()` -> 'get_device_capability'."""
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def accelerator_method(call: ast.Call) -> Optional[str]:
    """`get_accelerator().M(...)` -> 'M'."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call) \
            and call_name(func.value) == "get_accelerator":
        return func.attr
    return None


def function_calls_unguarded(body: list[ast.stmt], hazards: set[str], guard: str) -> bool:
    """Whether running `body` reaches a call named in `hazards` before an early return
    guarded by a call to `guard` (`if not self.is_available(): return False`)."""
    for stmt in body:
        if isinstance(stmt, ast.If) and any(isinstance(n, ast.Call) and call_name(n) == guard
                                            for n in ast.walk(stmt.test)) \
                and any(isinstance(n, ast.Return) for n in stmt.body):
            return False
        if any(isinstance(n, ast.Call) and call_name(n) in hazards for n in ast.walk(stmt)):
            return True
    return False


def _truth(node: ast.expr, names: dict[str, bool], device: str) -> Optional[bool]:
    """Three-valued evaluation of an `if` test under assumed names and accelerator:
    True, False, or None (unknown: both branches may run)."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Constant):
        return bool(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = _truth(node.operand, names, device)
        return None if inner is None else not inner
    if isinstance(node, ast.BoolOp):
        values = [_truth(v, names, device) for v in node.values]
        if isinstance(node.op, ast.And):
            return False if False in values else None if None in values else True
        return True if True in values else None if None in values else False
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
        left, right = node.left, node.comparators[0]
        if isinstance(left, ast.Call) and accelerator_method(left) == "device_name" \
                and isinstance(right, ast.Constant):
            equal = right.value == device
            return equal if isinstance(node.ops[0], ast.Eq) else not equal
    return None


def reachable_module_calls(tree: ast.Module, names: dict[str, bool], device: str,
                           caught: set[str]) -> Iterator[ast.Call]:
    """Calls a script makes at module level on a path its `if` tests allow (given `names`
    and the accelerator `device`), leaving out calls inside a `try` whose handler catches
    one of `caught` (or a bare/`Exception` handler)."""

    def walk(statements: list[ast.stmt]) -> Iterator[ast.Call]:
        for stmt in statements:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(stmt, ast.If):
                yield from calls(stmt.test)
                truth = _truth(stmt.test, names, device)
                if truth is not False:
                    yield from walk(stmt.body)
                if truth is not True:
                    yield from walk(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                handled = {ast.unparse(h.type).rpartition(".")[2] if h.type else "Exception" for h in stmt.handlers}
                if not handled & (caught | {"Exception", "BaseException"}):
                    yield from walk(stmt.body)
                for handler in stmt.handlers:
                    yield from walk(handler.body)
                yield from walk(stmt.orelse + stmt.finalbody)
            elif isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
                yield from calls(stmt.test if isinstance(stmt, ast.While) else stmt.iter)
                yield from walk(stmt.body + stmt.orelse)
            elif isinstance(stmt, (ast.With, ast.AsyncWith)):
                for item in stmt.items:
                    yield from calls(item.context_expr)
                yield from walk(stmt.body)
            else:
                yield from calls(stmt)

    def calls(node: ast.AST) -> Iterator[ast.Call]:
        return (n for n in import_time_nodes(ast.Module(body=[ast.Expr(node)] if isinstance(node, ast.expr)
                                                        else [node], type_ignores=[]))
                if isinstance(n, ast.Call))

    yield from walk(tree.body)
