"""Pull Python code out of an LLM reply, and say precisely what is wrong when it fails.

Replies come in many shapes: fenced blocks (```python, ```py, bare ```, ~~~), a fence
the model never closed, several blocks (a draft, a helper, the final version), or bare
code with prose around it. :func:`extract_code` returns the most likely code;
:func:`extract_function` finds the block that defines a given function and returns it
with its helpers and imports, or an error text meant to be sent back to the LLM;
:func:`program_from_reply` turns a reply into a program record either way (usable, or
rejected with that error as its reason), so that no reply is dropped silently.

A reply whose only flaw is the function's name (``improved_compute_reward`` for
``compute_reward``) is accepted by renaming when asked (``rename=True``): exactly one
top-level function fits the expected arguments, or exactly one of those that fit has
the expected name inside its own. The rename is noted (``ExtractResult.renamed``) and
recorded with the program (``meta["renamed_from"]``).

Nothing here executes code: it only parses it (``ast``). Safety checks live in
:mod:`core.sandbox`.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

from core.records import Program

P = TypeVar("P", bound=Program)

# Language tags that mark a block as Python (anything else tagged is not Python).
_PY_TAGS = {"python", "python3", "py", "py3", "pycon", "ipython", "{python}", "{py}"}
_FENCE = re.compile(r"^[ \t]{0,3}(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_JIT_DECORATORS = {"torch.jit.script", "jit.script", "torch.compile", "torch.jit.ignore"}
_CODE_START = re.compile(r"^(def |async def |class |import |from \S+ import |@\w)")


@dataclass
class ExtractResult:
    """The function's source with its helpers and imports, or why it could not be found.

    ``error`` is feedback text for the LLM and ``kind`` its category (:data:`KINDS`);
    ``notes`` lists harmless things that were changed or dropped (example calls,
    ``if __name__ == "__main__"`` blocks, a rename); ``renamed`` is the function's name
    in the reply when it was accepted under another.
    """

    ok: bool
    source: str = ""
    error: str = ""
    notes: list[str] = field(default_factory=list)
    kind: str = ""  # why it failed: one of KINDS ("" when ok)
    renamed: str = ""  # the reply's name for the function, when it was renamed to the entry


#: the categories of unusable replies, as ``ExtractResult.kind`` and in run records
KINDS = ("empty", "no_code", "syntax", "no_function", "duplicate", "async", "signature", "names")


@dataclass
class _Block:
    code: str
    tag: str  # lower-cased language tag ("" when bare)
    index: int  # 1-based position in the reply, for messages

    @property
    def pythonish(self) -> bool:
        return self.tag in _PY_TAGS or self.tag == ""


def _fenced_blocks(text: str) -> list[_Block]:
    """Every fenced block; an unterminated fence runs to the end of the reply."""
    blocks: list[_Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence = m.group("fence")
        tag = m.group("info").strip().split(" ")[0].lower() if m.group("info").strip() else ""
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            # A closing fence: same character, at least as long, no info string.
            if (
                close
                and close.group("fence")[0] == fence[0]
                and len(close.group("fence")) >= len(fence)
                and not close.group("info").strip()
            ):
                break
            body.append(lines[i])
            i += 1
        i += 1  # skip the closing fence (or run past the end)
        blocks.append(_Block("\n".join(body).strip("\n"), tag, len(blocks) + 1))
    return blocks


def _unfenced_code(text: str) -> str:
    """Code written without fences: from the first code-looking line, trimmed to parse."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if _CODE_START.match(ln)), None)
    if start is None:
        return ""
    tail = lines[start:]
    # Drop trailing prose one line at a time until the rest parses (or nothing is left).
    for end in range(len(tail), 0, -1):
        candidate = "\n".join(tail[:end]).rstrip()
        if not candidate:
            continue
        try:
            ast.parse(candidate)
        except SyntaxError:
            continue
        return candidate
    return "\n".join(tail).rstrip()


def _blocks(reply: str) -> list[_Block]:
    text = _THINK.sub("", reply or "")
    blocks = [b for b in _fenced_blocks(text) if b.code.strip()]
    if not blocks:
        code = _unfenced_code(text)
        if code:
            blocks = [_Block(code, "", 1)]
    return blocks


def extract_code(reply: str) -> str:
    """The reply's code: the last Python-tagged (or bare) fenced block that parses,
    else the last Python-looking block, else unfenced code; ``""`` when there is none."""
    blocks = [b for b in _blocks(reply) if b.pythonish]
    for block in reversed(blocks):
        try:
            ast.parse(block.code)
        except SyntaxError:
            continue
        return block.code
    return blocks[-1].code if blocks else ""


def _defs(tree: ast.Module, name: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]


def signature_error(fn: ast.FunctionDef | ast.AsyncFunctionDef, entry: str, arg_names: list[str]) -> str:
    """Why ``fn`` cannot be called positionally with ``arg_names``; ``""`` when it can."""
    a = fn.args
    positional = [x.arg for x in a.posonlyargs + a.args]
    required = len(positional) - len(a.defaults)
    kw_required = [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    n = len(arg_names)
    fits = required <= n and (n <= len(positional) or a.vararg is not None) and not kw_required
    if fits:
        return ""
    found = ", ".join(positional + ([f"*{a.vararg.arg}"] if a.vararg else []) + kw_required) or "no arguments"
    return (
        f"`{entry}` has the wrong signature: expected `def {entry}({', '.join(arg_names)})` "
        f"({n} positional argument{'s' if n != 1 else ''}), found `def {entry}({found})`."
    )


def _strip_script_parts(code: str, tree: ast.Module) -> tuple[str, list[str]]:
    """Drop top-level example calls and ``if __name__ == ...`` blocks; keep the rest as written."""
    drop: set[int] = set()
    notes: list[str] = []
    for i, node in enumerate(tree.body):
        is_docstring = i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if isinstance(node, ast.Expr) and not is_docstring:
            notes.append(f"dropped top-level statement on line {node.lineno}")
        elif isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            notes.append(f"dropped `if __name__ == ...` block on line {node.lineno}")
        else:
            if isinstance(node, ast.FunctionDef):
                # TorchScript decorators (common in Eureka-style replies) only compile.
                for dec in node.decorator_list:
                    if ast.unparse(dec) in _JIT_DECORATORS:
                        notes.append(f"dropped `@{ast.unparse(dec)}` on line {dec.lineno}")
                        drop.update(range(dec.lineno, (dec.end_lineno or dec.lineno) + 1))
            continue
        drop.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    if not drop:
        return code, notes
    kept = [ln for i, ln in enumerate(code.splitlines(), start=1) if i not in drop]
    return "\n".join(kept).rstrip() + "\n", notes


def extract_function(
    reply: str, entry: str, arg_names: list[str] | None = None, *, rename: bool = False
) -> ExtractResult:
    """Find the code block defining ``entry`` and return it with its helpers and imports.

    :param reply: the raw LLM reply.
    :param entry: the function the caller will call (``compute_reward``).
    :param arg_names: the positional arguments it will be called with, to check arity.
    :param rename: accept a reply whose only function fitting ``arg_names`` has another
        name, renamed to ``entry`` (see the module docstring).
    :return: ``ok`` with ``source``, or ``error`` text (and ``kind``) saying what was wrong.
    """
    if not (reply or "").strip():
        return ExtractResult(
            False, error="The reply is empty: write the function in a ```python code block.", kind="empty"
        )
    blocks = _blocks(reply)
    if not blocks:
        return ExtractResult(
            False,
            error=f"The reply contains no code, only prose. Write `def {entry}(...)` in a ```python code block.",
            kind="no_code",
        )
    candidates = [b for b in blocks if b.pythonish] or blocks
    found: list[tuple[_Block, ast.Module]] = []
    syntax_errors: list[str] = []
    for block in candidates:
        try:
            tree = ast.parse(block.code)
        except SyntaxError as e:
            if re.search(rf"\bdef\s+{re.escape(entry)}\s*\(", block.code):
                line = (e.text or "").rstrip()
                syntax_errors.append(
                    f"SyntaxError in code block {block.index}, line {e.lineno}: {e.msg}"
                    + (f"\n    {line.strip()}" if line else "")
                )
            continue
        if _defs(tree, entry):
            found.append((block, tree))
    if not found:
        if syntax_errors:
            return ExtractResult(False, error=syntax_errors[-1], kind="syntax")
        if rename and arg_names is not None:
            renamed = _renamed(candidates, entry, list(arg_names))
            if renamed is not None:
                return renamed
        defined = sorted(
            {
                n.name
                for b in candidates
                for n in _safe_body(b.code)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
        )
        if not defined and any(_parse_error(b.code) for b in candidates):
            return ExtractResult(
                False, error=_parse_error(candidates[-1].code) or _first_parse_error(candidates), kind="syntax"
            )
        also = f" (found: {', '.join(f'`{d}`' for d in defined)})" if defined else ""
        return ExtractResult(
            False,
            error=f"No function named `{entry}` is defined at the top level of the code{also}.",
            kind="no_function",
        )
    n_defs = sum(len(_defs(tree, entry)) for _, tree in found)
    distinct = {ast.dump(_defs(tree, entry)[0]) for _, tree in found}
    if any(len(_defs(tree, entry)) > 1 for _, tree in found) or len(distinct) > 1:
        where = ", ".join(str(b.index) for b, _ in found)
        return ExtractResult(
            False,
            error=(
                f"`{entry}` is defined {n_defs} times (code block{'s' if len(found) > 1 else ''} {where}); "
                "give exactly one definition."
            ),
            kind="duplicate",
        )
    block, tree = found[-1]
    fn = _defs(tree, entry)[0]
    if isinstance(fn, ast.AsyncFunctionDef):
        return ExtractResult(False, error=f"`{entry}` must be a plain `def`, not `async def`.", kind="async")
    if arg_names is not None:
        err = signature_error(fn, entry, list(arg_names))
        if err:
            return ExtractResult(False, error=err, kind="signature")
    source, notes = _strip_script_parts(block.code, tree)
    return ExtractResult(True, source=source, notes=notes)


def _renamed(blocks: list[_Block], entry: str, arg_names: list[str]) -> ExtractResult | None:
    """The one top-level function that fits ``arg_names``, renamed to ``entry``; None when
    there is no such function or several (those with ``entry`` in their name first)."""
    fits: list[tuple[_Block, ast.Module, ast.FunctionDef]] = []
    for block in blocks:
        try:
            tree = ast.parse(block.code)
        except SyntaxError:
            continue
        fits += [
            (block, tree, n)
            for n in tree.body
            if isinstance(n, ast.FunctionDef) and not signature_error(n, n.name, arg_names)
        ]
    if len({n.name for _, _, n in fits}) > 1:
        fits = [f for f in fits if entry in f[2].name]
    names = {n.name for _, _, n in fits}
    if len(names) != 1:
        return None
    block, _, fn = fits[-1]
    old = fn.name
    code = re.sub(rf"\b{re.escape(old)}\b", entry, block.code)
    tree = ast.parse(code)
    if len(_defs(tree, entry)) != 1:
        return None
    source, notes = _strip_script_parts(code, tree)
    return ExtractResult(True, source=source, notes=[f"renamed `{old}` to `{entry}`", *notes], renamed=old)


def _parse_error(code: str) -> str:
    """The code's syntax error as feedback text, or ``""`` when it parses."""
    try:
        ast.parse(code)
    except SyntaxError as e:
        line = (e.text or "").strip()
        return f"SyntaxError on line {e.lineno}: {e.msg}" + (f"\n    {line}" if line else "")
    return ""


def _first_parse_error(blocks: list[_Block]) -> str:
    return next((_parse_error(b.code) for b in blocks if _parse_error(b.code)), "")


def program_from_reply(
    cls: type[P],
    reply: str,
    entry: str,
    arg_names: list[str],
    *,
    state_fields: list[str] | None = None,
    prelude: str = "",
    **fields: Any,
) -> P:
    """The program a reply holds, or the same record rejected with the reason.

    A usable reply gives ``cls(source=..., entry=entry, reply=reply, **fields)``; an
    unusable one the same record with ``rejected`` set to the error (feedback text for
    the LLM), ``source`` the reply's best-guess code, and ``meta["rejected_kind"]`` one of
    :data:`KINDS`. A function accepted under another name is renamed and recorded in
    ``meta["renamed_from"]``; ``meta["notes"]`` lists what extraction changed.

    With ``state_fields`` (the task's :meth:`~core.envs.task.Task.field_names`), the names
    the code reads are checked (:func:`core.namecheck.check_names`): the deterministic
    fixes are applied and listed in ``meta["fixes"]``; an unknown field or a name never
    assigned rejects the reply (kind ``names``) with the valid fields.

    ``prelude`` is code the plugin puts before the reply's (Text2Reward's helper
    functions): the names it defines count as bound, it is prepended to the usable
    program's source and kept in ``meta["prelude"]`` (a repair shows the LLM the code
    without it and puts it back).

    :param cls: the program record (:class:`core.records.RewardProgram`, ...).
    :param fields: the record's other fields (``origin``, ``prompt``, ``meta``, ...).
    """
    from core.namecheck import add_missing_return, check_names, state_arguments
    from core.sandbox.policy import SAFE_BUILTIN_NAMES

    found = extract_function(reply, entry, arg_names, rename=True)
    meta = dict(fields.pop("meta", None) or {})
    if found.notes:
        meta["notes"] = list(found.notes)
    if found.renamed:
        meta["renamed_from"] = found.renamed
    if prelude:
        meta["prelude"] = prelude
    if found.ok and state_fields is not None:
        provided = tuple(defined_names(prelude))
        names = check_names(
            found.source,
            list(state_fields),
            available=SAFE_BUILTIN_NAMES + provided,
            state_args=state_arguments(found.source, entry, arg_names),
        )
        found.source, returned = add_missing_return(names.source, entry)
        fixes = names.fixes + ([returned] if returned else [])
        if fixes:
            meta["fixes"] = fixes
        if not names.ok:
            found = ExtractResult(False, source=names.source, error=names.message(list(state_fields)), kind="names")
    if not found.ok:
        meta["rejected_kind"] = found.kind
        source = found.source if found.kind == "names" else extract_code(reply)
        return cls(source=source, entry=entry, reply=reply, meta=meta, rejected=found.error, **fields)
    source = f"{prelude.rstrip()}\n\n\n{found.source}" if prelude else found.source
    return cls(source=source, entry=entry, reply=reply, meta=meta, **fields)


def defined_names(code: str) -> list[str]:
    """The names ``code`` defines at its top level (functions, assignments, imports); [] if it does not parse."""
    out: list[str] = []
    for node in _safe_body(code):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out += [(a.asname or a.name).split(".")[0] for a in node.names]
        elif isinstance(node, ast.Assign):
            out += [t.id for t in node.targets if isinstance(t, ast.Name)]
    return out


def without_prelude(program: Any, prelude: str | None = None) -> str:
    """A program's source without the plugin's prelude (``meta["prelude"]`` unless given): what the LLM wrote."""
    prelude = str(program.meta.get("prelude", "") or "") if prelude is None else prelude
    source = program.source
    if prelude and source.startswith(prelude.rstrip()):
        return source[len(prelude.rstrip()) :].lstrip("\n")
    return source


def _safe_body(code: str) -> list[ast.stmt]:
    try:
        return ast.parse(code).body
    except SyntaxError:
        return []
