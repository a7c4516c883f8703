"""The user-facing docs speak to users: no internal issue numbers, nothing about the machines the project is built
on. (The figures' commands are checked by eye; this catches the words that crept in.)"""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                        if f.endswith(".md")] + ["omni_accel/builtin/model/README.md"]
INTERNAL = re.compile(r"[Ii]ssues? #?\d+|\$OUT\b|device machine|workplace|KINDS\.md|\b(second|third|fourth) session\b")


@pytest.mark.parametrize("doc", DOCS)
def test_docs_carry_no_internal_references(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as fh:
        hits = [f"{doc}:{n}: {m.group(0)}" for n, line in enumerate(fh, 1) for m in INTERNAL.finditer(line)]
    assert not hits, hits
