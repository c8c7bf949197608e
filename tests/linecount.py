"""Code lines of a Python file: lines holding code, not counting blank lines, comments and docstrings."""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path


def code_lines(path: Path) -> int:
    source = Path(path).read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines: set[int] = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docstrings)
    return len(lines)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(f"{code_lines(Path(name)):5d} {name}")
