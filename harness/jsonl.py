r"""JSON Lines split the way JSON writes them: a row ends at "\n" and nowhere else.

`str.splitlines()` also ends a line at U+2028, U+2029 and U+0085 (and at \r, \v, \f, \x1c-\x1e), and
`json.dumps(..., ensure_ascii=False)` writes those three raw inside a string, so a question, a tool's output or a corpus
row that holds one would be cut in two: a valid row refused as "Unterminated string", a finished run's trees.jsonl
unreadable, a --resume dropping complete rows as "cut mid-write". Every reader of a JSON Lines file here (datasets, the
search corpus, the cold start's demonstrations, a run's logs and trees) splits its text with `lines`.
"""
from __future__ import annotations


def lines(text: str) -> list[str]:
    r"""The lines of the JSON Lines `text`, split at "\n" only. The final "\n" ends the last line (it starts no empty
    one); a last line without it (a row cut mid-write) is kept as it is. A "\r" before "\n" (a file written on
    Windows) stays at the end of its line, where JSON reads it as white space."""
    parts = text.split("\n")
    if parts[-1] == "":
        parts.pop()
    return parts
