"""Write docs/reference/configuration.md from the code, so the reference cannot drift from it.

- the experiment config: every field of the dataclasses in ``ssl_models/config.py`` (key, type, default) with its
  meaning taken from the comment on (or just above) the field's line;
- every SSL method's and every strategy's options: name, default, and the comment beside it in the class's
  ``default_options`` (a strategy's own options first, the ones it inherits after).

A field or option without a comment is an error: documenting it is part of adding it (tests/test_docs.py runs
this and compares the page). Usage: ``python docs/gen_reference.py`` (``--check`` exits 1 when the page is stale).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PAGE = REPO / "docs" / "reference" / "configuration.md"


class Undocumented(ValueError):
    """A config field or a component option has no comment."""


def comments_by_line(source: str) -> dict[int, str]:
    """1-based line -> the comment on that line (without ``#``)."""
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def parsed_source(obj) -> tuple[ast.Module, list[str], dict[int, str]]:
    """The syntax tree, lines and comments of ``obj``'s source (dedented: a class or method defined inside a
    function or class parses too; line numbers are those of the source, 1-based)."""
    source = textwrap.dedent(inspect.getsource(obj))
    return ast.parse(source), source.splitlines(), comments_by_line(source)


def is_comment_only(lines: list[str], line: int) -> bool:
    return lines[line - 1].strip().startswith("#")


def meaning_at(lines: list[str], comments: dict[int, str], first: int, last: int | None = None) -> str:
    """The meaning of the code on lines ``first``..``last`` (1-based; a value may span several lines): the
    comments at the end of those lines, else the block of comment-only lines just above ``first``."""
    last = first if last is None else last
    trailing = [comments[n] for n in range(first, last + 1) if n in comments and not is_comment_only(lines, n)]
    if trailing:
        return " ".join(trailing)
    block = []
    i = first - 1
    while i >= 1 and i in comments and is_comment_only(lines, i):
        block.insert(0, comments[i])
        i -= 1
    return " ".join(block)


def named_comment(lines: list[str], comments: dict[int, str], name: str, names) -> str:
    """The comment-only lines ``# name: meaning`` (and the comment-only lines that continue it, up to one that
    starts another ``<one of names>:``): how an option is documented where several share one line of code
    (``return {"a": 1, "b": 2}``)."""

    def starts_entry(n: int, which) -> str | None:
        head = comments[n].split(":", 1)
        return head[1].strip() if len(head) == 2 and head[0].strip() in which else None

    for n in sorted(comments):
        if not is_comment_only(lines, n) or starts_entry(n, {name}) is None:
            continue
        parts = [starts_entry(n, {name})]
        n += 1
        while n in comments and is_comment_only(lines, n) and starts_entry(n, names) is None:
            parts.append(comments[n])
            n += 1
        return " ".join(p for p in parts if p)
    return ""


def field_spans(cls: type) -> dict[str, tuple[int, int]]:
    """Field name -> (first, last) line of its definition in the class source (1-based, relative to the source)."""
    tree, _, _ = parsed_source(cls)
    out: dict[str, tuple[int, int]] = {}
    for node in tree.body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.setdefault(node.target.id, (node.lineno, node.end_lineno))
    return out


def class_intro(cls: type) -> str:
    """The first paragraph of ``cls``'s own docstring (not the signature ``dataclass`` writes when it has none)."""
    doc = cls.__dict__.get("__doc__") or ""
    if dataclasses.is_dataclass(cls) and doc.startswith(f"{cls.__name__}("):
        return ""
    return inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ")


def type_name(hint) -> str:
    return getattr(hint, "__name__", str(hint)).replace("typing.", "")


def default_of(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def fmt(value) -> str:
    if isinstance(value, str):
        return f"`{value!r}`" if value else "`''`"
    return f"`{value}`".replace("|", "\\|")


def cell(text: str) -> str:
    """``text`` in a table cell: its ``|`` escaped (a norm ``||w||`` or a list of choices ``a | b`` stays as it is)."""
    return text.replace("|", "\\|")


def config_rows(cls: type, prefix: str, missing: list[str]) -> list[tuple[str, list[str]]]:
    """(section title, table lines) for ``cls`` and its nested dataclasses."""
    _, lines, comments = parsed_source(cls)
    where = field_spans(cls)
    hints = typing.get_type_hints(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            nested.append((f.name, hint))
            continue
        meaning = meaning_at(lines, comments, *where[f.name]) if f.name in where else ""
        key = prefix + f.name
        if not meaning:
            missing.append(key)
        rows.append(f"| `{key}` | {type_name(hint)} | {fmt(default_of(f))} | {cell(meaning)} |")
    out = []
    if rows:
        intro = class_intro(cls) if prefix else ""
        # generate() puts a blank line under the title: the intro (if any) and one blank line, then the table
        out.append((prefix.rstrip(".") or "top level", [intro, ""] if intro else []))
        out[-1][1].extend(["| key | type | default | meaning |", "|---|---|---|---|", *rows])
    for name, sub in nested:
        out += config_rows(sub, f"{prefix}{name}.", missing)
    return out


def option_rows(cls: type, what: str, missing: list[str]) -> list[str]:
    """Rows of a component's options: each option with its default and the comment beside it in the first class
    of the MRO whose ``default_options`` names it (and documents it), the class's own options first, the ones it
    inherits after. An option's comment: at the end of its line(s), else the comment-only lines just above it;
    where several options share a line of code (``return {**super().default_options(), "a": 1, "b": 2}``), a
    comment-only line ``# <option>: meaning`` (and the comment lines continuing it) in that function."""
    defaults = cls.default_options()
    documented: dict[str, str] = {}
    declared: dict[str, int] = {}  # option -> MRO index of the first class that names it
    for depth, klass in enumerate(cls.__mro__):
        fn = klass.__dict__.get("default_options")
        if fn is None:
            continue
        fn = fn.__func__ if hasattr(fn, "__func__") else fn
        tree, lines, comments = parsed_source(fn)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Dict):
                continue
            spans = [((k or v).lineno, v.end_lineno) for k, v in zip(node.keys, node.values)]
            for i, key in enumerate(node.keys):
                if not (isinstance(key, ast.Constant) and key.value in defaults) or documented.get(key.value):
                    continue
                name, (first, last) = key.value, spans[i]
                declared.setdefault(name, depth)
                # another option on the same line(s) (a ``**super()...`` spread does not count)?
                alone = not any(
                    a <= last and first <= b for j, (a, b) in enumerate(spans) if j != i and node.keys[j] is not None
                )
                meaning = meaning_at(lines, comments, first, last) if alone else ""
                if meaning.startswith(f"{name}:"):  # a block above written as ``# name: meaning``
                    meaning = meaning[len(name) + 1 :].strip()
                documented[name] = meaning or named_comment(lines, comments, name, set(defaults))
    rows = []
    for name in sorted(defaults, key=lambda n: declared.get(n, len(cls.__mro__))):
        meaning = documented.get(name, "")
        if not meaning:
            missing.append(f"{what}.{name}")
        rows.append(f"| `{name}` | {fmt(defaults[name])} | {cell(meaning)} |")
    return rows


def generate() -> str:
    from ssl_models.config import ExperimentConfig
    from ssl_models.methods import METHODS
    from strategies import STRATEGIES

    missing: list[str] = []
    out = [
        "# Configuration reference",
        "",
        (
            "Generated from the code by `python docs/gen_reference.py` (`ssl_models/config.py` for the experiment, "
            "each method's and strategy's `default_options` for their options); edit the code's comments, not this "
            "page. Every key can be set in the YAML file, from a study's variant, or from the run config "
            '(`--run-config "train.lr=0.1 strategy.options.mu=0.1"`); lists only in YAML. '
            "See [running experiments](../running.md) for how configs compose."
        ),
        "",
    ]
    for title, lines in config_rows(ExperimentConfig, "", missing):
        out += [f"## `{title}`" if title != "top level" else "## Top level", "", *lines, ""]
    out += ["## Method options (`method.options`)", ""]
    for name, cls in sorted(METHODS.items()):
        out += [
            f"### `{name}`",
            "",
            "| option | default | meaning |",
            "|---|---|---|",
            *option_rows(cls, f"method.options ({name})", missing),
            "",
        ]
    out += ["## Strategy options (`strategy.options`)", ""]
    for name, cls in sorted(STRATEGIES.items()):
        out += [
            f"### `{name}`",
            "",
            "| option | default | meaning |",
            "|---|---|---|",
            *option_rows(cls, f"strategy.options ({name})", missing),
            "",
        ]
    if missing:
        raise Undocumented("no comment documents: " + ", ".join(missing))
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = generate()
    if "--check" in args:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(REPO)} is stale: run python docs/gen_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(PAGE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
