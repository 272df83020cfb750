"""The static half of the sandbox: what LLM-written code may say, checked on its AST.

Nothing is executed here. :func:`find_violation` walks the syntax tree and returns the
first construct outside the policy, with its line, as text for the LLM. The policy is
an allow-list where that is practical and a deny-list where the allowed libraries are
too large to enumerate:

- names: only the safe builtins of :data:`SAFE_BUILTIN_NAMES` plus what the program
  binds itself are available at run time; introspection and I/O builtins are refused
  here already so the LLM gets a clear message instead of a ``NameError``;
- imports: only modules in the configured roots, and of numpy/torch only the
  submodules in :data:`ALLOWED_SUBMODULES` (no ``torch.utils``, ``numpy.ctypeslib``);
- module attributes are resolved against the real modules at check time: a chain may
  pass only through allowed modules, and a module is never taken as a value
  (``t = torch`` would let ``t.os`` slip past the attribute rules);
- attributes: no leading underscore (so no dunders, no ``torch._C``), no frame/code
  objects (``gi_frame``, ``f_globals``), no file, process, RNG-seed or global-setting
  functions (:data:`FORBIDDEN_ATTRS`);
- statements: no classes, ``global``, ``async``, bare ``except`` or ``finally``, no star
  imports; no assignment to or deletion of attributes of imported modules or of objects
  imported from them (``torch.isfinite = ...``, ``del nn.Linear.forward``); no class built
  by a three-argument call (``type(name, bases, namespace)``); no ``match`` class
  pattern on a forbidden attribute (``case F(__globals__=g)``);
- ``typing``: importable only when allowed, except ``from typing import <name>`` of the
  plain annotation names (:data:`TYPING_ANNOTATIONS`), and those only inside annotations;
- constants: integer literals and constant allocations beyond :data:`MAX_CONST_INT`
  elements, the cheap static guard against ``[0] * 10**10`` in the training process.
"""

from __future__ import annotations

import ast
import importlib
import math
import re
import types
from typing import Iterable

#: Builtins available to programs (``print`` is replaced by a bounded one).
SAFE_BUILTIN_NAMES = (
    "abs", "all", "any", "bool", "callable", "chr", "dict", "divmod", "enumerate", "filter",
    "float", "frozenset", "int", "isinstance", "iter", "len", "list", "map", "max", "min",
    "next", "ord", "pow", "print", "range", "repr", "reversed", "round", "set", "slice",
    "sorted", "str", "sum", "tuple", "zip",
    # exceptions a program may raise or catch
    "ArithmeticError", "AssertionError", "AttributeError", "Exception", "FloatingPointError",
    "IndexError", "KeyError", "LookupError", "NameError", "NotImplementedError",
    "OverflowError", "RuntimeError", "StopIteration", "TypeError", "ValueError",
    "ZeroDivisionError",
)  # fmt: skip

#: Builtins refused by name, with a clear message (they are absent at run time anyway).
FORBIDDEN_NAMES = frozenset(
    {
        "open", "exec", "eval", "compile", "globals", "locals", "vars", "getattr", "setattr",
        "delattr", "hasattr", "breakpoint", "input", "help", "exit", "quit", "dir", "type",
        "object", "super", "memoryview", "id", "classmethod", "staticmethod", "property",
        "BaseException", "SystemExit", "KeyboardInterrupt", "GeneratorExit", "bytearray",
        "issubclass", "format", "BaseExceptionGroup",
    }
)  # fmt: skip

#: Submodules of numpy/torch a program may reach (roots come from ``allowed_imports``).
ALLOWED_SUBMODULES = frozenset(
    {
        "numpy.linalg", "numpy.random", "numpy.fft",
        "torch.nn", "torch.nn.functional", "torch.linalg", "torch.special", "torch.fft",
        "torch.distributions",
    }
)  # fmt: skip

#: Attribute names refused on any object: files, processes, native memory, modules
#: re-exported by torch/numpy, RNG seeding and process-wide settings.
FORBIDDEN_ATTRS = frozenset(
    {
        # files and serialisation
        "load", "loads", "save", "savez", "savez_compressed", "savetxt", "loadtxt",
        "genfromtxt", "fromfile", "tofile", "from_file", "fromregex", "memmap", "dump",
        "dumps", "DataSource", "open",
        # native code, processes, threads, modules reachable through torch/numpy
        "ops", "classes", "os", "sys", "subprocess", "ctypes", "ctypeslib", "multiprocessing",
        "utils", "hub", "jit", "package", "library", "distributed", "backends", "cuda", "mps",
        "xpu", "mtia", "profiler", "compile", "compiler", "export", "onnx", "fx", "testing",
        "f2py", "distutils", "lib", "core", "builtins", "importlib", "inspect", "glob",
        "signal", "platform", "threading", "socket", "shutil", "pathlib", "io", "pickle",
        "marshal", "types", "gc", "weakref", "resource", "posix", "serialization", "storage",
        "untyped_storage", "data_ptr", "share_memory_", "apply_", "map_", "map2_",
        "register_hook", "pin_memory", "system", "popen", "spawn", "fork",
        "import_module", "modules",
        # global state of the host process
        "seed", "manual_seed", "initial_seed", "get_rng_state", "set_rng_state", "fork_rng",
        "seterr", "seterrcall", "setbufsize", "show_config", "info", "source", "lookfor",
        "get_include", "use_deterministic_algorithms",
        # introspection, and exceptions that are not ``Exception`` (they pass ``except Exception``)
        "format", "format_map", "mro", "BaseException", "BaseExceptionGroup", "KeyboardInterrupt",
        "SystemExit", "GeneratorExit", "CancelledError",
    }
)  # fmt: skip

_FRAME_ATTR = re.compile(r"^(gi|cr|ag|f|tb|co|func|im)_")
#: Largest integer literal, and largest constant allocation (product of literal sizes).
MAX_CONST_INT = 10**8


def _attr_problem(name: str) -> str:
    if name.startswith("_"):
        return f"attribute `{name}` (names starting with `_` are not allowed)"
    if name in FORBIDDEN_ATTRS or name.startswith("set_") or name == "set_":
        return f"attribute `{name}`"
    if _FRAME_ATTR.match(name):
        return f"attribute `{name}` (frame and code objects are not allowed)"
    return ""


#: Always importable: ``from __future__ import annotations`` (a compiler directive).
ALWAYS_ALLOWED = frozenset({"__future__"})
#: Names a program may import from ``typing`` without ``typing`` being allowed, for
#: Eureka-style hints (``-> Tuple[torch.Tensor, Dict[str, torch.Tensor]]``); they may
#: appear only in annotations. ``Type``, ``cast``, ``get_type_hints`` and the rest need
#: ``typing`` in ``allowed_imports``.
TYPING_ANNOTATIONS = frozenset(
    {"Any", "Callable", "Dict", "FrozenSet", "Iterable", "Iterator", "List", "Mapping", "Optional",
     "Sequence", "Set", "Tuple", "Union"}
)  # fmt: skip


def module_allowed(module: str, allowed_imports: Iterable[str]) -> bool:
    """Whether ``module`` (dotted) may be imported or reached under ``allowed_imports``."""
    allowed = set(allowed_imports) | ALWAYS_ALLOWED
    root = module.split(".")[0]
    return module in allowed or (root in allowed and module in ALLOWED_SUBMODULES)


def annotation_import(module: str, names: Iterable[str] | None, allowed_imports: Iterable[str]) -> bool:
    """Whether ``from module import names`` is the annotation-only ``typing`` import."""
    return (
        module == "typing"
        and not module_allowed("typing", allowed_imports)
        and bool(names)
        and all(n in TYPING_ANNOTATIONS for n in names or ())
    )


class _Checker(ast.NodeVisitor):
    def __init__(self, allowed_imports: tuple[str, ...]) -> None:
        self.allowed = allowed_imports
        self.aliases: dict[str, str] = {}  # local name -> dotted module it names
        self.imported: set[str] = set()  # local names of objects imported from modules
        self.hints: set[str] = set()  # local names of typing's annotation names
        self._in_annotation = 0
        self.problems: list[tuple[int, str]] = []
        self._chain_parents: set[int] = set()  # ids of Name/Attribute nodes inside a larger chain

    def fail(self, node: ast.AST, what: str) -> None:
        self.problems.append((getattr(node, "lineno", 0), what))

    # -- imports ---------------------------------------------------------------------
    def _bind_module(self, node: ast.AST, local: str, module: str) -> None:
        if not module_allowed(module, self.allowed):
            self.fail(node, f"import of `{module}` (allowed: {', '.join(sorted(self.allowed))})")
        else:
            self.aliases[local] = module

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self._bind_module(node, alias.asname, alias.name)
            else:
                # `import torch.nn` binds `torch` and makes `torch.nn` reachable
                parts = alias.name.split(".")
                for i in range(1, len(parts) + 1):
                    if not module_allowed(".".join(parts[:i]), self.allowed):
                        self.fail(node, f"import of `{'.'.join(parts[:i])}`")
                        break
                else:
                    self.aliases[parts[0]] = parts[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            self.fail(node, "relative import")
            return
        if annotation_import(node.module, [a.name for a in node.names], self.allowed):
            self.hints.update(a.asname or a.name for a in node.names)
            return
        if not module_allowed(node.module, self.allowed):
            self.fail(node, f"import from `{node.module}` (allowed: {', '.join(sorted(self.allowed))})")
            return
        for alias in node.names:
            if alias.name == "*":
                self.fail(node, f"`from {node.module} import *` (import names explicitly)")
                continue
            problem = _attr_problem(alias.name)
            if problem:
                self.fail(node, f"import of {problem} from `{node.module}`")
                continue
            target = f"{node.module}.{alias.name}"
            obj = _resolve(node.module, [alias.name])
            if isinstance(obj, types.ModuleType):
                self._bind_module(
                    node,
                    alias.asname or alias.name,
                    obj.__name__ if module_allowed(obj.__name__, self.allowed) else target,
                )
            elif obj is _MISSING:
                self.fail(node, f"`{target}` does not exist")
            else:
                self.imported.add(alias.asname or alias.name)

    # -- names and attributes ----------------------------------------------------------
    def visit_Name(self, node: ast.Name) -> None:
        if node.id.startswith("__") or node.id in FORBIDDEN_NAMES:
            self.fail(node, f"name `{node.id}`")
        elif node.id in self.hints and not self._in_annotation:
            self.fail(node, f"using `{node.id}` from typing outside a type annotation")
        elif node.id in self.aliases and id(node) not in self._chain_parents:
            if isinstance(node.ctx, ast.Load):
                self.fail(node, f"using module `{node.id}` as a value (only `{node.id}.name` is allowed)")
            else:
                self.fail(node, f"rebinding the imported name `{node.id}`")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        problem = _attr_problem(node.attr)
        if problem:
            self.fail(node, problem)
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            root: ast.AST = node.value
            while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
                root = root.func if isinstance(root, ast.Call) else root.value
            if isinstance(root, ast.Name) and (root.id in self.aliases or root.id in self.imported):
                verb = "deleting" if isinstance(node.ctx, ast.Del) else "assigning to"
                self.fail(
                    node, f"{verb} `{ast.unparse(node)[:60]}` (an attribute of an imported module or its objects)"
                )
        # Resolve `alias.a.b` chains against the real modules.
        if id(node) not in self._chain_parents:
            chain: list[str] = []
            cur: ast.AST = node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                self._chain_parents.add(id(cur.value))
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in self.aliases and not problem:
                self._check_module_chain(node, self.aliases[cur.id], list(reversed(chain)))
        self.generic_visit(node)

    def _check_module_chain(self, node: ast.Attribute, module: str, chain: list[str]) -> None:
        obj: object = importlib.import_module(module)
        path = module
        for i, attr in enumerate(chain):
            path = f"{path}.{attr}"
            if _attr_problem(attr):
                return  # reported on its own node
            obj = getattr(obj, attr, _MISSING)
            if obj is _MISSING:
                self.fail(node, f"`{path}` does not exist")
                return
            if isinstance(obj, types.ModuleType):
                if not module_allowed(obj.__name__, self.allowed):
                    self.fail(node, f"module `{path}`")
                    return
                if i == len(chain) - 1:
                    self.fail(node, f"using module `{path}` as a value")
                    return

    # -- statements -------------------------------------------------------------------
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.fail(node, "class definitions (write plain functions)")

    def _def(self, node: ast.FunctionDef | ast.Lambda) -> None:
        name = getattr(node, "name", "")
        if name.startswith("__") or name in self.aliases:
            self.fail(node, f"function name `{name}`")
        a = node.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
            if arg.arg.startswith("__") or arg.arg in self.aliases:
                self.fail(node, f"argument name `{arg.arg}`")
        for name, value in ast.iter_fields(node):
            if name == "returns" and value is not None:
                self._annotation(value)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):
                        self.visit(item)
            elif isinstance(value, ast.AST):
                self.visit(value)

    visit_FunctionDef = _def
    visit_Lambda = _def

    def _annotation(self, node: ast.AST) -> None:
        self._in_annotation += 1
        try:
            self.visit(node)
        finally:
            self._in_annotation -= 1

    def visit_arg(self, node: ast.arg) -> None:
        if node.annotation is not None:
            self._annotation(node.annotation)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._annotation(node.annotation)
        self.visit(node.target)
        if node.value is not None:
            self.visit(node.value)

    # -- match statements: class patterns read attributes by name ----------------------
    def visit_MatchClass(self, node: ast.MatchClass) -> None:
        for attr in node.kwd_attrs:
            problem = _attr_problem(attr)
            if problem:
                self.fail(node, f"match pattern on {problem}")
        self.generic_visit(node)

    def _capture(self, node: ast.AST, name: str | None) -> None:
        if name and (name.startswith("__") or name in self.aliases):
            self.fail(node, f"name `{name}` in a match pattern")

    def visit_MatchAs(self, node: ast.MatchAs) -> None:
        self._capture(node, node.name)
        self.generic_visit(node)

    def visit_MatchStar(self, node: ast.MatchStar) -> None:
        self._capture(node, node.name)

    def visit_MatchMapping(self, node: ast.MatchMapping) -> None:
        self._capture(node, node.rest)
        self.generic_visit(node)

    def visit_AsyncFunctionDef(self, node: ast.AST) -> None:
        self.fail(node, "`async def`")

    def visit_Await(self, node: ast.AST) -> None:
        self.fail(node, "`await`")

    visit_AsyncFor = visit_AsyncWith = visit_Await

    def visit_Global(self, node: ast.AST) -> None:
        self.fail(node, "`global`/`nonlocal` statements")

    visit_Nonlocal = visit_Global

    def visit_Try(self, node: ast.Try) -> None:
        if node.finalbody:
            self.fail(node, "`finally` blocks")
        for handler in node.handlers:
            if handler.type is None:
                self.fail(handler, "bare `except:` (catch `Exception` or a specific error)")
        self.generic_visit(node)

    visit_TryStar = visit_Try

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name and (node.name.startswith("__") or node.name in self.aliases):
            self.fail(node, f"name `{node.name}`")
        self.generic_visit(node)

    # -- constants ----------------------------------------------------------------------
    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, int) and not isinstance(node.value, bool) and abs(node.value) > MAX_CONST_INT:
            self.fail(node, f"integer constant {node.value} (larger than {MAX_CONST_INT})")

    def visit_BinOp(self, node: ast.BinOp) -> None:
        value = _const_int(node)
        if value is None or abs(value) > MAX_CONST_INT:
            if value is not None or _const_too_big(node):
                self.fail(node, f"constant expression `{ast.unparse(node)}` is too large (limit {MAX_CONST_INT})")
                return
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if _class_building(node):
            self.fail(node, f"building a class with `{ast.unparse(node.func)[:40]}(name, bases, namespace)`")
        sizes = [v for v in (_const_int(a) for a in _flat(node.args)) if v is not None and v > 0]
        if len(sizes) > 1 and math.prod(sizes) > MAX_CONST_INT:
            self.fail(node, f"allocation of {math.prod(sizes):.3g} elements in `{ast.unparse(node)[:60]}`")
        self.generic_visit(node)


def _class_building(node: ast.Call) -> bool:
    """``X("Name", (bases...), {namespace})``: the three-argument ``type`` call, whatever ``X`` is bound to."""
    if len(node.args) != 3:
        return False
    name, bases, namespace = node.args
    is_dict = isinstance(namespace, ast.Dict) or (
        isinstance(namespace, ast.Call) and isinstance(namespace.func, ast.Name) and namespace.func.id == "dict"
    )
    return isinstance(name, ast.Constant) and isinstance(name.value, str) and isinstance(bases, ast.Tuple) and is_dict


class _Missing:
    pass


_MISSING = _Missing()


def _resolve(module: str, chain: list[str]) -> object:
    obj: object = importlib.import_module(module)
    for attr in chain:
        obj = getattr(obj, attr, _MISSING)
        if obj is _MISSING:
            return obj
    if obj is _MISSING and module:
        try:  # `from torch import nn` when torch.nn is not yet an attribute
            return importlib.import_module(f"{module}.{'.'.join(chain)}")
        except ImportError:
            return _MISSING
    return obj


def _flat(nodes: list[ast.expr]) -> list[ast.expr]:
    out: list[ast.expr] = []
    for n in nodes:
        out.extend(_flat(list(n.elts)) if isinstance(n, (ast.Tuple, ast.List)) else [n])
    return out


def _const_too_big(node: ast.BinOp) -> bool:
    """``a ** b`` / ``a << b`` of integer literals that would be huge (not evaluated)."""
    left, right = _const_int(node.left), _const_int(node.right)
    if left is None or right is None:
        return False
    if isinstance(node.op, ast.Pow):
        return right > 0 and abs(left) > 1 and right * math.log10(abs(left)) > math.log10(MAX_CONST_INT)
    if isinstance(node.op, ast.LShift):
        return right > math.log2(MAX_CONST_INT)
    return False


def _const_int(node: ast.AST) -> int | None:
    """The value of an integer literal expression when it is small enough to compute."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _const_int(node.operand)
        return None if v is None else -v
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Pow, ast.LShift)):
        if _const_too_big(node):
            return None
        left, right = _const_int(node.left), _const_int(node.right)
        if left is None or right is None:
            return None
        if isinstance(node.op, ast.Pow) and right < 0:
            return None
        ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.Pow: lambda a, b: a**b, ast.LShift: lambda a, b: a << b}  # fmt: skip
        return ops[type(node.op)](left, right)
    return None


def find_violation(tree: ast.Module, allowed_imports: Iterable[str]) -> str:
    """The first construct of ``tree`` outside the policy as feedback text, or ``""``."""
    checker = _Checker(tuple(allowed_imports))
    # Imports first, so that aliases are known wherever they are used.
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            checker.visit(node)
    import_problems = list(checker.problems)
    checker.problems = []
    checker.generic_visit(tree)  # visits the imports again: keep their problems once
    problems = import_problems + [p for p in checker.problems if p not in import_problems]
    if not problems:
        return ""
    line, what = min(problems)
    more = f" ({len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    return f"line {line}: {what} is not allowed{more}."
