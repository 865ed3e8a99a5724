"""Text made safe for where people read it. Torch-free and dependency-free: the analyzer, the profile suite and
tools/traces/strip_export.py share it.

- :func:`scrub_paths`: absolute paths -> ``<path>/<basename>`` (what the stripped fixtures hold, and what a report
  shows of paths: no user names or home directories); :func:`scrub_argv` / :func:`scrub_command` a command
  line argument by argument.
- :func:`to_spreadsheet` / :func:`from_spreadsheet`: CSV formula injection. A spreadsheet evaluates a cell that
  begins with ``=``, ``+``, ``-`` or ``@`` (and some strip a leading tab or CR first), so a kernel name or an
  NVTX message like ``=HYPERLINK(...)`` would run as a formula. Every CSV written for people (the analyzer's
  tables, the profile suite's report) passes its *text* cells through :func:`to_spreadsheet`, which puts one
  ``'`` in front of such a cell (and of one that already begins with ``'``, so the mapping can be undone
  exactly); each line of a cell after a CR or LF is treated the same (a reader that ends the row at a bare CR
  would start a row with it); numbers, and text that is a plain number (``-1.5``), are left alone. ``'`` is
  what a spreadsheet itself takes as "this cell is text" and does not show. :func:`from_spreadsheet` undoes
  it: a program that reads these CSVs back (and the tests that compare their names with nsys's) drops one
  leading ``'``. :func:`lf_row_ends`: the CSVs are written with CRLF row ends, so that the csv module quotes a
  cell holding a bare CR (with LF alone it does not, and readers split the row there), then given LF ones.
  ``ncu.csv`` in a run directory is an input the analyzer joins on, never neutralised.
- :func:`terminal` and :func:`visible`: control characters in names (NUL, ESC, newlines, C1 codes, bidi
  controls) reach the terminal escaped (``\\x1b``, ``\\n``: no colour change, no forged line) and the HTML as
  visible symbols (U+2400 Control Pictures: ``␛``, ``␊``, ``␀``; other non-printables as ``\\x9b``). CSV cells
  keep them exactly (quoted as CSV requires): the CSVs are data.
"""
from __future__ import annotations

import re

# An absolute path token: "/" then non-separators, at the start of the value or after a space, quote, "=", ":",
# "(", "," or "[" (so "a/b", "<path>/x" and "kworker/0:1" are not paths).
PATH_TOKEN = re.compile(r"""(?:^|(?<=[\s"'=:(,\[]))/[^\s"'`,;()\[\]{}<>|]+""")


def _basename(m: re.Match) -> str:
    parts = [p for p in m.group(0).split("/") if p]
    return f"<path>/{parts[-1]}" if parts else m.group(0)


# With spaces=True a path token goes on over a space and a word holding a "/" (``/home/user name/venv/x.so``),
# for free text such as an error message, where a path with spaces cannot be told apart otherwise.
_SPACED_PATH = re.compile(PATH_TOKEN.pattern + r"""(?: [^\s"'`,;()\[\]{}<>|/]*/[^\s"'`,;()\[\]{}<>|]*)*""")


def scrub_paths(value, spaces: bool = False):
    """Every absolute path token of a string -> ``<path>/<basename>``; anything else is returned as is. With
    ``spaces``, a token takes in the words after it that hold a "/" (a path with spaces, in a message)."""
    if not isinstance(value, str) or "/" not in value:
        return value
    return (_SPACED_PATH if spaces else PATH_TOKEN).sub(_basename, value)


def scrub_command(argv) -> str:
    """A command line to show: each argument scrubbed (:func:`scrub_argv`), then joined by spaces; joining
    first would cut a path with spaces in two and leave its first part's directories in view."""
    return " ".join(scrub_argv(argv))


# What a spreadsheet may take as the start of a formula; "'" is included so that to_spreadsheet is reversible.
FORMULA_LEADS = ("=", "+", "-", "@", "\t", "\r", "'")
NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


# A line start inside a cell (after CR or LF) whose first character a spreadsheet may take for a formula: a reader
# that ends the row there (a bare CR splits rows in many) would start a new row with it.
_INNER_LEAD = re.compile("(?<=[\r\n])(?=[=+\\-@\t\r'])")
_INNER_QUOTED = re.compile("(?<=[\r\n])'(?=[=+\\-@\t\r'])")


def to_spreadsheet(value):
    """A CSV cell safe to open in a spreadsheet: text that begins with = + - @ tab CR or ' gets a leading ', and
    so does each line of it after a CR or LF that begins so; anything else (numbers, None, text that is a plain
    number) is returned as is."""
    if not isinstance(value, str):
        return value
    if "\r" in value or "\n" in value:
        value = _INNER_LEAD.sub("'", value)
    if value[:1] in FORMULA_LEADS and not NUMBER.fullmatch(value):
        return "'" + value
    return value


def from_spreadsheet(value):
    """The text :func:`to_spreadsheet` was given: one leading ' dropped, at the start and after each CR or LF
    (text cells only)."""
    if not isinstance(value, str):
        return value
    if "\r" in value or "\n" in value:
        value = _INNER_QUOTED.sub("", value)
    if value[:1] == "'" and value[1:2] in FORMULA_LEADS and value[1:2]:
        return value[1:]
    return value


def lf_row_ends(text: str) -> str:
    """CSV text written with CRLF row ends (every cell holding a CR or LF quoted) -> LF row ends: CRLF is
    replaced outside quoted cells only (the even-numbered pieces between '"'; a doubled "" inside a cell is an
    empty outside piece), so a cell's own CR LF stays as it was."""
    parts = text.split('"')
    parts[::2] = [p.replace("\r\n", "\n") for p in parts[::2]]
    return '"'.join(parts)


_C_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(c: str) -> str:
    o = ord(c)
    return _C_ESCAPES.get(c) or (f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")


def terminal(text: str) -> str:
    """``text`` safe to print: every non-printable character (C0, DEL, C1, line separators, format controls)
    as a Python-style escape, so a name cannot move the cursor, recolour the terminal or forge a line."""
    return text if text.isprintable() else "".join(c if c.isprintable() else _escape(c) for c in text)


def visible(text: str) -> str:
    """``text`` with its control characters shown: C0 codes and DEL as their Control Pictures (``␀``, ``␛``,
    ``␊``, ``␡``), any other non-printable character as a Python-style escape."""
    if text.isprintable():
        return text
    out = []
    for c in text:
        o = ord(c)
        out.append(c if c.isprintable() else chr(0x2400 + o) if o < 0x20 else "\u2421" if o == 0x7F else _escape(c))
    return "".join(out)


# A value glued to its option: --opt=/abs/path, or a short option written as one word, -o/abs/path.
_GLUED = re.compile(r"(-{1,2}[A-Za-z0-9][\w.-]*=|-[A-Za-z])(/.*)", re.S)


def _path_basename(path: str) -> str:
    parts = [p for p in path.split("/") if p]
    return f"<path>/{parts[-1]}" if parts else path


def scrub_argv(argv) -> list[str]:
    """A command line (a list of arguments) with its absolute paths as ``<path>/<basename>``, argument by argument,
    before it is ever joined: an argument that is a path is one path, spaces included (``/home/user name/venv/bin/
    python`` -> ``<path>/python``), as is the value of ``--opt=/path`` and of a glued short option ``-o/path``;
    any other argument has its path tokens scrubbed (``scrub_paths``)."""
    out = []
    for a in argv:
        a = str(a)
        if a.startswith("/"):
            out.append(_path_basename(a))
        elif (m := _GLUED.fullmatch(a)) is not None:
            out.append(m.group(1) + _path_basename(m.group(2)))
        else:
            out.append(scrub_paths(a))
    return out
