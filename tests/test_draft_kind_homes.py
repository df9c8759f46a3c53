"""A draft kind has one home: its model, its descriptor, its proposer, its draft trainer and one line in
the table of kinds (plus, where vLLM needs one, its repair in rollout/vllm/drafter_repairs.py).

Read from the product code's tokens (the packages and train_rl.py, as tests/test_import_layers.py reads
them), comments and docstrings aside: each external kind's name and title appear in at most 6 files,
and everything keyed by kind elsewhere is derived from the table. A kind built on another (DSpark on
DFlash's block draft) names it in its own home files: those are the other kind's, not this kind's.
"""
import ast
import functools
import io
import tokenize

import pytest

from test_import_layers import REPO, module_files
from vime.models.draft_kinds import EXTERNAL_KINDS

MAX_FILES = 6


def docstring_positions(tree):
    """(line, column) of every module, class and function docstring of `tree`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add((first.lineno, first.col_offset))
    return found


def code_words(source):
    """The names and string literals of `source`, comments and docstrings left out."""
    docstrings = docstring_positions(ast.parse(source))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME or (tok.type == tokenize.STRING and tok.start not in docstrings):
            yield tok.string


@functools.cache
def product_words():
    """{product file: its code words, lower-cased} (read once)."""
    return {str(path.relative_to(REPO)): {w.lower() for w in code_words(path.read_text())}
            for path in module_files().values()}


def files_naming(needles):
    """The product files whose code (not comments or docstrings) holds any of `needles` (case-insensitive)."""
    needles = [n.lower() for n in needles]
    return sorted(f for f, words in product_words().items() if any(n in w for w in words for n in needles))


def home_files(kind):
    """The files of a kind's home that bear its name: its model, descriptor, proposer and trainer."""
    return {f for f in product_words() if f.rsplit("/", 1)[-1] == f"{kind.name}.py"}


@pytest.mark.parametrize("kind", EXTERNAL_KINDS, ids=lambda k: k.name)
def test_an_external_kinds_name_is_in_at_most_six_product_files(kind):
    others = set().union(*(home_files(k) for k in EXTERNAL_KINDS if k is not kind))
    files = [f for f in files_naming([kind.name, kind.title]) if f not in others]
    assert len(files) <= MAX_FILES, files


def test_the_reader_sees_names_and_strings_but_not_comments_or_docstrings():
    source = '"""dflash in a docstring."""\n# dflash in a comment\nx = "eagle3"\ndef f():\n    """DFlash."""\n    return DFlashDraft\n'
    assert list(code_words(source)) == ["x", '"eagle3"', "def", "f", "return", "DFlashDraft"]
