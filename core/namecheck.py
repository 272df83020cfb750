"""The names an LLM program reads, checked against the task before anything runs.

A program reads the task's fields as attributes (``next_state.pole_angle``) or keys
(``state["pole_angle"]``) of its state arguments. :func:`check_names` finds every such
read and every free name the program uses (a name that nothing in the program binds and
that is not a builtin the sandbox offers), so that a made-up field (``state.x``) or a
variable never assigned (``closeness``) is refused with the valid fields and a "did you
mean", instead of failing at run time in a worker.

Cheap deterministic fixes are applied first, each recorded as a note:

- a field name with exactly one close match among the task's fields is renamed to it
  (``pole_angle_velocity`` -> ``pole_angular_velocity``);
- a ``torch`` function that needs a tensor but is given a Python number
  (``torch.exp(0.5)``, ``torch.maximum(x, 0.0)``, or a name only ever assigned a number)
  gets the number wrapped in ``torch.tensor(...)``;
- a module the prompts offer used under its usual name but never imported (``math.pi``
  with no ``import math``; ``np`` for numpy) gets its import at the top; the sandbox still
  refuses a module its config does not allow;
- an entry that never returns a value (a reply cut off and continued often loses the
  last line) returns the last value it assigned to a name that says what the entry
  computes (``compute_reward``: ``total_reward``): :func:`add_missing_return`.

``state.device`` is not a field read: a state answers it with its tensors' device.

Nothing here executes code; the scope analysis is deliberately simple (a name bound
anywhere in the program counts as bound everywhere), so it refuses no valid program.
"""

from __future__ import annotations

import ast
import builtins
import difflib
from dataclasses import dataclass, field

#: the argument names that hold a task state in the programs the core asks for
STATE_ARGS = ("state", "next_state")
#: a state is a dict: these attribute reads are its methods, not fields
DICT_METHODS = frozenset({"get", "keys", "values", "items"})
#: attribute reads a state answers that are not fields (``torch.zeros(n, device=state.device)``)
STATE_ATTRIBUTES = DICT_METHODS | {"device"}
#: torch functions of one tensor that refuse a Python number as it
UNARY = frozenset(
    {
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "sin",
        "cos",
        "tan",
        "tanh",
        "sinh",
        "cosh",
        "sigmoid",
        "abs",
        "atan",
        "asin",
        "acos",
        "log1p",
        "expm1",
        "sign",
        "square",
        "floor",
        "ceil",
        "round",
        "erf",
        "exp2",
        "log2",
        "log10",
        "relu",
        "neg",
        "isnan",
        "isfinite",
        "isinf",
        "deg2rad",
        "rad2deg",
    }
)
#: torch functions of two tensors that refuse a Python number as either
BINARY = frozenset({"maximum", "minimum", "fmax", "fmin", "atan2", "hypot", "logaddexp"})
#: the import a usual module name asks for, when a program uses the name and never binds it
USUAL_IMPORTS = {"math": "import math", "np": "import numpy as np", "numpy": "import numpy", "torch": "import torch"}
#: how close a misspelt field must be to one field to be renamed to it (difflib's ratio)
CLOSE = 0.8


@dataclass
class NameCheck:
    """The outcome: ``source`` (with the fixes applied), ``fixes`` (one note each), ``errors``."""

    source: str
    fixes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def message(self, fields: list[str]) -> str:
        """The refusal as feedback text: every problem, then the fields the state has."""
        return (
            "The code reads names that do not exist:\n"
            + "\n".join(f"- {e}" for e in self.errors)
            + f"\nThe state has exactly these fields: {', '.join(fields)}."
        )


def check_names(
    source: str,
    fields: list[str],
    *,
    state_args: tuple[str, ...] = STATE_ARGS,
    available: tuple[str, ...] | None = None,
    fix: bool = True,
) -> NameCheck:
    """Check (and, with ``fix``, mend) the field reads and free names of ``source``.

    :param fields: the names the task's states have (:meth:`core.envs.task.Task.field_names`).
    :param state_args: the argument names that hold states (``state``, ``next_state``).
    :param available: the builtins the program may use (default: Python's own).
    :return: a :class:`NameCheck`; code that does not parse passes unchanged (the syntax
        check reports it).
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return NameCheck(source)
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, int, str]] = []  # (line, start col, end col, new text)
    out = NameCheck(source)
    known = set(fields)
    for read, name, where in _field_reads(tree, state_args):
        if name in known:
            continue
        close = _close(name, fields)
        if fix and len(close) == 1:
            edits.append((*where, close[0] if isinstance(read, ast.Attribute) else repr(close[0])))
            out.fixes.append(f"field `{name}` (line {read.lineno}) read as `{close[0]}`, the one field close to it")
            continue
        hint = f" (did you mean {' or '.join(f'`{c}`' for c in close)}?)" if close else ""
        out.errors.append(f"line {read.lineno}: `{ast.unparse(read)}`: `{name}` is not a field of this task{hint}")
    bound = _bound_names(tree)
    usable = bound | set(available if available is not None else dir(builtins))  # every name a read may use
    imports: list[str] = []
    reported: set[str] = set()
    for node in ast.walk(tree):
        if fix and isinstance(node, ast.Name) and node.id in USUAL_IMPORTS and node.id not in usable:
            line = USUAL_IMPORTS[node.id]
            if line not in imports:
                imports.append(line)
                out.fixes.append(f"`{node.id}` (line {node.lineno}) used but never imported: `{line}` added")
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in usable:
            if node.id in reported:
                continue
            reported.add(node.id)
            if node.id in known:
                hint = f" To read the field, write `{state_args[-1]}.{node.id}` (or `{state_args[0]}.{node.id}`)."
            else:
                close = difflib.get_close_matches(node.id, sorted(bound), n=1, cutoff=CLOSE)
                hint = f" (did you mean `{close[0]}`?)" if close else ""
            out.errors.append(f"line {node.lineno}: `{node.id}` is used but never assigned.{hint}")
    if fix:
        numbers = _number_names(tree)
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            for arg in _numbers_given_to_torch(call, numbers):
                seg = ast.get_source_segment(source, arg) or ast.unparse(arg)
                edits.append((arg.lineno, arg.col_offset, arg.end_col_offset or arg.col_offset, f"torch.tensor({seg})"))
                out.fixes.append(
                    f"line {arg.lineno}: `{seg}` given to `{ast.unparse(call.func)}` wrapped in "
                    "`torch.tensor(...)` (torch functions take tensors, not Python numbers)"
                )
    if edits:
        out.source = _apply(lines, edits)
    if imports:  # after the edits, which are placed by the original line numbers
        head = max(
            (n.end_lineno or 0 for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"),
            default=0,
        )
        kept = out.source.splitlines(keepends=True)
        out.source = "".join(kept[:head]) + "".join(f"{line}\n" for line in imports) + "".join(kept[head:])
    return out


def state_arguments(source: str, entry: str, arg_names: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """What the entry itself calls the arguments that hold states (``def compute_reward(s, a, n)``: ``s``, ``n``).

    ``arg_names`` are the core's names for the entry's positional arguments; those in
    :data:`STATE_ARGS` hold states. Without them, or when the code does not parse, the
    core's own names are assumed.
    """
    if not arg_names:
        return STATE_ARGS
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return STATE_ARGS
    fn = _entry(tree, entry)
    if fn is None:
        return STATE_ARGS
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    return tuple(params[i] for i, name in enumerate(arg_names) if name in STATE_ARGS and i < len(params)) or STATE_ARGS


def add_missing_return(source: str, entry: str) -> tuple[str, str | None]:
    """``source`` with ``return <name>`` appended to ``entry`` if it never returns a value, and the fix's note.

    ``<name>`` is the last name the entry's own body assigns at its top level that contains
    the entry's last word (``compute_reward``: ``reward``, ``total_reward``; ``act``:
    ``action``). Nothing changes (note ``None``) when the entry returns or yields anywhere,
    or no such name exists: the probe then reports the ``None`` it returns.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return source, None
    fn = _entry(tree, entry)
    if fn is None or fn.body[0].lineno == fn.lineno or _returns_value(fn):  # a one-line def has no indent to reuse
        return source, None
    noun = entry.rsplit("_", 1)[-1].lower()
    assigned = [
        target.id
        for stmt in fn.body
        if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign))
        for target in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
        if isinstance(target, ast.Name) and noun in target.id.lower()
    ]
    if not assigned:
        return source, None
    name = assigned[-1]
    lines = source.splitlines(keepends=True)
    first = lines[fn.body[0].lineno - 1].encode()  # col_offset counts UTF-8 bytes
    indent = first[: fn.body[0].col_offset].decode()  # the body's own indent, tabs included
    end = fn.end_lineno or len(lines)
    head, tail = lines[:end], lines[end:]
    if head and not head[-1].endswith("\n"):
        head[-1] += "\n"
    fixed = "".join(head) + f"{indent}return {name}\n" + "".join(tail)
    return (
        fixed,
        f"`{entry}` never returned a value: `return {name}` added "
        f"(the last value it assigns to a name with `{noun}` in it)",
    )


def _entry(tree: ast.Module, entry: str) -> ast.FunctionDef | None:
    """The top-level ``def`` of ``entry``, if the program has one."""
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == entry), None)


def _returns_value(fn: ast.FunctionDef) -> bool:
    """Whether ``fn`` itself (not a function nested in it) returns a value or yields."""
    todo: list[ast.AST] = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return) and node.value is not None:
            return True
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return True
        todo.extend(ast.iter_child_nodes(node))
    return False


def _field_reads(tree: ast.Module, state_args: tuple[str, ...]) -> list[tuple[ast.expr, str, tuple[int, int, int]]]:
    """``state.x``, ``state["x"]`` and ``state.get("x")`` reads: (node, field name, where the name is written)."""
    found: list[tuple[ast.expr, str, tuple[int, int, int]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in state_args:
            if node.attr in STATE_ATTRIBUTES:
                continue
            end = node.end_col_offset or 0
            if node.end_lineno == node.lineno:
                found.append((node, node.attr, (node.lineno, end - len(node.attr), end)))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in state_args:
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.end_lineno == key.lineno:
                found.append((node, key.value, (key.lineno, key.col_offset, key.end_col_offset or key.col_offset)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in state_args
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            key = node.args[0]
            found.append((node, str(key.value), (key.lineno, key.col_offset, key.end_col_offset or key.col_offset)))
    return found


def _close(name: str, fields: list[str]) -> list[str]:
    """The fields close to ``name``: by spelling, or the same once case and underscores are ignored."""
    squash = {f.lower().replace("_", ""): f for f in fields}
    same = squash.get(name.lower().replace("_", ""))
    if same is not None:
        return [same]
    return difflib.get_close_matches(name, fields, n=3, cutoff=CLOSE)


def _bound_names(tree: ast.Module) -> set[str]:
    """Every name the program binds anywhere: assignments, loops, arguments, defs, imports, handlers."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.add(node.rest)
    return bound


def _is_number(node: ast.expr, numbers: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _is_number(node.operand, numbers)
    if isinstance(node, ast.BinOp):
        return _is_number(node.left, numbers) and _is_number(node.right, numbers)
    return isinstance(node, ast.Name) and node.id in numbers


def _number_names(tree: ast.Module) -> set[str]:
    """Names whose every binding is a plain number (``temperature = 0.5``)."""
    values: dict[str, list[ast.expr | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values.setdefault(target.id, []).append(node.value)
                else:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            values.setdefault(name.id, []).append(None)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            values.setdefault(node.target.id, []).append(node.value)
        elif isinstance(node, (ast.AugAssign, ast.For, ast.comprehension, ast.NamedExpr, ast.arg, ast.With)):
            for name in ast.walk(node.target if hasattr(node, "target") else node):
                if isinstance(name, ast.Name):
                    values.setdefault(name.id, []).append(None)
            if isinstance(node, ast.arg):
                values.setdefault(node.arg, []).append(None)
    numbers: set[str] = set()
    for ident, bindings in values.items():
        if bindings and all(v is not None and _is_number(v, set()) for v in bindings):
            numbers.add(ident)
    return numbers


def _numbers_given_to_torch(node: ast.AST, numbers: set[str]) -> list[ast.expr]:
    """The arguments of a ``torch.f(...)`` call that must be tensors but are Python numbers."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
    ):
        return []
    name = node.func.attr
    if name in UNARY and node.args and _is_number(node.args[0], numbers):
        return [node.args[0]]
    if name in BINARY:
        given = [a for a in node.args[:2] if _is_number(a, numbers)]
        return given if len(given) < len(node.args[:2]) else []  # two numbers: leave it (no tensor to match)
    return []


def _apply(lines: list[str], edits: list[tuple[int, int, int, str]]) -> str:
    """The source with each ``(line, start, end, text)`` replacement made (columns are UTF-8 offsets)."""
    out = [ln.encode() for ln in lines]
    for line, start, end, text in sorted(set(edits), key=lambda e: (e[0], e[1]), reverse=True):
        raw = out[line - 1]
        out[line - 1] = raw[:start] + text.encode() + raw[end:]
    return b"".join(out).decode()
